"""``SyncDataTransport``: the seed ``DataTransport`` contract (thread and poll) over an :class:`Agent`.

One :class:`~omni_async.agent.Agent` runs on the loop of a :class:`~omni_async.seed.portal.Portal`:

* ``add_remote_peer``, ``remove_remote_peer``, ``cancel(mode="wait")`` and ``close`` wait
  (bounded) for the loop; ``write_blocks`` never waits for it: it checks the peer and the
  indices in the caller's thread (the same :func:`~omni_async.region.plan_runs` the core runs),
  numbers the write (the facade's own ids) and starts it there if the caller holds the loop
  (:meth:`Portal.driving <omni_async.seed.portal.Portal.driving>`), else hands it to the loop's
  thread;
* the loop pushes every settled transfer into locked books that ``poll`` drains; a ``poll`` that
  finds nothing while transfers are in flight runs the loop in the caller's thread until the
  next settlement (at most :data:`~omni_async.seed.portal.NEWS_WAIT_S`), or waits for it on a
  condition where it cannot run the loop, so a caller polling in a tight loop or between
  pure-Python work never starves the loop of the GIL.

Threading: every public method may be called from any thread except one that runs the
transport's loop (a call from there would wait on itself and raises :class:`RuntimeError`).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import socket
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from functools import partial
from typing import Any, Final, NamedTuple

import msgspec

from ..agent import Agent, PeerEvent
from ..auth import join_address, split_address
from ..config import AgentConfig
from ..errors import (
    AlreadyConnected,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    HandshakeRejected,
    HandshakeTimeout,
    LayoutMismatch,
    OmniAsyncError,
    PeerLost,
    TransferFailed,
)
from ..region import BlockRegion, Run, config_fingerprint, plan_runs
from ..session import SessionEvent
from ..transport import CancelMode, Transfer
from .card import AgentCard, decode_agent_metadata, encode_agent_metadata
from .portal import NEWS_WAIT_S, Facade, Portal

__all__ = ["PollResult", "SyncDataTransport"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0
"""How long the constructor waits for the loop to open UCX and bind the control plane."""
_CLOSE_BUDGET_S = 30.0
"""Safety bound on ``close()``: far above the agent's own bounded close (lane drain, endpoint
close grace, socket linger: seconds), which is never cut short."""
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


def _dialable(address: str, advertise_host: str | None) -> str:
    """The bound ``tcp://host:port[?key=K]`` with a wildcard host replaced by one a peer can dial."""
    endpoint, key = split_address(address)
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if advertise_host:
        host = advertise_host
    elif host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    return join_address(f"tcp://{host}:{port}", key)


