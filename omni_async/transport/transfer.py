"""The :class:`Transfer` handle: an awaitable outcome of one write or message.  No I/O.

A transfer settles exactly once: *done* (the receiver acknowledged that the data is in place)
or *failed* with an :class:`~omni_async.errors.OmniAsyncError` that says why.  Awaiting it
returns ``None`` or raises that error.  No asyncio future exists until somebody awaits, so a
transfer that is only polled (the sync facade) never produces "exception never retrieved"
warnings, and a fire-and-forget write costs no future.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from enum import Enum
from typing import Any, Final, Literal

from ..errors import OmniAsyncError, TransferCancelled
from ..metrics import Kind

CancelMode = Literal["immediate", "wait"]


class State(Enum):
    PENDING = "pending"
    DRAINING = "draining"  # cancelled in "wait" mode: settles once the data plane lets go
    DONE = "done"
    FAILED = "failed"


_PENDING: Final = State.PENDING
_DRAINING: Final = State.DRAINING
_DONE: Final = State.DONE
_FAILED: Final = State.FAILED
"""(The members as module constants for the per-transfer paths: reading one through its Enum
class costs ~0.13 µs on Python 3.11, a module global ~0.01.)"""
_SETTLED: Final = (_DONE, _FAILED)
"""The settled states (a tuple: ``in`` compares members by identity, a set would hash an Enum in Python)."""


class Transfer:
    """Handle of one transfer to ``peer_id``; ``id`` is unique for the transport's life.

    ``await transfer`` returns when the receiver acknowledged, or raises the failure.
    ``kind`` says what it moves (``"blocks"``, ``"messages"``: its metrics' label) and
    ``started`` when it was submitted (the event loop's clock: its latency counts from there).
    """

    __slots__ = (
        "_answer_here", "_callbacks", "_error", "_on_cancel", "_state", "_waiters",
        "id", "kind", "nbytes", "peer_id", "started",
    )

    def __init__(
        self,
        transfer_id: int,
        peer_id: str,
        nbytes: int,
        on_cancel: Callable[[Transfer, CancelMode], bool] | None = None,
        kind: Kind = "blocks",
        started: float = 0.0,
    ) -> None:
        self.id = transfer_id
        self.peer_id = peer_id
        self.nbytes = nbytes
        self.kind: Kind = kind
        self.started = started
        self._state = _PENDING
        self._error: OmniAsyncError | None = None
        self._waiters: list[asyncio.Future[None]] = []
        """One future per ``await`` in progress: cancelling an awaiter cancels only its own (no
        shield, whose extra future costs a loop hop per transfer)."""
        self._callbacks: list[Callable[[Transfer], None]] = []
        self._on_cancel = on_cancel
        self._answer_here: Callable[[Transfer], bool] | None = None

    def __repr__(self) -> str:
        return f"<Transfer {self.id} to {self.peer_id!r} {self._state.value} {self.nbytes} B>"

    # -- observing ---------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    def done(self) -> bool:
        """True once settled (done or failed)."""
        return self._state in _SETTLED

    def error(self) -> OmniAsyncError | None:
        """The failure, or None if pending or done."""
        return self._error

    @property
    def waiters(self) -> int:
        """How many ``await`` expressions on this transfer are in progress (a cancelled one is forgotten)."""
        return len(self._waiters)

    def add_done_callback(self, callback: Callable[[Transfer], None]) -> None:
        """Call ``callback(self)`` once settled (at once if already settled)."""
        if self.done():
            callback(self)
        else:
            self._callbacks.append(callback)

    def __await__(self) -> Generator[Any, None, None]:
        """Wait until settled; raise its error, if any.

        Gives the loop a turn, even for a transfer settled before it was awaited (a read from
        a mapped peer, an empty write): a caller awaiting such transfers in a loop would
        otherwise never let the loop run (no heartbeats, no timers).  The one exception: a
        transfer whose answer the transport took in this task (:meth:`answer_in_awaiter`)
        goes on at once while the transport's :class:`~.turns.TurnBudget` allows it."""
        answer_here = self._answer_here
        if answer_here is not None:
            self._answer_here = None
            if answer_here(self):  # settled here, and the loop had a turn not long ago
                if self._error is not None:
                    raise self._error
                return
        if self._state not in _SETTLED:  # (done(), inline: once per await)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                yield from waiter.__await__()
            finally:
                if self._state not in _SETTLED:  # the awaiter was cancelled: forget its future
                    self._waiters.remove(waiter)
        else:
            yield  # a bare yield: the task comes back on the loop's next turn (as asyncio.sleep(0))
        if self._error is not None:
            raise self._error

    def take_answer(self) -> bool:
        """For a caller that polls instead of awaiting (the sync facade, holding the loop in
        its own thread): let the transport take this transfer's answer here and now, as the
        first ``await`` would (:meth:`answer_in_awaiter`; at most once, and only where the
        transport offered it); True if the transfer is settled."""
        answer_here = self._answer_here
        if answer_here is not None:
            self._answer_here = None
            answer_here(self)
        return self._state in _SETTLED

    def answer_in_awaiter(self, answer_here: Callable[[Transfer], bool]) -> None:
        """Let the first ``await`` take the answer in its own task: while pending it calls
        ``answer_here(self)`` once, which may settle the transfer (the transport polls for the
        answer briefly there, sparing the loop turn that would take it and the one that would
        resume the awaiter) and returns True if the awaiter may go on without a loop turn.
        Else (or if it did not settle) the await waits as any other."""
        if self._state not in _SETTLED:
            self._answer_here = answer_here

    # -- driving (the transport) -------------------------------------------------------------
    def cancel(self, mode: CancelMode = "immediate") -> bool:
        """Cancel; return True if the transfer is still draining (``"wait"`` mode only).

        ``"immediate"`` settles at once with :class:`TransferCancelled`; the data plane may
        still read the source blocks for a moment.  ``"wait"`` settles with
        :class:`TransferCancelled` only once the data plane has let go of the transfer (the
        receiver answered or the peer was lost), so the source blocks are then free to reuse.
        A settled transfer is left alone (returns False).
        """
        if self.done():
            return False
        if mode not in ("immediate", "wait"):
            raise ValueError(f"cancel mode must be 'immediate' or 'wait', got {mode!r}")
        draining = self._on_cancel(self, mode) if self._on_cancel is not None else False
        if draining and mode == "wait":
            self._state = _DRAINING
            return True
        self._settle(TransferCancelled(f"transfer {self.id} cancelled"))
        return False

    def set_done(self) -> bool:
        """Settle successfully (a draining transfer settles as cancelled).  True if that woke
        an awaiter or ran a done-callback (see :meth:`_settle`)."""
        if self._state is _DRAINING:
            return self._settle(TransferCancelled(f"transfer {self.id} cancelled"))
        if self._state not in _SETTLED:
            return self._settle(None)
        return False

    def set_failed(self, error: OmniAsyncError) -> bool:
        """Settle with ``error`` (a draining transfer settles as cancelled).  True if that
        woke an awaiter or ran a done-callback."""
        if self._state is _DRAINING:
            error = TransferCancelled(f"transfer {self.id} cancelled")
        if not self.done():
            return self._settle(error)
        return False

    def _settle(self, error: OmniAsyncError | None) -> bool:
        """Settle; True if an awaiter was woken (its task runs on a coming loop turn) or a
        done-callback ran."""
        self._error = error
        self._answer_here = None  # (it holds the transport)
        self._state = _DONE if error is None else _FAILED
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)  # the error is raised by __await__, never left unretrieved
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return bool(waiters or callbacks)
