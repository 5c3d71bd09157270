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

**Shared pools** (one copy per byte for large same-host chunks): a :class:`SharedPool` is a
pool whose arena lies in shared memory that a same-host peer maps (after its ring, in the
ring's memfd, see :mod:`.samehost`), and a :class:`PoolWriter` is that peer's side of it.  The
*sender* places pieces, copying a message's frames straight into the receiver's memory, and
tells the receiver in a ring record (:data:`~.samehost.KIND_POOLED`); the receiver hands them
to its consumer as views, without copying.  Both sides place pieces with the same rule
(:func:`fit`), so a record needs no offset: the receiver knows where the next piece starts and
only checks that it fits in the room it gave back.  The receiver publishes how far it has
reclaimed (its tail, a u64 in the first cache line of the shared bytes); the sender reads it to
know its room, and validates it (a tail outside ``[head - capacity, head]`` raises
:class:`~.ring.RingError`).  Trust: a peer that maps the pool can write any byte of it at any
time, also a piece the consumer holds (as it can write any row of a region it maps); no value
it writes can make the receiver touch memory outside the pool.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Final

import numpy as np
import numpy.typing as npt

from .memcopy import COPY_PIECE, copy_into
from .ring import RingError

CONTROL_BYTES: Final = 64
"""The shared pool's control line before its arena: the receiver's tail, a little-endian u64."""
FRAME_ALIGN: Final = 64
"""Where each frame of a pooled message starts in its piece (a dtype never needs more)."""


def shared_pool_bytes(mib: int) -> int:
    """Bytes of a shared pool with an arena of ``mib`` MiB (its control line included); 0 for none."""
    return CONTROL_BYTES + (mib << 20) if mib else 0


def is_pool_size(nbytes: int) -> bool:
    """Whether ``nbytes`` can hold a shared pool: its control line and whole frame slots."""
    return nbytes > CONTROL_BYTES and (nbytes - CONTROL_BYTES) % FRAME_ALIGN == 0


def fit(head: int, tail: int, capacity: int, nbytes: int) -> int | None:
    """The bytes to skip before the next piece of ``nbytes`` (pieces never wrap: when it does
    not fit before the arena's end it starts at 0), or None if the arena has no room for it.
    ``head`` and ``tail`` count bytes handed out and given back so far."""
    pos = head % capacity
    skip = capacity - pos if nbytes > capacity - pos else 0
    if head - tail + skip + nbytes > capacity:
        return None
    return skip


def frame_slots(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each frame of a message starts in its piece (each on a ``FRAME_ALIGN`` boundary),
    and the piece's size."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // FRAME_ALIGN) * FRAME_ALIGN
    return starts, total


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

    _restarts = True
    """Whether an empty pool starts over at its arena's start (not a shared one: its writer
    places pieces by the same counters)."""

    def __init__(self, capacity: int, arena: memoryview | None = None) -> None:
        if capacity <= 0:
            raise ValueError("a receive pool needs a positive capacity")
        self.capacity = capacity
        self._arena = np.empty(capacity, np.uint8).data if arena is None else arena  # virtual until used
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
        skip = fit(self._head, self._tail, self.capacity, nbytes)
        if skip is None:
            self.fallbacks += 1
            return None
        return self._hand_out(skip, nbytes)

    def _hand_out(self, skip: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """The next piece, ``skip`` bytes on (see :func:`fit`), as an array owned by the caller."""
        start = 0 if skip else self._head % self.capacity
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
        if not slots and self._restarts:
            self._head = self._tail = 0


class SharedPool(ReceivePool):
    """The receiver's side of a pool in shared memory that a same-host peer fills (see the
    module docstring): ``buffer`` is the control line and the arena, the arena's size a
    multiple of ``FRAME_ALIGN``.  Loop thread only (the arrays it hands out may be dropped in
    any thread)."""

    _restarts = False

    def __init__(self, buffer: memoryview) -> None:
        super().__init__(len(buffer) - CONTROL_BYTES, buffer[CONTROL_BYTES:])
        self._ctl = buffer[:CONTROL_BYTES].cast("Q")

    def place(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """The piece of ``nbytes`` the writer placed next, as a fresh array (owned as one from
        :meth:`take`).  Raises :class:`RingError` if it does not fit in the room given back
        (the writer overran it)."""
        skip = fit(self._head, self._tail, self.capacity, nbytes)
        if skip is None:
            room = self.capacity - (self._head - self._tail)
            raise RingError(f"a pooled piece of {nbytes} bytes overruns the {room} bytes given back")
        return self._hand_out(skip, nbytes)

    def publish(self) -> None:
        """Give the writer the room of every piece released since (stores the tail)."""
        self._reclaim()
        self._ctl[0] = self._tail

    def release(self) -> None:
        """Drop this side's view of the control line (the arena stays while pieces live)."""
        self._ctl.release()


class PoolWriter:
    """The sender's side of a peer's :class:`SharedPool` (``buffer``: its control line and
    arena, mapped).  :meth:`reserve` a piece, copy the frames in, and :meth:`commit` it once
    the record that announces it is in the ring (in that order: the receiver places pieces in
    the order of their records)."""

    __slots__ = ("_arena", "_ctl", "_head", "_next", "capacity")

    def __init__(self, buffer: memoryview) -> None:
        self._ctl = buffer[:CONTROL_BYTES].cast("Q")
        self._arena = buffer[CONTROL_BYTES:]
        self.capacity = len(self._arena)
        self._head = 0
        self._next = 0

    def reserve(self, nbytes: int) -> int | None:
        """Where a piece of ``nbytes`` goes in the arena, or None if the receiver has not given
        back room for it yet.  Raises :class:`RingError` for a tail the receiver could not
        have published."""
        head, tail, capacity = self._head, int(self._ctl[0]), self.capacity
        if not 0 <= head - tail <= capacity:
            raise RingError(f"the pool's tail is {head - tail} bytes behind its head (capacity {capacity})")
        skip = fit(head, tail, capacity, nbytes)
        if skip is None:
            return None
        self._next = head + skip + nbytes
        return 0 if skip else head % capacity

    def write(
        self, start: int, frames: Sequence[npt.NDArray[np.uint8]], sizes: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Copy the message's non-empty ``frames`` (its frame ``sizes``, empty ones included)
        into the piece reserved at ``start``, each at its slot (``slots``: :func:`frame_slots`)."""
        arena = self._arena
        parts = iter(frames)
        for offset, size in zip(slots, sizes, strict=True):
            if size:
                at = start + offset
                if size > COPY_PIECE:
                    copy_into(np.frombuffer(arena, np.uint8, size, at), next(parts).reshape(-1))
                else:
                    arena[at : at + size] = next(parts)  # type: ignore[call-overload]  # (numpy's stubs export buffers on 3.12+ only)

    def commit(self) -> None:
        """The piece reserved last is announced: the next one goes after it."""
        self._head = self._next

    def release(self) -> None:
        """Drop the views of the mapping (so it can close)."""
        self._arena.release()
        self._ctl.release()
