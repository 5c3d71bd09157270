"""The lane protocol's state, free of I/O: events in, actions out.

A lane driver (:mod:`.core` and the other parts of :mod:`.ucx`) reports what happened (a
header was handled, a payload message arrived, an answer came, a cancel was asked for, its
timer went off, the lane made progress) and carries out what it is told (receive this message
into these buffers, post this request, send an Abort, settle that transfer, arm the timer,
release the lane, drop the peer).  The
receiver's side is :class:`Inbox` (payload messages matched to the headers that announced
them, within bounds); the sender's is :class:`Outbox` (sequence numbers, requests waiting for
the receiver's :class:`~.limits.Window`, answers awaited per transfer, what a cancel or a
local failure does: :meth:`Outbox.give_up`).  :class:`Deadlines` says when transfers run out
of time (one timer per lane, not one per transfer); :class:`Drain` says when a lane that said
goodbye may be released.  The driver keeps the ``Transfer`` handles (they hold the awaiters'
futures), the timer itself and the bound on a drain's wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from enum import Enum
from typing import Any, Generic, TypeVar

from ..errors import ProtocolError
from ..wire import MAX_PENDING_PAYLOADS, MIN_RECEIVE_BUDGET
from .limits import Window
from .transfer import CancelMode

T = TypeVar("T")


class Inbox(Generic[T]):
    """The receiver's payload messages of one peer, matched to their headers by sequence
    number in whichever order the two arrive, within per-peer bounds.

    A header announces payload messages with :meth:`expect` (``target``: where each goes, opaque
    here); a payload message reports itself with :meth:`arrived` (``message``: the driver's
    handle, opaque here).  Either returns ``(message, target)`` once both are known: the
    driver receives the message into the target.  Bounds: at most ``max_pending`` messages
    pending (announced and not arrived, or arrived before their header), at most ``max_bytes``
    of buffers :meth:`admit`-ted and not yet :meth:`received`, and at most ``max_early_bytes``
    of messages arrived before their header (UCX holds an eager one's bytes until it is taken).
    Those under ``rendezvous_bytes`` count (None: all of them: a lane whose headers always go
    eagerly is handled before the payloads behind it, so a legitimate peer has none early); a
    larger one a legitimate sender sends by rendezvous, which holds only its announcement.
    On a same-host lane a header of 8 KiB or more goes by rendezvous and the payloads behind it
    may come first: a legitimate peer's counted ones stay under ``max_pending`` ×
    ``rendezvous_bytes`` (8,192 × 8 KiB = 64 MiB), within the default ``max_early_bytes`` (the
    floor of every receive budget, 64 MiB).  A sequence number is announced once and its
    message arrives once (a second one of either would overwrite the first: a write waiting
    for good, or a message UCX holds that nobody takes).  Every violation raises
    :class:`ProtocolError`; the driver then drops the peer and calls :meth:`release`, which
    hands back every message it must still take (UCX must not be left holding them).
    """

    __slots__ = ("_early", "_expected", "_strays", "early_bytes", "max_bytes", "max_early_bytes", "max_pending",
                 "pending_bytes", "rendezvous_bytes")

    def __init__(
        self, max_bytes: int, max_pending: int = MAX_PENDING_PAYLOADS, *,
        rendezvous_bytes: int | None = None, max_early_bytes: int = MIN_RECEIVE_BUDGET,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self.max_early_bytes = max_early_bytes
        self.rendezvous_bytes = rendezvous_bytes
        self.pending_bytes = 0
        self.early_bytes = 0
        """Bytes counted of the messages arrived before their header."""
        self._expected: dict[int, tuple[int, T]] = {}
        self._early: dict[int, tuple[int, Any]] = {}
        self._strays: list[Any] = []  # a second payload message of one sequence number (a violation)

    @property
    def pending(self) -> int:
        """Payload messages announced and not arrived, or arrived and not announced."""
        return len(self._expected) + len(self._early)

    @property
    def expecting(self) -> bool:
        """True while some announced payload message has not arrived."""
        return bool(self._expected)

    def admit(self, seq: int, messages: int, nbytes: int) -> None:
        """A header announces ``messages`` payload messages from ``seq`` on, into ``nbytes`` of
        freshly allocated buffers: account them, or raise if that exceeds a bound."""
        early = self._early
        fresh = sum(1 for i in range(seq, seq + messages) if i not in early) if early else messages
        pending = self.pending + fresh
        if pending > self.max_pending or self.pending_bytes + nbytes > self.max_bytes:
            raise ProtocolError(
                f"over the receive bounds: {pending} payload messages pending (at most {self.max_pending}), "
                f"{self.pending_bytes + nbytes} bytes (at most {self.max_bytes})"
            )
        self.pending_bytes += nbytes

    def received(self, nbytes: int) -> None:
        """Buffers admitted with :meth:`admit` are filled (or failed): no longer pending."""
        self.pending_bytes -= nbytes

    def expect(self, seq: int, length: int, target: T) -> tuple[Any, T] | None:
        """Payload message ``seq`` of ``length`` bytes goes to ``target``: returns what to
        receive now if it already arrived, else remembers it."""
        if seq in self._expected:
            raise ProtocolError(f"payload message {seq} announced twice")
        early = self._early.pop(seq, None)
        if early is None:
            self._expected[seq] = (length, target)
            return None
        self.early_bytes -= self._counted(early[0])
        return self._match(seq, early[0], early[1], length, target)

    def arrived(self, seq: int, length: int, message: Any) -> tuple[Any, T] | None:
        """Payload message ``seq`` of ``length`` bytes arrived: returns what to receive now if
        its header was handled, else keeps it (raising if that exceeds the bound)."""
        expected = self._expected.pop(seq, None)
        if expected is None:
            if seq in self._early:
                self._strays.append(message)  # release() hands it back too
                raise ProtocolError(f"payload message {seq} arrived twice before its header")
            self._early[seq] = (length, message)  # kept first: release() hands it back
            self.early_bytes += self._counted(length)
            if self.pending > self.max_pending:
                raise ProtocolError(f"over {self.max_pending} payload messages pending")
            if self.early_bytes > self.max_early_bytes:
                raise ProtocolError(f"over {self.max_early_bytes} bytes of payload messages before their header")
            return None
        return self._match(seq, length, message, expected[0], expected[1])

    def _counted(self, length: int) -> int:
        """What an early message of ``length`` bytes counts against the bound."""
        return length if self.rendezvous_bytes is None or length < self.rendezvous_bytes else 0

    def _match(self, seq: int, length: int, message: Any, announced: int, target: T) -> tuple[Any, T]:
        if length != announced:
            self._early[seq] = (length, message)  # still to be taken: release() hands it back
            raise ProtocolError(f"payload message {seq} has {length} bytes, its header announced {announced}")
        return message, target

    def release(self) -> list[Any]:
        """Forget everything (the peer is gone); returns the arrived messages nobody took."""
        messages = [message for _, message in self._early.values()] + self._strays
        self._early.clear()
        self._strays = []
        self._expected.clear()
        self.pending_bytes = 0
        self.early_bytes = 0
        return messages


class _Out:
    """What the sender still awaits for one transfer."""

    __slots__ = ("abortable", "error", "parts", "posted")

    def __init__(self, parts: int, abortable: bool) -> None:
        self.parts = parts  # requests not answered yet
        self.posted = 0  # requests handed to the driver
        self.error: tuple[str, str] | None = None  # the first failed answer: (code, reason)
        self.abortable = abortable  # the receiver is told (an Abort) if it is given up after a post


class GiveUp(Enum):
    """What the driver does with a transfer this side gives up (:meth:`Outbox.give_up`)."""

    KEEP = "keep"
    """Nothing now: it settles on its last answer, its deadline or the peer's loss."""
    SETTLE = "settle"
    """Settle it now (and :meth:`Outbox.forget` it)."""
    ABORT = "abort"
    """Send the receiver an ``Abort`` first, then settle and forget it."""


class Outbox(Generic[T]):
    """The sender's side of one lane: sequence numbers, the requests of each transfer
    (``post``: what the driver does to send one, opaque here) and the receiver's window.

    :meth:`submit` and :meth:`answered` return the posts to carry out now, in order; a
    request that does not fit the window waits, in order, until answers make room.  A
    transfer settles on its last answer (:meth:`answered` says when, and with which failure);
    one given up here first (deadline, cancel, a failed send: :meth:`give_up` says how) is
    :meth:`forget`-ten: its waiting requests are dropped, but what it posted keeps its window
    share until answered.
    """

    __slots__ = ("_out", "_queue", "next_seq", "window")

    def __init__(self, window: Window) -> None:
        self.window = window
        self.next_seq = 0
        self._out: dict[int, _Out] = {}
        self._queue: deque[tuple[int, int, int, T]] = deque()

    def take_seq(self, count: int) -> int:
        """The first of ``count`` consecutive sequence numbers for payload messages."""
        seq = self.next_seq
        self.next_seq += count
        return seq

    def submit(self, transfer_id: int, requests: list[tuple[int, int, T]], abortable: bool = False) -> list[T]:
        """A new transfer of ``(payload messages, chunk bytes, post)`` requests; returns the
        posts to carry out now.  ``abortable``: the receiver must hear if it is given up after
        a request left (a block write with a notice: its notice fails; a chunk message: a sink
        still holding it lets it go)."""
        out = self._out[transfer_id] = _Out(len(requests), abortable)
        if len(requests) == 1 and not self._queue:  # the common case, as _pump would do it
            messages, nbytes, post = requests[0]
            if self.window.fits(messages, nbytes):
                self.window.take(transfer_id, messages, nbytes)
                out.posted = 1
                return [post]
        self._queue.extend((transfer_id, messages, nbytes, post) for messages, nbytes, post in requests)
        return self._pump()

    @property
    def idle(self) -> bool:
        """No request waits for window room (one that needs none may go at once: :meth:`start`)."""
        return not self._queue

    def start(self, transfer_id: int) -> None:
        """A new transfer of one request that takes no window share (a placed write: no
        payload message, no chunk bytes), posted now: as :meth:`submit` of it, on an
        :attr:`idle` outbox."""
        out = self._out[transfer_id] = _Out(1, False)
        out.posted = 1

    def answered(self, transfer_id: int, code: str, reason: str) -> tuple[bool, tuple[str, str] | None, list[T]]:
        """The receiver answered one request of ``transfer_id`` (``code`` empty: done).

        Returns ``(settled, first failure or None, posts to carry out now)``; ``settled`` is
        True once every request of the transfer is answered.  Unknown ids only free the window.
        """
        self.window.release(transfer_id)
        out = self._out.get(transfer_id)
        settled = False
        error = None
        if out is not None:
            if code and out.error is None:
                out.error = (code, reason)
            out.parts -= 1
            if out.parts <= 0:
                del self._out[transfer_id]
                settled, error = True, out.error
        return settled, error, self._pump() if self._queue else []

    def withdraw(self, transfer_id: int) -> list[T]:
        """A request of ``transfer_id`` counted in the window was never sent (its transfer
        settled while it waited): free its share; returns the posts that may go now."""
        self.window.release(transfer_id)
        return self._pump()

    def posted(self, transfer_id: int) -> bool:
        """True if some request of the transfer left this side (a ``"wait"`` cancel drains)."""
        out = self._out.get(transfer_id)
        return out is not None and out.posted > 0

    def give_up(self, transfer_id: int, mode: CancelMode = "immediate") -> GiveUp:
        """This side gives the transfer up: a cancel in ``mode``, or (``"immediate"``) its
        deadline passed or a send or local copy failed.  ``"wait"`` keeps a transfer some
        request of which left this side until the receiver answers (the data plane may still
        read its source); otherwise it settles now, after an ``Abort`` if it was submitted
        ``abortable`` and some of it was posted (the receiver must hear it was given up).
        Unknown ids (answered, never submitted) settle now.  Changes nothing: the driver
        :meth:`forget`-s what it settles."""
        if not self.posted(transfer_id):
            return GiveUp.SETTLE
        if mode == "wait":
            return GiveUp.KEEP
        return GiveUp.ABORT if self._out[transfer_id].abortable else GiveUp.SETTLE

    def forget(self, transfer_id: int) -> list[T]:
        """The transfer settled locally: drop its waiting requests; returns posts now possible
        (none if the transfer was not awaiting answers: nothing changed)."""
        if self._out.pop(transfer_id, None) is None:
            return []
        return self._pump()

    def clear(self) -> None:
        """The peer is gone: forget every transfer and waiting request."""
        self._out.clear()
        self._queue.clear()

    def _pump(self) -> list[T]:
        posts = []
        queue = self._queue
        while queue:
            transfer_id, messages, nbytes, post = queue[0]
            out = self._out.get(transfer_id)
            if out is None:  # settled while it waited
                queue.popleft()
            elif self.window.fits(messages, nbytes):
                queue.popleft()
                self.window.take(transfer_id, messages, nbytes)
                out.posted += 1
                posts.append(post)
            else:
                break
        return posts


class Deadlines:
    """When the transfers of one lane run out of time: one timer for all of them.

    Every transfer gets the same ``timeout`` from its start, so start order is deadline order
    (the driver's clock never goes back).  The book keeps nothing per transfer: the driver
    keeps its transfers in flight in start order anyway (with their start times) and hands
    them to :meth:`fired`; it keeps **one** timer per lane, armed when :meth:`start` or
    :meth:`fired` says so, never per transfer.  A transfer settled otherwise simply leaves the
    driver's book; the timer is not moved for that: it goes off at the time it was armed for,
    expires nothing, and is armed again at the next deadline (so a busy lane costs one timer
    per ``timeout``, not one per transfer).  The timer is armed :attr:`slack` after that
    deadline, so the transfers that start within ``slack`` of each other expire together, in
    one firing, however slowly the loop started them: a transfer expires no sooner than its
    deadline and at most ``slack`` (2 % of ``timeout``, at most 50 ms) after it.
    """

    __slots__ = ("_armed", "slack", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.slack = min(timeout * 0.02, 0.05)
        self._armed: float | None = None  # when the driver's timer goes off; None: not armed

    def start(self, now: float) -> float | None:
        """A transfer starts at ``now``: returns when to arm the timer, or None if it is armed."""
        if self._armed is not None:
            return None
        self._armed = now + self.timeout + self.slack
        return self._armed

    def fired(self, now: float, in_flight: Iterable[tuple[int, float]]) -> tuple[list[int], float | None]:
        """The timer went off at ``now``; ``in_flight``: the transfers not settled, as ``(id,
        start time)`` in start order.  Returns those that expire (due by ``now``, or by the
        time the timer was armed for: a loop may run a timer a little early), in start order,
        and when to arm the timer next (None: nothing is left to expire, leave it unarmed)."""
        cutoff = now if self._armed is None else max(now, self._armed)
        expired, timeout = [], self.timeout
        self._armed = None
        for transfer_id, started in in_flight:
            if started + timeout > cutoff:
                self._armed = started + timeout + self.slack
                break
            expired.append(transfer_id)
        return expired, self._armed


class Drain:
    """The orderly close of one lane: when it may be released.  No I/O, no clock.

    Both sides send a Goodbye and release the lane once this side left (:meth:`leave`), the
    peer's Goodbye arrived (:meth:`goodbye`; tag order: everything the peer sent before it
    has arrived), no payload message announced to ``inbox`` is still to come, and the lane
    reports no request in flight (:meth:`progress`), so no UCX request is left behind.  The
    driver bounds the wait (:meth:`expire`).  Exactly one of :meth:`progress` and
    :meth:`expire` answers True, once: the lane is released then.
    """

    __slots__ = ("_inbox", "leaving", "peer_left", "released")

    def __init__(self, inbox: Inbox[Any]) -> None:
        self._inbox = inbox
        self.leaving = False
        """This side sent its Goodbye: incoming messages are no longer delivered."""
        self.peer_left = False
        """The peer's Goodbye arrived: every message it sent is here."""
        self.released = False
        """The drain ended (drained, or its time was up)."""

    def leave(self) -> None:
        """This side sends its Goodbye (its own transfers are settled): the lane drains."""
        self.leaving = True

    def goodbye(self) -> bool:
        """The peer's Goodbye arrived (the driver handled what the peer sent before it first).
        True if this side has not left yet: it must leave now (:meth:`leave`), and its owner
        learn that the peer is closing; False if it already left."""
        self.peer_left = True
        return not self.leaving

    def progress(self, in_flight: int) -> bool:
        """The lane has ``in_flight`` requests pending (after a progress pass, or when the
        drain starts): True, once, when the lane may be released."""
        if self.released or not (self.leaving and self.peer_left) or in_flight or self._inbox.expecting:
            return False
        self.released = True
        return True

    def expire(self) -> bool:
        """The drain's time is up: the lane is released now.  True if it had not drained
        (the driver says so); False if it was released already."""
        if self.released:
            return False
        self.released = True
        return True