class _Engine:
    """The agent on the portal's loop, and the books shared with the caller's threads.

    Holds no reference to the facade, so an unreferenced :class:`SyncDataTransport` can be
    collected (and its finalizer shuts the engine down).  Fields marked *locked* are guarded by
    ``portal.lock``; ``handles`` belongs to the loop thread alone.
    """

    def __init__(self, config: AgentConfig, use_uvloop: bool) -> None:
        self.config = config
        self.inflight: dict[int, str] = {}  # locked: id -> caller's peer id, until polled/cancelled
        self.settled: dict[int, tuple[str, bool]] = {}  # locked: id -> (peer id, ok), not polled yet
        self.reasons: OrderedDict[int, OmniAsyncError] = OrderedDict()  # locked
        self.live: set[str] = set()  # locked: agent-level ids of joined peers
        self.peers: dict[str, str] = {}  # locked: caller's peer id -> agent-level peer id
        self.sizes: dict[str, int] = {}  # locked: agent-level peer id -> its num_blocks
        self.ids = itertools.count(1)  # locked: the facade's transfer ids
        self.handles: dict[int, Transfer] = {}  # loop thread only: id -> core transfer, until settled
        self.unposted: deque[Callable[[], None]] = deque()  # locked: writes made, not posted yet, in call order
        self.agent: Agent | None = None
        self.region: BlockRegion | None = None
        self.portal = Portal(f"omni-sync-{config.peer_id}", "SyncDataTransport", use_uvloop=use_uvloop)

    def start(self, region: BlockRegion) -> Agent:
        self.region = region

        async def start_agent() -> Agent:
            agent = Agent(region, self.config)
            agent.add_peer_listener(self.on_peer_event)
            agent.add_session_listener(self.on_session_event)
            self.agent = agent
            return await agent.start()

        return self.portal.run(start_agent(), _START_TIMEOUT_S, "starting the agent")

    def shutdown(self) -> None:
        """Close the agent (failing what is in flight) to its end, stop the loop, join its thread;
        close the descriptor of the caller's region file if the agent offered one to peers."""
        agent = self.agent
        try:
            self.portal.stop(agent.close if agent is not None else None, _CLOSE_BUDGET_S)
        finally:  # even if stopping raised (an interrupt): the descriptor never outlives this
            if self.region is not None:
                self.region.release_shared_file()
        with self.portal.lock:
            self.inflight.clear()
            self.settled.clear()
            self.unposted.clear()
            self.peers.clear()
            self.sizes.clear()
            self.live.clear()

    # -- draining (caller's thread, lock held) -----------------------------------------------
    def collect(self, peer_id: str | None) -> PollResult:
        done: list[int] = []
        failed: list[int] = []
        for transfer_id, (owner, ok) in list(self.settled.items()):
            if peer_id is None or owner == peer_id:
                del self.settled[transfer_id]
                self.inflight.pop(transfer_id, None)
                (done if ok else failed).append(transfer_id)
        return PollResult(done, failed)

    def answer_here(self, core_id: str | None) -> bool:
        """Holding the loop in this thread: take the answer of the oldest write in flight (to
        agent-level peer ``core_id``, if given) here, if its transport offers that
        (:meth:`~omni_async.transport.transfer.Transfer.take_answer`: a same-host write the
        peer answers by consuming its ring record, polled for briefly).  True if it settled
        (then :meth:`on_transfer_done` has run): no loop run is needed for it."""
        for transfer in self.handles.values():
            if core_id is None or transfer.peer_id == core_id:
                return transfer.take_answer()
        return False

    def moving(self, peer_id: str | None) -> bool:
        """Whether a transfer (of ``peer_id``, if given) is in flight and not settled yet."""
        if peer_id is None:
            return len(self.inflight) > len(self.settled)
        return any(owner == peer_id and i not in self.settled for i, owner in self.inflight.items())

    # -- on the loop -------------------------------------------------------------------------
    def on_peer_event(self, event: PeerEvent) -> None:
        """A peer joined or left.  Its transfers are not settled here: each settles through its
        own handle (:meth:`on_transfer_done`), which the agent fails once nothing reads its rows
        any more (a peer removed in order drains first: its rows are read until then)."""
        with self.portal.lock:
            if event.kind == "joined":
                self.live.add(event.peer_id)
            else:
                self.live.discard(event.peer_id)

    def post_writes(self) -> None:
        """Post the writes made so far (:attr:`unposted`), in the order they were made.  Run by
        whoever holds the loop: its thread (a write handed over) or a caller that holds it (a
        write made there, after any made before it: one handed to the loop's thread may still
        wait in the loop's queue when the caller takes the loop back)."""
        while True:
            with self.portal.lock:
                if not self.unposted:
                    return
                write = self.unposted.popleft()
            write()

    def submit(self, transfer_id: int, core_id: str, runs: list[Run], blocks: int, remote_blocks: int) -> None:
        """Post write ``transfer_id`` (planned and put in flight by the caller: ``runs`` of
        ``blocks`` pairs against a peer of ``remote_blocks`` blocks) through the agent's
        transport; if it refuses it now (the peer left or changed its layout meanwhile, the
        agent is closing), it settles as failed with the reason."""
        assert self.agent is not None
        try:
            transfer = self.agent.transport.write_runs(core_id, runs, blocks, remote_blocks=remote_blocks)
        except OmniAsyncError as exc:
            self.settle(transfer_id, exc)
            return
        except Exception as exc:  # a UCX error posting the sends
            log.exception("a write to %s could not be posted", core_id)
            self.settle(transfer_id, TransferFailed(f"could not post the write: {exc!r}"))
            return
        self.handles[transfer_id] = transfer
        transfer.add_done_callback(partial(self.on_transfer_done, transfer_id))

    def on_session_event(self, event: SessionEvent) -> None:
        """A joined peer starts leaving: gone for callers from now on.  Its transfers fail
        next and its "left" event comes after them; a caller woken by such a failure must
        already find the peer gone (``write_blocks``: None)."""
        if event.old == "joined":
            with self.portal.lock:
                self.live.discard(event.peer_id)

    def on_transfer_done(self, transfer_id: int, transfer: Transfer) -> None:
        self.handles.pop(transfer_id, None)
        self.settle(transfer_id, transfer.error())

    def settle(self, transfer_id: int, error: OmniAsyncError | None) -> None:
        with self.portal.lock:
            peer_id = self.inflight.get(transfer_id)
            if peer_id is None or transfer_id in self.settled:
                return  # cancelled ("immediate"), released, or settled already
            self.settled[transfer_id] = (peer_id, error is None)
            if error is not None:
                self.reasons[transfer_id] = error
                while len(self.reasons) > _MAX_REASONS:
                    self.reasons.popitem(last=False)
            self.portal.notify()

    def cancel_now(self, transfer_ids: list[int]) -> None:
        known = [transfer.id for i in transfer_ids if (transfer := self.handles.pop(i, None)) is not None]
        if known and self.agent is not None:
            with suppress(ClosedError):
                self.agent.cancel(known, "immediate")

    def cancel_wait(self, transfer_ids: list[int]) -> list[int]:
        known = {self.handles[i].id: i for i in transfer_ids if i in self.handles}  # core id -> ours
        draining: set[int] = set()
        if known and self.agent is not None:
            with suppress(ClosedError):
                draining = {known[core] for core in self.agent.cancel(list(known), "wait")}
        still: list[int] = []
        with self.portal.lock:
            for transfer_id in transfer_ids:
                if transfer_id in draining and transfer_id in self.inflight:
                    still.append(transfer_id)
                else:  # settled already (not polled yet): released now
                    self.inflight.pop(transfer_id, None)
                    self.settled.pop(transfer_id, None)
        return still

    async def join(self, card: AgentCard, base_addr: int, num_blocks: int, block_len: int) -> None:
        """Make sure the agent behind ``card`` is joined, dialling it if needed; check its layout.

        The handshake checks the fingerprint and ``block_len`` against this side's; this checks
        that the peer is the one ``add_remote_peer`` described.  Both sides of a pair usually
        call ``add_remote_peer`` at about the same time: the agent joins crossing handshakes
        once (:func:`omni_async.handshake.admit`), and the side whose dial lost gets
        :class:`AlreadyConnected` while the other handshake joins the pair.
        """
        agent = self.agent
        assert agent is not None
        core_id = card.peer_id
        with self.portal.lock:
            registered = core_id in self.peers.values()  # under another name: left as it is
        if core_id not in agent.peers:
            try:
                joined = await agent.connect(card.address)
            except AlreadyConnected as exc:
                try:  # the peer's own handshake joins the pair (or did)
                    await agent.wait_for_peer(core_id, timeout=self.config.handshake_timeout)
                except TimeoutError:
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
            if not registered:  # (a registered peer stays: this call only failed)
                await agent.remove_peer(core_id)
            raise LayoutMismatch(
                f"peer {core_id!r} has (base_addr, num_blocks, block_len) = {actual}, "
                f"but add_remote_peer was given {expected}"
            )


