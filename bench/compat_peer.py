"""The synchronous facade in its own processes: the ``compat_*`` rows of ``blocks``.

``python -m bench.compat_peer recv SPEC_JSON`` / ``python -m bench.compat_peer send SPEC_JSON``
where SPEC is a list of ``{"path", "num_blocks", "block_len", "config"}``: one
:class:`~omni_async.compat.SyncDataTransport` per entry over the memory-mapped file ``path``
(shared with the bench process, which fills and checks it), configured by ``config`` (a mapping
for :func:`omni_async.load_config`).  The main thread is the caller, as in a NIXL user's program:
no asyncio of its own; each transport's loop runs in the transport's thread, or in this one
during its ``write_blocks`` and ``poll`` calls (the facade's caller-run loop).

* receiver: prints ``{"peers": [{"metadata" (hex), "base_addr", "num_blocks", "block_len"}]}``
  (one per entry), then only waits (blocked on stdin, so it never holds the GIL) until stdin closes.
* sender: prints ``{"ready": true}``, then answers one JSON line per request:
  ``{"cmd": "connect", "peers": [...]}`` registers receiver ``i`` with transport ``i`` and
  answers how each writes the receiver's blocks (``{"connected": n, "direct": [kind or null]}``,
  see ``UcxTransport.direct_kind``: the receivers' views map sealed memfds, so ``"file"``);
  ``{"cmd": "run", "index", "local", "remote", "iters", "warmup", "poll", "budget_s"}`` answers
  ``{"ns": [...]}``: each write timed from ``write_blocks`` to the ``poll()`` that reports its id
  done.  ``poll`` is ``"tight"`` (poll again at once) or ``"step"`` (before each poll, one step
  of :data:`STEP_S` of pure-Python work in the same thread).  The timed loop stops early once
  ``budget_s`` has passed (at least one timed write), so a slow facade costs seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

from omni_async import load_config
from omni_async.compat import SyncDataTransport, decode_agent_metadata

from .procs import say

STEP_S = 200e-6
"""One "step" of the caller's own work between polls in ``step`` mode (pure Python, holds the GIL)."""
WRITE_DEADLINE_S = 60.0
"""A write not reported within this long fails the run."""


def _transport(entry: dict[str, Any]) -> SyncDataTransport:
    shape = (int(entry["num_blocks"]), int(entry["block_len"]))
    mapped = np.memmap(entry["path"], dtype=np.uint8, mode="r+", shape=shape).view(np.ndarray)
    return SyncDataTransport(memoryview(mapped), config=load_config(entry["config"], environ={}))


def _direct_kind(t: SyncDataTransport, core_id: str) -> str | None:
    """How ``t`` writes the blocks of its peer ``core_id`` (asked on the transport's loop)."""

    async def ask() -> str | None:
        return t.agent.transport.direct_kind(core_id)

    return asyncio.run_coroutine_threadsafe(ask(), t.loop).result(WRITE_DEADLINE_S)


def busy(seconds: float) -> int:
    """Pure-Python work for ``seconds`` (never releases the GIL on purpose); returns a checksum."""
    clock = time.perf_counter
    end, total = clock() + seconds, 0
    while clock() < end:
        for i in range(64):
            total += i * i
    return total


def _timed_writes(t: SyncDataTransport, peer: str, request: dict[str, Any]) -> list[int]:
    local, remote = list(request["local"]), list(request["remote"])
    step = request["poll"] == "step"
    if request["poll"] not in ("tight", "step"):
        raise ValueError(f"unknown poll mode {request['poll']!r}")
    clock = time.perf_counter_ns
    budget_end = clock() + int(float(request["budget_s"]) * 1e9)
    warmup, iters = int(request["warmup"]), int(request["iters"])
    samples: list[int] = []
    for i in range(warmup + iters):
        t0 = clock()
        transfer_id = t.write_blocks(peer, local, remote)
        if transfer_id is None:
            raise RuntimeError(f"write_blocks refused: {t.last_error}")
        deadline = t0 + int(WRITE_DEADLINE_S * 1e9)
        while True:
            if step:
                busy(STEP_S)
            result = t.poll(peer)
            if transfer_id in result.done:
                break
            if transfer_id in result.failed:
                raise RuntimeError(f"write failed: {t.failure_reason(transfer_id)}")
            if clock() > deadline:
                raise TimeoutError(f"write not reported within {WRITE_DEADLINE_S} s")
        t1 = clock()
        if i >= warmup:
            samples.append(t1 - t0)
            if t1 > budget_end:
                break
    return samples


def main(argv: list[str]) -> None:
    role, spec = argv[0], json.loads(argv[1])
    transports: list[SyncDataTransport] = []
    try:
        transports.extend(_transport(entry) for entry in spec)
        if role == "recv":
            say({"peers": [
                {"metadata": t.get_agent_metadata().hex(), "base_addr": t.base_addr, "num_blocks": t.num_blocks,
                 "block_len": t.block_len}
                for t in transports
            ]})
            sys.stdin.read()  # blocks (GIL released) until the bench closes stdin
            return
        if role != "send":
            raise SystemExit(f"unknown role {role!r}")
        say({"ready": True})
        while line := sys.stdin.readline():
            request = json.loads(line)
            try:
                if request["cmd"] == "connect":
                    kinds = []
                    for i, (t, peer) in enumerate(zip(transports, request["peers"], strict=True)):
                        metadata = bytes.fromhex(peer["metadata"])
                        t.add_remote_peer(f"recv-{i}", metadata, int(peer["base_addr"]),
                                          int(peer["num_blocks"]), int(peer["block_len"]))
                        kinds.append(_direct_kind(t, decode_agent_metadata(metadata).peer_id))
                    say({"connected": len(transports), "direct": kinds})
                elif request["cmd"] == "run":
                    index = int(request["index"])
                    say({"ns": _timed_writes(transports[index], f"recv-{index}", request)})
                else:
                    say({"error": f"unknown request {request['cmd']!r}"})
            except Exception as exc:
                say({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for t in transports:
            t.close()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception as exc:  # one line the parent can report, not a traceback it cannot parse
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
