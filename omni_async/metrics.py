"""Metrics: Prometheus counters and histograms, plus a plain snapshot for code (``stats()``).

One :class:`Metrics` per agent, labelled with its peer id.  The Prometheus series live in the
process's default registry (so one ``/metrics`` endpoint serves every agent of the process);
:func:`serve_metrics` starts that endpoint.  Updating costs a few dict and counter operations
per transfer, never per block.

Per-peer figures (bytes, transfers, in flight) are plain integers on a :class:`PeerMeter`,
bumped on the event loop and read by one collector when ``/metrics`` is scraped (from
prometheus_client's thread: it only reads ints and takes atomic copies of dicts).  Heartbeat
ages and chunk streams are asked of the agent's probes at scrape time, so they cost nothing in
between.  docs/observability.md explains every series.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import REGISTRY, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

Kind = Literal["blocks", "messages"]

_BYTES = PromCounter("omni_async_bytes", "Payload bytes moved", ["agent", "direction", "kind"])
_TRANSFERS = PromCounter("omni_async_transfers", "Transfers settled, by outcome", ["agent", "kind", "outcome"])
_RECEIVED = PromCounter("omni_async_received", "Incoming transfers answered, by outcome", ["agent", "kind", "outcome"])
_LATENCY = Histogram(
    "omni_async_transfer_seconds",
    "From submission to the receiver's acknowledgement",
    ["agent", "kind"],
    buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 0.5, 2.5),
)
_PEERS = Gauge("omni_async_peers", "Joined peers", ["agent"])
_PEER_EVENTS = PromCounter("omni_async_peer_events", "Peers joined and left, by reason", ["agent", "event", "reason"])


LaneKind = Literal["same-host", "ucx"]
"""``same-host``: a peer on this host over shared memory; ``ucx``: any other UCX lane (tcp)."""
HeartbeatProbe = Callable[[str], float | None]
"""``probe(peer_id)``: ``time.monotonic()`` when the peer was last heard from (None: unknown)."""
StreamProbe = Callable[[], list[tuple[str, int, int]]]
"""``probe()``: ``(stage, active streams, stall deadlines fired so far)`` of each adapter."""


class PeerMeter:
    """What one joined peer moved, as plain ints bumped on the event loop."""

    __slots__ = ("lane", "received", "received_bytes", "sent", "sent_bytes", "settled", "started")

    def __init__(self, lane: LaneKind) -> None:
        self.lane = lane
        self.started = 0
        self.settled = 0
        self.sent = 0
        self.sent_bytes = 0
        self.received = 0
        self.received_bytes = 0

    @property
    def in_flight(self) -> int:
        """Transfers to the peer submitted and not settled yet."""
        return self.started - self.settled


class Metrics:
    """Counters of one agent, mirrored into Prometheus.

    The owner sets :attr:`heartbeat` (and a service sets :attr:`streams`) so that a scrape can
    report heartbeat ages and chunk streams; :meth:`close` takes the agent off ``/metrics``.
    """

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self._counts: Counter[str] = Counter()
        self._bytes_sent = {kind: _BYTES.labels(agent, "sent", kind) for kind in ("blocks", "messages")}
        self._bytes_received = {kind: _BYTES.labels(agent, "received", kind) for kind in ("blocks", "messages")}
        self._latency = {kind: _LATENCY.labels(agent, kind) for kind in ("blocks", "messages")}
        self._peers = _PEERS.labels(agent)
        self._outcomes: dict[tuple[PromCounter, str, str], PromCounter] = {}
        self._meters: dict[str, PeerMeter] = {}
        self.heartbeat: HeartbeatProbe | None = None
        self.heartbeat_timeout = 0.0
        """Seconds of silence after which a peer is dropped; past half of it, it shows as ``late``."""
        self.streams: StreamProbe | None = None
        _COLLECTOR.add(self)

    def started(self, peer: str) -> None:
        """A transfer to ``peer`` was submitted; exactly one :meth:`settled` follows."""
        meter = self._meters.get(peer)
        if meter is not None:
            meter.started += 1

    def settled(self, kind: Kind, nbytes: int, outcome: str, seconds: float, peer: str) -> None:
        """A transfer this side sent to ``peer`` settled; ``outcome`` is ``"ok"`` or an error code."""
        self._counts[f"{kind}.{outcome}"] += 1
        self._child(_TRANSFERS, kind, outcome).inc()
        meter = self._meters.get(peer)
        if meter is not None:
            meter.settled += 1
        if outcome == "ok":
            self._counts[f"{kind}.bytes_sent"] += nbytes
            self._bytes_sent[kind].inc(nbytes)
            self._latency[kind].observe(seconds)
            if meter is not None:
                meter.sent += 1
                meter.sent_bytes += nbytes

    def answered(self, kind: Kind, nbytes: int, outcome: str, peer: str) -> None:
        """An incoming transfer from ``peer`` was acknowledged (``"ok"``) or refused (an error code)."""
        self._counts[f"received.{kind}.{outcome}"] += 1
        self._child(_RECEIVED, kind, outcome).inc()
        if outcome == "ok":
            self._counts[f"{kind}.bytes_received"] += nbytes
            self._bytes_received[kind].inc(nbytes)
            meter = self._meters.get(peer)
            if meter is not None:
                meter.received += 1
                meter.received_bytes += nbytes

    def _child(self, family: PromCounter, kind: str, outcome: str) -> PromCounter:
        """The labelled series, looked up once (``labels()`` costs microseconds per call)."""
        key = (family, kind, outcome)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = family.labels(self.agent, kind, outcome)
        return child

    def peer_event(self, event: str, peer_id: str, reason: str, peers: int, lane: LaneKind = "ucx") -> None:
        """``peer_id`` joined (over a ``lane`` of that kind) or left (``reason``: an error code)."""
        self._counts[f"peers.{event}"] += 1
        _PEER_EVENTS.labels(self.agent, event, reason).inc()
        self._peers.set(peers)
        if event == "joined":
            self._meters[peer_id] = PeerMeter(lane)
        else:
            self._meters.pop(peer_id, None)

    def snapshot(self) -> dict[str, int]:
        """Plain counters, e.g. ``{"blocks.ok": 3, "blocks.bytes_sent": 196608, ...}``."""
        return dict(self._counts)

    def close(self) -> None:
        """Forget the peers and leave ``/metrics`` (the agent closed).  Idempotent."""
        self._meters.clear()
        self._peers.set(0)
        _COLLECTOR.discard(self)

    def collect(self, out: _Families) -> None:
        """Add this agent's per-peer and per-stream series to ``out`` (runs in the scrape thread)."""
        agent, now, probe = self.agent, time.monotonic(), self.heartbeat
        for peer, meter in list(self._meters.items()):  # an atomic copy: the loop may change it
            heard = probe(peer) if probe is not None else None
            age = None if heard is None else max(0.0, now - heard)
            late = age is not None and self.heartbeat_timeout > 0 and age > self.heartbeat_timeout / 2
            out.info.add_metric([agent, peer, meter.lane, "late" if late else "joined"], 1)
            if age is not None:
                out.heartbeat_age.add_metric([agent, peer], age)
            out.in_flight.add_metric([agent, peer], meter.in_flight)
            out.peer_bytes.add_metric([agent, peer, "sent"], meter.sent_bytes)
            out.peer_bytes.add_metric([agent, peer, "received"], meter.received_bytes)
            out.peer_transfers.add_metric([agent, peer, "sent"], meter.sent)
            out.peer_transfers.add_metric([agent, peer, "received"], meter.received)
        streams = self.streams
        if streams is not None:
            by_stage: dict[str, tuple[int, int]] = {}
            for stage, active, stalls in streams():
                total_active, total_stalls = by_stage.get(stage, (0, 0))
                by_stage[stage] = (total_active + active, total_stalls + stalls)
            for stage, (active, stalls) in by_stage.items():
                out.streams_active.add_metric([agent, stage], active)
                out.streams_stalled.add_metric([agent, stage], stalls)


