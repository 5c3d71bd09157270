"""A private tmux server for tests that look at a terminal the way a person does."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


class Tmux:
    """Commands run in panes of a tmux server of their own (its own socket, killed at the end).

    Panes stay after their command exits (``remain-on-exit``), so its last screen can be read.
    """

    def __init__(self) -> None:
        self.prefix = ["tmux", "-L", f"omni-test-{os.getpid()}-{secrets.token_hex(4)}", "-f", "/dev/null"]
        self._tmux("new-session", "-d", "-s", "base")
        self._tmux("set-option", "-g", "remain-on-exit", "on")

    def _tmux(self, *args: str) -> str:
        return subprocess.run([*self.prefix, *args], capture_output=True, text=True, timeout=10, check=True).stdout

    def run(self, name: str, *argv: str, width: int = 160) -> None:
        """Run ``python -m omni_async.cli ARGV`` in a new session ``name`` (a terminal ``width`` wide)."""
        command = " ".join([f"env PYTHONPATH={ROOT} UCX_NET_DEVICES=lo", sys.executable, "-m", "omni_async.cli", *argv])
        self._tmux("new-session", "-d", "-s", name, "-x", str(width), "-y", "40", "-c", str(ROOT), command)

    def screen(self, name: str, *, history: bool = False) -> str:
        """What the session's pane shows now (lines the terminal wrapped joined again); with
        ``history``, everything it printed, lines scrolled off the top included."""
        scrollback = ["-S", "-"] if history else []
        return self._tmux("capture-pane", "-p", "-J", *scrollback, "-t", name)

    def record(self, name: str, path: Path) -> None:
        """Append everything the session's pane is sent from now on to ``path``, raw (escape
        sequences included): what a live screen shows only for a moment (a progress bar that
        vanishes when done) is there for good."""
        self._tmux("pipe-pane", "-o", "-t", name, f"cat >> {shlex.quote(str(path))}")

    def close(self) -> None:
        subprocess.run([*self.prefix, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    """A :class:`Tmux`; the test is skipped when tmux is not installed."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install -y tmux): the terminal view cannot be watched")
    server = Tmux()
    try:
        yield server
    finally:
        server.close()
