"""``omni-async top``: a live view of one process's agents, read from its ``/metrics`` endpoint.

The core is free of I/O: :func:`parse` turns Prometheus exposition text into a :class:`Scrape`
(per-agent peers, in-flight transfers, failures by reason, streams), :class:`Rates` keeps the
scrapes of the last seconds and :meth:`Rates.view` adds bytes/s and transfers/s per peer,
:func:`render` draws a view with rich.  :func:`run` is the thin loop that fetches, computes and
refreshes the terminal in place (or prints one JSON snapshot with ``once``).
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

FETCH_TIMEOUT = 5.0
"""Seconds one scrape of ``/metrics`` may take."""


@dataclass
class PeerRow:
    """One joined peer as its agent reports it (counters are totals since it joined)."""

    peer: str
    lane: str = "?"
    state: str = "?"
    heartbeat_age_s: float | None = None
    in_flight: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    transfers_sent: float = 0.0
    transfers_received: float = 0.0


@dataclass
class AgentRow:
    """One agent of the scraped process."""

    agent: str
    peers: dict[str, PeerRow] = field(default_factory=dict)
    failures: dict[str, dict[str, float]] = field(default_factory=lambda: {"sent": {}, "received": {}})
    """``direction -> error code -> transfers`` that did not settle ok."""
    streams: dict[str, dict[str, float]] = field(default_factory=dict)
    """``stage -> {"active": n, "stalled": n}``."""
    peers_joined: float = 0.0
    peers_left: float = 0.0

    def peer(self, peer_id: str) -> PeerRow:
        row = self.peers.get(peer_id)
        if row is None:
            row = self.peers[peer_id] = PeerRow(peer_id)
        return row

    def stream(self, stage: str) -> dict[str, float]:
        return self.streams.setdefault(stage, {"active": 0.0, "stalled": 0.0})


@dataclass
class Scrape:
    """What one scrape said, at ``at`` (``time.monotonic()``)."""

    at: float
    agents: dict[str, AgentRow] = field(default_factory=dict)

    def agent(self, agent_id: str) -> AgentRow:
        row = self.agents.get(agent_id)
        if row is None:
            row = self.agents[agent_id] = AgentRow(agent_id)
        return row


def parse(text: str, at: float) -> Scrape:
    """Read omni_async's series out of a ``/metrics`` body; other series are ignored.

    Raises ``ValueError`` if the text is not Prometheus exposition format.
    """
    scrape = Scrape(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            agent_id = labels.get("agent")
            if agent_id is None or not sample.name.startswith("omni_async_"):
                continue
            agent = scrape.agent(agent_id)
            name = sample.name
            if name == "omni_async_peer_info":
                row = agent.peer(labels["peer"])
                row.lane, row.state = labels.get("lane", "?"), labels.get("state", "?")
            elif name == "omni_async_peer_heartbeat_age_seconds":
                agent.peer(labels["peer"]).heartbeat_age_s = value
            elif name == "omni_async_in_flight":
                agent.peer(labels["peer"]).in_flight = int(value)
            elif name in ("omni_async_peer_bytes_total", "omni_async_peer_transfers_total"):
                what = "bytes" if "bytes" in name else "transfers"
                direction = labels.get("direction", "sent")
                setattr(agent.peer(labels["peer"]), f"{what}_{direction}", value)
            elif name in ("omni_async_transfers_total", "omni_async_received_total"):
                outcome = labels.get("outcome", "ok")
                if outcome != "ok" and value:
                    by_reason = agent.failures["sent" if name == "omni_async_transfers_total" else "received"]
                    by_reason[outcome] = by_reason.get(outcome, 0.0) + value
            elif name == "omni_async_streams_active":
                agent.stream(labels["stage"])["active"] = value
            elif name == "omni_async_streams_stalled_total":
                agent.stream(labels["stage"])["stalled"] = value
            elif name == "omni_async_peer_events_total":
                if labels.get("event") == "joined":
                    agent.peers_joined += value
                else:
                    agent.peers_left += value
    return scrape


class Rates:
    """The scrapes of the last ``window`` seconds; :meth:`view` turns them into a snapshot."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._history: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> None:
        self._history.append(scrape)
        while len(self._history) > 2 and scrape.at - self._history[1].at >= self.window:
            self._history.popleft()

    def view(self) -> dict[str, Any]:
        """The latest scrape as plain data, with per-peer rates over the window (JSON-ready).

        Rates are null until two scrapes exist; a peer that re-joined (counters restarted)
        shows 0 for that window.
        """
        if not self._history:
            return {"window_s": None, "agents": []}
        latest, oldest = self._history[-1], self._history[0]
        seconds = latest.at - oldest.at
        agents = []
        for agent_id in sorted(latest.agents):
            agent = latest.agents[agent_id]
            before = oldest.agents.get(agent_id)
            peers: list[dict[str, Any]] = []
            for peer_id in sorted(agent.peers):
                row = agent.peers[peer_id]
                prior = before.peers.get(peer_id) if before is not None else None

                def rate(attr: str, row: PeerRow = row, prior: PeerRow | None = prior) -> float | None:
                    if seconds <= 0:
                        return None
                    if prior is None:
                        return float(getattr(row, attr)) / seconds if oldest is not latest else None
                    return max(0.0, float(getattr(row, attr) - getattr(prior, attr)) / seconds)

                peers.append({
                    "peer": peer_id, "lane": row.lane, "state": row.state,
                    "heartbeat_age_s": row.heartbeat_age_s, "in_flight": row.in_flight,
                    "bytes_sent": row.bytes_sent, "bytes_received": row.bytes_received,
                    "transfers_sent": row.transfers_sent, "transfers_received": row.transfers_received,
                    "sent_bytes_per_s": rate("bytes_sent"), "received_bytes_per_s": rate("bytes_received"),
                    "sent_transfers_per_s": rate("transfers_sent"),
                    "received_transfers_per_s": rate("transfers_received"),
                })
            agents.append({
                "agent": agent_id, "peers": peers, "in_flight": sum(p["in_flight"] for p in peers),
                "failures": agent.failures, "streams": agent.streams,
                "peers_joined": agent.peers_joined, "peers_left": agent.peers_left,
            })
        return {"window_s": round(seconds, 3) if seconds > 0 else None, "agents": agents}


