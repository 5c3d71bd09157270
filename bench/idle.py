"""``python -m bench idle``: CPU used by a connected, idle pair of omni_async agents.

Two child processes (``bench.omni_peer serve`` and ``dial``) connect with the default
:class:`~omni_async.AgentConfig` (heartbeats included), settle, then sit idle for N seconds.
CPU time is read from ``/proc`` for every thread of both processes and their descendants: ``task/*/schedstat``
(nanoseconds on CPU) and, as a cross-check, ``stat`` utime+stime (clock ticks).  The result is
a percentage of one core; the target is below 1 % for the pair.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time
from typing import Any

from .procs import Children
from .provenance import stamp

TARGET_PCT = 1.0
SETTLE_S = 1.0


def family(pid: int) -> list[int]:
    """``pid`` and its live descendants (e.g. omni_async's address-vetting child)."""
    children: dict[int, list[int]] = {}
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(path.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_ns(pid: int) -> int:
    """Nanoseconds on CPU of every live thread of ``pid`` (``/proc/PID/task/*/schedstat``)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread exited meanwhile
    return total


def cpu_ticks_ns(pid: int) -> int:
    """utime + stime of ``pid`` (all its threads) from ``/proc/PID/stat``, in nanoseconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat(5))
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


async def run_idle(seconds: float) -> dict[str, Any]:
    """Measure the idle pair for ``seconds``; return per-process and total % of one core."""
    spec = [{"path": None, "num_blocks": 64, "block_len": 4096, "config": {"ucx_net_devices": "lo"}}]
    async with Children() as children:
        server = await children.start("bench.omni_peer", ["serve", json.dumps(spec)])
        dialer = await children.start("bench.omni_peer", ["dial", json.dumps(spec), server.ready["addresses"][0]])
        await asyncio.sleep(SETTLE_S)
        pids = {"receiver": family(server.pid), "dialer": family(dialer.pid)}

        def sample() -> dict[str, tuple[int, int]]:
            return {name: (sum(map(cpu_ns, group)), sum(map(cpu_ticks_ns, group))) for name, group in pids.items()}

        start = sample()
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        wall = time.monotonic() - t0
        end = sample()
        for child in (server, dialer):
            if child.proc.returncode is not None:
                raise RuntimeError(f"{child.name} exited during the idle window")

    def pct(ns: int) -> float:
        return round(100.0 * ns / (wall * 1e9), 4)

    per = {name: pct(end[name][0] - start[name][0]) for name in pids}
    ticks = {name: pct(end[name][1] - start[name][1]) for name in pids}
    total = round(sum(per.values()), 4)
    return {
        **stamp(),
        "seconds": round(wall, 3),
        "processes": {name: len(group) for name, group in pids.items()},
        "cpu_pct_of_one_core": {**per, "total": total},
        "cpu_pct_from_ticks": {**ticks, "total": round(sum(ticks.values()), 4)},
        "target_pct": TARGET_PCT,
        "met": total < TARGET_PCT,
        "config": "AgentConfig defaults (heartbeat_interval 0.5 s), ucx_net_devices=lo",
    }


def table(report: dict[str, Any]) -> str:
    """One line per process and the verdict."""
    cpu = report["cpu_pct_of_one_core"]
    lines = [f"idle pair over {report['seconds']} s ({report['config']}):"]
    lines += [f"  {name:9s} {value:.3f} % of one core" for name, value in cpu.items()]
    verdict = "met" if report["met"] else "MISSED"
    lines.append(f"  target < {report['target_pct']} % for the pair: {verdict}")
    return "\n".join(lines)
