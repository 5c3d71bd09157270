"""The lane protocol's state, free of I/O: events in, actions out.

A lane driver (:mod:`.ucx`) reports what happened (a header was handled, a payload message
arrived, an answer came) and carries out what it is told (receive this message into these
buffers, post this request, settle that transfer, drop the peer).  The receiver's side is
:class:`Inbox` (payload messages matched to the headers that announced them, within bounds);
the sender's is :class:`Outbox` (sequence numbers, requests waiting for the receiver's
:class:`~.limits.Window`, answers awaited per transfer).  Deadlines, the ``Transfer`` handles,
goodbye and drain stay in the driver for now.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, TypeVar

from ..errors import ProtocolError
from ..wire import MAX_PENDING_PAYLOADS
from .limits import Window

T = TypeVar("T")


class Inbox(Generic[T]):
    """The receiver's payload messages of one peer, matched to their headers by sequence
    number in whichever order the two arrive, within per-peer bounds.

    A header announces payload messages with :meth:`expect` (``target``: where each goes, opaque
    here); a payload message reports itself with :meth:`arrived` (``message``: the driver's
    handle, opaque here).  Either returns ``(message, target)`` once both are known: the
    driver receives the message into the target.  Bounds: at most ``max_pending`` messages
    pending (announced and not arrived, or arrived before their header), at most ``max_bytes``
    of buffers :meth:`admit`-ted and not yet :meth:`received`.  Every violation raises
    :class:`ProtocolError`; the driver then drops the peer and calls :meth:`release`, which
    hands back every message it must still take (UCX must not be left holding them).
    """

    __slots__ = ("_early", "_expected", "max_bytes", "max_pending", "pending_bytes")

    def __init__(self, max_bytes: int, max_pending: int = MAX_PENDING_PAYLOADS) -> None:
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self.pending_bytes = 0
        self._expected: dict[int, tuple[int, T]] = {}
        self._early: dict[int, tuple[int, Any]] = {}

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
        pending = self.pending + sum(1 for i in range(seq, seq + messages) if i not in early)
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
        early = self._early.pop(seq, None)
        if early is None:
            self._expected[seq] = (length, target)
            return None
        return self._match(seq, early[0], early[1], length, target)

    def arrived(self, seq: int, length: int, message: Any) -> tuple[Any, T] | None:
        """Payload message ``seq`` of ``length`` bytes arrived: returns what to receive now if
        its header was handled, else keeps it (raising if that exceeds the bound)."""
        expected = self._expected.pop(seq, None)
        if expected is None:
            self._early[seq] = (length, message)  # kept first: release() hands it back
            if self.pending > self.max_pending:
                raise ProtocolError(f"over {self.max_pending} payload messages pending")
            return None
        return self._match(seq, length, message, expected[0], expected[1])

    def _match(self, seq: int, length: int, message: Any, announced: int, target: T) -> tuple[Any, T]:
        if length != announced:
            self._early[seq] = (length, message)  # still to be taken: release() hands it back
            raise ProtocolError(f"payload message {seq} has {length} bytes, its header announced {announced}")
        return message, target

    def release(self) -> list[Any]:
        """Forget everything (the peer is gone); returns the arrived messages nobody took."""
        messages = [message for _, message in self._early.values()]
        self._early.clear()
        self._expected.clear()
        self.pending_bytes = 0
        return messages


class _Out:
    """What the sender still awaits for one transfer."""

    __slots__ = ("error", "parts", "posted")

    def __init__(self, parts: int) -> None:
        self.parts = parts  # requests not answered yet
        self.posted = 0  # requests handed to the driver
        self.error: tuple[str, str] | None = None  # the first failed answer: (code, reason)


class Outbox(Generic[T]):
    """The sender's side of one lane: sequence numbers, the requests of each transfer
    (``post``: what the driver does to send one, opaque here) and the receiver's window.

    :meth:`submit` and :meth:`answered` return the posts to carry out now, in order; a
    request that does not fit the window waits, in order, until answers make room.  A
    transfer settles on its last answer (:meth:`answered` says when, and with which failure);
    one settled locally first (deadline, cancel, peer removal) is :meth:`forget`-ten: its
    waiting requests are dropped, but what it posted keeps its window share until answered.
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

    def submit(self, transfer_id: int, requests: list[tuple[int, int, T]]) -> list[T]:
        """A new transfer of ``(payload messages, chunk bytes, post)`` requests; returns the
        posts to carry out now."""
        self._out[transfer_id] = _Out(len(requests))
        self._queue.extend((transfer_id, messages, nbytes, post) for messages, nbytes, post in requests)
        return self._pump()

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
        return settled, error, self._pump()

    def posted(self, transfer_id: int) -> bool:
        """True if some request of the transfer left this side (a ``"wait"`` cancel drains)."""
        out = self._out.get(transfer_id)
        return out is not None and out.posted > 0

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