# -- rendering -----------------------------------------------------------------------------------
def _size(value: float | None, unit: str) -> str:
    """``1.3 GB/s``-style text (decimal prefixes); a dash for an unknown value."""
    if value is None:
        return "–"
    prefixes = ["", "K", "M", "G", "T"]
    prefix = prefixes.pop(0)
    while abs(value) >= 1000 and prefixes:
        value, prefix = value / 1000, prefixes.pop(0)
    return f"{value:.1f} {prefix}{unit}" if prefix else f"{value:.0f} {unit}"


def render(view: dict[str, Any], source: str, error: str | None = None) -> RenderableType:
    """The terminal picture of a :meth:`Rates.view` (``error``: why the last scrape failed)."""
    window = view.get("window_s")
    header = Text(f"omni-async top — {source}", style="bold")
    header.append(f"   rates over {window:.1f}s" if window else "   rates: waiting for a second scrape", style="dim")
    parts: list[RenderableType] = [header]
    if error:
        parts.append(Text(f"cannot scrape: {error}", style="bold red"))
    if not view["agents"] and not error:
        parts.append(Text("no omni_async agent in this process's metrics yet", style="yellow"))
    for agent in view["agents"]:
        parts.append(Text(
            f"agent {agent['agent']}: {len(agent['peers'])} peers, {agent['in_flight']} in flight, "
            f"peers joined {agent['peers_joined']:.0f} / left {agent['peers_left']:.0f}", style="bold cyan"))
        peers = Table(expand=False, box=None, header_style="bold")
        for column in ("peer", "lane", "state", "heartbeat", "in flight", "send", "recv", "transfers/s"):
            peers.add_column(column, justify="left" if column in ("peer", "lane", "state") else "right")
        for p in agent["peers"]:
            age = p["heartbeat_age_s"]
            rates = [p["sent_transfers_per_s"], p["received_transfers_per_s"]]
            per_s = None if rates[0] is None or rates[1] is None else rates[0] + rates[1]
            peers.add_row(
                p["peer"], p["lane"], Text(p["state"], style="green" if p["state"] == "joined" else "red"),
                "–" if age is None else f"{age:.1f}s ago", str(p["in_flight"]),
                _size(p["sent_bytes_per_s"], "B/s"), _size(p["received_bytes_per_s"], "B/s"),
                "–" if per_s is None else f"{per_s:.1f}")
        if not agent["peers"]:
            peers.add_row("(no peers)", "", "", "", "", "", "", "")
        parts.append(peers)
        failures = [(direction, reason, count) for direction, reasons in agent["failures"].items()
                    for reason, count in sorted(reasons.items())]
        parts.append(Text("failures: " + (", ".join(f"{d} {r} {c:.0f}" for d, r, c in failures) or "none"),
                          style="red" if failures else "dim"))
        streams = agent["streams"]
        parts.append(Text("streams: " + (", ".join(
            f"{stage} {s['active']:.0f} active / {s['stalled']:.0f} stalled" for stage, s in sorted(streams.items()))
            or "none"), style="dim" if not streams else ""))
    return Group(*parts)


