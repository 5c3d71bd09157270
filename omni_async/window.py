"""The :class:`SaveWindow`: how many chunk saves may be sent and not yet acknowledged.  No I/O.

A counting semaphore, as :class:`asyncio.Semaphore` (``acquire``, ``release``, ``locked``),
with one more method: :meth:`SaveWindow.take_nowait`, a share taken in one plain call where
a semaphore needs a coroutine stepped by hand and four calls more (its ``locked`` runs a
generator).  A save takes a share on its path, so that is per chunk: with the semaphore, 7
Python calls of the sender's ~58 per chunk of ``chunk_256k`` went to it (measured,
docs/tuning.md).  Adapters given the same window share its bound.
"""

from __future__ import annotations

import asyncio
from collections import deque


class SaveWindow:
    """``size`` shares, handed out first come, first served: a share given back while someone
    waits goes to the oldest waiter, never to a caller that did not wait (no barging).  A
    waiter cancelled before it got a share leaves the queue; one cancelled just after it got
    one gives it back.  Event loop thread only."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a save window needs at least one share, got {size}")
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __repr__(self) -> str:
        return f"<SaveWindow {self._free} free, {len(self._waiters)} waiting>"

    def locked(self) -> bool:
        """True if a share cannot be taken without waiting."""
        return not self._free or bool(self._waiters)

    def take_nowait(self) -> bool:
        """Take a share if none has to be waited for; False if the window is full or others
        wait (they come first)."""
        if self._free and not self._waiters:
            self._free -= 1
            return True
        return False

    async def acquire(self) -> bool:
        """Take a share, waiting in turn for one; returns True (as ``asyncio.Semaphore``)."""
        if self.take_nowait():
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.cancelled():
                self.release()  # it was handed a share as it was cancelled: pass that on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)  # never served: it leaves the queue
            raise
        return True

    def release(self) -> None:
        """Give a share back: to the oldest waiter still waiting, else to the window."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1
