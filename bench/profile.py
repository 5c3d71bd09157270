"""``python -m bench profile``: where the time of one small transfer goes, per function.

Two agents in this process, on one event loop, joined as a same-host pair (the default lane);
``--kind a`` awaits ``write_blocks`` of one 64 KiB block (workload a), ``--kind message``
awaits ``send_message`` of one 8.9 KiB frame (the chunk_8k shape, without the adapter).  It
first times ``--writes`` transfers without the profiler (p50, the number to compare), then runs
them again under cProfile and prints the functions that take the most time *per transfer*
(both sides together: sender and receiver share the loop, so this is the whole hand-off cost).
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from omni_async import Agent, AgentConfig, BlockRegion

from .provenance import provenance_text, stamp

BLOCK_LEN = 64 * 1024
MESSAGE_BYTES = 9088  # 8.9 KiB, the chunk_8k frame


async def _pair(stack: contextlib.AsyncExitStack) -> Agent:
    """A connected sender whose receiver ("rx") drops messages; both are closed by ``stack``."""
    config = {"ucx_net_devices": "lo", "heartbeat_timeout": 30.0}
    rx, tx = [
        await stack.enter_async_context(Agent(BlockRegion.allocate(16, BLOCK_LEN), AgentConfig(peer_id=name, **config)))
        for name in ("rx", "tx")
    ]
    await tx.connect(rx.control_address)
    rx.set_message_sink(lambda _peer, _key, _meta, _frames: None)
    return tx


def _transfer(tx: Agent, kind: str) -> Callable[[], Awaitable[None]]:
    frame = np.ones(MESSAGE_BYTES, np.uint8)

    async def one() -> None:
        if kind == "a":
            await tx.write_blocks("rx", [3], [5])
        else:
            await tx.send_message("rx", "k", b"", [frame])

    return one


async def run_profile(kind: str, writes: int, top: int) -> dict[str, Any]:
    """Time ``writes`` transfers, then profile as many; return the report."""
    async with contextlib.AsyncExitStack() as stack:
        tx = await _pair(stack)
        one = _transfer(tx, kind)
        for _ in range(200):  # warm-up: lanes wired, pages touched
            await one()
        samples = []
        for _ in range(writes):
            t0 = time.perf_counter_ns()
            await one()
            samples.append(time.perf_counter_ns() - t0)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(writes):
            await one()
        profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    functions = [
        {
            "function": f"{path.rsplit('/', 1)[-1]}:{line}({name})",
            "calls_per_transfer": round(calls / writes, 2),
            "own_us_per_transfer": round(own / writes * 1e6, 2),
            "cumulative_us_per_transfer": round(cumulative / writes * 1e6, 2),
        }
        for (path, line, name), (_prim, calls, own, cumulative, _callers) in rows
    ]
    return {
        **stamp(),
        "kind": kind,
        "transfers": writes,
        "p50_us_unprofiled": round(float(np.percentile(samples, 50)) / 1e3, 1),
        "functions": functions,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"profile of {report['transfers']} transfers of kind {report['kind']!r} (one process, both sides); "
        f"unprofiled p50 {report['p50_us_unprofiled']} µs",
        "| own µs/transfer | cumulative µs | calls/transfer | function |",
        "|---|---|---|---|",
    ]
    for row in report["functions"]:
        lines.append(
            f"| {row['own_us_per_transfer']} | {row['cumulative_us_per_transfer']} | "
            f"{row['calls_per_transfer']} | `{row['function']}` |"
        )
    lines.append(provenance_text(report))
    return "\n".join(lines)


