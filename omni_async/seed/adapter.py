"""``SyncTransferAdapter``: the seed ``OmniTransferAdapterBase`` contract over a :class:`TransferAdapter`.

A :class:`~omni_async.service.ConnectorService` and its adapters run on the loop of a
:class:`~omni_async.seed.portal.Portal`; ``save_async`` / ``load_async`` return at once and
report through drained books (``get_finished_requests``, ``collect_failed_*``), ``save`` /
``load`` block with a bound.  A ``get_finished_requests`` that finds nothing new while saves or
loads are outstanding waits for the next one to settle (at most
:data:`~omni_async.seed.portal.NEWS_WAIT_S`), so a scheduler that drains in a tight loop does not
starve the loop of the GIL.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Coroutine, Mapping
from functools import partial
from typing import Any, TypeVar

import msgspec

from ..adapter import Chunk, TransferAdapter
from ..config import ServiceConfig, load_config
from ..errors import ClosedError, DeadlineExceeded, OmniAsyncError, TransferCancelled
from ..serde import Payload
from ..service import ConnectorService
from .portal import Facade, Portal

__all__ = ["Chunk", "SyncTransferAdapter"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_START_TIMEOUT_S = 10.0
"""How long the constructor waits for the loop to open UCX and bind the control plane."""
_CLOSE_MARGIN_S = 30.0
"""Beyond the adapters' ``drain_timeout``: a safety bound on closing the service, whose own
close (agent drain and grace) is never cut short."""


def _reason(error: BaseException) -> str:
    """The text a scheduler sees for a failed request: ``"PeerLost: peer 'x' left"``."""
    return f"{type(error).__name__}: {error}"


def _outcome(future: asyncio.Future[Any]) -> BaseException | None:
    if future.cancelled():
        return TransferCancelled("cancelled")
    return future.exception()


class _SaveBook:
    """Send-side state of one request saved with ``save_async`` (loop thread writes, under the lock)."""

    __slots__ = ("failed", "final", "pending")

    def __init__(self) -> None:
        self.pending = 0  # chunks queued and not yet settled
        self.final = False  # the final chunk was queued
        self.failed = False  # a chunk failed: reported once, never finished


class _LoadBook:
    """Receive-side state of one request loaded with ``load_async``: its loads not handed out
    yet, in the order they were made (loop thread writes, under the lock).  Loads settle in
    the order their chunks arrive, which is not the stream's (a small final chunk overtakes a
    large first one); they are handed out in the order made.  Gone once every load was handed
    out, or the request was cleaned up."""

    __slots__ = ("failed", "loads")

    def __init__(self) -> None:
        self.loads: deque[asyncio.Future[Chunk]] = deque()
        self.failed = False  # a load failed: reported once; later chunks are not handed out


class _AdapterEngine:
    """The service and adapters on the portal's loop, and the books the facade drains.

    Holds no reference to the facade (its finalizer shuts the engine down).  Fields marked
    *locked* are guarded by ``portal.lock``; ``service``, ``sender`` and ``receiver`` are
    touched only on the loop thread once started.
    """

    def __init__(self, config: ServiceConfig, stage: str, destination: str | None, source: str | None,
                 use_uvloop: bool) -> None:
        self.config = config
        self.stage = stage
        self.destination = destination  # locked
        self.outstanding = 0  # locked: save_async / load_async calls not settled yet
        self.saves: dict[str, _SaveBook] = {}  # locked
        self.loads: dict[str, _LoadBook] = {}  # locked
        self.finished: set[str] = set()  # locked
        self.failed_send: dict[str, str] = {}  # locked
        self.failed_recv: dict[str, str] = {}  # locked
        self.loaded: dict[str, deque[Chunk]] = {}  # locked
        self.source = source
        self.service: ConnectorService | None = None
        self.sender: TransferAdapter | None = None
        self.receiver: TransferAdapter | None = None
        self.portal = Portal(f"omni-sync-adapter-{config.agent.peer_id}", "SyncTransferAdapter",
                             use_uvloop=use_uvloop)

    @property
    def thread(self) -> threading.Thread:
        """The loop's thread."""
        return self.portal.thread

    # -- lifecycle (caller's thread) ------------------------------------------------------------
    def start(self) -> ConnectorService:
        async def start_service() -> ConnectorService:
            service = ConnectorService(self.config)
            self.service = service
            await service.start()
            self.receiver = service.adapter(self.stage, source=self.source)
            return service

        return self.portal.run(start_service(), _START_TIMEOUT_S, "starting the service")

    def shutdown(self) -> None:
        """Close the service (draining saves) to its end, stop the loop and join its thread."""
        service = self.service
        budget = self.config.adapter.drain_timeout + _CLOSE_MARGIN_S
        self.portal.stop(service.close if service is not None else None, budget)

    def post(self, fn: Any, *args: Any) -> None:
        """Hand ``fn(*args)``, a save or load, to the loop; it counts as outstanding until settled."""
        with self.portal.lock:
            self.outstanding += 1
        try:
            self.portal.post(fn, *args)
        except ClosedError:
            with self.portal.lock:
                self.outstanding -= 1
            raise

    # -- on the loop ---------------------------------------------------------------------------
    def outgoing(self) -> TransferAdapter:
        """The sending adapter, created on first use for the destination known by then."""
        if self.sender is None:
            assert self.service is not None
            with self.portal.lock:
                destination = self.destination
            if destination is None:
                raise ValueError("no destination: pass destination= or call connect() first")
            self.sender = self.service.adapter(self.stage, peer_id=destination)
        return self.sender

    def incoming(self) -> TransferAdapter:
        assert self.receiver is not None
        return self.receiver

    async def connect(self, address: str) -> str:
        assert self.service is not None
        peer = await self.service.agent.connect(address)
        with self.portal.lock:
            if self.destination is None:
                self.destination = peer
        return peer

    def submit_save(self, request_id: str, chunk: Payload, final: bool) -> None:
        with self.portal.lock:
            book = self.saves.setdefault(request_id, _SaveBook())
            book.pending += 1
            book.final = book.final or final
        try:
            future = self.outgoing().save_async(request_id, chunk, final=final)
        except (OmniAsyncError, ValueError, TypeError) as exc:
            self.on_saved(request_id, book, exc)
            return
        future.add_done_callback(lambda f: self.on_saved(request_id, book, _outcome(f)))

    def on_saved(self, request_id: str, book: _SaveBook, error: BaseException | None) -> None:
        """A save settled: count it in the book it was made under (``book``), unless that
        request was cleaned up meanwhile (a new request under the same id has its own book)."""
        with self.portal.lock:
            self.settled()
            if self.saves.get(request_id) is not book:  # cleaned up meanwhile
                return
            book.pending -= 1
            if error is not None and not book.failed:
                book.failed = True
                self.failed_send[request_id] = _reason(error)
            if book.pending == 0 and book.final:  # a failed request stays (quiet) until final or cleanup
                del self.saves[request_id]
                if not book.failed:
                    self.finished.add(request_id)

    def submit_load(self, request_id: str) -> None:
        try:
            future = self.incoming().load_async(request_id)
        except (OmniAsyncError, ValueError, TypeError) as exc:  # as a save's: reported, never left waiting
            future = self.portal.loop.create_future()
            future.set_exception(exc)
        with self.portal.lock:
            book = self.loads.setdefault(request_id, _LoadBook())
            book.loads.append(future)
        future.add_done_callback(lambda _: self.on_loaded(request_id, book))

    def on_loaded(self, request_id: str, book: _LoadBook) -> None:
        """A load of the request settled: hand out every one settled so far in the order they
        were made (its chunk into :attr:`loaded`, or its failure), up to the first one still
        waiting; unless the request was cleaned up meanwhile (the cleanup failed its loads:
        that is no failure to report)."""
        with self.portal.lock:
            self.settled()
            if self.loads.get(request_id) is not book:
                return
            while book.loads and book.loads[0].done():
                done = book.loads.popleft()
                error = _outcome(done)
                if book.failed:
                    continue
                if error is not None:
                    book.failed = True
                    self.failed_recv.setdefault(request_id, _reason(error))
                else:
                    self.loaded.setdefault(request_id, deque()).append(done.result())
                    self.finished.add(request_id)
            if not book.loads:
                del self.loads[request_id]

    def settled(self) -> None:
        """One outstanding save or load settled: wake a waiting drain.  Lock held."""
        self.outstanding -= 1
        self.portal.notify()

    def forget(self, request_id: str, *, cancel: bool) -> None:
        """Drop the request from the books and from the adapters (``cancel``: tell the receiver)."""
        with self.portal.lock:
            self.saves.pop(request_id, None)
            self.loads.pop(request_id, None)
            self.loaded.pop(request_id, None)
            self.finished.discard(request_id)
            self.failed_send.pop(request_id, None)
            self.failed_recv.pop(request_id, None)
        if self.sender is not None:
            if cancel:
                self.sender.cancel(request_id)
            else:
                self.sender.cleanup(request_id)
        if self.receiver is not None:
            self.receiver.cleanup(request_id)


