"""Child processes that speak JSON lines: one request per stdin line, one answer per stdout line.

A :class:`Child` is started with :meth:`Child.start`, which waits for its first line (the
"ready" message).  :meth:`Child.stop` closes stdin (the child's cue to exit) and kills it if it
does not exit in time; use ``async with`` or a ``try/finally`` so no child ever outlives the bench.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from . import CLEAN_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""Repository root: children run there so ``python -m bench.<module>`` resolves."""

_LINE_LIMIT = 64 << 20  # answers carry per-iteration timings and metadata blobs


def _die_with_parent() -> None:
    """In the child before exec: be killed if the bench process dies (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class ChildError(RuntimeError):
    """A child exited, timed out or answered with an error."""


class Child:
    """One ``python -m MODULE ARGS...`` child; ``ready`` is the first JSON object it printed."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str, stderr: Any) -> None:
        self.proc = proc
        self.name = name
        self.ready: dict[str, Any] = {}
        self._stderr = stderr  # a temporary file: a pipe nobody reads could block the child
        self.noise: list[str] = []
        """Non-JSON stdout lines (at most 1000 kept), e.g. UCX_PROTO_INFO tables."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(
        cls,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Child:
        """Spawn the child with :data:`bench.CLEAN_ENV` plus ``env``; wait up to ``timeout`` s
        for its ready line.

        Raises :class:`ChildError` (with the child's stderr tail) if it exits or stays silent.
        """
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child; closed by stop()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *args,
            cwd=ROOT,
            env={**CLEAN_ENV, **(env or {})},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            limit=_LINE_LIMIT,
            preexec_fn=_die_with_parent,
        )
        child = cls(proc, module, stderr)
        try:
            child.ready = await child._read(timeout)
        except BaseException:
            await child.stop(grace=0)
            raise
        return child

    async def request(self, message: Mapping[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """Send one JSON line and return the child's one-line JSON answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()
        return await self._read(timeout)

    async def _read(self, timeout: float) -> dict[str, Any]:
        """The next JSON object line; other lines (UCX_PROTO_INFO and the like print to
        stdout) are skipped."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await self.proc.stdout.readline()
                    if not line:
                        break
                    if line.startswith(b"{"):
                        try:
                            answer: dict[str, Any] = json.loads(line)
                        except ValueError:
                            pass
                        else:
                            break
                    if len(self.noise) < 1000:
                        self.noise.append(line.decode(errors="replace").rstrip())
        except TimeoutError:
            raise ChildError(f"{self.name} gave no answer within {timeout} s") from None
        if not line:
            raise ChildError(f"{self.name} exited: {await self._stderr_tail()}")
        if "error" in answer:
            raise ChildError(f"{self.name}: {answer['error']}")
        return answer

    async def _stderr_tail(self) -> str:
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            pass
        return f"rc={self.proc.returncode}: " + " | ".join(self.stderr_text().splitlines()[-5:])

    def stderr_text(self) -> str:
        """Everything the child wrote to stderr so far ("" once stopped)."""
        if self._stderr.closed:
            return ""
        self._stderr.seek(0)
        text: bytes = self._stderr.read()
        return text.decode(errors="replace").strip()

    async def stop(self, grace: float = 5.0) -> None:
        """Close stdin, wait ``grace`` s, then kill.  Idempotent; never raises."""
        proc = self.proc
        if proc.returncode is None:
            try:
                if proc.stdin is not None and not proc.stdin.is_closing():
                    proc.stdin.close()
                await asyncio.wait_for(proc.wait(), grace)
            except (TimeoutError, OSError, ConnectionError):
                pass
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        self._stderr.close()


class Children:
    """Every child started through it is stopped by :meth:`stop_all` (use ``async with``)."""

    def __init__(self) -> None:
        self._children: list[Child] = []

    async def start(self, module: str, args: Sequence[str], **kwargs: Any) -> Child:
        child = await Child.start(module, args, **kwargs)
        self._children.append(child)
        return child

    async def stop_all(self) -> None:
        children, self._children = self._children, []
        await asyncio.gather(*(child.stop() for child in reversed(children)))

    async def __aenter__(self) -> Children:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop_all()


def say(message: Mapping[str, Any]) -> None:
    """Child side: print one JSON line and flush it."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def until_stdin_closes() -> None:
    """Child side, in an asyncio program: wait for EOF on stdin (input is discarded), no thread."""
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    fd = sys.stdin.fileno()

    def readable() -> None:
        if not os.read(fd, 4096):
            closed.set()

    loop.add_reader(fd, readable)
    try:
        await closed.wait()
    finally:
        loop.remove_reader(fd)
