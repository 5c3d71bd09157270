"""``omni-async top`` and the series it reads: a live pair of real processes, watched in tmux as a
person would, ``--once --json`` for scripts, and the per-peer / stream series scraped over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from omni_async import DeadlineExceeded, top

if TYPE_CHECKING:
    from tests.helpers.terminal import Tmux

pytestmark = pytest.mark.timeout(60)
pytest_plugins = ["tests.helpers.terminal"]  # the tmux fixture

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "omni_async.cli"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def scrape(port: int) -> top.Scrape:
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    return top.parse(body, time.monotonic())


@pytest.fixture
async def live_pair(spawn_peer: Any, tmp_path: Path) -> tuple[int, Any]:
    """A receiver process ``rx`` serving /metrics on a port, and a process ``tx`` writing blocks
    into it in a loop; returns ``(metrics port, writer)``.  A free port can be taken by another
    socket before the receiver binds it (its start then fails): a few fresh ports are tried."""
    for attempt in range(3):
        port = free_port()
        try:
            rx = await spawn_peer("serve", str(tmp_path / f"rx{attempt}"), 64, 4096,
                                  {"peer_id": "rx", "metrics_port": port})
            break
        except RuntimeError:  # exited before it was ready: the port was taken
            if attempt == 2:
                raise
    tx = await spawn_peer("pump", str(tmp_path / "tx"), 64, 4096, {"peer_id": "tx"}, rx.info["address"])
    assert tx.info == {"connected": "rx"}
    return port, tx


# -- the plain, scriptable snapshot ---------------------------------------------------------------
async def test_once_json_reports_peers_and_rates_of_a_live_pair(live_pair: tuple[int, Any]) -> None:
    port, _ = live_pair
    proc = await asyncio.create_subprocess_exec(
        *CLI, "top", str(port), "--once", "--json", "--interval", "0.5", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    snapshot = json.loads(out)
    assert snapshot["ok"] is True and snapshot["window_s"] >= 0.5
    (agent,) = snapshot["agents"]
    assert agent["agent"] == "rx" and agent["peers_joined"] == 1 and agent["peers_left"] == 0
    (peer,) = agent["peers"]
    assert peer["peer"] == "tx" and peer["lane"] == "same-host" and peer["state"] == "joined"
    assert 0 <= peer["heartbeat_age_s"] < 1.0
    assert peer["received_bytes_per_s"] > 0 and peer["received_transfers_per_s"] > 0
    assert peer["bytes_received"] == 64 * 4096 * peer["transfers_received"]  # whole-region writes
    assert agent["failures"] == {"sent": {}, "received": {}}


def test_once_without_an_endpoint_fails_with_the_reason() -> None:
    port = free_port()  # nothing listens there
    done = subprocess.run([*CLI, "top", str(port), "--once", "--json", "--interval", "0.1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    answer = json.loads(done.stdout)
    assert answer["ok"] is False and str(port) in answer["error"]


def test_top_needs_an_endpoint_and_json_needs_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_async import cli

    monkeypatch.delenv("OMNI_ASYNC_AGENT__METRICS_PORT", raising=False)
    assert cli.main(["top", "--once"]) == cli.EXIT_USAGE  # the default config has no metrics port
    assert "agent.metrics_port" in capsys.readouterr().err
    assert cli.main(["top", "9", "--json"]) == cli.EXIT_USAGE
    assert "--json needs --once" in capsys.readouterr().err


# -- as a person sees it: the live view in a terminal -----------------------------------------------
_RECV_ROW = re.compile(r"^\s*tx\s+(\S+)\s+(\S+)\s+([\d.]+)s ago\s+(\d+)\s+\S+ \S*B/s\s+([\d.]+) (\S*)B/s\s+([\d.]+)\s*$")


async def test_live_view_in_tmux_shows_the_peer_and_a_moving_throughput(live_pair: tuple[int, Any], tmux: Tmux) -> None:
    port, _ = live_pair
    tmux.run("top", "top", str(port), "--interval", "0.3", "--window", "1", width=120)

    def tx_row(text: str) -> re.Match[str] | None:
        return next((m for line in text.splitlines() if (m := _RECV_ROW.match(line))), None)

    seen: list[re.Match[str]] = []
    screen = ""
    async with asyncio.timeout(30):
        while len({m.group(7) for m in seen}) < 2:  # the transfers/s figure moved
            await asyncio.sleep(0.4)
            screen = await asyncio.to_thread(tmux.screen, "top")
            row = tx_row(screen)
            if row is not None and float(row.group(5)) > 0:
                seen.append(row)
    assert "omni-async top" in screen and "agent rx: 1 peers" in screen, screen
    row = seen[-1]
    assert row.group(1) == "same-host" and row.group(2) == "joined"
    assert float(row.group(3)) < 1.0  # heartbeat age
    assert row.group(6) in ("K", "M", "G") and float(row.group(7)) > 0, screen
    assert "failures: none" in screen


# -- the series top reads, scraped from in-process services -----------------------------------------
async def test_in_flight_and_per_peer_series(make_agent: Any) -> None:
    port = free_port()
    a = await make_agent(peer_id="fa", metrics_port=port)
    b = await make_agent(peer_id="fb")
    await a.connect(b.control_address)
    await asyncio.wait_for(b.wait_for_peer("fa"), 5)
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_sink(*_args: Any) -> None:  # holds the acknowledgement back
        entered.set()
        await release.wait()

    b.set_message_sink(slow_sink)
    transfer = a.send_message("fb", "k", b"", [b"12345"])
    await asyncio.wait_for(entered.wait(), 5)
    peer = (await scrape(port)).agents["fa"].peers["fb"]
    assert peer.in_flight == 1 and peer.transfers_sent == 0
    release.set()
    await asyncio.wait_for(transfer, 5)
    peer = (await scrape(port)).agents["fa"].peers["fb"]
    assert peer.in_flight == 0 and peer.transfers_sent == 1 and peer.bytes_sent == 5
    assert peer.lane == "same-host" and peer.state == "joined" and peer.heartbeat_age_s is not None
    await a.remove_peer("fb")
    agent = (await scrape(port)).agents["fa"]
    assert agent.peers == {} and agent.peers_left == 1


async def test_an_empty_write_is_neither_in_flight_nor_a_failure(make_agent: Any) -> None:
    port = free_port()
    a = await make_agent(peer_id="ea", metrics_port=port, transfer_timeout=0.3)
    b = await make_agent(peer_id="eb")
    await a.connect(b.control_address)
    await asyncio.wait_for(a.write_blocks("eb", [], []), 5)
    assert (await scrape(port)).agents["ea"].peers["eb"].in_flight == 0
    await asyncio.sleep(0.5)  # past transfer_timeout: no deadline fires for it
    assert (await scrape(port)).agents["ea"].failures["sent"] == {}
    assert a.stats()["blocks.ok"] == 1 and "blocks.deadline" not in a.stats()


async def test_streams_active_then_stalled(make_service: Any) -> None:
    port = free_port()
    svc = await make_service("sa", agent={"metrics_port": port}, adapter={"stall_timeout": 0.3})
    adapter = svc.adapter("st")
    waiting = adapter.load_async("r1")  # a chunk that never comes
    assert (await scrape(port)).agents["sa"].streams == {"st": {"active": 1.0, "stalled": 0.0}}
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(waiting, 5)
    assert (await scrape(port)).agents["sa"].streams == {"st": {"active": 0.0, "stalled": 1.0}}


# -- the sans-I/O core ---------------------------------------------------------------------------
def _text(sent: int, transfers: int, failed: int = 0) -> str:
    return "\n".join([
        "# TYPE omni_async_peer_info gauge",
        'omni_async_peer_info{agent="a",peer="p",lane="ucx",state="late"} 1.0',
        "# TYPE omni_async_peer_bytes counter",
        f'omni_async_peer_bytes_total{{agent="a",peer="p",direction="sent"}} {sent}',
        "# TYPE omni_async_peer_transfers counter",
        f'omni_async_peer_transfers_total{{agent="a",peer="p",direction="sent"}} {transfers}',
        "# TYPE omni_async_transfers counter",
        f'omni_async_transfers_total{{agent="a",kind="blocks",outcome="peer_lost"}} {failed}',
        'omni_async_transfers_total{agent="a",kind="blocks",outcome="ok"} 9.0',
        "# TYPE other_metric gauge",
        "other_metric 3.0",
        "",
    ])


def test_rates_over_the_window_and_a_restarted_peer() -> None:
    rates = top.Rates(window=10)
    rates.add(top.parse(_text(1000, 10), at=100.0))
    assert rates.view()["agents"][0]["peers"][0]["sent_bytes_per_s"] is None  # one scrape: no rate yet
    rates.add(top.parse(_text(5000, 30, failed=2), at=102.0))
    view = rates.view()
    assert view["window_s"] == 2.0
    (agent,) = view["agents"]
    (peer,) = agent["peers"]
    assert (peer["lane"], peer["state"]) == ("ucx", "late")
    assert peer["sent_bytes_per_s"] == 2000.0 and peer["sent_transfers_per_s"] == 10.0
    assert agent["failures"] == {"sent": {"peer_lost": 2.0}, "received": {}}
    rates.add(top.parse(_text(10, 1, failed=2), at=104.0))  # the peer re-joined: counters restarted
    assert rates.view()["agents"][0]["peers"][0]["sent_bytes_per_s"] == 0.0
    rendered = top.render(rates.view(), "test")
    assert rendered is not None


def test_metrics_url_forms() -> None:
    assert top.metrics_url("9100") == "http://127.0.0.1:9100/metrics"
    assert top.metrics_url("host:9100") == "http://host:9100/metrics"
    assert top.metrics_url("http://host:9100/metrics") == "http://host:9100/metrics"
