"""How much CPU other processes used while the bench ran: the bench's numbers are only as good
as the machine was quiet (on 2 cores one busy neighbour halves what a two-process pair gets).

:class:`ForeignLoad` reads whole-machine busy time from ``/proc/stat`` and subtracts the CPU of
this process and its reaped children (``os.times``); call :meth:`ForeignLoad.stop` after every
child has been waited for.
"""

from __future__ import annotations

import os
import time


def _cpu_seconds() -> tuple[float, float]:
    """Whole-machine (process time: user + nice + system, steal) in seconds.  Interrupt time is
    left out: it is charged to no process (loopback TCP's softirqs land there)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (values[0] + values[1] + values[2]) / tick, values[7] / tick


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ForeignLoad:
    """Started on creation; :meth:`stop` returns other processes' CPU in cores (0.0 = quiet) and
    the hypervisor's steal."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._busy0, self._steal0 = _cpu_seconds()
        self._own0 = _own_seconds()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self._t0
        busy, steal = _cpu_seconds()
        busy, steal = busy - self._busy0, steal - self._steal0
        own = _own_seconds() - self._own0
        return {
            "wall_s": round(wall, 1),
            "bench_cores": round(own / wall, 2),
            "foreign_cores": round(max(0.0, busy - own) / wall, 2),
            "steal_cores": round(steal / wall, 2),
        }
