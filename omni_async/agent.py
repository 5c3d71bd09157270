"""The :class:`Agent`: a block region exposed to peers through a control plane and UCX lanes.

It is the async equivalent of the seed ``DataTransport``: peers join by a ZeroMQ handshake
(either side may dial), blocks move with :meth:`Agent.write_blocks`, which returns an awaitable
:class:`~omni_async.transport.Transfer`, and a lost peer fails its transfers with
:class:`~omni_async.errors.PeerLost` within the heartbeat timeout.

Use it as ``async with Agent(region, config) as agent:``; everything it starts (control tasks,
lanes) is stopped by ``await agent.close()``, which is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .config import AgentConfig, check_ucx_environment
from .control import ControlPlane
from .errors import ClosedError, HandshakeRejected, OmniAsyncError, PeerLost, ProtocolError
from .handshake import LocalIdentity, PeerInfo
from .metrics import Metrics, serve_metrics
from .region import BlockRegion, RegionSet, as_region_set, config_fingerprint
from .transport import CancelMode, MessageSink, Transfer, UcxTransport
from .transport.notices import Notice, NoticeSink
from .transport.shared import advertise
from .wire import Layer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """A peer joined, or left (``error`` says why)."""

    kind: Literal["joined", "left"]
    peer_id: str
    error: OmniAsyncError | None = None


PeerListener = Callable[[PeerEvent], None]


class Agent:
    """Block transfers between this process's ``region`` and its peers'.

    ``region`` may be a :class:`~omni_async.region.RegionSet` (one region per layer, sharing
    ``num_blocks``): a block index then moves that block in every region; :attr:`region` is
    the set's first region and :attr:`regions` the set.
    """

    def __init__(self, region: BlockRegion | RegionSet, config: AgentConfig | None = None) -> None:
        self.regions = as_region_set(region)
        region = self.regions.regions[0]
        self.region = region
        self.config = config or AgentConfig()
        share = self.config.same_host_lane
        self.identity = LocalIdentity(
            peer_id=self.config.resolved_peer_id(),
            base_addr=region.base_addr,
            num_blocks=region.num_blocks,
            block_len=region.block_len,
            fingerprint=config_fingerprint(self.config.config_fields),
            max_write_blocks=self.config.max_write_blocks,
            max_message_bytes=self.config.max_message_bytes,
            region_share=advertise(region) if share else None,
            max_notice_bytes=self.config.max_notice_bytes,
            allow_reads=self.config.allow_reads,
            layers=tuple(Layer(other.base_addr, other.block_len, advertise(other) if share else None)
                         for other in self.regions.regions[1:]),
        )
        self._transport: UcxTransport | None = None
        self._control: ControlPlane | None = None
        self.metrics = Metrics(self.identity.peer_id)
        self._listeners: list[PeerListener] = []
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> Agent:
        """Open the UCX context and bind the control plane.  Returns self."""
        if self._closed:
            raise ClosedError("agent is closed")
        if self._control is not None:
            return self
        check_ucx_environment(self.config, os.environ)
        self._transport = UcxTransport(
            self.regions, self.config, fault=self._fault, metrics=self.metrics, host_id=self.identity.host_id
        )
        self._control = ControlPlane(self.identity, self.config, accept=self._accept, lost=self._lost)
        self.metrics.heartbeat = self._control.last_seen
        self.metrics.heartbeat_timeout = self.config.heartbeat_timeout
        try:
            await self._transport.warm_up()
            await self._control.start()
            if self.config.metrics_port:
                serve_metrics(self.config.metrics_port, self.config.host)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> Agent:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Fail in-flight transfers with :class:`ClosedError`, say goodbye, stop everything.

        Idempotent; after it returns no task or lane of this agent is left.
        """
        if self._closed:
            return
        self._closed = True
        if self._transport is not None:
            await self._transport.close()
        if self._control is not None:
            await self._control.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.metrics.close()
        self._signal()

    # -- identity and peers ------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    @property
    def control_address(self) -> str:
        """``tcp://host:port`` that peers pass to :meth:`connect`."""
        return self._started_control().address

    @property
    def transport(self) -> UcxTransport:
        if self._transport is None:
            raise ClosedError("agent is not started")
        return self._transport

    @property
    def control(self) -> ControlPlane:
        return self._started_control()

    @property
    def peers(self) -> dict[str, PeerInfo]:
        """Joined peers by id."""
        return {pid: self.transport.peer(pid) for pid in self.transport.peer_ids}

    async def connect(self, address: str) -> str:
        """Handshake with the agent at ``address`` and return its peer id.

        Raises :class:`~omni_async.errors.HandshakeTimeout`, :class:`FingerprintMismatch`,
        :class:`LayoutMismatch` (or another :class:`HandshakeRejected`) with the reason, and
        :class:`AlreadyConnected` if the pair is joined, or being joined, through another
        handshake (e.g. both sides dialled at once: dial from one side only).
        """
        control, transport = self._started_control(), self.transport
        lane = transport.open_lane()
        info: PeerInfo | None = None
        try:
            info = await control.connect(address, lane.address)
            await transport.add_peer(info, lane)
            if not control.has_peer(info.peer_id, info.nonce):  # lost while its lane was added
                transport.remove_peer(info.peer_id)
                raise PeerLost(f"peer {info.peer_id!r} left during the handshake")
        except BaseException as exc:
            # Roll back both halves, whatever failed (a cancellation included); the far side
            # gets a Bye so it does not keep a half-joined peer.
            transport.discard_lane(lane, exc if isinstance(exc, OmniAsyncError) else None)
            if info is not None:
                control.abandon(info.peer_id, info.nonce, f"handshake abandoned: {type(exc).__name__}")
            if isinstance(exc, ProtocolError) and info is not None:
                raise HandshakeRejected(f"peer {info.peer_id!r} sent unusable agent metadata: {exc}") from None
            raise
        self._emit(PeerEvent("joined", info.peer_id))
        return info.peer_id

    async def remove_peer(self, peer_id: str) -> bool:
        """Fail the peer's in-flight transfers, say goodbye and forget it; False if unknown."""
        removed = self.transport.remove_peer(peer_id, PeerLost(f"peer {peer_id!r} removed"), orderly=True)
        await self._started_control().disconnect(peer_id, "removed")
        if removed:
            self._emit(PeerEvent("left", peer_id, PeerLost(f"peer {peer_id!r} removed")))
        return removed

    async def wait_for_peer(self, peer_id: str | None = None, timeout: float | None = None) -> str:
        """Wait until ``peer_id`` (or, if None, any peer) has joined; return its id."""
        async with asyncio.timeout(timeout):
            while True:
                if self._closed:
                    raise ClosedError("agent is closed")
                ids = self.transport.peer_ids
                if peer_id is None and ids:
                    return ids[0]
                if peer_id is not None and peer_id in ids:
                    return peer_id
                await self._changed.wait()

    def stats(self) -> dict[str, Any]:
        """A snapshot for code: transfer counters and bytes by kind and outcome, peers, refusals."""
        control = self._control
        return {
            **self.metrics.snapshot(),
            "peers": len(self.transport.peer_ids) if self._transport is not None else 0,
            "in_flight": len(self.transport.in_flight()) if self._transport is not None and not self._closed else 0,
            "control.rejected": control.stats.rejected if control else 0,
            "control.protocol_errors": control.stats.protocol_errors if control else 0,
            "control.unauthenticated": control.unauthenticated if control else 0,
        }

    def add_peer_listener(self, listener: PeerListener) -> None:
        """Call ``listener(event)`` whenever a peer joins or leaves (on the loop)."""
        self._listeners.append(listener)

    # -- transfers ---------------------------------------------------------------------------
    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int], *, notice: bytes | None = None
    ) -> Transfer:
        """See :meth:`UcxTransport.write_blocks`; returns at once, await the transfer.

        With ``notice`` (at most the peer's ``max_notice_bytes``) the peer's :meth:`notices`
        yields a :class:`Notice` with it once the rows are in place, before this transfer
        settles; if the write fails after some of it was sent, a notice with ``failed`` set.
        """
        return self.transport.write_blocks(peer_id, local_idxs, remote_idxs, notice=notice)

    def read_blocks(self, peer_id: str, remote_idxs: Sequence[int], local_idxs: Sequence[int]) -> Transfer:
        """See :meth:`UcxTransport.read_blocks`: copy the peer's rows into ours; returns at
        once, await the transfer (it resolves once the rows are in place)."""
        return self.transport.read_blocks(peer_id, remote_idxs, local_idxs)

    def notices(self) -> AsyncIterator[Notice]:
        """``async for notice in agent.notices()``: notices of the writes peers sent with one,
        in arrival order (per peer: write order), until the agent closes.

        At most ``config.notice_queue`` wait unread; beyond that the senders' writes stay
        unacknowledged until the application reads (nothing is dropped).
        """
        return aiter(self.transport.notices)

    def set_notice_sink(self, sink: NoticeSink | None) -> None:
        """The callback form of :meth:`notices`: ``sink(notice)`` is called for each new
        notice; the sender's write settles once it returns (or its awaitable completes)."""
        self.transport.notices.sink = sink

    def send_message(self, peer_id: str, key: str, meta: bytes, frames: Sequence[Any]) -> Transfer:
        """See :meth:`UcxTransport.send_message`."""
        return self.transport.send_message(peer_id, key, meta, frames)

    def set_message_sink(self, sink: MessageSink | None) -> None:
        """Where incoming chunk messages go (see :data:`~omni_async.transport.MessageSink`)."""
        self.transport.message_sink = sink

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode = "immediate") -> list[int]:
        """Cancel transfers with the seed's ``"immediate"`` / ``"wait"`` semantics."""
        return self.transport.cancel(transfer_ids, mode)

    # -- callbacks from the control plane and the transport --------------------------------
    async def _accept(self, info: PeerInfo) -> bytes:
        """Add the peer's lane (a restarted peer's replaces the old one); on any failure or
        cancellation the new lane is discarded and nothing else changes."""
        lane = self.transport.open_lane()
        try:
            # The control plane refused a second handshake of the same process (same nonce):
            # a known id here is the peer's new incarnation.
            replaced = await self.transport.add_peer(info, lane, replace=info.peer_id in self.control.peers)
        except BaseException as exc:
            self.transport.discard_lane(lane, exc if isinstance(exc, OmniAsyncError) else None)
            if isinstance(exc, ProtocolError):
                raise HandshakeRejected(f"unusable agent metadata: {exc}") from None
            raise
        if replaced:
            self._emit(PeerEvent("left", info.peer_id, PeerLost(f"peer {info.peer_id!r} restarted")))
        self._emit(PeerEvent("joined", info.peer_id))
        return lane.address

    def _lost(self, peer_id: str, error: OmniAsyncError, orderly: bool) -> None:
        if self.transport.remove_peer(peer_id, error, orderly=orderly):
            self._emit(PeerEvent("left", peer_id, error))

    def _fault(self, peer_id: str, error: OmniAsyncError) -> None:
        level = logging.INFO if isinstance(error, PeerLost) else logging.WARNING
        log.log(level, "dropping peer %s: %s", peer_id, error)
        self.transport.remove_peer(peer_id, error)
        self._emit(PeerEvent("left", peer_id, error))
        self._spawn(self._started_control().disconnect(peer_id, f"dropped: {error}"), f"omni-drop-{peer_id}")

    # -- helpers -----------------------------------------------------------------------------
    def _emit(self, event: PeerEvent) -> None:
        reason = "" if event.error is None else event.error.code
        transport = self._transport
        peers = len(transport.peer_ids) if transport is not None else 0
        same_host = event.kind == "joined" and transport is not None and transport.same_host(event.peer_id)
        self.metrics.peer_event(event.kind, event.peer_id, reason, peers, "same-host" if same_host else "ucx")
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("peer listener failed on %s", event)
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _started_control(self) -> ControlPlane:
        if self._control is None:
            raise ClosedError("agent is not started")
        return self._control

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        if self._closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
