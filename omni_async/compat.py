"""A synchronous drop-in for the seed ``DataTransport``: the thread-and-poll contract over :class:`Agent`.

:class:`SyncDataTransport` keeps the seed's exact surface (``get_agent_metadata``,
``add_remote_peer``, ``write_blocks`` returning an id or ``None``, ``poll`` returning a
:class:`PollResult`, ``cancel`` with ``"immediate"`` / ``"wait"``, idempotent ``close``) for code
that cannot become async yet.  Underneath, one :class:`~omni_async.agent.Agent` runs on an
event loop *owned by the transport* in a daemon thread (uvloop where installed):

* calls that need an answer from the loop (``add_remote_peer``, ``remove_remote_peer``,
  ``cancel(mode="wait")``, ``close``) hand the work over with ``call_soon_threadsafe`` or
  ``run_coroutine_threadsafe`` and wait on it with a timeout; nothing ever busy-waits;
* ``write_blocks``, ``poll`` and ``cancel(mode="immediate")`` never wait for the loop: a write
  gets its id at once in the caller's thread and is submitted on the loop in call order;
  completions are pushed by the loop into a locked table that ``poll`` drains.

Threading: every public method may be called from any thread except the transport's own loop
thread (a call from there would wait on itself and raises :class:`RuntimeError`).

:class:`SyncTransferAdapter` does the same for the seed ``OmniTransferAdapterBase``: a
:class:`~omni_async.service.ConnectorService` and its :class:`~omni_async.adapter.TransferAdapter`
run on an owned loop (the same :class:`_LoopThread` machinery); ``save_async`` / ``load_async``
return at once and report through drained books (``get_finished_requests``,
``collect_failed_*``), ``save`` / ``load`` block with a bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import itertools
import logging
import socket
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import suppress
from functools import partial
from typing import Annotated, Any, NamedTuple, Self, TypeVar, cast

import msgspec

from .adapter import Chunk, TransferAdapter
from .agent import Agent, PeerEvent
from .config import AgentConfig, ServiceConfig, load_config
from .errors import (
    AlreadyConnected,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    FingerprintMismatch,
    HandshakeRejected,
    HandshakeTimeout,
    InvalidBlocks,
    LayoutMismatch,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferCancelled,
    TransferFailed,
)
from .region import BlockRegion, config_fingerprint, fingerprints_compatible, plan_runs
from .serde import Payload
from .service import ConnectorService
from .transport import CancelMode, Transfer
from .wire import MAX_METADATA_BYTES, MAX_PEER_ID

__all__ = ["Chunk", "PollResult", "SyncDataTransport", "SyncTransferAdapter", "decode_agent_metadata"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_START_TIMEOUT_S = 10.0
"""How long the constructor waits for the loop to open UCX and bind the control plane."""
_DIAL_GRACE_S = 0.5
"""How long the side with the larger peer id waits for the other side's dial before dialling."""
_ADMISSION_CHECK_S = 0.05
"""While a peer's handshake is being admitted here, how often to check whether it ended."""
_MAX_REASONS = 1 << 16
"""Failure reasons kept for :meth:`SyncDataTransport.failure_reason` (oldest dropped first)."""
_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


class PollResult(NamedTuple):
    """Result of polling inflight transfers.

    Attributes:
        done: Transfer IDs that completed successfully.
        failed: Transfer IDs that failed (error, timeout, etc.).
    """

    done: Sequence[int]
    failed: Sequence[int]


# -- agent metadata ------------------------------------------------------------------------------
class _AgentCard(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True, tag="omni-sync/1"):
    """What a peer needs to reach an agent: the opaque bytes of ``get_agent_metadata()``."""

    address: Annotated[str, msgspec.Meta(pattern=r"^tcp://\S+:\d+$", max_length=512)]
    peer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PEER_ID)]
    fingerprint: Annotated[str, msgspec.Meta(max_length=64)]


_CARD_ENCODER = msgspec.msgpack.Encoder()
_CARD_DECODER = msgspec.msgpack.Decoder(_AgentCard)


class AgentCard(NamedTuple):
    """Decoded agent metadata: the control-plane ``address``, the agent's ``peer_id`` and fingerprint."""

    address: str
    peer_id: str
    fingerprint: str


