"""The receive pool: memory for received chunk frames that is reused rather than freed.  No I/O.

A large chunk message copied out of a same-host ring into a fresh array pays for fresh memory
on every message: a streaming receiver holds many at once, the allocator hands their memory
back to the kernel and gets it again, and each copy also faults in its pages (delivering a
256.5 KiB chunk from the ring took 41 µs at p50 and 186 µs at p90 in the ``chunk_256k``
receiver; a copy into warm memory takes 6-9 µs).  The
pool is one arena, allocated once (its pages are touched when first used and stay mapped),
handed out first in, first out.

Ownership contract: :meth:`ReceivePool.take` returns a plain writable ``uint8`` array over
pool memory.  Whoever holds it (or any array, memoryview or object viewing it: the frames,
the decoded payload's arrays) owns that memory; it goes back to the pool when the last
reference to it is dropped, exactly as a fresh array's memory goes back to the allocator.
Nothing has to be called to release it, and nothing can release it early: memory still
referenced is never handed out again.  (Like any numpy memory, a raw address taken from it
is valid only while the arrays live.)  Release may happen in any thread (the drop of the last
reference); it only marks the slot.

A consumer that keeps frames for long does not block anything: the pool reclaims memory in
the order it handed it out, so a held frame keeps the space after it from being reused; once
no room is left :meth:`take` returns None and the caller allocates a fresh array (the copy
it would have made without a pool), counted in :attr:`ReceivePool.fallbacks`.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import deque
from functools import partial

import numpy as np
import numpy.typing as npt


class _Slot:
    """One handed-out piece: where it ends in the pool's byte count, and whether released."""

    __slots__ = ("end", "released", "watch")

    def __init__(self, end: int) -> None:
        self.end = end
        self.released = False
        self.watch: weakref.ref[ctypes.Array[ctypes.c_ubyte]] | None = None


def _release(slot: _Slot, _gone: object) -> None:
    slot.released = True  # one store: safe from any thread (it runs where the last reference died)


class ReceivePool:
    """An arena of ``capacity`` bytes handed out first in, first out (see the module docstring).

    Loop thread only, except that the arrays it hands out may be dropped in any thread.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("a receive pool needs a positive capacity")
        self.capacity = capacity
        self._arena = np.empty(capacity, np.uint8).data  # virtual until used; then its pages stay
        self._head = 0
        """Bytes handed out so far (wrap-around skips included)."""
        self._tail = 0
        """Bytes given back so far (in order: up to the oldest slot still held)."""
        self._slots: deque[_Slot] = deque()
        self.taken = 0
        """Arrays handed out so far."""
        self.fallbacks = 0
        """Requests refused because the pool had no room (the caller allocated instead)."""

    @property
    def in_use(self) -> int:
        """Bytes not reclaimed yet: held by live arrays, or behind one that is."""
        self._reclaim()
        return self._head - self._tail

    def take(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """A fresh writable ``uint8`` array of ``nbytes`` (> 0) in pool memory, owned by the
        caller until its last reference is dropped; None if the pool has no room now."""
        self._reclaim()
        capacity = self.capacity
        pos = self._head % capacity
        skip = capacity - pos if nbytes > capacity - pos else 0  # a piece never wraps
        if self._head - self._tail + skip + nbytes > capacity:
            self.fallbacks += 1
            return None
        start = 0 if skip else pos
        self._head += skip + nbytes
        slot = _Slot(self._head)
        # A ctypes array over the piece is the owner every view leads back to (numpy does not
        # collapse a view's base past it, as it would past an ndarray); it keeps the arena
        # alive, and its death (the last view gone) releases the slot.
        owner = (ctypes.c_ubyte * nbytes).from_buffer(self._arena, start)
        slot.watch = weakref.ref(owner, partial(_release, slot))
        self._slots.append(slot)
        self.taken += 1
        array: npt.NDArray[np.uint8] = np.frombuffer(memoryview(owner), np.uint8)  # the view's exporter: owner
        return array

    def _reclaim(self) -> None:
        """Give back the released slots at the old end; start over at 0 once all are back."""
        slots = self._slots
        while slots and slots[0].released:
            self._tail = slots.popleft().end
        if not slots:
            self._head = self._tail = 0
