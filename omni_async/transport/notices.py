"""Receiver notices: what a block write with ``notice=`` tells the receiving application.

A sender attaches opaque ``data`` to a write; once every byte of it is in the receiver's
region the receiver's application gets a :class:`Notice` (before the sender's await returns:
the acknowledgement that settles the sender's transfer is held until the notice is queued).
A write that failed or was given up after some of it may have landed yields a notice with
``failed`` set and the rows concerned, so the receiver can free or re-request them.

:class:`NoticeBook` (no I/O) tracks one peer's writes with notices in the order their first
header arrived (the sender's write order) and says which notices are ready and which held
acknowledgements go with them.  :class:`NoticeQueue` is the bounded, agent-wide queue the
application reads; a full queue holds the acknowledgements back (back-pressure to the senders)
and never drops a notice.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..errors import OmniAsyncError, ProtocolError, TransferFailed
from ..wire import MAX_NOTICE_RUNS, NOTICE_BOOK_RUNS
from .sink_tasks import SinkTasks

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Notice:
    """A write from ``peer_id`` into ``remote_idxs`` (this side's rows, in the sender's order)
    carrying ``data``.  ``failed`` is None when every row is in place; otherwise it says why
    the write failed and ``remote_idxs`` are the rows any byte of it may have reached."""

    peer_id: str
    remote_idxs: tuple[int, ...]
    data: bytes
    failed: OmniAsyncError | None = None


NoticeSink = Callable[[Notice], Awaitable[None] | None]
"""``sink(notice)``: the callback form of :meth:`NoticeQueue.__aiter__`.  The sender's transfer
settles when the sink returns or, if it returns an awaitable, when that completes."""


@dataclass(slots=True)
class _Pending(Generic[T]):
    """One write with a notice, as far as its headers and answers arrived."""

    parts: int
    data: bytes
    runs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Runs ``(start, count)`` of each part seen, by part number."""
    size: int = 0
    """What the parts seen count against the bounds: their runs, at least one a part."""
    done: int = 0
    error: OmniAsyncError | None = None
    aborted: bool = False
    held: list[T] = field(default_factory=list)
    """Acknowledgements that go out once the notice is queued."""

    def rows(self) -> tuple[int, ...]:
        return tuple(row for part in sorted(self.runs) for start, count in self.runs[part]
                     for row in range(start, start + count))

    def complete(self) -> bool:
        return self.done == self.parts or (self.aborted and self.done == len(self.runs))


Ready = tuple[Notice, list[T]]
"""A notice to queue and the acknowledgements to send once it is queued."""


