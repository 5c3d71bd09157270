"""The lane protocol's state, free of I/O: events in, actions out.

A lane driver (:mod:`.ucx`) reports what happened (a header was handled, a payload message
arrived) and carries out what it is told (receive this message into these buffers, drop the
peer).  This module holds the receiver's matching of payload messages to the headers that
announced them (:class:`Inbox`); the sender's account of what the receiver holds is
:class:`~.limits.Window`.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ..errors import ProtocolError
from ..wire import MAX_PENDING_PAYLOADS

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
