"""How the loop-driven parts of the data plane (a lane, a ring receiver) take turns on the
event loop: :class:`NextTurn` queues one run of a callback per loop turn, :func:`spin` polls
briefly for something that is about to happen instead of sleeping until a wake-up.  No I/O.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable


class NextTurn:
    """``next_turn(callback)`` runs ``callback`` on the loop's next turn (``loop.call_soon``),
    once however often it is called before then; a call made during that run queues one more.
    Give it the same callback every time (a later one is dropped while one is queued).

    Only the queued run clears the request, not a direct call of ``callback`` meanwhile: so at
    most one run is queued at a time, however many callers post work per loop iteration.  It
    keeps no reference to ``callback`` but the queued one (no cycle with the owner whose
    method it runs).  Loop thread only.
    """

    __slots__ = ("_loop", "_queued")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queued = False

    def __call__(self, callback: Callable[[], None]) -> None:
        if not self._queued:
            self._queued = True
            self._loop.call_soon(self._run, callback)

    def _run(self, callback: Callable[[], None]) -> None:
        self._queued = False
        callback()


def spin(poll: Callable[[], object], seconds: float) -> bool:
    """Call ``poll`` until it returns something true or ``seconds`` passed (a busy wait: keep
    ``seconds`` to microseconds); True as soon as it did.  Each round yields the CPU to any
    other runnable thread on it: the peer we wait for may have been woken onto our core."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if poll():
            return True
        os.sched_yield()
    return False