class NoticeBook(Generic[T]):
    """One peer's writes with notices, in write order (the order their first header arrived).

    Calls: :meth:`seen` for each request header that carries a notice, :meth:`done` when that
    request is answered (``ack``: the driver's acknowledgement, opaque here), :meth:`aborted`
    when the sender gave the write up, :meth:`lost` when the peer is gone.  Each returns the
    notices now ready, in write order, with the acknowledgements to send once they are queued.
    At most ``max_pending`` writes are tracked (the sender's window keeps within it), at most
    ``max_runs`` runs in all (each part counts its runs, at least one), and one write has at most
    :data:`~omni_async.wire.MAX_NOTICE_RUNS` runs and parts (a sender refuses larger ones
    locally); more is a protocol violation.
    """

    __slots__ = ("_pending", "max_pending", "max_runs", "peer_id", "runs")

    def __init__(self, peer_id: str, max_pending: int, max_runs: int = NOTICE_BOOK_RUNS) -> None:
        self.peer_id = peer_id
        self.max_pending = max_pending
        self.max_runs = max_runs
        self.runs = 0
        """Runs (at least one a part) of the writes tracked."""
        self._pending: OrderedDict[int, _Pending[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def seen(self, transfer_id: int, part: int, parts: int, runs: Sequence[tuple[int, int]], data: bytes) -> None:
        """Request ``part`` of ``parts`` of a write with a notice arrived (``runs``: the rows it
        may write; empty for a refused request).  Raises :class:`ProtocolError` if it
        contradicts earlier parts or exceeds a bound."""
        if part >= parts or parts > MAX_NOTICE_RUNS:
            raise ProtocolError(f"write {transfer_id}: part {part} of {parts} (at most {MAX_NOTICE_RUNS} parts)")
        entry = self._pending.get(transfer_id)
        if entry is None:
            if len(self._pending) >= self.max_pending:
                raise ProtocolError(f"over {self.max_pending} writes with notices pending")
        elif entry.parts != parts or entry.data != data or part in entry.runs:
            raise ProtocolError(f"write {transfer_id}: part {part} contradicts the parts before it")
        size = max(len(runs), 1)
        if (0 if entry is None else entry.size) + size > MAX_NOTICE_RUNS:
            raise ProtocolError(f"write {transfer_id}: over {MAX_NOTICE_RUNS} runs")
        if self.runs + size > self.max_runs:
            raise ProtocolError(f"over {self.max_runs} runs of writes with notices pending")
        if entry is None:
            entry = self._pending[transfer_id] = _Pending(parts, data)
        entry.runs[part] = list(runs)
        entry.size += size
        self.runs += size

    def done(self, transfer_id: int, error: OmniAsyncError | None, ack: T) -> tuple[bool, list[Ready[T]]]:
        """A request of the write was answered.  Returns ``(held, ready)``: if ``held`` the
        driver must not send ``ack`` now (it comes back with the write's notice in ``ready``);
        acknowledgements of earlier parts go out at once (the sender may wait for them to post
        the later parts).  Unknown ids: ``(False, [])``."""
        entry = self._pending.get(transfer_id)
        if entry is None:
            return False, []
        entry.done += 1
        if error is not None and entry.error is None:
            entry.error = error
        if not entry.complete():
            return False, []
        entry.held.append(ack)
        return True, self._ready()

    def aborted(self, transfer_id: int, error: OmniAsyncError) -> list[Ready[T]]:
        """The sender gave the write up (deadline, cancel): it fails, with the rows of the
        parts seen, once those are answered (their payload may still be landing)."""
        entry = self._pending.get(transfer_id)
        if entry is None:
            return []
        entry.aborted = True
        if entry.error is None:
            entry.error = error
        return self._ready()

    def lost(self, error: OmniAsyncError) -> list[Notice]:
        """The peer is gone: every write not notified yet fails (in write order); forgets all."""
        notices = [self._notice(entry, entry.error or error) for entry in self._pending.values()]
        self._pending.clear()
        self.runs = 0
        return notices

    def _ready(self) -> list[Ready[T]]:
        ready: list[Ready[T]] = []
        while self._pending:
            transfer_id, entry = next(iter(self._pending.items()))
            if not entry.complete():
                break
            del self._pending[transfer_id]
            self.runs -= entry.size
            ready.append((self._notice(entry, entry.error), entry.held))
        return ready

    def _notice(self, entry: _Pending[T], error: OmniAsyncError | None) -> Notice:
        return Notice(self.peer_id, entry.rows(), entry.data, error)


class NoticeQueue:
    """The application's notices, at most ``capacity`` queued; read with ``async for``.

    :meth:`offer` queues a notice and calls ``release`` (which sends the held
    acknowledgements) once it is in the queue; while the queue is full offers wait, in order,
    and their senders' transfers stay unsettled.  With a sink set (:attr:`sink`) new notices go
    to it instead, and are released when it is done with them (an async sink's task runs in
    ``sink_tasks``).  Nothing is ever dropped:
    what waits is bounded by the senders' windows.  ``handed()`` is called whenever a notice
    goes to the sink or wakes the readers (the transport's :meth:`.Handoffs.handed`).
    """

    def __init__(self, capacity: int, sink_tasks: SinkTasks, handed: Callable[[], None]) -> None:
        self.capacity = capacity
        self.sink: NoticeSink | None = None
        self._handed = handed
        self._sink_tasks = sink_tasks  # what an async sink returned runs there
        self._queue: deque[Notice] = deque()
        self._waiting: deque[tuple[Notice, Callable[[], None]]] = deque()
        self._changed = asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def waiting(self) -> int:
        """Offers held back by a full queue."""
        return len(self._waiting)

    def offer(self, notice: Notice, release: Callable[[], None]) -> None:
        if self.sink is not None:
            self._handed()
            self._to_sink(self.sink, notice, release)
        elif len(self._queue) < self.capacity and not self._waiting:
            self._queue.append(notice)
            release()
            self._handed()
            self._changed.set()
        else:
            self._waiting.append((notice, release))

    def get_nowait(self) -> Notice | None:
        """The oldest queued notice, or None; admits one waiting offer."""
        if not self._queue:
            return None
        notice = self._queue.popleft()
        if self._waiting:
            waiting, release = self._waiting.popleft()
            self._queue.append(waiting)
            release()
        return notice

    async def __aiter__(self) -> AsyncIterator[Notice]:
        """Notices in arrival order (per peer: write order) until :meth:`close`."""
        while True:
            notice = self.get_nowait()
            if notice is not None:
                yield notice
                continue
            if self._closed:
                return
            self._changed.clear()
            await self._changed.wait()

    def close(self) -> None:
        """Readers stop once the queue is empty."""
        self._closed = True
        self._changed.set()

    def _to_sink(self, sink: NoticeSink, notice: Notice, release: Callable[[], None]) -> None:
        try:
            pending = sink(notice)
        except Exception:
            log.exception("notice sink failed on %s", notice)
            release()
            return
        if pending is None or not inspect.isawaitable(pending):
            release()
            return
        future = self._sink_tasks.start(pending, f"omni-notice-sink-{notice.peer_id}")

        def finished(task: asyncio.Future[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.error("notice sink failed on %s", notice, exc_info=task.exception())
            release()

        future.add_done_callback(finished)


def sink_error(exc: BaseException) -> OmniAsyncError:
    """The error a notice reports for a local failure that is not one of ours."""
    return exc if isinstance(exc, OmniAsyncError) else TransferFailed(f"receive failed: {exc}")