def decode_agent_metadata(blob: bytes) -> AgentCard:
    """Decode bytes from :meth:`SyncDataTransport.get_agent_metadata`.

    Raises :class:`ProtocolError` for anything else (wrong type, garbage, foreign format, oversize).
    """
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise ProtocolError(f"agent metadata must be bytes, got {type(blob).__name__}")
    if len(blob) > MAX_METADATA_BYTES:
        raise ProtocolError(f"agent metadata of {len(blob)} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        card = _CARD_DECODER.decode(blob)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ProtocolError(f"malformed agent metadata: {exc}") from None
    return AgentCard(card.address, card.peer_id, card.fingerprint)


def _dialable(address: str, advertise_host: str | None) -> str:
    """The bound ``tcp://host:port`` with a wildcard host replaced by one a peer can dial."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if advertise_host:
        host = advertise_host
    elif host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    return f"tcp://{host}:{port}"


# -- the loop side ---------------------------------------------------------------------------------
class _Registration(NamedTuple):
    core_id: str  # the agent-level peer id (from the metadata and the handshake)
    num_blocks: int


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class _LoopThread:
    """An event loop that runs forever in a daemon thread, and bounded hand-offs to it.

    Shared by the synchronous facades of this module.  ``owner`` names the facade in the error
    raised when it is called from its own loop thread (where waiting on the loop would deadlock).
    Stopping is the subclass's job: ``loop.stop`` from any thread ends :meth:`_run`, which
    cancels the tasks left, shuts down async generators and the default executor, and closes
    the loop.
    """

    def __init__(self, name: str, owner: str, use_uvloop: bool) -> None:
        self.owner = owner
        self.loop = _new_loop(use_uvloop)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for task in tasks:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())  # its threads too
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def check_caller(self) -> None:
        if threading.current_thread() is self.thread:
            raise RuntimeError(f"{self.owner} must not be called from its own event-loop thread")

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run ``coro`` on the loop and wait up to ``timeout`` s (None: no limit here); raise its
        error, :class:`DeadlineExceeded`, or :class:`ClosedError` if the loop cancelled it."""
        self.check_caller()
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError subclass (HandshakeTimeout, ...)
                raise
            future.cancel()
            raise DeadlineExceeded(f"{what} did not finish within {timeout:.1f}s") from None
        except concurrent.futures.CancelledError:
            raise ClosedError(f"{what} was cancelled: the transport is closing") from None

    def call(self, fn: Callable[..., T], *args: Any, timeout: float, what: str) -> T:
        """Run the plain function ``fn(*args)`` on the loop and wait for its result."""
        self.check_caller()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def invoke() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(invoke)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"{what} did not finish within {timeout:.1f}s") from None


