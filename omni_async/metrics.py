"""Metrics: Prometheus series of every agent, plus a plain snapshot for code (``stats()``).

One :class:`Metrics` per agent, labelled with its peer id.  Nothing is written to Prometheus
while transfers run: every figure is a plain int or float on a small record bumped on the
agent's event loop (a transfer costs a few attribute and dict increments and, for latency, an
append to a pending array, counted into the buckets in bulk), and one custom collector turns
the records into families when ``/metrics`` is scraped (in a thread of the endpoint: it only
reads numbers and takes atomic copies of dicts and arrays).  The process's default registry
serves every agent of the process; :func:`serve_metrics` starts that endpoint, a
:class:`MetricsServer` its owner stops.

Agent-wide series are summed over every agent of one name, and stay after the agent closed
(its ``omni_async_peers`` drops to 0), as labelled Prometheus children did.  Per-peer figures
live on a :class:`PeerMeter` while the peer is joined.  Heartbeat ages and chunk streams are
asked of the agent's probes at scrape time.  docs/observability.md explains every series.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Hashable, Iterator
from socketserver import TCPServer
from typing import Any, Generic, Literal, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import numpy as np
import numpy.typing as npt
from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .errors import ConfigError

log = logging.getLogger(__name__)

Kind = Literal["blocks", "messages"]
KINDS: tuple[Kind, ...] = ("blocks", "messages")
BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 0.5, 2.5)
"""Upper bounds (seconds) of ``omni_async_transfer_seconds``; ``+Inf`` follows."""
_LE = [*(floatToGoString(bound) for bound in BUCKETS), "+Inf"]  # type: ignore[no-untyped-call]

LaneKind = Literal["same-host", "ucx"]
"""``same-host``: a peer on this host over shared memory; ``ucx``: any other UCX lane (tcp)."""
HeartbeatProbe = Callable[[str], float | None]
"""``probe(peer_id)``: ``time.monotonic()`` when the peer was last heard from (None: unknown)."""
InFlightProbe = Callable[[str], int]
"""``probe(peer_id)``: transfers to the peer submitted and not settled yet (0 for one not joined)."""
StreamProbe = Callable[[], list[tuple[str, int, int]]]
"""``probe()``: ``(stage, active streams, stall deadlines fired so far)`` of each adapter."""

K = TypeVar("K", bound=Hashable)


class _Tally(Generic[K]):
    """Counts by key (an outcome, or an event and reason), with when each key was first seen
    (the series' ``_created``) and, for transfers, the bytes of those that settled ok."""

    __slots__ = ("bytes", "counts", "created", "first_seen")

    def __init__(self) -> None:
        self.created = time.time()
        self.bytes = 0
        self.counts: dict[K, int] = {}
        self.first_seen: dict[K, float] = {}

    def count(self, key: K, times: int = 1) -> None:
        counts = self.counts
        n = counts.get(key)
        if n is None:
            self.first_seen[key] = time.time()
            n = 0
        counts[key] = n + times

    def absorb(self, other: _Tally[K]) -> None:
        """Add ``other``'s figures to these (earliest creation times win)."""
        self.created = min(self.created, other.created)
        self.bytes += other.bytes
        for key, n in list(other.counts.items()):
            self.counts[key] = self.counts.get(key, 0) + n
        for key, seen in list(other.first_seen.items()):
            self.first_seen[key] = min(seen, self.first_seen.get(key, seen))


class _Histogram:
    """Latencies in :data:`BUCKETS`: a count per bucket (not cumulative) and their sum.

    :meth:`observe` (the agent's loop, once per settled transfer) only appends the latency to
    a pending array (eight bytes, no object, no bucket search: the search and the sums cost
    a one-block write ~4 % of its latency, measured); the pending ones are counted into the
    buckets in bulk every :data:`_FOLD` observations and read with them by :meth:`figures`,
    which any thread may call (a scrape's): the fold and the reads hold the lock, the append
    does not need it (only the loop's thread appends and folds)."""

    __slots__ = ("_buckets", "_lock", "_pending", "_total", "created")

    def __init__(self) -> None:
        self.created = time.time()
        self._buckets = np.zeros(len(BUCKETS) + 1, np.int64)
        self._total = 0.0
        self._pending = array("d")
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        pending = self._pending
        pending.append(seconds)
        if len(pending) >= _FOLD:
            with self._lock:
                self._buckets += _bucket_counts(pending)
                self._total += sum(pending)
                del pending[:]

    def figures(self) -> tuple[list[int], float]:
        """The count in each bucket (``+Inf`` last) and the sum of every latency observed."""
        with self._lock:
            pending = array("d", self._pending)  # (an atomic copy: the loop may append meanwhile)
            return (self._buckets + _bucket_counts(pending)).tolist(), self._total + sum(pending)

    def absorb(self, other: _Histogram) -> None:
        buckets, total = other.figures()
        with self._lock:
            self.created = min(self.created, other.created)
            self._buckets += np.asarray(buckets, np.int64)
            self._total += total


_FOLD = 512
"""Latencies a :class:`_Histogram` keeps pending before it counts them into its buckets."""
_BOUNDS = np.asarray(BUCKETS)


def _bucket_counts(latencies: array[float]) -> npt.NDArray[np.int64]:
    """How many of ``latencies`` fall in each bucket (a bound is inclusive: ``le``)."""
    return np.bincount(np.searchsorted(_BOUNDS, np.frombuffer(latencies, np.float64)), minlength=len(BUCKETS) + 1)


class _Tallies:
    """Everything one agent counted for the agent-wide series, as plain numbers."""

    __slots__ = ("events", "latency", "received", "sent")

    def __init__(self) -> None:
        self.sent: dict[str, _Tally[str]] = {kind: _Tally() for kind in KINDS}
        self.received: dict[str, _Tally[str]] = {kind: _Tally() for kind in KINDS}
        self.latency = {kind: _Histogram() for kind in KINDS}
        self.events: _Tally[tuple[str, str]] = _Tally()

    def absorb(self, other: _Tallies) -> None:
        for kind in KINDS:
            self.sent[kind].absorb(other.sent[kind])
            self.received[kind].absorb(other.received[kind])
            self.latency[kind].absorb(other.latency[kind])
        self.events.absorb(other.events)


class _Name:
    """The agent-wide series of one agent name: the tallies of its live agents, those of its
    closed ones merged into one, and the ``omni_async_peers`` gauge (last value set wins)."""

    def __init__(self) -> None:
        self.live: list[_Tallies] = []
        self.retired = _Tallies()
        self.peers = 0

    def total(self) -> _Tallies:
        total = _Tallies()
        total.absorb(self.retired)
        for tallies in list(self.live):
            total.absorb(tallies)
        return total


class PeerMeter:
    """What one joined peer moved, as plain ints bumped on the event loop."""

    __slots__ = ("lane", "received", "received_bytes", "sent", "sent_bytes")

    def __init__(self, lane: LaneKind) -> None:
        self.lane = lane
        self.sent = 0
        self.sent_bytes = 0
        self.received = 0
        self.received_bytes = 0


class Metrics:
    """Counters of one agent, exported to Prometheus at scrape time.

    Every method runs on the agent's event loop.  The owner sets :attr:`heartbeat` and
    :attr:`in_flight` (and a service sets :attr:`streams`) so that a scrape can report
    heartbeat ages, transfers in flight and chunk streams (nothing is counted per transfer
    for those); :meth:`close` takes the agent's per-peer series off ``/metrics``.
    """

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self._tallies = _Tallies()
        self._sent = self._tallies.sent
        self._received = self._tallies.received
        self._latency = self._tallies.latency
        self._meters: dict[str, PeerMeter] = {}
        self.heartbeat: HeartbeatProbe | None = None
        self.heartbeat_timeout = 0.0
        """Seconds of silence after which a peer is dropped; past half of it, it shows as ``late``."""
        self.in_flight: InFlightProbe | None = None
        """Called in the scrape's thread: it must only read."""
        self.streams: StreamProbe | None = None
        self._name = _COLLECTOR.add(self, self._tallies)

    def settled(self, kind: Kind, nbytes: int, outcome: str, seconds: float, peer: str) -> None:
        """A transfer this side sent to ``peer`` settled; ``outcome`` is ``"ok"`` or an error code."""
        sent = self._sent[kind]
        sent.count(outcome)
        if outcome == "ok":
            sent.bytes += nbytes
            self._latency[kind].observe(seconds)
            meter = self._meters.get(peer)
            if meter is not None:
                meter.sent += 1
                meter.sent_bytes += nbytes

    def answered(self, kind: Kind, nbytes: int, outcome: str, peer: str, transfers: int = 1) -> None:
        """``transfers`` incoming transfers from ``peer`` (of ``nbytes`` in all) were
        acknowledged (``"ok"``) or refused (an error code)."""
        received = self._received[kind]
        received.count(outcome, transfers)
        if outcome == "ok":
            received.bytes += nbytes
            meter = self._meters.get(peer)
            if meter is not None:
                meter.received += transfers
                meter.received_bytes += nbytes

    def peer_event(self, event: str, peer_id: str, reason: str, peers: int, lane: LaneKind = "ucx") -> None:
        """``peer_id`` joined (over a ``lane`` of that kind) or left (``reason``: an error code)."""
        self._tallies.events.count((event, reason))
        self._name.peers = peers
        if event == "joined":
            self._meters[peer_id] = PeerMeter(lane)
        else:
            self._meters.pop(peer_id, None)

    def snapshot(self) -> dict[str, int]:
        """Plain counters of this agent, e.g. ``{"blocks.ok": 3, "blocks.bytes_sent": 196608, ...}``:
        ``{kind}.{outcome}``, ``received.{kind}.{outcome}``, ``{kind}.bytes_sent`` and
        ``{kind}.bytes_received`` (once one settled ok), ``peers.{event}``."""
        out: dict[str, int] = {}
        for kind in KINDS:
            sent, received = self._sent[kind], self._received[kind]
            out.update((f"{kind}.{outcome}", n) for outcome, n in sent.counts.items())
            if "ok" in sent.counts:
                out[f"{kind}.bytes_sent"] = sent.bytes
            out.update((f"received.{kind}.{outcome}", n) for outcome, n in received.counts.items())
            if "ok" in received.counts:
                out[f"{kind}.bytes_received"] = received.bytes
        for (event, _reason), n in self._tallies.events.counts.items():
            out[f"peers.{event}"] = out.get(f"peers.{event}", 0) + n
        return out

    def close(self) -> None:
        """Forget the peers and leave ``/metrics``' per-peer series; the agent-wide ones stay,
        with ``omni_async_peers`` at 0 (the agent closed).  Idempotent."""
        self._meters.clear()
        _COLLECTOR.discard(self, self._tallies)

    def collect(self, out: _Families) -> None:
        """Add this agent's per-peer and per-stream series to ``out`` (runs in the scrape thread)."""
        agent, now, probe, in_flight = self.agent, time.monotonic(), self.heartbeat, self.in_flight
        for peer, meter in list(self._meters.items()):  # an atomic copy: the loop may change it
            heard = probe(peer) if probe is not None else None
            age = None if heard is None else max(0.0, now - heard)
            late = age is not None and self.heartbeat_timeout > 0 and age > self.heartbeat_timeout / 2
            out.info.add_metric([agent, peer, meter.lane, "late" if late else "joined"], 1)
            if age is not None:
                out.heartbeat_age.add_metric([agent, peer], age)
            out.in_flight.add_metric([agent, peer], in_flight(peer) if in_flight is not None else 0)
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
    """The families one scrape fills: the agent-wide ones (one series per agent name, kind,
    outcome...), then one series per agent and peer (or stage)."""

    def __init__(self) -> None:
        self.bytes = CounterMetricFamily("omni_async_bytes", "Payload bytes moved",
                                         labels=["agent", "direction", "kind"])
        self.transfers = CounterMetricFamily("omni_async_transfers", "Transfers settled, by outcome",
                                             labels=["agent", "kind", "outcome"])
        self.received = CounterMetricFamily("omni_async_received", "Incoming transfers answered, by outcome",
                                            labels=["agent", "kind", "outcome"])
        self.latency = HistogramMetricFamily("omni_async_transfer_seconds",
                                             "From submission to the receiver's acknowledgement",
                                             labels=["agent", "kind"])
        self.peers = GaugeMetricFamily("omni_async_peers", "Joined peers", labels=["agent"])
        self.peer_events = CounterMetricFamily("omni_async_peer_events", "Peers joined and left, by reason",
                                               labels=["agent", "event", "reason"])
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

    def add_agent(self, agent: str, peers: int, tallies: _Tallies) -> None:
        """The agent-wide series of the agents named ``agent``."""
        for direction, by_kind in (("sent", tallies.sent), ("received", tallies.received)):
            for kind in KINDS:
                tally = by_kind[kind]
                self.bytes.add_metric([agent, direction, kind], tally.bytes, created=tally.created)
        for family, by_kind in ((self.transfers, tallies.sent), (self.received, tallies.received)):
            for kind in KINDS:
                tally = by_kind[kind]
                for outcome, n in tally.counts.items():
                    family.add_metric([agent, kind, outcome], n, created=tally.first_seen[outcome])
        for kind in KINDS:
            histogram = tallies.latency[kind]
            counts, total = histogram.figures()
            cumulative, buckets = 0, []
            for le, n in zip(_LE, counts, strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            self.latency.add_metric([agent, kind], buckets, total)
            self.latency.samples.append(Sample(  # what a Histogram child exports, and this family cannot add
                "omni_async_transfer_seconds_created", {"agent": agent, "kind": kind}, histogram.created))
        self.peers.add_metric([agent], peers)
        for (event, reason), n in tallies.events.counts.items():
            self.peer_events.add_metric([agent, event, reason], n, created=tallies.events.first_seen[(event, reason)])

    def __iter__(self) -> Iterator[Metric]:
        return iter(vars(self).values())


class _Collector:
    """The custom collector that reads every agent's records at scrape time."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Metrics] = weakref.WeakSet()
        self._names: dict[str, _Name] = {}
        self._lock = threading.Lock()

    def add(self, metrics: Metrics, tallies: _Tallies) -> _Name:
        """Export ``metrics`` (per peer) and ``tallies`` (summed into its name's series)."""
        with self._lock:
            self._live.add(metrics)
            name = self._names.setdefault(metrics.agent, _Name())
            name.live.append(tallies)
            return name

    def discard(self, metrics: Metrics, tallies: _Tallies) -> None:
        """``metrics``' agent closed: drop its per-peer series, keep its counts under its name."""
        with self._lock:
            self._live.discard(metrics)
            name = self._names[metrics.agent]
            name.peers = 0
            if any(live is tallies for live in name.live):
                name.live.remove(tallies)
                name.retired.absorb(tallies)

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        with self._lock:
            live = list(self._live)
            names = [(agent, name.peers, name.total()) for agent, name in self._names.items()]
        for agent, peers, tallies in names:
            families.add_agent(agent, peers, tallies)
        for metrics in live:
            metrics.collect(families)
        return iter(families)

    def describe(self) -> Iterator[Metric]:
        return iter(_Families())


_COLLECTOR = _Collector()
REGISTRY.register(_COLLECTOR)


METRICS_CONNECTIONS = 16
"""Connections the ``/metrics`` server serves at once; one more is closed unanswered."""
METRICS_IO_TIMEOUT = 5.0
"""Seconds a ``/metrics`` connection may stay silent (or not read the answer) before it is closed."""
METRICS_STOP_TIMEOUT = 5.0
"""Seconds :meth:`MetricsServer.close` waits for its threads to end, all together."""


class _Handler(WSGIRequestHandler):
    """One ``/metrics`` request; a read or write that waits :data:`METRICS_IO_TIMEOUT` fails it."""

    timeout = METRICS_IO_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        """Log no request."""


class MetricsServer(WSGIServer):
    """``/metrics`` of every agent of this process over HTTP: a listening thread and one
    thread per connection, at most :data:`METRICS_CONNECTIONS` of them (more are closed
    unanswered), each ended by :data:`METRICS_IO_TIMEOUT` of silence.

    Made by :func:`serve_metrics`; whoever made it owns it and stops it with :meth:`close`.
    """

    request_queue_size = 64  # the listen backlog (5 by default: connections beyond it wait for SYN retries)

    def __init__(self, family: socket.AddressFamily, address: tuple[Any, ...]) -> None:
        self.address_family = family
        self._open: dict[socket.socket, threading.Thread] = {}  # connections being served
        self._lock = threading.Lock()  # guards _open and _closing (the listener adds, threads remove)
        self._closing = False
        super().__init__(address, _Handler)  # binds and listens; closes its socket if that fails
        self.set_app(make_wsgi_app(REGISTRY))
        self._thread = threading.Thread(target=self.serve_forever, name="omni-async-metrics", daemon=True)
        self._thread.start()

    def server_bind(self) -> None:
        """Bind without HTTPServer's reverse lookup of the host name (a blocking DNS query)."""
        TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` on a thread of its own, or close it if :data:`METRICS_CONNECTIONS` are served."""
        thread = threading.Thread(target=self._serve, args=(request, client_address),
                                  name="omni-async-metrics-connection", daemon=True)
        with self._lock:
            refused = self._closing or len(self._open) >= METRICS_CONNECTIONS
            if not refused:
                self._open[request] = thread
        if refused:
            self.shutdown_request(request)
            return
        try:
            thread.start()
        except BaseException:
            self._done(request)
            raise

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # a timed out or reset connection ends only itself
            self.handle_error(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: socket.socket) -> None:
        self.shutdown_request(request)
        with self._lock:
            self._open.pop(request, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection failed (timed out, reset): logged at debug level, not printed to stderr."""
        log.debug("/metrics connection from %s failed", client_address, exc_info=True)

    def _stop(self) -> None:
        """Stop listening, free the port, end every connection (blocks, bounded)."""
        self.shutdown()  # serve_forever notices within its 0.5 s poll interval
        self.server_close()
        with self._lock:
            self._closing = True
            serving = dict(self._open)
        for connection in serving:  # wakes their threads' reads and writes
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + METRICS_STOP_TIMEOUT
        for thread in (self._thread, *serving.values()):
            thread.join(max(0.0, deadline - time.monotonic()))

    async def close(self) -> None:
        """Stop serving: once it returns the port is free and, unless a thread outlived
        :data:`METRICS_STOP_TIMEOUT` (a scrape still collecting), no thread of it runs.  Idempotent."""
        await asyncio.to_thread(self._stop)


async def serve_metrics(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` for every agent of this process on ``host:port``.

    Raises :class:`ConfigError` if the address cannot be served (the port is taken, by another
    process or another agent of this one; the host is not this machine's), leaving nothing
    behind.  The caller owns the server and stops it with ``await server.close()``.
    """
    try:
        family, _, _, _, address = (await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))[0]
        return MetricsServer(family, address)
    except OSError as exc:
        raise ConfigError(f"metrics_port {port}: cannot serve /metrics on {host}:{port} ({exc}); "
                          "one endpoint serves every agent of a process: set metrics_port on one of them") from exc
