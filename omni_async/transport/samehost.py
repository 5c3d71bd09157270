"""Same-host message rings: headers, acknowledgements and chunk messages between two processes
on one host go through shared memory instead of UCX.  The asyncio driver of :mod:`.ring`.

Each side of a same-host link makes one :class:`RingReceiver` (the ring its peer writes into:
a sealed memfd, :mod:`omni_async.memfd`, plus a pipe it sleeps on) and offers it over the UCX
lane (:class:`~omni_async.wire.RingOffer`); the peer maps it with the same checks as a block
region (:func:`.shared.map_memfd`: ``/proc/<pid>/fd/<fd>``, the token, the size, the seals),
opens the pipe's write end through ``/proc`` (an eventfd cannot be reopened that way: ENXIO)
and from then on writes into it with a :class:`RingSender`.  The UCX lane still carries
everything else (non-placed block payloads, goodbyes, messages larger than the ring) and is
the fallback whenever the ring is full.

Wake-up rule: the receiver runs in turns, from the pipe's ``loop.add_reader`` callback or
soon after this side sent a request (:meth:`RingReceiver.kick`).  A turn takes the records
published so far (one batch) and, if there were some, comes back after the callbacks they
woke; a turn that finds none spins on the ring's head for at most ``SPIN`` seconds if an
answer is expected (a transfer awaits its acknowledgement: always), then marks itself asleep
(odd epoch) and sleeps.  Two bounded exceptions keep it polling, a ``SPIN`` per turn with the
loop's other callbacks in between, instead of sleeping: while the owner expects a record
soon (the commit of a write the peer copies now: :meth:`RingReceiver.stay_awake`), and for
``LINGER`` seconds after the peer's last record when the peer runs in another process (the
next record of a stream comes after the peer's Python between two, typically within it;
gated, :class:`~.turns.SpinGate`: after a few windows in which nothing came, only an
occasional one).  A spin during which another process had the core ends either.  A sender
writes one byte into the pipe after a record only when the receiver sleeps, once per sleep.
An idle pair costs nothing: at most one window after the last record, then both sides sleep.

Failure rules: a killed receiver leaves its ring mapped here (our mapping keeps the pages; a
wake-up write fails with EPIPE and the sender falls back to UCX); a killed sender just stops
writing.  Neither side ever blocks on the other; liveness comes from the control plane.  A
ring whose framing or counters the other side broke raises :class:`~.ring.RingError`: the
peer is dropped.  Nothing is named in ``/dev/shm``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from ..errors import ProtocolError
from ..memfd import SharedSegment
from ..wire import MAX_HEADER_BYTES, RingOffer
from .pool import PoolWriter, SharedPool, is_pool_size
from .ring import NO_BOUND, Consumer, Part, Producer, RingError, max_payload, ring_size
from .shared import Refused, map_memfd, open_pipe
from .turns import Handoffs, NextTurn, SpinGate, spin

log = logging.getLogger(__name__)

RING_CAPACITY: Final = 8 << 20
"""Data bytes of each ring (one per direction and peer; pages are touched only when used)."""
KIND_HEADER: Final = 1
"""A record holding one encoded data header."""
KIND_MESSAGE: Final = 2
"""A record holding an encoded :class:`~omni_async.wire.MessageHeader`, then its frames."""
KIND_POOLED: Final = 3
"""A record holding an encoded :class:`~omni_async.wire.MessageHeader` whose frames the
sender copied into the receiver's shared pool (the next piece, :mod:`.pool`)."""
SPIN: Final = 50e-6
"""Seconds a receiver that expects an answer polls its ring before sleeping (and the most one
turn polls: others' callbacks run between two)."""
LINGER: Final = 200e-6
"""Seconds a receiver keeps polling, over several turns, after the peer's last record: the
Python a peer runs between two records of a stream (a chunk's save, a block write's planning)
takes 50-150 µs here; catching its next record spares it a wake-up (15-80 µs of its time)
and us one.  Gated: after a few windows in which nothing came, only every ``LINGER_RETRY``-th."""
LINGER_RETRY: Final = 8
"""Once lingering stopped paying, every how many chances a window is tried again: a stream
that starts after a quiet spell (or after a few records that came alone, as a connection's
set-up) is caught again within a few records; a peer that never follows up costs one
fruitless window per this many records."""
LOST_CORE: Final = 4 * SPIN
"""A spin of ``SPIN`` that took longer than this lost the core to another process meanwhile."""
_BATCH: Final = 256
"""Records taken per run before yielding to the loop (a flooding peer cannot hold it)."""