class _Engine(_LoopThread):
    """The background loop, the agent on it, and the books shared with the caller's threads.

    Holds no reference to the facade, so an unreferenced :class:`SyncDataTransport` can be
    collected (and its finalizer shuts the engine down).  Fields marked *locked* are guarded by
    ``lock``; ``handles`` belongs to the loop thread alone.
    """

    def __init__(self, config: AgentConfig, use_uvloop: bool) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.closed = False  # locked
        self.ids = itertools.count(1)  # locked
        self.inflight: dict[int, str] = {}  # locked: id -> caller's peer id, until polled/cancelled
        self.settled: dict[int, tuple[str, bool]] = {}  # locked: id -> (peer id, ok), not polled yet
        self.reasons: OrderedDict[int, OmniAsyncError] = OrderedDict()  # locked
        self.live: set[str] = set()  # locked: agent-level ids of joined peers
        self.peers: dict[str, _Registration] = {}  # locked: caller's peer id -> registration
        self.handles: dict[int, Transfer] = {}  # loop thread only: id -> core transfer, until settled
        self.agent: Agent | None = None
        super().__init__(f"omni-sync-{config.peer_id}", "SyncDataTransport", use_uvloop)

    def start(self, region: BlockRegion) -> None:
        async def start_agent() -> None:
            agent = Agent(region, self.config)
            agent.add_peer_listener(self.on_peer_event)
            self.agent = agent
            await agent.start()

        self.run(start_agent(), _START_TIMEOUT_S, "starting the agent")

    def shutdown(self, timeout: float) -> None:
        """Close the agent (failing what is in flight), stop the loop and join its thread."""
        with self.lock:
            self.closed = True
        if threading.current_thread() is self.thread:
            # Collected on the loop thread itself: nothing may wait here, so finish on the loop.
            self.loop.create_task(self._close_and_stop())
            return
        if self.thread.is_alive() and not self.loop.is_closed():
            if self.agent is not None:
                try:
                    self.run(self.agent.close(), timeout, "closing the agent")
                except Exception:
                    log.exception("closing the agent of %s failed", self.config.peer_id)
            with suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            if self.thread.is_alive():
                log.warning("event-loop thread of %s did not stop within %.1fs", self.config.peer_id, timeout)
        self._forget_all()

    async def _close_and_stop(self) -> None:
        try:
            if self.agent is not None:
                await self.agent.close()
        finally:
            self._forget_all()
            self.loop.stop()

    def _forget_all(self) -> None:
        with self.lock:
            self.inflight.clear()
            self.settled.clear()
            self.peers.clear()
            self.live.clear()

    # -- callbacks on the loop -------------------------------------------------------------------
    def on_peer_event(self, event: PeerEvent) -> None:
        with self.lock:
            if event.kind == "joined":
                self.live.add(event.peer_id)
                return
            self.live.discard(event.peer_id)
        # The agent already failed the peer's transfers; catch any it did not know about.
        error = event.error or PeerLost(f"peer {event.peer_id!r} left")
        for transfer_id, transfer in list(self.handles.items()):
            if transfer.peer_id == event.peer_id and not transfer.done():
                self.handles.pop(transfer_id, None)
                self.settle(transfer_id, error)

    def submit(self, transfer_id: int, core_id: str, local: list[int], remote: list[int]) -> None:
        with self.lock:
            if transfer_id not in self.inflight:
                return  # cancelled before it reached the loop
        assert self.agent is not None
        try:
            transfer = self.agent.write_blocks(core_id, local, remote)
        except OmniAsyncError as exc:
            self.settle(transfer_id, exc)
            return
        except Exception as exc:  # a UCX error posting the sends
            log.exception("write %d to %s could not be posted", transfer_id, core_id)
            self.settle(transfer_id, TransferFailed(f"could not post the write: {exc!r}"))
            return
        self.handles[transfer_id] = transfer
        transfer.add_done_callback(partial(self.on_transfer_done, transfer_id))

    def on_transfer_done(self, transfer_id: int, transfer: Transfer) -> None:
        self.handles.pop(transfer_id, None)
        self.settle(transfer_id, transfer.error())

    def settle(self, transfer_id: int, error: OmniAsyncError | None) -> None:
        with self.lock:
            peer_id = self.inflight.get(transfer_id)
            if peer_id is None or transfer_id in self.settled:
                return  # cancelled ("immediate"), released, or settled already
            self.settled[transfer_id] = (peer_id, error is None)
            if error is not None:
                self.reasons[transfer_id] = error
                while len(self.reasons) > _MAX_REASONS:
                    self.reasons.popitem(last=False)

    def cancel_now(self, transfer_ids: list[int]) -> None:
        handles = [self.handles.pop(i) for i in transfer_ids if i in self.handles]
        if handles and self.agent is not None:
            with suppress(ClosedError):
                self.agent.cancel([h.id for h in handles], "immediate")

    def cancel_wait(self, transfer_ids: list[int]) -> list[int]:
        by_core = {self.handles[i].id: i for i in transfer_ids if i in self.handles}
        draining: set[int] = set()
        if by_core and self.agent is not None:
            with suppress(ClosedError):
                draining = {by_core[c] for c in self.agent.cancel(list(by_core), "wait")}
        still: list[int] = []
        with self.lock:
            for transfer_id in transfer_ids:
                if transfer_id in draining and transfer_id in self.inflight:
                    still.append(transfer_id)
                else:  # settled already (not polled yet) or never posted: released now
                    self.inflight.pop(transfer_id, None)
                    self.settled.pop(transfer_id, None)
        return still

    async def join(self, card: AgentCard, base_addr: int, num_blocks: int, block_len: int) -> None:
        """Make sure the agent behind ``card`` is joined, dialling it if needed; check its layout.

        Both sides of a pair usually call ``add_remote_peer`` at about the same time, and two
        handshakes crossing each other make both sides drop the pair.  So the side with the
        smaller peer id dials at once; the other waits ``_DIAL_GRACE_S`` for that dial before
        dialling itself (needed when only one side registers the other); and neither dials while
        a handshake from the peer is being admitted here.
        """
        agent = self.agent
        assert agent is not None
        core_id = card.peer_id
        timeout = self.config.handshake_timeout
        grace = min(_DIAL_GRACE_S, timeout / 2) if agent.peer_id > core_id else 0.0
        await self._await_their_handshake(core_id, grace)
        if core_id not in agent.peers:
            try:
                joined = await agent.connect(card.address)
            except AlreadyConnected as exc:
                # The peer dialled us meanwhile: its handshake completes (or completed) here.
                await self._await_their_handshake(core_id, timeout)
                if core_id not in agent.peers:
                    raise HandshakeRejected(f"crossed handshakes with {core_id!r}: {exc}") from None
            else:
                if joined != core_id:
                    await agent.remove_peer(joined)
                    raise HandshakeRejected(
                        f"{card.address} answered as {joined!r}, but the metadata names {core_id!r}"
                    )
        info = agent.peers.get(core_id)
        if info is None:
            raise PeerLost(f"peer {core_id!r} left during the handshake")
        expected = (base_addr, num_blocks, block_len)
        actual = (info.base_addr, info.num_blocks, info.block_len)
        if actual != expected:
            await agent.remove_peer(core_id)
            raise LayoutMismatch(
                f"peer {core_id!r} has (base_addr, num_blocks, block_len) = {actual}, "
                f"but add_remote_peer was given {expected}"
            )

    async def _await_their_handshake(self, core_id: str, grace: float) -> None:
        """Wait up to ``grace`` s for ``core_id`` to join, and on while its handshake is admitted here.

        Joins wake this at once; while a handshake is being admitted the admission's end is
        re-checked every ``_ADMISSION_CHECK_S`` (a rejected one emits no event).
        """
        agent = self.agent
        assert agent is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        limit = start + grace + self.config.handshake_timeout
        while core_id not in agent.peers:
            now = loop.time()
            if now >= limit:
                return
            if agent.control.is_admitting(core_id):
                wait = min(_ADMISSION_CHECK_S, limit - now)
            elif now < start + grace:
                wait = start + grace - now
            else:
                return
            with suppress(TimeoutError):
                await agent.wait_for_peer(core_id, timeout=wait)


