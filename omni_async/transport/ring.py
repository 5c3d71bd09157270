"""A single-producer, single-consumer ring of framed records in shared bytes.  No I/O.

Layout of a ring of ``capacity`` data bytes (a power of two, at least 64) in a buffer of
``ring_size(capacity)`` bytes, every counter a little-endian u64 on its own cache line:

* ``[0, 8)`` **head**: bytes ever produced (written only by the producer);
* ``[64, 72)`` **tail**: bytes ever consumed (written only by the consumer);
* ``[128, 136)`` **epoch**: the consumer's sleep counter, odd while it sleeps (written only by
  the consumer; the producer wakes it once per odd epoch);
* ``[HEADER_BYTES, HEADER_BYTES + capacity)``: records at ``counter % capacity``.

A record is a u32 payload length, a u32 kind, the payload, zero padding to 8 bytes; a record
never wraps: when it does not fit before the end, the producer writes a wrap marker (length
``WRAP``) and starts again at offset 0.  A payload is at most ``max_payload(capacity)`` (half
the ring less the framing), so a record always fits an empty ring.

Trust: each side validates what the other wrote before using it.  The consumer raises
:class:`RingError` for a head that runs backwards or ahead by more than the capacity, or a
record whose framing leaves the ring or the produced bytes; the producer for a tail outside
``[head - capacity, head]``.  No value in the ring can make either side touch bytes outside
the ring's buffer.

Memory order: the producer copies a record, then publishes the head; the consumer reads the
head, then the record.  Python issues those stores in program order; :func:`fence` (a locked
instruction) separates a store from the following load where the wake-up rule needs it.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, TypeAlias

from ..errors import ProtocolError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Part: TypeAlias = "bytes | memoryview | npt.NDArray[np.uint8]"
"""A piece of a record: anything whose ``len`` is its byte count and that a byte memoryview's
slice takes as it is (a flat uint8 array needs no ``memoryview`` of its own)."""

HEADER_BYTES: Final = 192
_HEAD: Final = 0
_TAIL: Final = 8  # in u64 units: byte offset 64
_EPOCH: Final = 16  # byte offset 128
_FRAME: Final = struct.Struct("<II")
_FRAME_BYTES: Final = _FRAME.size
WRAP: Final = 0xFFFFFFFF
"""Length of a wrap marker: the rest of the ring up to its end is skipped."""

_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (an uncontended lock's atomic exchange), between a store to the
    ring and a load the other side's store must be visible to."""
    _lock.acquire()
    _lock.release()


def ring_size(capacity: int) -> int:
    """Bytes of shared memory a ring of ``capacity`` data bytes needs."""
    return HEADER_BYTES + capacity


def max_payload(capacity: int) -> int:
    """The largest payload a record in a ring of ``capacity`` bytes may carry."""
    return capacity // 2 - _FRAME.size


NO_BOUND: Final = 1 << 64
"""A head no ring reaches (its counters are u64s): :meth:`Consumer.take` unbounded."""
MAX_HEAD: Final = 1 << 62
"""The highest head a producer starts from (a ring is made with 0): its counters stay far from
the u64 they are stored in (a ring moving 10 GB/s reaches it in 14 years)."""


class RingError(ProtocolError):
    """The other side wrote something into the ring that breaks its framing or counters."""


class _Ring:
    """One side's views of a ring: ``buffer`` (all of it, counters and records: the bytes both
    sides share), ``data`` (the records part) and its ``capacity``."""

    __slots__ = ("_ctl", "buffer", "capacity", "data", "max_payload")

    def __init__(self, buffer: memoryview) -> None:
        buf = buffer.cast("B") if buffer.format != "B" else buffer
        capacity = len(buf) - HEADER_BYTES
        if capacity < 64 or capacity & (capacity - 1):
            raise ValueError(f"a ring needs {HEADER_BYTES} + a power of two (>= 64) bytes, got {len(buf)}")
        self.buffer = buf
        self._ctl = buf[:HEADER_BYTES].cast("Q")
        self.capacity = capacity
        self.max_payload = max_payload(capacity)
        self.data = buf[HEADER_BYTES:]

    def release(self) -> None:
        """Drop this side's views of the buffer (so a mapping under it can close)."""
        self.data.release()
        self._ctl.release()
        self.buffer.release()


