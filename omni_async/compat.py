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
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Sequence
from contextlib import suppress
from functools import partial
from typing import Annotated, Any, NamedTuple, Self, TypeVar

import msgspec

from .agent import Agent, PeerEvent
from .config import AgentConfig
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
    TransferFailed,
)
from .region import BlockRegion, config_fingerprint, fingerprints_compatible, plan_runs
from .transport import CancelMode, Transfer
from .wire import MAX_METADATA_BYTES, MAX_PEER_ID

__all__ = ["PollResult", "SyncDataTransport", "decode_agent_metadata"]

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


class _Engine:
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
        self.loop = _new_loop(use_uvloop)
        self.thread = threading.Thread(target=self._run, name=f"omni-sync-{config.peer_id}", daemon=True)
        self.thread.start()

    # -- thread and loop ----------------------------------------------------------------------
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
            raise RuntimeError("SyncDataTransport must not be called from its own event-loop thread")

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Run ``coro`` on the loop and wait up to ``timeout`` s; raise its error or DeadlineExceeded."""
        self.check_caller()
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
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
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(invoke)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"{what} did not finish within {timeout:.1f}s") from None

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