# -- the facade ----------------------------------------------------------------------------------
class SyncDataTransport:
    """The seed ``DataTransport`` contract, synchronous, backed by an :class:`Agent` on its own loop.

    Construction:
        view: a writeable, C-contiguous 2-D memoryview (``num_blocks × block_len`` bytes) over the
            local block storage.  The caller owns the memory; the transport keeps a reference
            and, once peers are added, peers may write into any block at any time.  A block
            passed to :meth:`write_blocks` must not change until its id is polled.
        config_fields: model config values hashed into :attr:`config_fingerprint` (None or
            empty: compatible with any peer).  Overrides ``config.config_fields`` when given.
        config: agent settings (control-plane host/port, timeouts, UCX transports, peer id).

    The constructor blocks until the agent is listening (raises :class:`ConfigError` for a bad
    view, or the agent's start error).  Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        view: memoryview,
        config_fields: dict[str, Any] | None = None,
        *,
        config: AgentConfig | None = None,
        advertise_host: str | None = None,
        use_uvloop: bool = True,
    ) -> None:
        """``advertise_host`` (extra): host put in the metadata instead of the bound one."""
        view = memoryview(view)
        if view.ndim != 2 or view.itemsize != 1:
            raise ConfigError(
                f"view must be a 2-D byte memoryview (num_blocks × block_len), got ndim={view.ndim} "
                f"format={view.format!r}"
            )
        if view.readonly or not view.c_contiguous:
            raise ConfigError("view must be writeable and C-contiguous: peers write into it")
        config = config or AgentConfig()
        if config_fields is not None:
            config = msgspec.structs.replace(config, config_fields=config_fields)
        config = msgspec.structs.replace(config, peer_id=config.resolved_peer_id())
        self._view = view
        self._base_addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        shape = view.shape
        assert shape is not None  # a 2-D view always has one
        self._num_blocks, self._block_len = int(shape[0]), int(shape[1])
        self._config_fingerprint = config_fingerprint(config.config_fields)
        self._config = config
        self._last_error: OmniAsyncError | None = None
        region = BlockRegion.wrap(view)
        engine = _Engine(config, use_uvloop)
        self._engine = engine
        self._finalizer = weakref.finalize(self, engine.shutdown, max(5.0, config.handshake_timeout))
        try:
            engine.start(region)
        except BaseException:
            self._finalizer()
            raise
        assert engine.agent is not None
        self._address = _dialable(engine.agent.control_address, advertise_host)
        self._metadata = _CARD_ENCODER.encode(_AgentCard(self._address, config.peer_id, self._config_fingerprint))

    def __repr__(self) -> str:
        state = "closed" if self._engine.closed else f"at {self._address}"
        return f"<SyncDataTransport {self.peer_id!r} {self._num_blocks}×{self._block_len} {state}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the seed's properties ------------------------------------------------------------------
    @property
    def base_addr(self) -> int:
        """Base address of the local block memory region (``ctypes.addressof`` of the view)."""
        return self._base_addr

    @property
    def num_blocks(self) -> int:
        """Number of blocks in the local region."""
        return self._num_blocks

    @property
    def block_len(self) -> int:
        """Size of each block in bytes."""
        return self._block_len

    @property
    def config_fingerprint(self) -> str:
        """Seed-identical content hash of ``config_fields`` (hex, 16 chars); ``""`` = always compatible."""
        return self._config_fingerprint

    # -- extras ---------------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        """This side's agent-level id (carried in the metadata; not the caller's peer ids)."""
        return self._config.peer_id

    @property
    def control_address(self) -> str:
        """The ``tcp://host:port`` carried in :meth:`get_agent_metadata`."""
        return self._address

    @property
    def agent(self) -> Agent:
        """The underlying agent.  Touch it only on :attr:`loop` (e.g. ``run_coroutine_threadsafe``)."""
        assert self._engine.agent is not None
        return self._engine.agent

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the agent runs on, in this transport's daemon thread."""
        return self._engine.loop

    @property
    def last_error(self) -> OmniAsyncError | None:
        """Why the latest :meth:`write_blocks` that returned ``None`` was refused."""
        return self._last_error

    def failure_reason(self, transfer_id: int) -> OmniAsyncError | None:
        """The error a failed transfer ended with (:class:`PeerLost`, :class:`DeadlineExceeded`,
        :class:`TransferCancelled`...), or None if it did not fail or is forgotten."""
        with self._engine.lock:
            return self._engine.reasons.get(transfer_id)

    # -- the seed's methods ---------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        """Opaque bytes a peer passes to its ``add_remote_peer``: control address, peer id, fingerprint."""
        self._check_open()
        return self._metadata

    def add_remote_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register the peer as ``peer_id`` (the caller's name for it), handshaking if needed.

        Blocks for a handshake (bounded by a few handshake timeouts).  Succeeds when the peer
        already joined us (it registered us first); calling it again for the same peer is a
        no-op, for a different peer it replaces the registration.  Raises
        :class:`ProtocolError` (malformed metadata), :class:`FingerprintMismatch`,
        :class:`LayoutMismatch` (``block_len`` differs from ours, or the handshake's
        ``base_addr``/``num_blocks``/``block_len`` differ from the arguments: the peer is then
        disconnected), :class:`HandshakeTimeout` or another :class:`HandshakeRejected`,
        :class:`ClosedError`.
        """
        self._check_open()
        card = decode_agent_metadata(agent_metadata)
        if not fingerprints_compatible(self._config_fingerprint, card.fingerprint):
            raise FingerprintMismatch(
                f"config fingerprint {card.fingerprint} of {peer_id!r} differs from this side's "
                f"{self._config_fingerprint}"
            )
        if block_len != self._block_len:
            raise LayoutMismatch(f"block_len {block_len} of {peer_id!r} differs from this side's {self._block_len}")
        engine = self._engine
        timeout = self._config.handshake_timeout
        budget = min(_DIAL_GRACE_S, timeout / 2) + 4 * timeout + 1.0
        try:
            engine.run(engine.join(card, base_addr, num_blocks, block_len), budget, f"handshake with {peer_id!r}")
        except DeadlineExceeded as exc:
            raise HandshakeTimeout(str(exc)) from None
        with engine.lock:
            previous = engine.peers.get(peer_id)
            engine.peers[peer_id] = _Registration(card.peer_id, num_blocks)
            orphan = (
                previous is not None
                and previous.core_id != card.peer_id
                and all(r.core_id != previous.core_id for r in engine.peers.values())
            )
        if orphan:
            assert previous is not None and engine.agent is not None
            engine.run(engine.agent.remove_peer(previous.core_id), timeout, f"removing the old {peer_id!r}")

    def remove_remote_peer(self, peer_id: str) -> None:
        """Unregister ``peer_id``, fail its in-flight transfers (:class:`PeerLost`, seen in
        :meth:`poll` as failed) and say goodbye to it.  Unknown ids are ignored.  Blocks until done."""
        self._check_open()
        engine = self._engine
        with engine.lock:
            registration = engine.peers.pop(peer_id, None)
            if registration is None:
                return
            shared = any(r.core_id == registration.core_id for r in engine.peers.values())
        if not shared:
            assert engine.agent is not None
            engine.run(
                engine.agent.remove_peer(registration.core_id),
                max(5.0, self._config.handshake_timeout),
                f"removing {peer_id!r}",
            )

    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        """Submit a write of local blocks into the peer's blocks; never blocks.

        Returns a transfer id, unique for this transport's life, to find in :meth:`poll`; or
        ``None`` if ``peer_id`` is not registered (or its connection is gone) or the indices are
        invalid (see :attr:`last_error`).  The index lists are copied.  Raises
        :class:`ClosedError` after :meth:`close`.
        """
        engine = self._engine
        local, remote = list(local_idxs), list(remote_idxs)
        with engine.lock:
            if engine.closed:
                raise ClosedError("transport is closed")
            registration = engine.peers.get(peer_id)
            joined = registration is not None and registration.core_id in engine.live
        if registration is None or not joined:
            self._last_error = PeerLost(f"peer {peer_id!r} is not registered or not connected")
            return None
        try:
            plan_runs(local, remote, self._num_blocks, registration.num_blocks)
        except InvalidBlocks as exc:
            self._last_error = exc
            log.warning("write to %s refused: %s", peer_id, exc)
            return None
        with engine.lock:
            transfer_id = next(engine.ids)
            engine.inflight[transfer_id] = peer_id
        try:
            engine.loop.call_soon_threadsafe(engine.submit, transfer_id, registration.core_id, local, remote)
        except RuntimeError:  # closed concurrently
            with engine.lock:
                engine.inflight.pop(transfer_id, None)
            self._last_error = ClosedError("transport is closed")
            return None
        return transfer_id

    def poll(self, peer_id: str | None = None) -> PollResult:
        """Ids settled since the last poll (of ``peer_id`` only, if given); never blocks.

        Each id is reported once, then leaves the inflight set.  The loop makes progress on its
        own: polling only collects results.
        """
        engine = self._engine
        done: list[int] = []
        failed: list[int] = []
        with engine.lock:
            if engine.closed:
                raise ClosedError("transport is closed")
            for transfer_id, (owner, ok) in list(engine.settled.items()):
                if peer_id is None or owner == peer_id:
                    del engine.settled[transfer_id]
                    engine.inflight.pop(transfer_id, None)
                    (done if ok else failed).append(transfer_id)
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> list[int]:
        """Cancel inflight transfers; unknown or already-polled ids are ignored.

        ``"immediate"``: the ids leave the inflight set now and will never be reported; returns
        ``[]`` without waiting (the data plane may still read their source blocks briefly).
        ``"wait"``: waits for the loop (bounded) and returns the ids whose data is still moving;
        they stay inflight and surface in a later :meth:`poll` (as failed, cancelled) once the
        data plane let go, after which their source blocks are free.  Ids that had already
        settled but were not polled are released and not returned.
        """
        if mode not in ("immediate", "wait"):
            raise ValueError(f"cancel mode must be 'immediate' or 'wait', got {mode!r}")
        engine = self._engine
        wanted = list(dict.fromkeys(transfer_ids))
        with engine.lock:
            if engine.closed:
                raise ClosedError("transport is closed")
            known = [i for i in wanted if i in engine.inflight]
            if mode == "immediate":
                for transfer_id in known:
                    del engine.inflight[transfer_id]
                    engine.settled.pop(transfer_id, None)
        if not known:
            return []
        if mode == "immediate":
            with suppress(RuntimeError):  # closed concurrently: closing cancels everything anyway
                engine.loop.call_soon_threadsafe(engine.cancel_now, known)
            return []
        return engine.call(
            engine.cancel_wait, known, timeout=max(5.0, self._config.handshake_timeout), what="cancel"
        )

    def close(self) -> None:
        """Fail what is in flight, say goodbye to every peer, stop the loop and join its thread.

        Idempotent.  Afterwards every other method raises :class:`ClosedError`.
        """
        self._engine.check_caller()
        self._finalizer()

    def _check_open(self) -> None:
        if self._engine.closed:
            raise ClosedError("transport is closed")


# -- the transfer-adapter facade -------------------------------------------------------------------
_SHUTDOWN_MARGIN_S = 5.0
"""Beyond the adapters' ``drain_timeout``: how long closing the service may take before we give up."""


def _reason(error: BaseException) -> str:
    """The text a scheduler sees for a failed request: ``"PeerLost: peer 'x' left"``."""
    return f"{type(error).__name__}: {error}"


class _SaveBook:
    """Send-side state of one request saved with ``save_async`` (loop thread writes, under the lock)."""

    __slots__ = ("failed", "final", "pending")

    def __init__(self) -> None:
        self.pending = 0  # chunks queued and not yet settled
        self.final = False  # the final chunk was queued
        self.failed = False  # a chunk failed: reported once, never finished


class _AdapterEngine(_LoopThread):
    """The loop thread, the service and adapters on it, and the books the facade drains.

    Holds no reference to the facade (its finalizer shuts the engine down).  Fields marked
    *locked* are guarded by ``lock``; ``service``, ``sender`` and ``receiver`` are touched only
    on the loop thread once started.
    """

    def __init__(self, config: ServiceConfig, stage: str, destination: str | None, source: str | None,
                 use_uvloop: bool) -> None:
        self.config = config
        self.stage = stage
        self.lock = threading.Lock()
        self.closed = False  # locked
        self.destination = destination  # locked
        self.saves: dict[str, _SaveBook] = {}  # locked
        self.finished: set[str] = set()  # locked
        self.failed_send: dict[str, str] = {}  # locked
        self.failed_recv: dict[str, str] = {}  # locked
        self.loaded: dict[str, deque[Chunk]] = {}  # locked
        self.source = source
        self.service: ConnectorService | None = None
        self.sender: TransferAdapter | None = None
        self.receiver: TransferAdapter | None = None
        super().__init__(f"omni-sync-adapter-{config.agent.peer_id}", "SyncTransferAdapter", use_uvloop)

    # -- lifecycle (caller's thread) ------------------------------------------------------------
    def start(self) -> None:
        async def start_service() -> None:
            service = ConnectorService(self.config)
            self.service = service
            await service.start()
            self.receiver = service.adapter(self.stage, source=self.source)

        self.run(start_service(), _START_TIMEOUT_S, "starting the service")

    def shutdown(self, timeout: float) -> None:
        """Close the service (draining saves), stop the loop and join its thread.  Idempotent."""
        with self.lock:
            self.closed = True
        if threading.current_thread() is self.thread:
            self.loop.create_task(self._close_and_stop())  # collected on its own thread: cannot wait
            return
        if self.thread.is_alive() and not self.loop.is_closed():
            if self.service is not None:
                try:
                    self.run(self.service.close(), timeout, "closing the service")
                except Exception:
                    log.exception("closing the service of %s failed", self.config.agent.peer_id)
            with suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            if self.thread.is_alive():
                log.warning("event-loop thread of %s did not stop within %.1fs", self.config.agent.peer_id, timeout)

    async def _close_and_stop(self) -> None:
        try:
            if self.service is not None:
                await self.service.close()
        finally:
            self.loop.stop()

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Hand ``fn(*args)`` to the loop without waiting (call order is kept)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed concurrently
            raise ClosedError("adapter is closed") from None

    # -- on the loop ---------------------------------------------------------------------------
    def outgoing(self) -> TransferAdapter:
        """The sending adapter, created on first use for the destination known by then."""
        if self.sender is None:
            assert self.service is not None
            with self.lock:
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
        with self.lock:
            if self.destination is None:
                self.destination = peer
        return peer

    def submit_save(self, request_id: str, chunk: Payload, final: bool) -> None:
        with self.lock:
            book = self.saves.setdefault(request_id, _SaveBook())
            book.pending += 1
            book.final = book.final or final
        try:
            future = self.outgoing().save_async(request_id, chunk, final=final)
        except (OmniAsyncError, ValueError, TypeError) as exc:
            self.on_saved(request_id, exc)
            return
        future.add_done_callback(lambda f: self.on_saved(request_id, _outcome(f)))

    def on_saved(self, request_id: str, error: BaseException | None) -> None:
        with self.lock:
            book = self.saves.get(request_id)
            if book is None:  # cleaned up meanwhile
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
        except OmniAsyncError as exc:
            self.on_loaded(request_id, None, exc)
            return
        future.add_done_callback(
            lambda f: self.on_loaded(request_id, None if f.cancelled() or f.exception() else f.result(), _outcome(f))
        )

    def on_loaded(self, request_id: str, chunk: Chunk | None, error: BaseException | None) -> None:
        with self.lock:
            if error is not None:
                self.failed_recv.setdefault(request_id, _reason(error))
            elif chunk is not None:
                self.loaded.setdefault(request_id, deque()).append(chunk)
                self.finished.add(request_id)

    def forget(self, request_id: str, *, cancel: bool) -> None:
        """Drop the request from the books and from the adapters (``cancel``: tell the receiver)."""
        with self.lock:
            self.saves.pop(request_id, None)
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


def _outcome(future: asyncio.Future[Any]) -> BaseException | None:
    if future.cancelled():
        return TransferCancelled("cancelled")
    return future.exception()


class SyncTransferAdapter:
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
        engine = _AdapterEngine(config, stage, destination, source, use_uvloop)
        self._engine = engine
        self._finalizer = weakref.finalize(
            self, engine.shutdown, config.adapter.drain_timeout + _SHUTDOWN_MARGIN_S
        )
        try:
            engine.start()
        except BaseException:
            self._finalizer()
            raise
        assert engine.service is not None
        self._address = engine.service.control_address

    def __repr__(self) -> str:
        state = "closed" if self._engine.closed else f"at {self._address}"
        return f"<SyncTransferAdapter {self.peer_id!r} stage={self.stage!r} {state}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- extras: identity and peers ----------------------------------------------------------
    @property
    def peer_id(self) -> str:
        """This side's agent id (what a peer's ``destination`` / ``source`` names)."""
        return self._config.agent.peer_id

    @property
    def stage(self) -> str:
        return self._engine.stage

    @property
    def control_address(self) -> str:
        """``tcp://host:port`` (with ``?key=`` under CURVE) that a peer passes to :meth:`connect`."""
        return self._address

    @property
    def destination(self) -> str | None:
        """Where saved chunks go (None until given or set by the first :meth:`connect`)."""
        with self._engine.lock:
            return self._engine.destination

    @property
    def service(self) -> ConnectorService:
        """The underlying service.  Touch it only on :attr:`loop` (e.g. ``run_coroutine_threadsafe``)."""
        assert self._engine.service is not None
        return self._engine.service

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the service runs on, in this adapter's daemon thread."""
        return self._engine.loop

    def connect(self, address: str, timeout: float | None = None) -> str:
        """Handshake with the service at ``address``; return its peer id.  Blocks (bounded).

        The first peer connected becomes the :attr:`destination` if none was given.  Raises what
        :meth:`Agent.connect` raises (:class:`HandshakeTimeout`, :class:`HandshakeRejected`...).
        """
        self._check_open()
        budget = timeout if timeout is not None else 4 * self._config.agent.handshake_timeout + 1.0
        engine = self._engine
        what = f"connecting to {address}"
        return self._wait(lambda: _bounded(engine.connect(address), budget, what), budget + 1.0, what)

    def wait_for_peer(self, peer_id: str | None = None, timeout: float = 30.0) -> str:
        """Block until ``peer_id`` (None: any peer) has joined; return its id.

        Raises :class:`DeadlineExceeded` after ``timeout`` s."""
        self._check_open()
        service = self.service
        what = f"waiting for peer {peer_id!r}" if peer_id else "waiting for a peer"
        return self._wait(lambda: _bounded(service.agent.wait_for_peer(peer_id), timeout, what), timeout + 1.0, what)

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

        what = f"saving a chunk of {request_id!r}"
        self._wait(lambda: _bounded(save_one(), timeout, what), None, what)

    def load_async(self, request_id: str) -> None:
        """Ask for the request's next chunk (each call one more, in order); never blocks.

        When it arrives the request shows in :meth:`get_finished_requests` and the chunk waits in
        :meth:`get_loaded`; if it cannot (``stall_timeout`` passed, source lost, sender
        cancelled, invalid payload) the request shows in :meth:`collect_failed_receive_request_ids`.
        """
        self._check_open()
        self._engine.post(self._engine.submit_load, request_id)

    def load(self, request_id: str, timeout: float | None = None) -> Chunk:
        """Block for the request's next chunk and return it; raise the failure.

        ``timeout`` (None: the adapter's ``stall_timeout`` bounds it) raises
        :class:`DeadlineExceeded` and withdraws the wait: a later load asks for the same chunk.
        Not reported in the books.
        """
        self._check_open()
        engine = self._engine

        async def load_one() -> Chunk:
            return await engine.incoming().load_async(request_id)

        what = f"loading a chunk of {request_id!r}"
        return self._wait(lambda: _bounded(load_one(), timeout, what), None, what)

    def get_loaded(self, request_id: str) -> Chunk | None:
        """Take the oldest chunk that :meth:`load_async` brought in for the request, or None."""
        with self._engine.lock:
            ready = self._engine.loaded.get(request_id)
            if not ready:
                return None
            chunk = ready.popleft()
            if not ready:
                del self._engine.loaded[request_id]
            return chunk

    def get_finished_requests(self) -> set[str]:
        """Drain and return ids finished since the last call: saved (final chunk acknowledged)
        or loaded (a chunk asked for with :meth:`load_async` is ready in :meth:`get_loaded`)."""
        with self._engine.lock:
            finished, self._engine.finished = self._engine.finished, set()
        return finished

    def collect_failed_send_request_ids(self) -> dict[str, str]:
        """Drain and return the requests whose send gave up: ``{request_id: reason}``."""
        with self._engine.lock:
            failed, self._engine.failed_send = self._engine.failed_send, {}
        return failed

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        """Drain and return the requests whose receive failed: ``{request_id: reason}``."""
        with self._engine.lock:
            failed, self._engine.failed_recv = self._engine.failed_recv, {}
        return failed

    def record_send_failure(self, request_id: str | None, reason: str) -> None:
        """Note that a chunk of ``request_id`` will never be delivered (None is ignored)."""
        if request_id is not None:
            with self._engine.lock:
                self._engine.failed_send.setdefault(request_id, reason)

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        """Record an invalid received chunk that cannot be retried."""
        with self._engine.lock:
            self._engine.failed_recv.setdefault(request_id, reason)

    def cleanup(self, request_id: str) -> None:
        """Forget the request here: books, buffered and waited-for chunks (late ones are refused).

        Non-blocking and idempotent."""
        self._check_open()
        self._engine.post(partial(self._engine.forget, request_id, cancel=False))

    def cancel(self, request_id: str) -> None:
        """:meth:`cleanup`, and if this side was sending the request, the receiver's waits fail
        with :class:`TransferCancelled`.  Non-blocking and idempotent."""
        self._check_open()
        self._engine.post(partial(self._engine.forget, request_id, cancel=True))

    def shutdown(self) -> None:
        """Drain queued saves (up to ``adapter.drain_timeout``), fail the rest, close the service
        and join the loop thread.  Idempotent; afterwards the other methods raise :class:`ClosedError`."""
        self._engine.check_caller()
        self._finalizer()

    # -- helpers -------------------------------------------------------------------------------
    def _wait(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float | None, what: str) -> T:
        """Run the coroutine ``make()`` on the loop; return its result or raise its own error unchanged.

        The caller's thread is checked before the coroutine exists.  (``_LoopThread.run`` would
        read a ``TimeoutError`` subclass raised by the coroutine, such as :class:`DeadlineExceeded`,
        as its own wait timing out; boxing the outcome avoids that.)
        """
        self._engine.check_caller()
        ok, value = self._engine.run(_boxed(make()), timeout, what)
        if not ok:
            raise value
        return cast(T, value)

    def _check_open(self) -> None:
        if self._engine.closed:
            raise ClosedError("adapter is closed")

    def _check_save(self, request_id: str, chunk: Mapping[str, Any]) -> None:
        self._check_open()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if not isinstance(chunk, Mapping):
            raise TypeError(f"chunk must be a mapping of str to payload values, got {type(chunk).__name__}")
        if self.destination is None:
            raise ValueError("no destination: pass destination= or call connect() first")


async def _boxed(coro: Coroutine[Any, Any, T]) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, exception)``; cancellation still propagates."""
    try:
        return True, await coro
    except Exception as exc:  # re-raised in the caller's thread
        return False, exc


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float | None, what: str = "the operation") -> T:
    """``coro`` under ``timeout`` s (None: unbounded here), :class:`DeadlineExceeded` past it."""
    if timeout is None:
        return await coro
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise DeadlineExceeded(f"{what} did not finish within {timeout}s") from None