def is_ring_capacity(capacity: int) -> bool:
    """Whether a ring of ``capacity`` data bytes may be offered: a power of two whose records
    carry every header (a pooled record's, length-prefixed, is up to ``MAX_HEADER_BYTES``;
    :data:`~omni_async.wire.MIN_RING_CAPACITY` is the smallest)."""
    return capacity > 0 and not capacity & (capacity - 1) and max_payload(capacity) >= MAX_HEADER_BYTES


Deliver = Callable[[int, memoryview], None]
"""``deliver(kind, payload)``: one record; the view is valid only during the call.  Raising
:class:`ProtocolError` drops the peer."""


class RingReceiver:
    """The ring this side reads and the pipe it sleeps on (see the module docstring).

    ``deliver`` gets each record in order; ``fault`` is called once with the error that broke
    the ring (then nothing more is delivered); ``expecting()`` says whether to spin;
    ``batch_done()`` is called after every batch of records delivered (what they produced can
    be sent together: the transport's batched acknowledgements), also one that a record
    breaking the protocol ends early (for the records before it), unless the ring was closed.
    ``pool_bytes`` (:func:`~.pool.shared_pool_bytes`; 0: none) adds a shared pool after the
    ring, offered with it: the peer copies large chunk frames into it (:data:`KIND_POOLED`).
    ``handoffs``: the transport's :class:`~.turns.Handoffs`, which a turn asks before it spins
    (a turn it refuses polls once and comes back on the next loop turn).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Deliver,
        fault: Callable[[ProtocolError], None],
        expecting: Callable[[], bool],
        capacity: int = RING_CAPACITY,
        batch_done: Callable[[], None] | None = None,
        pool_bytes: int = 0,
        handoffs: Handoffs | None = None,
    ) -> None:
        if not is_ring_capacity(capacity):
            raise ValueError(f"a ring of {capacity} bytes (not a power of two whose records carry every header)")
        if pool_bytes and not is_pool_size(pool_bytes):
            raise ValueError(f"a shared pool of {pool_bytes} bytes (not a control line and whole frame slots)")
        self.capacity = capacity
        self.pool_bytes = pool_bytes
        self._loop = loop
        self._deliver = deliver
        self._batch_done = batch_done
        self._fault = fault
        self._expecting = expecting
        self._handoffs = handoffs if handoffs is not None else Handoffs()
        self._segment = SharedSegment(ring_size(capacity) + pool_bytes)
        shared = self._segment.array.data
        self._consumer = Consumer(shared[: ring_size(capacity)])
        self.pool = SharedPool(shared[ring_size(capacity) :]) if pool_bytes else None
        """Where the peer copies large chunk frames (:data:`KIND_POOLED` records), or None."""
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False
        self._next_turn = NextTurn(loop)
        self._awake_until = 0.0
        self._linger_until = 0.0
        self._linger_gate = SpinGate(LINGER_RETRY)
        self.linger = 0.0
        """Seconds to keep polling after the peer's last record, for its next one (0: not at
        all).  Set it only for a peer in another process: one in this process cannot write
        while we poll."""
        self._delivering = False
        self._answering: RingSender | None = None
        self._answered: Callable[[int], None] | None = None
        self.turns = 0
        """Turns run so far (for idle-CPU tests)."""
        self.wakeups = 0
        """Pipe wake-ups so far (for idle-CPU tests)."""
        self.taken_in_place = 0
        """Answers taken by whoever waits for them, not by a turn (:meth:`take_answers_until`:
        an awaiting task, a polling facade), for tests."""
        self.lost_core = LOST_CORE
        """Seconds after which a fruitless spin while staying awake counts as having lost the
        core (:meth:`stay_awake` then ends)."""
        self._consumer.sleep()  # until the first record, the sender must wake us
        loop.add_reader(self._read, self._readable)

    def offer(self) -> RingOffer:
        """What the peer needs to write into this ring."""
        return RingOffer(
            pid=os.getpid(),
            fd=self._segment.fd,
            token=self._segment.token,
            wake_fd=self._write,
            capacity=self.capacity,
            pool=self.pool_bytes,
        )

    @property
    def fds(self) -> tuple[int, int, int]:
        """The descriptors this receiver holds (memfd, pipe read end, pipe write end)."""
        return self._segment.fd, self._read, self._write

    def answers_from(self, ring: RingSender, answered: Callable[[int], None]) -> None:
        """Also take the answers that come without a record: ``ring`` is the peer's (the other
        direction of the same link), and ``answered(key)`` is called once the peer consumed a
        record put there with ``answered=key`` (:meth:`RingSender.send`; the peer answers such
        records that way, :attr:`~omni_async.wire.WriteRequest.tail`).  A turn takes them after
        its records (an answer among those comes first), spins for them as for records, and
        looks once more before it sleeps (the peer wakes us once it consumed them).  A tail
        the peer broke breaks the ring (:class:`~.ring.RingError`)."""
        self._answering = ring
        self._answered = answered

    def stop_answers(self) -> None:
        """Take no more answers without records (the peer's ring is closed here)."""
        self._answering = None
        self._answered = None

    def _ready(self) -> bool:
        """Whether a record, or an answer without one, is there to take."""
        ring = self._answering  # (RingSender.answered_yet inlined: a call less per turn on row a's path)
        return self._consumer.ready() or (
            ring is not None and bool(ring.awaiting) and ring.producer.passed(ring.awaiting[0][0])
        )

    def take_answers_until(self, settled: Callable[[], bool]) -> None:
        """Poll for the answers the peer's consumption gives (see :meth:`answers_from`) and
        hand them on, until ``settled()`` or ``SPIN`` passed: called by whoever waits for one
        of them (a task awaiting it, a facade polling in the loop's stead), so that the answer
        is taken there and then, not by a turn the loop runs later.
        The ring counts as awake meanwhile (the peer does not wake us for the answer) and a
        turn is queued after (which puts it to sleep if nothing else comes).  Not for a peer
        in this process (it cannot answer while we poll)."""
        ring = self._answering
        if ring is None or self._closed or self._delivering:
            return
        self._consumer.awake()
        deadline = time.perf_counter() + SPIN
        try:
            while self._answering is ring:  # (a callback may drop the ring)
                if settled():
                    self.taken_in_place += 1
                    break
                if ring.answered_yet():
                    self._answers(ring)
                elif time.perf_counter() < deadline:
                    os.sched_yield()
                else:
                    break
        except ProtocolError as exc:  # the peer broke its tail
            self.close()
            self._fault(exc)
        finally:
            self.kick()  # (the ring counts as awake: a turn must come, whatever a callback raised)

    def _readable(self) -> None:
        try:
            os.read(self._read, 4096)
        except BlockingIOError:
            pass
        self.wakeups += 1
        self.run()

    def kick(self) -> None:
        """Run a turn soon (after the loop's ready callbacks): called after this side sent
        something that expects an answer, so the turn spins for it instead of sleeping."""
        if not self._closed:
            self._next_turn(self.run)

    def stay_awake(self, seconds: float) -> None:
        """The peer is about to put a record in (the commit of a write it copies now): for
        ``seconds`` from now a turn that finds none spins (at most ``SPIN``) and comes back on
        the next loop turn instead of sleeping, so the record is taken as soon as it comes,
        without a wake-up.  ``0`` ends that early (the record came, or will not); so does a spin
        during which another process had the core (a wake-up serves better then)."""
        self._awake_until = time.perf_counter() + seconds if seconds > 0 else 0.0
        if seconds > 0:
            self.kick()  # (if called outside a turn, by drain(), while this side sleeps)

    def run(self) -> None:
        """One turn: deliver the records published so far (at most a batch), then come back
        after the callbacks they woke.  With none: while told to stay awake
        (:meth:`stay_awake`) or lingering after the peer's last record (:attr:`linger`,
        gated), spin (at most ``SPIN``) and come back; else spin once if an answer is
        expected, and sleep.  A spin the transport's ``handoffs`` refuses (work it just handed
        to the application waits on the loop) is a poll of the ring and a turn queued instead."""
        if self._closed:
            return
        self.turns += 1
        consumer = self._consumer
        consumer.awake()
        if self.pool is not None:
            self.pool.publish()  # the pieces our consumers dropped since the last turn
        try:
            delivered = sum(self._take_batch())
            polling = False
            if not delivered and not self._closed:
                started = time.perf_counter()
                polling = started < self._awake_until or started < self._linger_until
                if polling or self._expects():
                    if not self._handoffs.may_spin():
                        polling = True  # what the last records woke runs first: poll on the next turn
                    elif spin(self._ready, SPIN):
                        delivered = sum(self._take_batch())
                    elif polling and time.perf_counter() - started > self.lost_core:
                        # Another process had this core meanwhile: polling costs it more than
                        # a wake-up (which also lets the scheduler run us at once): sleep.
                        self._awake_until = 0.0
                        polling = False
            if self._closed:
                return
            self._account_linger(delivered > 0, polling)
            if delivered or polling:
                self.kick()
            elif consumer.sleep() or self._ready():  # a record (or answer) came just before it slept
                consumer.awake()
                self.kick()
        except ProtocolError as exc:
            self.close()
            self._fault(exc)

    def _account_linger(self, delivered: bool, polling: bool) -> None:
        """Open a linger window after records came (while lingering pays, see
        :class:`~.turns.SpinGate`; not while told to stay awake, which polls anyway and may
        outlast a window: a large write's copy); a record within it counts as a hit, a window
        that ran out (or in which we lost the core) as a miss."""
        if delivered:
            if self._linger_until:
                self._linger_gate.record(True)
            now = time.perf_counter()
            linger = self.linger and now >= self._awake_until and self._linger_gate.may()
            self._linger_until = now + self.linger if linger else 0.0
        elif self._linger_until and (not polling or time.perf_counter() >= self._linger_until):
            self._linger_gate.record(False)
            self._linger_until = 0.0

    def drain(self) -> None:
        """Deliver every record published before this call, now (before acting on something
        that came another way, after the peer put them: its goodbye, its loss, a header that
        refers to earlier records).  Records published meanwhile are left to the turns, which
        yield between batches: a peer that keeps its ring full cannot hold the loop here
        (at most a ring's worth is taken).  Does nothing inside a turn (the turn delivers
        them) or once closed."""
        if self._closed or self._delivering:
            return
        try:
            until = self._consumer.published()
            while self._take_batch(until)[0] == _BATCH and not self._closed:
                pass
        except ProtocolError as exc:
            self.close()
            self._fault(exc)

    def _take_batch(self, until: int = NO_BOUND) -> tuple[int, int]:
        """Deliver at most a batch of the records published (before ``until``, a head from
        :meth:`.Consumer.published`), then the answers without records that came (see
        :meth:`answers_from`); returns how many of each."""
        consumer = self._consumer
        take, commit, deliver = consumer.take, consumer.commit, self._deliver
        delivered = answers = 0
        broken: ProtocolError | None = None
        self._delivering = True
        try:
            while delivered < _BATCH:
                record = take(until)
                if record is None:
                    break
                try:
                    deliver(*record)
                except ProtocolError as exc:
                    broken = exc  # what the records before it produced still goes out (below)
                    break
                except Exception:  # a handler bug fails that record, not the ring
                    log.exception("handling a ring record failed")
                delivered += 1
                if self._closed:
                    return delivered, 0
                commit()  # its bytes are free now: before any answer that lets the peer refill
            ring = self._answering
            if (  # (RingSender.answered_yet inlined: a call less per batch on row a's path)
                broken is None
                and ring is not None
                and ring.awaiting
                and not self._closed
                and ring.producer.passed(ring.awaiting[0][0])
            ):
                answers = self._answers(ring)
            if (delivered or answers) and self._batch_done is not None and not self._closed:
                try:
                    self._batch_done()
                except ProtocolError:
                    raise
                except Exception:  # a turn cut short would leave the ring awake, never woken again
                    log.exception("a ring's batch_done callback failed")
        finally:
            self._delivering = False
        if broken is not None:
            raise broken
        return delivered, answers

    def _answers(self, ring: RingSender) -> int:
        """Hand on the answers the peer's consumption of ``ring`` gave (see :meth:`answers_from`)."""
        answered = self._answered
        assert answered is not None
        count = 0
        for key in ring.consumed():
            count += 1
            try:
                answered(key)
            except Exception:  # a bug settling one fails that answer, not the ring
                log.exception("handling an answer of a ring's consumption failed")
        return count

    def _expects(self) -> bool:
        """Whether an answer is expected (the peer works for us: its answer is near)."""
        try:
            return self._expecting()
        except Exception:
            log.exception("a ring's expecting callback failed")
            return False

    def close(self) -> None:
        """Stop reading, close the pipe and the memfd (the peer's mapping stays valid until it
        unmaps).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._read)
        os.close(self._read)
        os.close(self._write)
        self._consumer.release()
        if self.pool is not None:
            self.pool.release()  # (pieces still held keep the mapping: they stay valid)
        self._segment.close()


class RingSender:
    """Writes records into a peer's :class:`RingReceiver` (mapped from its offer).

    Raises :class:`~.shared.Refused` (or :class:`OSError`) if the offer cannot be mapped, its
    ring cannot carry every header (:func:`is_ring_capacity`: so :meth:`send` never meets a
    header record it cannot hold), or is not as a new one is (a head that is no record
    boundary, or past :data:`~.ring.MAX_HEAD`).
    """

    def __init__(self, offer: RingOffer) -> None:
        capacity = offer.capacity
        if not is_ring_capacity(capacity):
            raise Refused(f"a ring of {capacity} bytes (not a power of two whose records carry every header)")
        pool = offer.pool
        if pool and not is_pool_size(pool):
            raise Refused(f"a shared pool of {pool} bytes (not a control line and whole frame slots)")
        mapping = map_memfd(offer.pid, offer.fd, offer.token, ring_size(capacity) + pool)
        try:
            self._wake = open_pipe(offer.pid, offer.wake_fd)
        except BaseException:
            mapping.close()
            raise
        self._mapping = mapping
        self.token = offer.token
        self.in_this_process = offer.pid == os.getpid()
        """The peer that reads this ring runs in this process (it cannot answer while we spin)."""
        shared = memoryview(mapping)
        try:
            self.producer = Producer(shared[: ring_size(capacity)])
            """The mapped ring's writer (without the wake-up: :meth:`send` is put + wake)."""
        except RingError as exc:  # a head its maker could not have left in a new ring
            shared.release()
            os.close(self._wake)
            mapping.close()
            raise Refused(f"the offered ring: {exc}") from None
        self.pool = PoolWriter(shared[ring_size(capacity) :]) if pool else None
        """The writer of the peer's shared pool (:data:`KIND_POOLED` records), or None."""
        shared.release()
        self.max_payload = max_payload(capacity)
        self.broken: OSError | None = None
        """Set once a wake-up failed (the peer closed the ring or exited): stop using it."""
        self.awaiting: deque[tuple[int, int]] = deque()
        """The records put with ``answered`` whose consumption the peer's answer is, in ring
        order: where each ends (the ring's byte count) and its key, until the peer's tail
        passed it (:meth:`consumed`)."""

    def send(self, kind: int, parts: Sequence[Part], answered: int | None = None) -> bool:
        """Append one record (``parts`` concatenated) and wake the peer if it sleeps; False if
        it does not fit now or the ring broke (send it another way).  ``answered``: the peer
        answers the record by consuming it: it is awaited under this key (:attr:`awaiting`).
        Raises :class:`~.ring.RingError` if the peer corrupted the ring."""
        producer = self.producer
        if self.broken is not None or not producer.put(kind, parts):
            return False
        if answered is not None:
            self.awaiting.append((producer.head, answered))
        if producer.wants_wake():
            self.wake()
        return True

    def answered_yet(self) -> bool:
        """Whether the peer consumed the oldest awaited record (one load of its tail,
        unchecked: :meth:`consumed` checks it before it is acted on)."""
        awaiting = self.awaiting
        return bool(awaiting) and self.producer.passed(awaiting[0][0])

    def consumed(self) -> Iterator[int]:
        """The keys of the awaited records the peer consumed (by its tail now), in order, each
        leaving :attr:`awaiting` only as it is handed out: so what handling one key does (a
        done-callback that drops the peer, whose removal takes the rest with a call of its own)
        finds the others still there.  Raises :class:`~.ring.RingError` (at the call) for a
        tail the peer broke."""
        return self._handed_out(self.producer.consumed())

    def _handed_out(self, tail: int) -> Iterator[int]:
        awaiting = self.awaiting
        while awaiting and awaiting[0][0] <= tail:
            yield awaiting.popleft()[1]

    def wake(self) -> None:
        """Write a wake-up byte into the peer's pipe: its receiver runs a turn.  Sets
        :attr:`broken` if the peer's end is gone."""
        try:
            os.write(self._wake, b"\1")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already
        except OSError as exc:  # EPIPE: the peer's read end is gone
            self.broken = exc

    def close(self) -> None:
        """Unmap the peer's ring and close the pipe.  Idempotent."""
        if self._wake < 0:
            return
        os.close(self._wake)
        self._wake = -1
        self.producer.release()
        if self.pool is not None:
            self.pool.release()
        self._mapping.close()