class SyncDataTransport(Facade):
    """The seed ``DataTransport`` contract, synchronous, backed by an :class:`Agent` on its own loop.

    Construction:
        view: a writeable, C-contiguous 2-D memoryview (``num_blocks × block_len`` bytes) over the
            local block storage.  The caller owns the memory; the transport keeps a reference
            and, once peers are added, peers may write into any block at any time.  A block
            passed to :meth:`write_blocks` must not change until its id is polled.  A view that
            is a shared mapping of a tmpfs file sealed against shrinking (a memfd with
            ``F_SEAL_SHRINK``, e.g. ``BlockRegion.allocate(n, l).array``; not a plain
            ``/dev/shm`` file) is offered to peers on this host as that file, which they map (one copy; see
            :meth:`~omni_async.region.BlockRegion.shared_file`): the transport then holds a
            descriptor of it until :meth:`close`.
        config_fields: model config values hashed into :attr:`config_fingerprint` (None or
            empty: compatible with any peer).  Overrides ``config.config_fields`` when given.
        config: agent settings (control-plane host/port, timeouts, UCX transports, peer id,
            CURVE keys: the metadata then carries this side's public key).

    The constructor blocks until the agent is listening (raises :class:`ConfigError` for a bad
    view, or the agent's start error).  Use as a context manager or call :meth:`close`.
    """

    # -- the seed's properties ------------------------------------------------------------------
    base_addr: Final[int]
    """Base address of the local block memory region (``ctypes.addressof`` of the view)."""
    num_blocks: Final[int]
    """Number of blocks in the local region."""
    block_len: Final[int]
    """Size of each block in bytes."""
    config_fingerprint: Final[str]
    """Seed-identical content hash of ``config_fields`` (hex, 16 chars); ``""`` = always compatible."""

    def __init__(
        self,
        view: memoryview,
        config_fields: dict[str, Any] | None = None,
        *,
        config: AgentConfig | None = None,
        advertise_host: str | None = None,
        use_uvloop: bool = False,
    ) -> None:
        """``advertise_host`` (extra): host put in the metadata instead of the bound one.
        ``use_uvloop`` (extra): run the transport's loop on uvloop.  Off by default: the
        caller's thread runs the loop in every :meth:`poll` that waits, and uvloop sets up
        signal handling on each run in the main thread (~30 µs, against ~4 µs for asyncio's
        own loop: a 64 KiB write polled in a tight loop took 112 µs with it, 57 without)."""
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
        self.base_addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        shape = view.shape
        assert shape is not None  # a 2-D view always has one
        self.num_blocks, self.block_len = int(shape[0]), int(shape[1])
        self.config_fingerprint = config_fingerprint(config.config_fields)
        self._config = config
        self.peer_id = config.peer_id
        self._last_error: OmniAsyncError | None = None
        engine = _Engine(config, use_uvloop)
        self._engine = engine
        self._portal = engine.portal
        self._arm(engine.shutdown)
        try:
            agent = engine.start(BlockRegion.wrap(view))
        except BaseException:
            self._stop()
            raise
        self.control_address = _dialable(agent.control_address, advertise_host)
        self._metadata = encode_agent_metadata(AgentCard(self.control_address, config.peer_id, self.config_fingerprint))

    def _describe(self) -> str:
        return f"{self.peer_id!r} {self.num_blocks}×{self.block_len}"

    # -- extras (and peer_id, control_address, loop) --------------------------------------------
    @property
    def agent(self) -> Agent:
        """The underlying agent.  Touch it only on :attr:`loop` (e.g. ``run_coroutine_threadsafe``)."""
        assert self._engine.agent is not None
        return self._engine.agent

    @property
    def last_error(self) -> OmniAsyncError | None:
        """Why the latest :meth:`write_blocks` that returned ``None`` was refused."""
        return self._last_error

    def failure_reason(self, transfer_id: int) -> OmniAsyncError | None:
        """The error a failed transfer ended with (:class:`PeerLost`, :class:`DeadlineExceeded`,
        :class:`TransferCancelled`...), or None if it did not fail or is forgotten."""
        with self._portal.lock:
            return self._engine.reasons.get(transfer_id)

    # -- the seed's methods ---------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        """Opaque bytes a peer passes to its ``add_remote_peer``: control address, peer id, fingerprint."""
        self._portal.check_open()
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
        disconnected, unless it is registered under another name already: that registration
        and its transfers are left as they are), :class:`HandshakeTimeout` or another :class:`HandshakeRejected`,
        :class:`ClosedError`.
        """
        self._portal.check_open()
        card = decode_agent_metadata(agent_metadata)
        engine = self._engine
        timeout = self._config.handshake_timeout
        budget = 4 * timeout + 1.0
        try:
            self._portal.run(engine.join(card, base_addr, num_blocks, block_len), budget, f"handshake with {peer_id!r}")
        except DeadlineExceeded as exc:
            raise HandshakeTimeout(str(exc)) from None
        with self._portal.lock:
            previous = engine.peers.get(peer_id)
            engine.peers[peer_id] = card.peer_id
            engine.sizes[card.peer_id] = num_blocks  # the join checked it is the peer's
            orphan = previous not in (None, card.peer_id, *engine.peers.values())
            if orphan and previous is not None:
                engine.sizes.pop(previous, None)
        if orphan:
            assert previous is not None and engine.agent is not None
            self._portal.run(engine.agent.remove_peer(previous), timeout, f"removing the old {peer_id!r}")

    def remove_remote_peer(self, peer_id: str) -> None:
        """Unregister ``peer_id``, fail its in-flight transfers (:class:`PeerLost`, seen in
        :meth:`poll` as failed) and say goodbye to it.  Unknown ids are ignored.  Blocks until done."""
        self._portal.check_open()
        engine = self._engine
        with self._portal.lock:
            core_id = engine.peers.pop(peer_id, None)
            if core_id is None or core_id in engine.peers.values():
                return
            engine.sizes.pop(core_id, None)
        assert engine.agent is not None
        self._portal.run(engine.agent.remove_peer(core_id), self._wait_budget, f"removing {peer_id!r}")

    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        """Submit a write of local blocks into the peer's blocks.

        The peer and the indices are checked here, and the write starts here too if this
        thread holds the transport's loop (it polled within the last
        :data:`~omni_async.seed.portal.LEASE_S`, see :meth:`Portal.driving
        <omni_async.seed.portal.Portal.driving>`), or takes it back from the loop's thread
        within :data:`~omni_async.seed.portal.NEWS_WAIT_S` in a burst of calls
        (:meth:`Portal.burst_wait <omni_async.seed.portal.Portal.burst_wait>`).  A write to a
        peer on this host is then copied into the peer's rows and told before this returns,
        its acknowledgement taken by a later :meth:`poll`; and if no call turned the loop for a
        lease (writes without polls), one pass of it runs here too, so heartbeats keep moving.
        Otherwise (the loop's thread has the loop, or this thread runs an event loop of its
        own) the write is handed to the loop's thread, without waiting.  Either way writes reach
        the transport in call order (two writes to one row land in that order).
        Returns a transfer id (this facade's own, unique for this transport's life) to find in
        :meth:`poll`; or ``None`` if ``peer_id`` is not registered (or its connection is gone)
        or the indices are invalid (see :attr:`last_error`).  A write the agent refuses once on
        the loop (the peer left in between) surfaces in :meth:`poll` as failed, with
        :meth:`failure_reason`.  The index lists are planned here
        (:func:`~omni_async.region.plan_runs`, once per write): the caller may reuse them at
        once.  Raises :class:`ClosedError` after :meth:`close`.
        """
        engine, portal = self._engine, self._portal
        local, remote = list(local_idxs), list(remote_idxs)  # lists: a contiguous write plans as one run at once
        refused: OmniAsyncError | None = None
        with portal.driving(portal.burst_wait()) as driving:
            with portal.lock:
                portal.check_open()
                core_id = engine.peers.get(peer_id)
                joined = core_id is not None and core_id in engine.live
                if core_id is None or not joined:
                    self._last_error = PeerLost(f"peer {peer_id!r} is not registered or not connected")
                    return None
                remote_blocks = engine.sizes[core_id]
                try:
                    runs = plan_runs(local, remote, self.num_blocks, remote_blocks)
                except OmniAsyncError as exc:
                    refused = exc
                else:
                    transfer_id = next(engine.ids)
                    engine.inflight[transfer_id] = peer_id
                    write = partial(engine.submit, transfer_id, core_id, runs, len(local), remote_blocks)
                    engine.unposted.append(write)
                    if not driving:
                        try:
                            portal.post(engine.post_writes)
                        except ClosedError:
                            engine.unposted.pop()
                            del engine.inflight[transfer_id]
                            raise
                        return transfer_id
            if refused is None:
                engine.post_writes()  # (ours, after any handed over before it) the loop's next run carries on
                portal.catch_up()  # (no poll for a while: this thread keeps the loop moving)
                return transfer_id
        self._last_error = refused
        log.warning("write to %s refused: %s", peer_id, refused)
        return None

    def poll(self, peer_id: str | None = None) -> PollResult:
        """Ids settled since the last poll (of ``peer_id`` only, if given).

        Each id is reported once, then leaves the inflight set.  If nothing settled since the
        last poll while transfers are in flight, takes the oldest write's answer in the
        caller's thread where the transport offers that (a same-host write the peer answers
        by consuming its ring record: polled for at most 50 µs), else runs the transport's
        loop in the caller's thread until the next settlement, at most
        :data:`~omni_async.seed.portal.NEWS_WAIT_S` (blocked in the loop's poll meanwhile, the
        GIL released); where this thread cannot run the loop, waits for it on a condition
        that the loop's thread signals.
        """
        engine, portal = self._engine, self._portal
        with portal.lock:
            portal.check_open()
            result = engine.collect(peer_id)
            if result.done or result.failed or not engine.moving(peer_id):
                return result
            core_id = None if peer_id is None else engine.peers.get(peer_id)
        with portal.driving(NEWS_WAIT_S) as driving:
            if driving:
                answered = False
                if peer_id is None or core_id is not None:  # (a name removed meanwhile: no write of it)
                    answered = engine.answer_here(core_id)
                if answered:  # taken here: no loop run for it (one if none ran for a lease)
                    portal.catch_up()
                else:
                    portal.turn(NEWS_WAIT_S)
            with portal.lock:
                if not driving:
                    portal.wait_for_news()
                return engine.collect(peer_id)

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
        with self._portal.lock:
            self._portal.check_open()
            known = [i for i in wanted if i in engine.inflight]
            if mode == "immediate":
                for transfer_id in known:
                    del engine.inflight[transfer_id]
                    engine.settled.pop(transfer_id, None)
        if not known:
            return []
        if mode == "immediate":
            with suppress(ClosedError):  # closed concurrently: closing cancels everything anyway
                self._portal.post(engine.cancel_now, known)
            return []
        return self._portal.call(engine.cancel_wait, known, timeout=self._wait_budget, what="cancel")

    def close(self) -> None:
        """Fail what is in flight, say goodbye to every peer, stop the loop and join its thread.

        Waits for the agent's own bounded close to finish (its lanes drained or given up, UCX
        workers released, the control socket closed): afterwards the port is free.  Idempotent.
        Afterwards every other method raises :class:`ClosedError`.
        """
        self._stop()

    @property
    def _wait_budget(self) -> float:
        """How long a call waits for the loop's answer."""
        return max(5.0, self._config.handshake_timeout)