class Producer(_Ring):
    """Writes records into the ring; keeps its own copy of the head (the consumer cannot
    move it)."""

    __slots__ = ("_head", "_woken")

    def __init__(self, buffer: memoryview) -> None:
        super().__init__(buffer)
        head = int(self._ctl[_HEAD])
        if head & 7 or head >= MAX_HEAD:  # (records start 8-byte aligned; the consumer wrote this head)
            self.release()
            raise RingError(f"the ring's head is {head} (a record boundary below {MAX_HEAD} expected)")
        self._head = head
        self._woken = -1

    @property
    def head(self) -> int:
        """Bytes produced so far: this side's own count, which the consumer cannot move."""
        return self._head

    def put(self, kind: int, parts: Sequence[Part]) -> bool:
        """Append one record whose payload is ``parts`` concatenated; False if the ring has no
        room now (nothing written).  Raises :class:`ValueError` for a payload over
        :func:`max_payload`, :class:`RingError` if the consumer corrupted its tail."""
        length = len(parts[0]) if len(parts) == 1 else sum(len(part) for part in parts)
        if length > self.max_payload:
            raise ValueError(f"a record of {length} bytes exceeds the ring's {self.max_payload}")
        capacity = self.capacity
        head = self._head
        used = head - self._ctl[_TAIL]
        if not 0 <= used <= capacity:
            raise RingError(f"the consumer's tail is {used} bytes behind the head (capacity {capacity})")
        need = _FRAME_BYTES + ((length + 7) & ~7)  # frame, payload, padding
        pos = head % capacity
        skip = capacity - pos if need > capacity - pos else 0
        if skip + need > capacity - used:
            return False
        data = self.data
        if skip:
            _FRAME.pack_into(data, pos, WRAP, 0)
            pos = 0
        _FRAME.pack_into(data, pos, length, kind)
        at = pos + _FRAME.size
        for part in parts:
            end = at + len(part)
            data[at:end] = part  # type: ignore[assignment]  # (numpy's stubs export buffers on 3.12+ only)
            at = end
        self._head = head = head + skip + need
        self._ctl[_HEAD] = head
        return True

    def consumed(self) -> int:
        """Bytes the consumer took and gave back so far (its tail: every record that ends at or
        before it was handled).  Raises :class:`RingError` for a tail outside ``[head -
        capacity, head]`` (the consumer broke the ring)."""
        tail = int(self._ctl[_TAIL])
        if not 0 <= self._head - tail <= self.capacity:
            behind = self._head - tail
            raise RingError(f"the consumer's tail is {behind} bytes behind the head (capacity {self.capacity})")
        return tail

    def passed(self, position: int) -> bool:
        """Whether the consumer's tail reached ``position`` (a :attr:`head` this side had):
        one load, unchecked (:meth:`consumed` checks the tail before it is acted on)."""
        return self._ctl[_TAIL] >= position

    def wants_wake(self) -> bool:
        """After :meth:`put`: True (once per sleep) if the consumer sleeps and must be woken."""
        fence()  # our head store before the load of its epoch (it stores the epoch, then loads the head)
        epoch = self._ctl[_EPOCH]
        if epoch & 1 and epoch != self._woken:
            self._woken = epoch
            return True
        return False


class Consumer(_Ring):
    """Reads records from the ring: :meth:`take` hands out views of the ring that stay valid
    until :meth:`commit` gives their bytes back to the producer."""

    __slots__ = ("_cursor", "_epoch", "_tail")

    def __init__(self, buffer: memoryview) -> None:
        super().__init__(buffer)
        self._tail = int(self._ctl[_TAIL])
        self._cursor = self._tail
        self._epoch = int(self._ctl[_EPOCH]) & ~1

    def ready(self) -> bool:
        """True if the producer published bytes not taken yet (cheap: one load)."""
        return self._ctl[_HEAD] != self._cursor

    def published(self) -> int:
        """The producer's head now: every record published so far ends at or before it (pass
        it to :meth:`take` to leave later ones for later).  Raises :class:`RingError` for a
        head behind the records taken, or ahead of them by more than the ring holds."""
        head = int(self._ctl[_HEAD])
        if not 0 <= head - self._cursor <= self.capacity - (self._cursor - self._tail):
            raise RingError(f"the producer's head is {head - self._cursor} bytes past the consumer")
        return head

    def take(self, until: int = NO_BOUND) -> tuple[int, memoryview] | None:
        """The next record as ``(kind, payload view)``, or None if none is published (none
        before ``until``, a head from :meth:`published`); raises :class:`RingError` if the
        producer broke the framing (then drop the ring)."""
        capacity = self.capacity
        while True:
            cursor = self._cursor
            head = self._ctl[_HEAD]
            available = (head if head < until else until) - cursor
            if available == 0:
                return None
            if not 0 < available <= capacity - (cursor - self._tail) or available & 7:
                raise RingError(f"the producer's head is {available} bytes past the consumer")
            pos = cursor % capacity
            to_end = capacity - pos
            length, kind = _FRAME.unpack_from(self.data, pos)
            if length == WRAP:
                if to_end > available:
                    raise RingError("a wrap marker past the produced bytes")
                self._cursor = cursor + to_end
                continue
            need = _FRAME_BYTES + ((length + 7) & ~7)  # frame, payload, padding
            if length > self.max_payload or need > to_end or need > available:
                raise RingError(f"a record of {length} bytes at {pos} leaves the ring or the produced bytes")
            self._cursor = cursor + need
            start = pos + _FRAME_BYTES
            return kind, self.data[start : start + length]

    def commit(self) -> None:
        """Give every record taken so far back to the producer (their views are now stale)."""
        self._tail = self._cursor
        self._ctl[_TAIL] = self._tail

    def sleep(self) -> bool:
        """About to wait for a wake-up: mark the ring asleep; returns True if a record arrived
        meanwhile (then call :meth:`awake` and take it instead of sleeping)."""
        if not self._epoch & 1:
            self._epoch += 1
            self._ctl[_EPOCH] = self._epoch
        fence()  # our epoch store before the load of its head (it stores the head, then loads the epoch)
        return self.ready()

    def awake(self) -> None:
        """Woken (or never slept): the producer need not wake this side until it sleeps again."""
        if self._epoch & 1:
            self._epoch += 1
            self._ctl[_EPOCH] = self._epoch
