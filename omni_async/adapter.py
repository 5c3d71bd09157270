"""The :class:`TransferAdapter`: per-request chunk streams between pipeline stages.

It replaces the seed adapter's save thread, recv thread and polled finished/failed sets:

* ``save_async(request_id, chunk, final=...)`` sends a chunk and returns a future: at once when
  the window has room and nothing is queued, else through a queue that one save task (woken
  by the queue, never by a timer) sends in order; at most ``max_in_flight`` are
  unacknowledged at a time, so a slow receiver back-pressures the sender.
  The future resolves when the receiver acknowledged the chunk, or fails with the reason.
* ``load_async(request_id)`` returns a future for the request's next chunk;
  ``stream(request_id)`` iterates the chunks in order and ends after the ``final`` one.  The
  receive side is driven by arriving messages (the connector's sink), not by a loop.
* A request whose next chunk does not arrive within ``stall_timeout`` of the last one fails its
  waiter with :class:`~omni_async.errors.DeadlineExceeded` and is cleaned up.

Chunk ``i`` of request ``r`` travels under the key ``f"{r}:{stage}:{i}"``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .batch import MAX_ITEMS
from .config import AdapterOptions
from .connector import Connector
from .errors import (
    ClosedError,
    DeadlineExceeded,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferCancelled,
    UnknownPeer,
)
from .lifecycle import close_task
from .serde import Payload
from .transport import Transfer
from .window import SaveWindow

log = logging.getLogger(__name__)

_EARLY = 1e-3
"""A stall timer that fires this close to its request's ``due`` counts as on time."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One received chunk: ``data`` is the payload mapping the sender saved.

    Its arrays are the receiver's: large ones from a same-host peer are views of the agent's
    receive pool (:mod:`omni_async.transport.pool`), reused only after the last reference to
    them is dropped; keeping them long only makes later chunks arrive in fresh arrays."""

    request_id: str
    index: int
    data: dict[str, Any]
    final: bool


@dataclass(eq=False)
class _Save:
    request_id: str
    index: int
    data: Payload
    final: bool
    cancelled: bool
    future: asyncio.Future[None]


@dataclass(eq=False)
class _Incoming:
    """Receive-side state of one request."""

    next_index: int = 0
    waiters: deque[asyncio.Future[Chunk]] = field(default_factory=deque)
    due: float | None = None
    """Loop time at which the request stalls unless a chunk comes first; None: not watched."""
    timer: asyncio.TimerHandle | None = None
    """The one timer that checks :attr:`due` (a chunk only moves ``due``: no timer per chunk)."""
    ended: bool = False
    """The final chunk was loaded while earlier loads still waited: forgotten once they end."""
    latest: tuple[asyncio.Future[Chunk], asyncio.Future[dict[str, Any]]] | None = None
    """The latest load that waits (for chunk ``next_index - 1``) and its wait in the connector."""
    kept: Chunk | None = None
    """Chunk ``next_index``, which came to a load given up before its owner got it: the next load takes it."""


class TransferAdapter:
    """Chunk streams of one pipeline ``stage`` over a connector.

    ``peer_id`` is where saved chunks go (None: this adapter only receives); ``source`` is the
    peer chunks come from, if known (its loss then fails waiters at once with ``PeerLost``).
    ``window`` bounds the saves sent and not yet acknowledged (default: a
    :class:`~omni_async.window.SaveWindow` of ``options.max_in_flight`` shares; an
    ``asyncio.Semaphore`` serves too, a little slower); adapters given the same one share
    the bound.
    """

    def __init__(
        self,
        connector: Connector,
        stage: str,
        *,
        peer_id: str | None = None,
        source: str | None = None,
        options: AdapterOptions | None = None,
        window: SaveWindow | asyncio.Semaphore | None = None,
    ) -> None:
        if ":" in stage:
            raise ValueError("a stage name must not contain ':'")
        self.connector = connector
        self.stage = stage
        self.peer_id = peer_id
        self.source = source
        self.options = options or AdapterOptions()
        self._loop = asyncio.get_running_loop()
        self._queue: deque[_Save] = deque()
        """Saves waiting for the save loop, in order."""
        self._queued: asyncio.Future[None] | None = None
        """Set while the save loop waits for a save to be queued (the next one resolves it)."""
        self._window = window if window is not None else SaveWindow(self.options.max_in_flight)
        self._next_save: dict[str, int] = {}
        self._unsettled: set[asyncio.Future[None]] = set()
        self._incoming: dict[str, _Incoming] = {}
        self._save_task: asyncio.Task[None] | None = None
        self._blocked = False
        """The save loop holds a save that waits for room in the window (later ones queue)."""
        self._broken = ""
        """Why the adapter broke (its save loop died); empty while it works."""
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None
        """The close in progress (or done): every :meth:`close` call waits for this one."""
        self.stalls = 0
        """Requests failed by their stall deadline so far (exported as ``omni_async_streams_stalled``)."""

    # -- saving -----------------------------------------------------------------------------
    def save_async(self, request_id: str, chunk: Payload, *, final: bool = False) -> asyncio.Future[None]:
        """Send (or queue) ``chunk`` as the request's next chunk; the future resolves on the receiver's ack.

        The chunk's arrays are borrowed until then.  A chunk that cannot travel fails its own
        future with ``TypeError``; later saves are unaffected.  Raises :class:`ClosedError`
        once closing, or if the adapter broke (its save loop died: every unsettled save failed).
        """
        return self._enqueue(request_id, chunk, final=final, cancelled=False)

    async def save(self, request_id: str, chunk: Payload, *, final: bool = False) -> None:
        """Save and wait for the receiver's acknowledgement."""
        await self.save_async(request_id, chunk, final=final)

    def _enqueue(self, request_id: str, chunk: Payload, *, final: bool, cancelled: bool) -> asyncio.Future[None]:
        if self._closing:
            raise ClosedError("adapter is closed")
        if self._broken:
            raise ClosedError(self._broken)
        if self.peer_id is None:
            raise ValueError("this adapter has no destination peer (peer_id=None)")
        index = self._next_save.get(request_id, 0)
        if final or cancelled:
            self._next_save.pop(request_id, None)
        else:
            self._next_save[request_id] = index + 1
        future: asyncio.Future[None] = self._loop.create_future()
        alone = not self._unsettled  # no other save of ours in flight or queued
        self._unsettled.add(future)  # until _settle (no done callbacks: each would cost a loop hop)
        item = _Save(request_id, index, chunk, final, cancelled, future)
        if alone and not self._blocked and not self._queue and self._take_share():
            self._send(item)  # nothing ahead of it, nothing in flight, room in the window: now, no loop hop
            return future
        self._queue.append(item)
        waiting = self._queued
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
        if self._save_task is None:
            self._save_task = self._loop.create_task(self._save_loop(), name=f"omni-adapter-save-{self.stage}")
            self._save_task.add_done_callback(self._save_loop_ended)
        return future

    async def _save_loop(self) -> None:
        """Send the saves that found the window full or others queued ahead of them, in order
        (:attr:`_blocked` while one waits for the window, so later saves queue behind it).
        The saves queued behind it that the window has room for go with it, in one call of
        the connector's ``put_many_nowait`` (which may send them as one message)."""
        queue = self._queue
        while True:
            if not queue:
                self._queued = self._loop.create_future()
                try:
                    await self._queued
                finally:
                    self._queued = None
                continue
            item = queue.popleft()
            if not _acquire_nowait(self._window):
                self._blocked = True
                try:
                    await self._window.acquire()
                finally:
                    self._blocked = False
            items = [item]
            while len(items) < MAX_ITEMS and queue and _acquire_nowait(self._window):
                items.append(queue.popleft())
            if len(items) == 1:
                self._send(item)
            else:
                self._send_many(items)

    def _take_share(self) -> bool:
        """A share of the window without waiting, for a save that may go at once."""
        try:
            return _acquire_nowait(self._window)
        except Exception:  # a broken window: the save loop meets it too and breaks the adapter loudly
            return False

    def _send(self, item: _Save) -> None:
        """Start one save (its window share taken).  A save that cannot start fails its own
        future (a payload the codec cannot carry: ``TypeError``) and frees its share."""
        assert self.peer_id is not None
        try:
            transfer = self.connector.put_nowait(self.peer_id, self._key(item.request_id, item.index), _envelope(item))
        except Exception as exc:
            self._finish(item, exc)
            return
        transfer.add_done_callback(partial(self._saved, item))

    def _send_many(self, items: list[_Save]) -> None:
        """Start several saves (each with its window share taken) through one call of the
        connector; each ends as :meth:`_send` would end it."""
        assert self.peer_id is not None
        self.connector.put_many_nowait(
            self.peer_id,
            [(self._key(item.request_id, item.index), _envelope(item)) for item in items],
            partial(self._many_done, items),
        )

    def _many_done(self, items: list[_Save], index: int, error: BaseException | None) -> None:
        self._finish(items[index], error)

    def _finish(self, item: _Save, error: BaseException | None) -> None:
        """A save settled, or could not start: free its window share and settle its future."""
        self._window.release()
        if isinstance(error, UnknownPeer):
            error = PeerLost(f"destination {self.peer_id!r} is not connected")
        elif error is not None and not isinstance(error, (OmniAsyncError, TypeError, ValueError)):
            log.error("save %d of %r could not start", item.index, item.request_id, exc_info=error)
        self._settle(item.future, error)

    def _save_loop_ended(self, task: asyncio.Task[None]) -> None:
        """The save loop only ends when :meth:`close` cancels it; if it died anyway (or someone
        else cancelled it) the adapter is broken: every unsettled save fails now and later
        saves raise at once."""
        if self._closing:
            return
        error: BaseException | None = asyncio.CancelledError() if task.cancelled() else task.exception()
        log.error("adapter %r save loop died; the adapter is broken", self.stage, exc_info=error)
        self._broken = f"adapter {self.stage!r} is broken: its save loop ended with {error!r}"
        for future in list(self._unsettled):
            self._settle(future, ClosedError(self._broken))

    def _saved(self, item: _Save, transfer: Transfer) -> None:
        self._finish(item, transfer.error())

    def _settle(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        """The one way a save's future ends (unless its owner cancels it): resolved, or failed
        and the failure logged too, so none goes unseen."""
        self._unsettled.discard(future)
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
            future.exception()  # logged here: a failed save nobody awaits is not reported again
            log.warning("chunk save failed: %s", error)

    # -- loading ----------------------------------------------------------------------------
    def load_async(self, request_id: str) -> asyncio.Future[Chunk]:
        """A future for the request's next chunk (in order).  Raises :class:`ClosedError` once closing."""
        taken = self._take_next(request_id)
        if taken is None:
            return self._wait_next(request_id)
        result: asyncio.Future[Chunk] = self._loop.create_future()
        if isinstance(taken, Chunk):
            result.set_result(taken)
        else:
            _fail_load(result, taken)
        return result

    async def load(self, request_id: str) -> Chunk:
        """Wait for the request's next chunk (a chunk here already is taken without a future).

        Cancelled once its chunk was handed to it but before it returned (a timeout around it
        firing in that turn), it leaves the chunk to the next load (see :meth:`_keep`)."""
        taken = self._take_next(request_id)
        if taken is None:
            loading = self._wait_next(request_id)
            try:
                return await loading
            except asyncio.CancelledError:
                if loading.done() and not loading.cancelled() and loading.exception() is None:
                    self._keep(request_id, loading.result().index, loading.result())
                raise
        if isinstance(taken, Chunk):
            return taken
        raise taken

    async def stream(self, request_id: str) -> AsyncIterator[Chunk]:
        """Yield the request's chunks in order; stop after the final one."""
        while True:
            chunk = await self.load(request_id)
            yield chunk
            if chunk.final:
                return

    def _take_next(self, request_id: str) -> Chunk | OmniAsyncError | None:
        """The request's next chunk if it is here (buffered by the connector, or kept from a
        load given up as it arrived), taken now (its index used), or why it cannot be loaded
        (the request is then cleaned up); None if it has not arrived (then :meth:`_wait_next`
        waits for it).  Raises :class:`ClosedError` once closing."""
        if self._closing:
            raise ClosedError("adapter is closed")
        state = self._incoming.get(request_id)
        if state is not None and state.latest is not None and state.latest[0].cancelled():
            # The latest load was given up a moment ago (its callback still queued): handle it
            # now, so this load asks for that chunk again rather than for the next one.
            result, payload = state.latest
            self._load_cancelled(request_id, state.next_index - 1, payload, result)
            state = self._incoming.get(request_id)
        index = 0 if state is None else state.next_index
        chunk: Chunk | OmniAsyncError
        if state is not None and state.kept is not None:
            chunk, state.kept = state.kept, None
        else:
            envelope = self.connector.take_nowait(self._key(request_id, index), source=self.source)
            if envelope is None:
                return None
            chunk = self._unwrap(request_id, index, envelope)
        if state is None:
            state = self._incoming[request_id] = _Incoming()
        state.next_index = index + 1
        state.latest = None  # (a load that still waits is no longer the latest)
        self._rearm(request_id, None)
        if not isinstance(chunk, Chunk):
            self._unloadable(request_id, chunk)
        elif chunk.final:
            self._ended(request_id, state)
        return chunk

    def _wait_next(self, request_id: str) -> asyncio.Future[Chunk]:
        """A future for the request's next chunk, which has not arrived: resolved when it
        does (or fails: the request's stall deadline, the source's loss, a cleanup)."""
        state = self._incoming.get(request_id)
        if state is None:
            state = self._incoming[request_id] = _Incoming()
        index = state.next_index
        state.next_index += 1
        result: asyncio.Future[Chunk] = self._loop.create_future()
        state.waiters.append(result)
        payload = self.connector.wait_for(self._key(request_id, index), source=self.source)
        state.latest = (result, payload)
        cancelled = partial(self._load_cancelled, request_id, index, payload)
        result.add_done_callback(cancelled)  # its owner may give it up
        payload.add_done_callback(partial(self._arrived, request_id, index, result, cancelled))
        if not payload.done() and state.due is None:
            state.due = self._loop.time() + self.options.stall_timeout
            if state.timer is None:
                state.timer = self._loop.call_at(state.due, self._stalled, request_id)
        return result

    def _arrived(
        self, request_id: str, index: int, result: asyncio.Future[Chunk],
        cancelled: Callable[[asyncio.Future[Chunk]], None], payload: asyncio.Future[dict[str, Any]],
    ) -> None:
        result.remove_done_callback(cancelled)  # settled from here now: it would only return, a loop turn later
        self._rearm(request_id, result)
        if payload.cancelled():
            result.cancel()
            return
        error = payload.exception()  # retrieved even when the result was settled already
        self._loaded(request_id, index, result, error, payload.result() if error is None else None)

    def _rearm(self, request_id: str, result: asyncio.Future[Chunk] | None) -> None:
        """A chunk came (for ``result``, or for a load that took it at once): restart the
        request's stall clock if other loads wait, else stop watching it (the armed timer,
        when it fires, finds that out)."""
        state = self._incoming.get(request_id)
        if state is not None and state.due is not None:
            if any(not w.done() and w is not result for w in state.waiters):
                state.due = self._loop.time() + self.options.stall_timeout
            else:
                state.due = None

    def _loaded(
        self, request_id: str, index: int, result: asyncio.Future[Chunk], error: BaseException | None,
        envelope: dict[str, Any] | None,
    ) -> None:
        """Settle load ``result`` with the chunk in ``envelope``, or with ``error`` (the request
        is then cleaned up); a load settled already (cancelled) is left alone."""
        if result.done():
            return
        state = self._incoming.get(request_id)
        if error is not None:
            _fail_load(result, error)
            self.cleanup(request_id)
            return
        assert envelope is not None
        chunk = self._unwrap(request_id, index, envelope)
        if not isinstance(chunk, Chunk):
            _fail_load(result, chunk)
            self._unloadable(request_id, chunk)
            return
        result.set_result(chunk)
        if state is not None and result in state.waiters:
            state.waiters.remove(result)
            if chunk.final or state.ended:
                self._ended(request_id, state)

    @staticmethod
    def _unwrap(request_id: str, index: int, envelope: dict[str, Any]) -> Chunk | OmniAsyncError:
        """The chunk an envelope holds, or why it cannot be loaded."""
        final, cancelled, data = envelope.get("final"), envelope.get("cancelled"), envelope.get("data")
        if type(final) is not bool or type(cancelled) is not bool or not isinstance(data, dict):
            return ProtocolError(f"chunk {index} of {request_id!r} is not a chunk envelope")
        if cancelled:
            return TransferCancelled(f"request {request_id!r} was cancelled by its sender")
        return Chunk(request_id, index, data, final)

    def _load_cancelled(
        self, request_id: str, index: int, payload: asyncio.Future[Any], result: asyncio.Future[Chunk]
    ) -> None:
        """A load given up by its owner (e.g. ``wait_for`` timed out) withdraws its wait.

        The stream stays usable when it was the latest load: the next load asks for the same
        chunk again, or takes it at once if it arrived in the turn the load was given up (its
        sender has the acknowledgement: the chunk is kept, not dropped).  Otherwise (a later
        load waits) the request cannot stay in order and is cleaned up: later loads of it fail
        at once with :class:`TransferCancelled` saying so (see :meth:`cleanup`).
        """
        if not result.cancelled():
            return
        state = self._incoming.get(request_id)
        if state is None or result not in state.waiters:
            return  # handled already (by the load made right after it, see _take_next)
        state.waiters.remove(result)
        if state.latest is not None and state.latest[0] is result:
            state.latest = None
        if payload.done():  # its chunk came in the turn the load was given up
            error = payload.exception()
            if error is None:
                self._keep(request_id, index, self._unwrap(request_id, index, payload.result()))
            else:
                self.cleanup(request_id, error if isinstance(error, OmniAsyncError) else None)
        elif state.next_index == index + 1:
            payload.cancel()
            state.next_index = index
            if not state.waiters:
                state.due = None
        else:
            payload.cancel()
            self.cleanup(request_id, TransferCancelled(f"a load of {request_id!r} was abandoned out of order"))

    def _keep(self, request_id: str, index: int, outcome: Chunk | OmniAsyncError) -> None:
        """Chunk ``index`` came to a load given up before its owner got it (the sender has its
        acknowledgement): it is kept for the next load of the request, which takes it at once.
        If a later load was made already (order cannot hold), the request is cleaned up
        instead; if it cannot be loaded (``outcome``: what :meth:`_unwrap` said), as any such."""
        state = self._incoming.get(request_id)
        if state is None and isinstance(outcome, Chunk) and outcome.final and not self._closing:
            state = self._incoming[request_id] = _Incoming(next_index=index + 1)  # (it had ended the request)
        if state is None:
            return  # cleaned up meanwhile
        if not isinstance(outcome, Chunk):
            self._unloadable(request_id, outcome)
        elif state.next_index != index + 1 or state.kept is not None:  # (a later chunk is kept)
            self.cleanup(request_id, TransferCancelled(f"a load of {request_id!r} was abandoned out of order"))
        else:
            state.next_index = index
            state.kept = outcome
            state.ended = False  # (until the next load takes it)

    def _stalled(self, request_id: str) -> None:
        """The request's timer fired: it stalled if its ``due`` passed; else the timer is
        armed again for ``due`` (moved by chunks meanwhile), or not at all (nothing waits)."""
        state = self._incoming.get(request_id)
        if state is None:
            return
        state.timer = None
        if state.due is None:
            return
        if state.due - self._loop.time() > _EARLY:
            state.timer = self._loop.call_at(state.due, self._stalled, request_id)
            return
        state.due = None
        self.stalls += 1
        self.cleanup(
            request_id,
            DeadlineExceeded(f"request {request_id!r} got no chunk for {self.options.stall_timeout}s"),
        )

    # -- cleanup ----------------------------------------------------------------------------
    def cleanup(self, request_id: str, error: OmniAsyncError | None = None) -> None:
        """Forget a request: fail its waiters, drop its buffered chunks, refuse late ones.

        Idempotent.  Waiters get ``error`` (default :class:`TransferCancelled`); later loads of
        the request fail at once with :class:`TransferCancelled` naming the first cleanup's
        ``error``.  Only this request's keys are concerned, not those of one whose id extends
        its key prefix (see :func:`~omni_async.connector.key_prefix`).
        """
        self._drop_request(request_id, error or TransferCancelled(f"request {request_id!r} cleaned up"),
                           refuse_later=True)

    def _unloadable(self, request_id: str, why: OmniAsyncError) -> None:
        """A chunk of the request came that cannot be loaded (what :meth:`_unwrap` gives instead
        of a chunk): the sender's cancel (its only :class:`TransferCancelled`) ends the sender's
        stream (:meth:`_cancelled_by_sender`); anything else cleans the request up."""
        if isinstance(why, TransferCancelled):
            self._cancelled_by_sender(request_id)
        else:
            self.cleanup(request_id)

    def _cancelled_by_sender(self, request_id: str) -> None:
        """A load took the sender's cancel, the last chunk of its stream (every earlier one was
        taken): loads made beyond it fail, and the request is forgotten; but what is buffered
        under its keys is kept, and what comes later taken (not refused, as after a cleanup):
        it can only be a new stream the sender started under the same id, which it may reuse
        once it cancelled, and it has the acknowledgements of those chunks already."""
        self._drop_request(request_id, TransferCancelled(f"request {request_id!r} was cancelled by its sender"),
                           keep_buffered=True)

    def _drop_request(self, request_id: str, error: OmniAsyncError, *, refuse_later: bool = False,
                      keep_buffered: bool = False) -> None:
        """Forget the request, fail its waiting loads with ``error`` and release its keys in the
        connector (with ``refuse_later`` and ``keep_buffered``: see :meth:`Connector.discard`)."""
        state = self._forget(request_id)
        if state is not None:
            for waiter in state.waiters:
                if not waiter.done():
                    _fail_load(waiter, error)
        self.connector.discard(f"{request_id}:{self.stage}:", error, refuse_later=refuse_later,
                               keep_buffered=keep_buffered)

    def cancel(self, request_id: str) -> None:
        """Cancel a request on both sides: local waiters fail, and if this side was sending
        it, the receiver's waiters fail with :class:`TransferCancelled`.  Idempotent."""
        if request_id in self._next_save and not self._closing:
            self._enqueue(request_id, {}, final=False, cancelled=True)
        self.cleanup(request_id)

    def _ended(self, request_id: str, state: _Incoming) -> None:
        """The request's final chunk was loaded (or, that done, an earlier one): forget the
        request once no load of it waits any more (a final chunk can arrive, and be loaded,
        before earlier ones: their loads keep the request, and its stall clock, until they
        end)."""
        if state.waiters:
            state.ended = True
        else:
            self._forget(request_id)

    def _forget(self, request_id: str) -> _Incoming | None:
        state = self._incoming.pop(request_id, None)
        if state is not None and state.timer is not None:
            state.timer.cancel()
        return state

    @property
    def active_requests(self) -> int:
        """Requests with receive-side state (waiters or a stall timer)."""
        return len(self._incoming)

    # -- lifecycle --------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop accepting, let queued and in-flight saves finish for up to ``drain_timeout``,
        then fail what is left with :class:`ClosedError`.  Idempotent, and whole when it
        returns: a second call waits for the first one's end, and a call cut short (its
        caller cancelled, a timeout around it) does not cut the close short: it goes on, and
        the next call waits for it."""
        if self._close_task is None:
            self._closing = True
            self._close_task = close_task(self._close(), f"omni-adapter-close-{self.stage}")
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        pending = list(self._unsettled)
        if pending:
            await asyncio.wait(pending, timeout=self.options.drain_timeout)
        if self._save_task is not None:
            self._save_task.cancel()
            await asyncio.gather(self._save_task, return_exceptions=True)
        closed = ClosedError("adapter closed")
        for future in list(self._unsettled):
            self._settle(future, closed)
        for request_id in list(self._incoming):
            self.cleanup(request_id, closed)

    async def __aenter__(self) -> TransferAdapter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _key(self, request_id: str, index: int) -> str:
        return f"{request_id}:{self.stage}:{index}"


def _envelope(item: _Save) -> dict[str, Any]:
    """What travels for a save: the chunk and its flags."""
    return {"final": item.final, "cancelled": item.cancelled, "data": item.data}


def _acquire_nowait(window: SaveWindow | asyncio.Semaphore) -> bool:
    """Take one share of ``window`` if that needs no wait (a semaphore's ``acquire`` then
    completes on its first step, as documented); False if it is locked (full, or others wait
    for it)."""
    if isinstance(window, SaveWindow):
        return window.take_nowait()
    if window.locked():
        return False
    step = window.acquire()
    try:
        step.send(None)
    except StopIteration:
        return True
    step.close()  # unreachable: an unlocked semaphore's acquire does not wait
    raise RuntimeError("asyncio.Semaphore.acquire waited although the semaphore was not locked")


def _fail_load(future: asyncio.Future[Any], error: BaseException) -> None:
    """Fail a load's future, marked retrieved: a load failure belongs to whoever awaits the
    future; one nobody awaits is not an error."""
    future.set_exception(error)
    future.exception()