class _Families:
    """The families one scrape fills, one series per agent and peer (or stage)."""

    def __init__(self) -> None:
        peer = ["agent", "peer"]
        self.info = GaugeMetricFamily(
            "omni_async_peer_info", "1 per joined peer; lane: same-host or ucx; state: joined or late "
            "(silent for over half the heartbeat timeout)", labels=[*peer, "lane", "state"])
        self.heartbeat_age = GaugeMetricFamily(
            "omni_async_peer_heartbeat_age_seconds", "Seconds since the peer was last heard from", labels=peer)
        self.in_flight = GaugeMetricFamily(
            "omni_async_in_flight", "Transfers to the peer submitted and not settled yet", labels=peer)
        self.peer_bytes = CounterMetricFamily(
            "omni_async_peer_bytes", "Payload bytes of transfers settled ok, by peer and direction",
            labels=[*peer, "direction"])
        self.peer_transfers = CounterMetricFamily(
            "omni_async_peer_transfers", "Transfers settled ok, by peer and direction", labels=[*peer, "direction"])
        self.streams_active = GaugeMetricFamily(
            "omni_async_streams_active", "Chunk streams with receive-side state (waiting or buffered)",
            labels=["agent", "stage"])
        self.streams_stalled = CounterMetricFamily(
            "omni_async_streams_stalled", "Chunk streams failed by their stall deadline", labels=["agent", "stage"])

    def __iter__(self) -> Iterator[Metric]:
        return iter(vars(self).values())


class _Collector:
    """The custom collector that reads every live :class:`Metrics` at scrape time."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Metrics] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, metrics: Metrics) -> None:
        with self._lock:
            self._live.add(metrics)

    def discard(self, metrics: Metrics) -> None:
        with self._lock:
            self._live.discard(metrics)

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        with self._lock:
            live = list(self._live)
        for metrics in live:
            metrics.collect(families)
        return iter(families)

    def describe(self) -> Iterator[Metric]:
        return iter(_Families())


_COLLECTOR = _Collector()
REGISTRY.register(_COLLECTOR)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` for every agent of this process (a daemon thread of prometheus_client)."""
    start_http_server(port, addr=host)
