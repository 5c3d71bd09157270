"""Progress of long-running commands, seen in a terminal (tmux): ``recv`` and ``send`` draw bars
on stderr while a session runs, and print nothing but JSON lines with ``--json``."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.helpers.terminal import Tmux

pytestmark = pytest.mark.timeout(60)
pytest_plugins = ["tests.helpers.terminal"]  # the tmux fixture

# 2 × 3000 chunks of 16 KiB: 98 MB (over send's 32 MiB threshold for a bar), a second or two
# here (1500 a request, 0.6 s since session 19, left a loaded run too little time to see a bar)
STREAM = ["--requests", "2", "--chunks", "3000", "--chunk-size", "16K", "--window", "4"]
_RECEIVING = re.compile(r"receiving \w+ from \S+ .*[\d.]+/[\d.]+ [KM]iB")
_SENDING = re.compile(r"sending .*[\d.]+/[\d.]+ [KM]iB")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def watch(tmux: Tmux, names: list[str], until: str, seconds: float = 45) -> list[dict[str, str]]:
    """Capture the panes every 50 ms until ``until`` shows in the last one; return every capture."""
    captures: list[dict[str, str]] = []
    async with asyncio.timeout(seconds):
        while True:
            screens = {name: await asyncio.to_thread(tmux.screen, name) for name in names}
            captures.append(screens)
            if until in screens[names[-1]]:
                return captures
            await asyncio.sleep(0.05)


async def started(tmux: Tmux, name: str, text: str) -> None:
    """Wait until ``text`` shows in pane ``name`` (scrolled-off lines included); on timeout,
    fail with what the pane printed."""
    screen = ""
    try:
        async with asyncio.timeout(30):
            while text not in (screen := await asyncio.to_thread(tmux.screen, name, history=True)):
                await asyncio.sleep(0.1)
    except TimeoutError:
        pytest.fail(f"{text!r} never showed in pane {name!r}; it shows:\n{screen}")


async def test_recv_and_send_draw_progress_bars_on_a_terminal(tmux: Tmux) -> None:
    port = free_port()
    tmux.run("recv", "recv", "--quiet", "--sessions", "1", "--port", str(port))
    await started(tmux, "recv", "listening on")
    tmux.run("send", "send", f"tcp://127.0.0.1:{port}", *STREAM)
    captures = await watch(tmux, ["send", "recv"], until="stopped (sessions)")
    assert any(_RECEIVING.search(c["recv"]) for c in captures), captures[-1]["recv"]
    assert any(_SENDING.search(c["send"]) for c in captures), captures[-1]["send"]
    final = captures[-1]
    assert "-> OK" in final["recv"] and not _RECEIVING.search(final["recv"])  # the bar is gone when done
    await started(tmux, "send", "throughput")  # the summary table replaced the bar


async def test_json_mode_on_a_terminal_prints_only_json(tmux: Tmux) -> None:
    port = free_port()
    tmux.run("recv", "recv", "--json", "--quiet", "--sessions", "1", "--port", str(port), width=250)
    await started(tmux, "recv", '"listening"')
    tmux.run("send", "send", f"tcp://127.0.0.1:{port}", "--json", *STREAM, width=250)
    captures = await watch(tmux, ["send", "recv"], until='"stopped"')
    assert not any(_RECEIVING.search(c["recv"]) or _SENDING.search(c["send"]) for c in captures)
    for name in ("recv", "send"):
        await started(tmux, name, '"ok": true')
        printed = (await asyncio.to_thread(tmux.screen, name, history=True)).splitlines()
        # tmux's own note once the command exited ("Pane is dead (status 0, ...)") is not the program's
        lines = [line for line in printed if line.strip() and not line.startswith("Pane is dead")]
        assert lines and all(isinstance(json.loads(line), dict) for line in lines), lines
