"""Metrics: Prometheus counters and histograms, plus a plain snapshot for code (``stats()``).

One :class:`Metrics` per agent, labelled with its peer id.  The Prometheus series live in the
process's default registry (so one ``/metrics`` endpoint serves every agent of the process);
:func:`serve_metrics` starts that endpoint.  Updating costs a few dict and counter operations
per transfer, never per block.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram, start_http_server

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


class Metrics:
    """Counters of one agent, mirrored into Prometheus."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self._counts: Counter[str] = Counter()
        self._bytes_sent = {kind: _BYTES.labels(agent, "sent", kind) for kind in ("blocks", "messages")}
        self._bytes_received = {kind: _BYTES.labels(agent, "received", kind) for kind in ("blocks", "messages")}
        self._latency = {kind: _LATENCY.labels(agent, kind) for kind in ("blocks", "messages")}
        self._peers = _PEERS.labels(agent)
        self._outcomes: dict[tuple[PromCounter, str, str], PromCounter] = {}

    def settled(self, kind: Kind, nbytes: int, outcome: str, seconds: float) -> None:
        """A transfer this side sent settled; ``outcome`` is ``"ok"`` or an error code."""
        self._counts[f"{kind}.{outcome}"] += 1
        self._child(_TRANSFERS, kind, outcome).inc()
        if outcome == "ok":
            self._counts[f"{kind}.bytes_sent"] += nbytes
            self._bytes_sent[kind].inc(nbytes)
            self._latency[kind].observe(seconds)

    def answered(self, kind: Kind, nbytes: int, outcome: str) -> None:
        """An incoming transfer was acknowledged (``"ok"``) or refused (an error code)."""
        self._counts[f"received.{kind}.{outcome}"] += 1
        self._child(_RECEIVED, kind, outcome).inc()
        if outcome == "ok":
            self._counts[f"{kind}.bytes_received"] += nbytes
            self._bytes_received[kind].inc(nbytes)

    def _child(self, family: PromCounter, kind: str, outcome: str) -> PromCounter:
        """The labelled series, looked up once (``labels()`` costs microseconds per call)."""
        key = (family, kind, outcome)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = family.labels(self.agent, kind, outcome)
        return child

    def peer_event(self, event: str, reason: str, peers: int) -> None:
        self._counts[f"peers.{event}"] += 1
        _PEER_EVENTS.labels(self.agent, event, reason).inc()
        self._peers.set(peers)

    def snapshot(self) -> dict[str, int]:
        """Plain counters, e.g. ``{"blocks.ok": 3, "blocks.bytes_sent": 196608, ...}``."""
        return dict(self._counts)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` for every agent of this process (a daemon thread of prometheus_client)."""
    start_http_server(port, addr=host)
