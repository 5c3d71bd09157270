"""How the loop-driven parts of the data plane (a lane, a ring receiver) take turns on the
event loop: :class:`NextTurn` queues one run of a callback per loop turn, :func:`spin` polls
briefly for something that is about to happen instead of sleeping until a wake-up, a
:class:`SpinGate` says whether a spin is still worth trying, :class:`Handoffs` whether one
would hold back work just handed to the application, and a :class:`TurnBudget` how long
awaiters whose answer was taken in place may keep the loop waiting.  No I/O.
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


class TurnBudget:
    """How many awaits may go on without giving the loop a turn, between two of its turns.

    An awaiter whose answer was taken in its own task (see
    :meth:`~.transfer.Transfer.answer_in_awaiter`) need not suspend: suspending costs a loop
    turn (a poll of its selector and the task's wake-up, ~5 µs) per await.  But a caller
    that awaits such writes back to back would then never let the loop run (no heartbeats,
    no timers, no other peer): :meth:`may_skip` allows ``limit`` in a row, then asks for a
    turn; the first turn after that clears the count (one ``call_soon`` per run of skips).
    Loop thread only."""

    LIMIT = 16
    __slots__ = ("_limit", "_loop", "_skipped")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = LIMIT) -> None:
        self._loop = loop
        self._limit = limit
        self._skipped = 0

    def may_skip(self) -> bool:
        """Whether an awaiter whose result is ready may go on without a loop turn (counted)."""
        skipped = self._skipped
        if skipped >= self._limit:
            return False
        if not skipped:
            self._loop.call_soon(self._turned)
        self._skipped = skipped + 1
        return True

    def _turned(self) -> None:
        self._skipped = 0


class Handoffs:
    """Whether a spin now would hold back work the transport just handed to the application.

    A transfer settled while someone awaited it (or with a done-callback), a notice or a chunk
    message given to a sink or a reader: what that wakes runs on the loop's coming turns,
    often as a chain of them (a task that wakes another: ``asyncio.wait_for``, a queue between
    tasks).  A spin inside a loop callback (a ring turn polling for the peer's next record)
    holds back everything queued behind it, for up to the whole spin, on each hop: a notice
    round trip between two processes spent two fruitless 50 µs spins of the sender's ring in
    its awaiter's chain, 118 µs of its 224 µs (2026-12-03).  So after a hand-off (:meth:`handed`)
    the next :attr:`QUIET` spins asked for are refused (:meth:`may_spin`): the spinner polls
    once and comes back on the loop's next turn instead, behind what was woken, which is
    polling too, one loop turn per poll.  Loop thread only."""

    QUIET = 4
    """Spins refused after a hand-off: enough for a chain of a few tasks (each hop is a loop turn)."""
    __slots__ = ("_quiet",)

    def __init__(self) -> None:
        self._quiet = 0

    def handed(self) -> None:
        """Work for the application was just queued on the loop."""
        self._quiet = self.QUIET

    def may_spin(self) -> bool:
        """Whether a spin may hold the loop now (each refusal counts)."""
        if self._quiet:
            self._quiet -= 1
            return False
        return True


class SpinGate:
    """Whether to spin: always while spins pay; after ``MISSES`` fruitless ones in a row, only
    every ``RETRY``-th chance (the peer's pace may have changed).  Chances are counted, not
    turns or wake-ups, so a steady rhythm of turns cannot keep the retry from ever coming."""

    MISSES = 3
    RETRY = 64
    __slots__ = ("_misses", "_retry", "_skipped")

    def __init__(self, retry: int = RETRY) -> None:
        """``retry``: every how many chances to try again once closed."""
        self._misses = 0
        self._skipped = 0
        self._retry = retry

    def may(self) -> bool:
        """A chance to spin: whether to take it."""
        if self._misses < self.MISSES:
            return True
        self._skipped += 1
        if self._skipped < self._retry:
            return False
        self._skipped = 0
        return True

    def spin(self, poll: Callable[[], object], seconds: float) -> bool:
        """:func:`spin`, counting the outcome."""
        hit = spin(poll, seconds)
        self.record(hit)
        return hit

    def record(self, hit: bool) -> None:
        """Count the outcome of a spin made otherwise (e.g. one spread over several turns)."""
        self._misses = 0 if hit else self._misses + 1


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
