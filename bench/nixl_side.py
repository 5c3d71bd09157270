"""The NIXL contender: a receiver and a sender process (``bench.nixl_peer``) per mode.

NIXL runs in child processes only, so its bundled UCX never shares a process with the one
omni_async loads.  Its agents run without a progress thread (the default thread spins about a
core per agent and halves throughput on a 2-core host); the receiver progresses only while
NIXL is being timed.  If NIXL cannot be imported or started, :attr:`NixlSide.reason` says why
and the bench reports NIXL as unavailable.
"""

from __future__ import annotations

import json
from typing import Any

from .modes import Mode
from .procs import Child, ChildError, Children
from .shm import ShmFile
from .workloads import Geometry

DEFAULT_ERROR_HANDLING = "peer"
"""NIXL's own default ``ucx_error_handling_mode`` (what ``nixl_agent`` creates unless told)."""


class NixlSide:
    """One connected NIXL sender/receiver pair in ``mode``, or the reason there is none."""

    def __init__(self, mode: Mode, error_handling: str = DEFAULT_ERROR_HANDLING) -> None:
        self.mode = mode
        self.error_handling = error_handling
        self.reason: str | None = "not started"
        self._sender: Child | None = None
        self._receiver: Child | None = None

    @property
    def available(self) -> bool:
        return self.reason is None

    @property
    def config(self) -> dict[str, Any]:
        """What the NIXL agents were configured with (for the report)."""
        return {
            "enable_prog_thread": False,
            "backend": "UCX",
            "ucx_error_handling_mode": self.error_handling,
            "env": self.mode.nixl_env,
            "completion": "sender polls check_xfer_state until DONE; a notification rides along",
        }

    async def start(self, children: Children, src: ShmFile, dst: ShmFile) -> NixlSide:
        """Start and connect both processes; on failure record the reason instead of raising."""
        def spec(role: str, file: ShmFile) -> list[str]:
            body = {"name": f"nixl-{role}-{self.mode.name}", "path": file.path, "nbytes": file.nbytes,
                    "error_handling": self.error_handling}
            return [role, json.dumps(body)]

        try:
            self._receiver = await children.start("bench.nixl_peer", spec("recv", dst), env=self.mode.nixl_env)
            self._sender = await children.start("bench.nixl_peer", spec("send", src), env=self.mode.nixl_env)
            await self._sender.request(
                {"cmd": "connect", "metadata": self._receiver.ready["metadata"], "addr": self._receiver.ready["addr"]}
            )
        except ChildError as exc:
            self.reason = str(exc)
            return self
        self.reason = None
        return self

    async def time_writes(
        self, geometry: Geometry, local: list[int], remote: list[int], iters: int, warmup: int
    ) -> list[int]:
        """Nanoseconds of each of ``iters`` NIXL writes, timed in the sender process."""
        assert self._sender is not None and self._receiver is not None, "NIXL is not available"
        await self._receiver.request({"cmd": "poll"})
        try:
            answer = await self._sender.request(
                {"cmd": "run", "block_len": geometry.block_len, "local": local, "remote": remote,
                 "iters": iters, "warmup": warmup},
                timeout=300,
            )
        finally:
            await self._receiver.request({"cmd": "idle"})
        return [int(ns) for ns in answer["ns"]]