# -- I/O -----------------------------------------------------------------------------------------
def metrics_url(target: str) -> str:
    """``PORT``, ``HOST:PORT`` or a URL → the ``http://…/metrics`` URL to scrape."""
    if target.isdigit():
        return f"http://127.0.0.1:{target}/metrics"
    if "://" not in target:
        target = f"http://{target}"
    scheme, _, rest = target.partition("://")
    return target if "/" in rest else f"{scheme}://{rest}/metrics"


def fetch(url: str) -> str:
    """The body of ``url`` (raises ``OSError`` when it cannot be scraped)."""
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response:
        body: bytes = response.read()
    return body.decode()


def _scrape(url: str) -> Scrape:
    try:
        return parse(fetch(url), time.monotonic())
    except (urllib.error.URLError, http.client.HTTPException, ValueError, UnicodeDecodeError) as exc:
        # (HTTPException: a port that is no number, or one that does not speak HTTP)
        raise OSError(f"{url}: {getattr(exc, 'reason', exc)}") from None


def run(url: str, *, interval: float, window: float, once: bool, as_json: bool) -> int:
    """Show ``url``'s agents until Ctrl-C; with ``once``, one snapshot (two scrapes ``interval``
    apart, for the rates) and return.  Returns the exit status: 1 if ``once`` could not scrape."""
    rates = Rates(window)
    if once:
        try:
            rates.add(_scrape(url))
            time.sleep(interval)
            rates.add(_scrape(url))
        except OSError as exc:
            if as_json:
                print(json.dumps({"ok": False, "url": url, "error": str(exc)}), flush=True)
            else:
                print(f"omni-async: cannot scrape {exc}", file=sys.stderr, flush=True)
            return 1
        view = rates.view()
        if as_json:
            print(json.dumps({"ok": True, "url": url, **view}), flush=True)
        else:
            Console().print(render(view, url))
        return 0
    console = Console()
    with Live(render(rates.view(), url), console=console, auto_refresh=False, screen=console.is_terminal) as live:
        while True:
            error = None
            try:
                rates.add(_scrape(url))
            except OSError as exc:
                error = str(exc)
            live.update(render(rates.view(), url, error), refresh=True)
            time.sleep(interval)
