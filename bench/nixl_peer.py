"""A NIXL agent in its own process: the receiver or the sender of the NIXL side of ``blocks``.

``python -m bench.nixl_peer recv SPEC_JSON`` / ``python -m bench.nixl_peer send SPEC_JSON``
where SPEC is ``{"name", "path", "nbytes", "error_handling"}``: the agent registers ``nbytes``
of the file ``path`` (memory-mapped, shared with the bench process, which fills and checks it)
with NIXL's UCX backend, **without a progress thread**, and prints its ready line:
``{"name", "addr", "metadata" (hex), "backend_params"}``.  ``UCX_*`` variables in the
environment choose the transports (``UCX_TLS=tcp`` for the tcp rows).

Requests, one JSON line each, answered with one line (``{"error": ...}`` on failure):

* receiver: ``{"cmd": "poll"}`` answers ``{"polling": true}`` then progresses the agent (by
  draining notifications) in a busy loop until the next line arrives, which must be
  ``{"cmd": "idle"}``, answered with ``{"notifs": N}``.  NIXL without a progress thread only
  moves when called, and UCX's tcp transport needs the target to progress; the receiver is
  busy only while the bench times NIXL, so it never competes with the other contenders.
* sender: ``{"cmd": "connect", "metadata": hex, "addr": int}`` loads the receiver's metadata;
  ``{"cmd": "run", "block_len", "local", "remote", "iters", "warmup"}`` answers ``{"ns": [...]}``,
  the time of each write of the listed blocks (make_prepped_xfer + transfer + polling
  check_xfer_state until DONE + release), one transfer in flight.

The process exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

import numpy as np

from .procs import say

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


class _Peer:
    """A NIXL agent over one registered file-backed region."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from nixl_cu12 import nixl_agent, nixl_agent_config

        self.name: str = spec["name"]
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self.agent = nixl_agent(self.name, config)
        params = {"ucx_error_handling_mode": spec["error_handling"]} if spec.get("error_handling") else {}
        self.agent.create_backend("UCX", params)
        self.buffer = np.memmap(spec["path"], dtype=np.uint8, mode="r+", shape=(spec["nbytes"],))
        self.addr = int(self.buffer.__array_interface__["data"][0])
        self.nbytes = int(spec["nbytes"])
        self.reg = self.agent.register_memory([(self.addr, self.nbytes, 0, "")], "DRAM")
        self.remote: str | None = None
        self.remote_addr = 0
        self._prepped: dict[int, tuple[Any, Any]] = {}

    def ready(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "addr": self.addr,
            "metadata": self.agent.get_agent_metadata().hex(),
            "backend_params": self.agent.get_backend_params("UCX"),
        }

    # -- sender --------------------------------------------------------------------------------
    def connect(self, metadata: str, addr: int) -> dict[str, Any]:
        name = self.agent.add_remote_agent(bytes.fromhex(metadata))
        self.remote = name.decode() if isinstance(name, bytes) else str(name)
        self.remote_addr = addr
        self.agent.make_connection(self.remote)
        return {"remote": self.remote}

    def _dlists(self, block_len: int) -> tuple[Any, Any]:
        """Prepared local and remote descriptor lists, one descriptor per block (cached)."""
        if block_len not in self._prepped:
            n = self.nbytes // block_len
            rows = np.arange(n, dtype=np.uint64) * np.uint64(block_len)

            def descs(base: int) -> np.ndarray:
                out = np.zeros((n, 3), dtype=np.uint64)
                out[:, 0] = rows + np.uint64(base)
                out[:, 1] = block_len
                return out

            local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(self.addr), "DRAM")
            assert self.remote is not None, "connect first"
            remote = self.agent.prep_xfer_dlist(self.remote, descs(self.remote_addr), "DRAM")
            self._prepped[block_len] = (local, remote)
        return self._prepped[block_len]

    def run(self, block_len: int, local: list[int], remote: list[int], iters: int, warmup: int) -> dict[str, Any]:
        assert self.remote is not None, "connect first"
        local_h, remote_h = self._dlists(block_len)
        lidx = np.asarray(local, dtype=np.int32)
        ridx = np.asarray(remote, dtype=np.int32)
        agent, clock = self.agent, time.perf_counter_ns
        samples: list[int] = []
        for i in range(warmup + iters):
            t0 = clock()
            handle = agent.make_prepped_xfer("WRITE", local_h, lidx, remote_h, ridx, b"w")
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            t1 = clock()
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in state {state}")
            if i >= warmup:
                samples.append(t1 - t0)
        return {"ns": samples}

    # -- receiver ------------------------------------------------------------------------------
    def poll_until_input(self) -> int:
        """Drain notifications until stdin is readable; return how many arrived."""
        count, spins = 0, 0
        agent = self.agent
        while True:
            notifs = agent.get_new_notifs()
            if notifs:
                count += sum(len(v) for v in notifs.values())
            spins += 1
            if spins % 32 == 0 and select.select([sys.stdin], [], [], 0)[0]:
                return count


def main(argv: list[str]) -> None:
    role, spec_json = argv
    try:
        peer = _Peer(json.loads(spec_json))
    except Exception as exc:  # report why NIXL is unavailable instead of a traceback
        say({"error": f"{type(exc).__name__}: {exc}"})
        return
    say(peer.ready())
    while line := sys.stdin.readline():
        request = json.loads(line)
        cmd = request.pop("cmd")
        try:
            if role == "send" and cmd == "connect":
                say(peer.connect(**request))
            elif role == "send" and cmd == "run":
                say(peer.run(**request))
            elif role == "recv" and cmd == "poll":
                say({"polling": True})
                notifs = peer.poll_until_input()
                follow = json.loads(sys.stdin.readline() or '{"cmd": "eof"}')
                if follow.get("cmd") != "idle":
                    return
                say({"notifs": notifs})
            else:
                say({"error": f"unknown request {cmd!r} for role {role!r}"})
        except Exception as exc:
            say({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main(sys.argv[1:])
