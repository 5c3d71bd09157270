"""How much CPU other processes used while the bench ran: the bench's numbers are only as good
as the machine was quiet (on 2 cores one busy neighbour halves what a two-process pair gets).

:class:`ForeignLoad` reads whole-machine busy time from ``/proc/stat`` and subtracts the CPU of
this process and its reaped children (``os.times``); call :meth:`ForeignLoad.stop` after every
child has been waited for.

:class:`CpuMeter` reads the CPU time of two processes (this one and a peer child) over the
stretches it is told to measure, precisely enough for one batch of chunks (``schedstat``: ns).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


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


def cpu_ns(pid: int) -> int:
    """Nanoseconds process ``pid`` has run on a CPU so far, all its threads together (their
    ``/proc/<pid>/task/<tid>/schedstat``; a thread that exited is not counted)."""
    total = 0
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread exited meanwhile
            pass
    return total


class CpuMeter:
    """CPU time of this process (the sender) and of ``peer`` (its receiver child), summed over
    every ``with meter.measure():`` stretch since the last :meth:`reset`."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.sender_ns = 0
        self.receiver_ns = 0

    def reset(self) -> None:
        self.sender_ns = self.receiver_ns = 0

    @contextmanager
    def measure(self) -> Iterator[None]:
        me, peer = cpu_ns(os.getpid()), cpu_ns(self.peer)
        try:
            yield
        finally:
            self.sender_ns += cpu_ns(os.getpid()) - me
            self.receiver_ns += cpu_ns(self.peer) - peer

    def per(self, count: int) -> dict[str, float]:
        """µs of CPU per item (``count`` items were measured) on each side."""
        return {"sender_us": round(self.sender_ns / count / 1e3, 1),
                "receiver_us": round(self.receiver_ns / count / 1e3, 1)}