class SyncTransferAdapter(Facade):
    """The seed ``OmniTransferAdapterBase`` contract, synchronous, over a :class:`TransferAdapter`.

    One :class:`~omni_async.service.ConnectorService` (built from ``config``: a
    :class:`ServiceConfig` or a mapping of its sections) runs on an event loop owned by this
    object, in a daemon thread.  Chunks of ``stage`` go to ``destination`` (an agent peer id;
    if None, the first peer reached with :meth:`connect`) and come from ``source`` (the peer
    whose loss fails waiting loads at once; None: any peer, bounded by ``stall_timeout``).

    Two ways to use it, per request:

    * **seed style**: :meth:`save_async` / :meth:`load_async` return at once; a scheduler thread
      drains :meth:`get_finished_requests`, :meth:`collect_failed_send_request_ids` and
      :meth:`collect_failed_receive_request_ids`, and takes loaded chunks with :meth:`get_loaded`;
    * **blocking**: :meth:`save` / :meth:`load` wait and return (or raise the typed error); they
      never appear in the books.

    The seed's methods, with the signatures it left to subclasses made concrete:

    ========================================  ==================================================
    seed                                      here
    ========================================  ==================================================
    ``save_async(*args, **kwargs)``           ``save_async(request_id, chunk, final=False)``
    ``load_async(*args, **kwargs)``           ``load_async(request_id)``; the chunk arrives in
                                              :meth:`get_loaded`
    ``save(*args, **kwargs)``                 ``save(request_id, chunk, final=False, timeout=None)``
    ``load(*args, **kwargs)``                 ``load(request_id, timeout=None) -> Chunk``
    ``get_finished_requests()``               same, ``-> set[str]``, drained
    ``collect_failed_*_request_ids()``        same, ``-> dict[str, str]``, drained
    ``record_send/receive_failure(...)``      same
    ``shutdown()``                            same, idempotent (drains saves first)
    ``create_connector(model_config)``        none: the connector comes from ``config.connector``
    ``save_loop()`` / ``recv_loop()``         none: nothing polls
    ========================================  ==================================================

    Threading: every method may be called from any thread; on the adapter's own loop thread
    the blocking ones (``connect``, ``save``, ``load``, ``shutdown``...) raise
    :class:`RuntimeError` instead of deadlocking.  The constructor blocks until the service
    listens; use as a context manager or call :meth:`shutdown`.
    """

    def __init__(
        self,
        config: ServiceConfig | Mapping[str, Any] | None = None,
        *,
        stage: str = "chunks",
        destination: str | None = None,
        source: str | None = None,
        use_uvloop: bool = True,
    ) -> None:
        if not isinstance(config, ServiceConfig):
            config = load_config(dict(config or {}), schema=ServiceConfig)
        if ":" in stage:
            raise ValueError("a stage name must not contain ':'")
        agent = msgspec.structs.replace(config.agent, peer_id=config.agent.resolved_peer_id())
        config = msgspec.structs.replace(config, agent=agent)
        self._config = config
        self.peer_id = agent.peer_id
        engine = _AdapterEngine(config, stage, destination, source, use_uvloop)
        self._engine = engine
        self._portal = engine.portal
        self._arm(engine.shutdown)
        try:
            service = engine.start()
        except BaseException:
            self._stop()
            raise
        self.control_address = service.control_address

    def _describe(self) -> str:
        return f"{self.peer_id!r} stage={self.stage!r}"

    # -- extras (and peer_id, control_address, loop): identity and peers ----------------------
    @property
    def stage(self) -> str:
        return self._engine.stage

    @property
    def destination(self) -> str | None:
        """Where saved chunks go (None until given or set by the first :meth:`connect`)."""
        with self._portal.lock:
            return self._engine.destination

    @property
    def service(self) -> ConnectorService:
        """The underlying service.  Touch it only on :attr:`loop` (e.g. ``run_coroutine_threadsafe``)."""
        assert self._engine.service is not None
        return self._engine.service

    def connect(self, address: str, timeout: float | None = None) -> str:
        """Handshake with the service at ``address``; return its peer id.  Blocks (bounded).

        The first peer connected becomes the :attr:`destination` if none was given.  Raises
        what :meth:`Agent.connect` raises (:class:`HandshakeTimeout`, :class:`HandshakeRejected`...).
        """
        self._portal.check_open()
        budget = timeout if timeout is not None else 4 * self._config.agent.handshake_timeout + 1.0
        return self._wait(self._engine.connect(address), budget, f"connecting to {address}")

    def wait_for_peer(self, peer_id: str | None = None, timeout: float = 30.0) -> str:
        """Block until ``peer_id`` (None: any peer) has joined; return its id.

        Raises :class:`DeadlineExceeded` after ``timeout`` s."""
        self._portal.check_open()
        what = f"waiting for peer {peer_id!r}" if peer_id else "waiting for a peer"
        return self._wait(self.service.agent.wait_for_peer(peer_id), timeout, what)

    # -- the seed's methods ------------------------------------------------------------------
    def save_async(self, request_id: str, chunk: Mapping[str, Any], final: bool = False) -> None:
        """Queue ``chunk`` as the request's next chunk; never blocks.

        Chunks of one request travel in call order.  The request shows in
        :meth:`get_finished_requests` once its ``final`` chunk and every chunk before it were
        acknowledged by the receiver, or in :meth:`collect_failed_send_request_ids` (once, with
        the first reason) if any of them failed.  The chunk's arrays are borrowed until then.
        Raises :class:`ClosedError` after :meth:`shutdown`, ``ValueError`` with no destination,
        ``TypeError`` if ``chunk`` is not a mapping.
        """
        self._check_save(request_id, chunk)
        self._engine.post(self._engine.submit_save, request_id, chunk, bool(final))

    def save(self, request_id: str, chunk: Mapping[str, Any], final: bool = False,
             timeout: float | None = None) -> None:
        """Send ``chunk`` and block until the receiver acknowledged it; raise the failure.

        ``timeout`` (None: the agent's ``transfer_timeout`` bounds it) raises
        :class:`DeadlineExceeded`; the chunk may still arrive afterwards.  Not reported in the books.
        """
        self._check_save(request_id, chunk)
        engine = self._engine

        async def save_one() -> None:
            await engine.outgoing().save(request_id, chunk, final=final)

        self._wait(save_one(), timeout, f"saving a chunk of {request_id!r}")

    def load_async(self, request_id: str) -> None:
        """Ask for the request's next chunk (each call one more, in order); never blocks.

        When it arrives, and every chunk asked for before it did, the request shows in
        :meth:`get_finished_requests` and the chunk waits in :meth:`get_loaded` (in stream
        order, whatever order the chunks arrived in); if it cannot (``stall_timeout`` passed, source lost, sender
        cancelled, invalid payload) the request shows in :meth:`collect_failed_receive_request_ids`.
        """
        self._portal.check_open()
        self._engine.post(self._engine.submit_load, request_id)

    def load(self, request_id: str, timeout: float | None = None) -> Chunk:
        """Block for the request's next chunk and return it; raise the failure.

        ``timeout`` (None: the adapter's ``stall_timeout`` bounds it) raises
        :class:`DeadlineExceeded` and withdraws the wait: a later load asks for the same chunk.
        Not reported in the books.
        """
        self._portal.check_open()
        engine = self._engine

        async def load_one() -> Chunk:
            return await engine.incoming().load_async(request_id)

        return self._wait(load_one(), timeout, f"loading a chunk of {request_id!r}")

    def get_loaded(self, request_id: str) -> Chunk | None:
        """Take the oldest chunk that :meth:`load_async` brought in for the request, or None."""
        with self._portal.lock:
            ready = self._engine.loaded.get(request_id)
            if not ready:
                return None
            chunk = ready.popleft()
            if not ready:
                del self._engine.loaded[request_id]
            return chunk

    def get_finished_requests(self) -> set[str]:
        """Drain and return ids finished since the last call: saved (final chunk acknowledged)
        or loaded (a chunk asked for with :meth:`load_async` is ready in :meth:`get_loaded`).

        If there are none while saves or loads are outstanding, waits for the next one to
        settle, at most :data:`~omni_async.seed.portal.NEWS_WAIT_S` (that wait releases the
        GIL, so a scheduler draining in a tight loop does not starve the adapter's loop)."""
        engine, portal = self._engine, self._portal
        with portal.lock:
            if not engine.finished and engine.outstanding > 0 and not portal.closed:
                portal.wait_for_news()
            finished, engine.finished = engine.finished, set()
        return finished

    def collect_failed_send_request_ids(self) -> dict[str, str]:
        """Drain and return the requests whose send gave up: ``{request_id: reason}``."""
        with self._portal.lock:
            failed, self._engine.failed_send = self._engine.failed_send, {}
        return failed

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        """Drain and return the requests whose receive failed: ``{request_id: reason}``."""
        with self._portal.lock:
            failed, self._engine.failed_recv = self._engine.failed_recv, {}
        return failed

    def record_send_failure(self, request_id: str | None, reason: str) -> None:
        """Note that a chunk of ``request_id`` will never be delivered (None is ignored)."""
        if request_id is not None:
            with self._portal.lock:
                self._engine.failed_send.setdefault(request_id, reason)

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        """Record an invalid received chunk that cannot be retried."""
        with self._portal.lock:
            self._engine.failed_recv.setdefault(request_id, reason)

    def cleanup(self, request_id: str) -> None:
        """Forget the request here: books, buffered and waited-for chunks (late ones are refused).

        Non-blocking and idempotent."""
        self._portal.check_open()
        self._portal.post(partial(self._engine.forget, request_id, cancel=False))

    def cancel(self, request_id: str) -> None:
        """:meth:`cleanup`, and if this side was sending the request, the receiver's waits fail
        with :class:`TransferCancelled`.  Non-blocking and idempotent."""
        self._portal.check_open()
        self._portal.post(partial(self._engine.forget, request_id, cancel=True))

    def shutdown(self) -> None:
        """Drain queued saves (up to ``adapter.drain_timeout``), fail the rest, close the service
        to its end and join the loop thread.  Idempotent; afterwards the other methods raise
        :class:`ClosedError`."""
        self._stop()

    # -- helpers -------------------------------------------------------------------------------
    def _wait(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run ``coro`` on the loop under ``timeout`` s (None: unbounded here, the core bounds
        it); return its result or raise its own error, :class:`DeadlineExceeded` past the bound."""
        try:
            self._portal.check_caller()
        except RuntimeError:
            coro.close()
            raise
        return self._portal.run(_bounded(coro, timeout, what), None, what)

    def _check_save(self, request_id: str, chunk: Mapping[str, Any]) -> None:
        self._portal.check_open()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if not isinstance(chunk, Mapping):
            raise TypeError(f"chunk must be a mapping of str to payload values, got {type(chunk).__name__}")
        if self.destination is None:
            raise ValueError("no destination: pass destination= or call connect() first")


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
    """``coro`` under ``timeout`` s (None: unbounded here), :class:`DeadlineExceeded` past it."""
    if timeout is None:
        return await coro
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise DeadlineExceeded(f"{what} did not finish within {timeout}s") from None
