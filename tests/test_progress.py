"""Progress of long-running commands, seen in a terminal (tmux): ``recv`` and ``send`` draw bars
on stderr while a session runs, and print nothing but JSON lines with ``--json``."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.helpers.terminal import Tmux

pytestmark = pytest.mark.timeout(60)
pytest_plugins = ["tests.helpers.terminal"]  # the tmux fixture

# 2 × 1500 chunks of 16 KiB: 49 MB (over send's 32 MiB threshold for a bar), 0.6 s or more here
STREAM = ["--requests", "2", "--chunks", "1500", "--chunk-size", "16K", "--window", "4"]
_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][A-Z0-9]|[=>78])")
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


async def recorded(path: Path, until: str) -> str:
    """What a pane recorded (:meth:`Tmux.record`) once ``until`` is in it, escape sequences
    taken out (a bar's redraws leave its text between them)."""
    text = ""
    async with asyncio.timeout(10):
        while until not in (text := _ESCAPE.sub("", path.read_text(errors="replace") if path.exists() else "")):
            await asyncio.sleep(0.05)
    return text


async def test_recv_and_send_draw_progress_bars_on_a_terminal(tmux: Tmux, tmp_path: Path) -> None:
    """Both draw a bar while the stream runs, and the bars are gone when it is done.  The bars
    are looked for in what the terminals were sent (recorded), not only in screenshots: a
    stream that takes half a second can end between two screenshots of a loaded machine."""
    port = free_port()
    tmux.run("recv", "recv", "--quiet", "--sessions", "1", "--port", str(port))
    await started(tmux, "recv", "listening on")
    tmux.record("recv", tmp_path / "recv.out")
    tmux.run("send", "send", f"tcp://127.0.0.1:{port}", *STREAM)
    tmux.record("send", tmp_path / "send.out")  # (its bar waits for the handshake: not missed)
    captures = await watch(tmux, ["send", "recv"], until="stopped (sessions)")
    assert _RECEIVING.search(await recorded(tmp_path / "recv.out", "stopped (sessions)"))
    sent = await recorded(tmp_path / "send.out", "throughput")  # (the summary table, after the bar)
    assert _SENDING.search(sent) or any(_SENDING.search(c["send"]) for c in captures), captures[-1]["send"]
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
