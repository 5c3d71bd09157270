"""The :class:`Agent`: a block region exposed to peers through a control plane and UCX lanes.

It is the async equivalent of the seed ``DataTransport``: peers join by a ZeroMQ handshake
(either side may dial, both at once too: exactly one handshake joins the pair, see
:func:`~omni_async.handshake.admit`), blocks move with :meth:`Agent.write_blocks`, which returns an awaitable
:class:`~omni_async.transport.Transfer`, and a lost peer fails its transfers with
:class:`~omni_async.errors.PeerLost` within the heartbeat timeout.

Use it as ``async with Agent(region, config) as agent:``; everything it starts (control tasks,
lanes) is stopped by ``await agent.close()``, which is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

from .config import AgentConfig, check_ucx_environment
from .control import ControlConnection, ControlPlane
from .errors import AlreadyConnected, ClosedError, HandshakeRejected, OmniAsyncError, PeerLost, ProtocolError
from .handshake import Connection, LocalIdentity, PeerInfo, Verdict, admit
from .lifecycle import Startable, started
from .metrics import Metrics, MetricsServer, serve_metrics
from .region import BlockRegion, RegionSet, as_region_set, config_fingerprint
from .session import PeerSession, Phase, SessionEvent
from .transport import CancelMode, MessageRetract, MessageSink, Transfer, UcxTransport
from .transport.lane import Lane
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
SessionListener = Callable[[SessionEvent], None]


class Agent(Startable):
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
        self._metrics_server: MetricsServer | None = None  # /metrics, when this agent serves it
        self._listeners: list[PeerListener] = []
        self._session_listeners: list[SessionListener] = []
        self._sessions: dict[str, PeerSession] = {}  # the one record of each peer's state
        self._changed = asyncio.Event()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> Self:
        """Open the UCX context, bind the control plane and, with ``metrics_port``, serve ``/metrics``.

        Returns self.  A ``metrics_port`` that cannot be served (taken) raises :class:`ConfigError`;
        whatever failed start() started is closed.
        """
        if self._closed:
            raise ClosedError("agent is closed")
        if self._control is not None:
            return self
        check_ucx_environment(self.config, os.environ)
        self._transport = UcxTransport(
            self.regions, self.config, fault=self._fault, metrics=self.metrics, host_id=self.identity.host_id,
            peer_id=self.identity.peer_id,
        )
        self._control = ControlPlane(self.identity, self.config, accept=self._accept, lost=self._lost)
        self.metrics.heartbeat = self._control.last_seen
        self.metrics.in_flight = self._transport.in_flight_count
        self.metrics.heartbeat_timeout = self.config.heartbeat_timeout
        try:
            await self._transport.warm_up()
            if self._closed:  # closed meanwhile (its close() tore down what start() made)
                raise ClosedError("agent closed while starting")
            await self._control.start()
            if self.config.metrics_port:
                server = await serve_metrics(self.config.metrics_port, self.config.host)
                if self._closed:  # closed meanwhile: its close() did not see this server
                    await server.close()
                    raise ClosedError("agent closed while starting")
                self._metrics_server = server
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        """Fail in-flight transfers with :class:`ClosedError`, say goodbye, stop everything.

        Idempotent; after it returns no task or lane of this agent is left, nor its ``/metrics``
        server (the port is free).
        """
        if self._closed:
            return
        self._closed = True
        if self._transport is not None:
            await self._transport.close()
        if self._control is not None:
            await self._control.close()
        for session in list(self._sessions.values()):  # no PeerEvent: the owner is closing
            self._session_event(session.move("gone", ClosedError("agent closed")))
        self._sessions.clear()
        if self._metrics_server is not None:
            await self._metrics_server.close()
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
        return self.control.address

    @property
    def transport(self) -> UcxTransport:
        return started(self._transport, "agent")

    @property
    def control(self) -> ControlPlane:
        return started(self._control, "agent")

    @property
    def peers(self) -> dict[str, PeerInfo]:
        """Joined peers by id."""
        return {pid: s.info for pid, s in self._sessions.items() if s.phase == "joined" and s.info is not None}

    def session_phase(self, peer_id: str) -> Phase:
        """Where the peer's session stands (``"gone"`` if there is none)."""
        session = self._sessions.get(peer_id)
        return "gone" if session is None else session.phase

    def handshakes_in_progress(self, peer_id: str) -> int:
        """How many handshakes of ``peer_id`` (dialled or being admitted) are in progress here."""
        session = self._sessions.get(peer_id)
        return 0 if session is None else session.pending

    def dialled_by(self, peer_id: str) -> str:
        """The peer id of the side that dialled the joined peer's connection; raises
        :class:`~omni_async.errors.UnknownPeer` unless joined."""
        self.transport.peer(peer_id)  # raises UnknownPeer
        connection = self._sessions[peer_id].connection
        assert connection is not None
        return connection.dialled_by

    async def connect(self, address: str) -> str:
        """Handshake with the agent at ``address`` and return its peer id once joined.

        Either side may dial at any moment, both at once too: of crossing handshakes exactly
        one joins the pair (the one dialled by the smaller peer id, see
        :func:`~omni_async.handshake.admit`); this returns once no other handshake of the pair
        is in progress here, and, for a peer on this host, once it proved which process it is
        (at most ``handshake_timeout``: the same-host lane, see
        :mod:`omni_async.transport.pid_proof`).  Raises :class:`~omni_async.errors.HandshakeTimeout`,
        :class:`FingerprintMismatch`, :class:`LayoutMismatch` (or another
        :class:`HandshakeRejected`) with the reason, and :class:`AlreadyConnected` if the pair
        is joined (or being joined) through another handshake: that one's connection stays.
        """
        control, transport = self.control, self.transport
        lane = transport.open_lane()
        conn: ControlConnection | None = None
        counted = False  # in its session's pending handshakes (until it ends)
        try:
            conn = await control.connect(address, lane.address)
            self._handshake_started(conn.info.peer_id)
            counted = True
            self._check(conn)  # early refusal, before the lane is vetted
            await transport.connect_lane(conn.info, lane)
            self._commit(conn, lane)
        except BaseException as exc:
            # Roll back, whatever failed (a cancellation included): the far side gets a Bye so
            # it does not keep a half-joined peer, unless it joined the pair another way.
            transport.discard_lane(lane, exc if isinstance(exc, OmniAsyncError) else None)
            crossed = self._crossed(conn) if isinstance(exc, ProtocolError) and conn is not None else None
            if conn is not None:
                joined_otherwise = crossed is not None or isinstance(exc, AlreadyConnected)
                control.release(conn, None if joined_otherwise else f"handshake abandoned: {type(exc).__name__}")
            if crossed is not None:
                raise crossed from None
            if isinstance(exc, ProtocolError) and conn is not None:
                raise HandshakeRejected(f"peer {conn.info.peer_id!r} sent unusable agent metadata: {exc}") from None
            raise
        finally:
            if counted and conn is not None:
                self._handshake_ended(conn.info.peer_id)
        # Once no crossing handshake is pending, and a peer on this host proved which process it
        # is (so the writes that follow take the same-host lane), return.  A connect cancelled
        # meanwhile leaves nothing behind, as one cancelled before: the pair it joined is left
        # (unless another handshake's connection replaced ours, or the agent is closing).
        try:
            await self._settled(conn.info.peer_id)
            await transport.same_host_settled(conn.info.peer_id, self.config.handshake_timeout)
        except asyncio.CancelledError:
            session = self._sessions.get(conn.info.peer_id)
            if session is not None and session.phase == "joined" and session.connection is conn and not self._closed:
                self._leave(session, PeerLost("connect cancelled"), orderly=True,
                            goodbye="handshake abandoned: CancelledError")
            raise
        return conn.info.peer_id

    async def remove_peer(self, peer_id: str) -> bool:
        """Fail the peer's in-flight transfers, say goodbye and forget it; False if unknown."""
        session = self._sessions.get(peer_id)
        if session is None or session.phase != "joined":
            return False
        error = PeerLost(f"peer {peer_id!r} removed")
        self._leave(session, error, orderly=True, goodbye="removed")
        return True

    async def wait_for_peer(self, peer_id: str | None = None, timeout: float | None = None) -> str:
        """Wait until ``peer_id`` (or, if None, any peer) has joined; return its id."""
        async with asyncio.timeout(timeout):
            while True:
                if self._closed:
                    raise ClosedError("agent is closed")
                ids = list(self.peers)
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
            "peers": len(self.peers),
            "in_flight": len(self.transport.in_flight()) if self._transport is not None and not self._closed else 0,
            "control.rejected": control.stats.rejected if control else 0,
            "control.protocol_errors": control.stats.protocol_errors if control else 0,
            "control.unauthenticated": control.unauthenticated if control else 0,
        }

    def add_peer_listener(self, listener: PeerListener) -> None:
        """Call ``listener(event)`` whenever a peer joins or leaves (on the loop)."""
        self._listeners.append(listener)

    def add_session_listener(self, listener: SessionListener) -> None:
        """Call ``listener(event)`` for every move of every peer session (on the loop): the
        finer-grained view of what :meth:`add_peer_listener` reports as joined / left."""
        self._session_listeners.append(listener)

    # -- transfers ---------------------------------------------------------------------------
    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int], *, notice: bytes | None = None
    ) -> Transfer:
        """See :meth:`UcxTransport.write_blocks`; returns at once, await the transfer.

        With ``notice`` (at most the peer's ``max_notice_bytes``) the peer's :meth:`notices`
        yields a :class:`Notice` with it once the rows are in place, before this transfer
        settles; if the write fails after some of it was sent, a notice with ``failed`` set.
        """
        transport = self._transport  # (the transport property's check, inline: the hot path of row a)
        if transport is None:
            raise ClosedError("agent is not started")
        return transport.write_blocks(peer_id, local_idxs, remote_idxs, notice=notice)

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
        notice; the sender's write settles once it returns (or its awaitable completes: that
        runs as a task of the agent's, cancelled by :meth:`close` if still running)."""
        self.transport.notices.sink = sink

    def send_message(self, peer_id: str, key: str, meta: bytes, frames: Sequence[Any]) -> Transfer:
        """See :meth:`UcxTransport.send_message`."""
        return self.transport.send_message(peer_id, key, meta, frames)

    def batch_bytes(self, peer_id: str) -> int:
        """See :meth:`UcxTransport.batch_bytes`."""
        return self.transport.batch_bytes(peer_id)

    def set_message_sink(self, sink: MessageSink | None, *, retract: MessageRetract | None = None) -> None:
        """Where incoming chunk messages go (see :data:`~omni_async.transport.MessageSink`), and
        whom to tell when a sender gives up a message whose sink's awaitable is still pending
        (see :data:`~omni_async.transport.MessageRetract`)."""
        self.transport.message_sink = sink
        self.transport.message_retract = retract

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode = "immediate") -> list[int]:
        """Cancel transfers with the seed's ``"immediate"`` / ``"wait"`` semantics."""
        return self.transport.cancel(transfer_ids, mode)

    # -- sessions: every move of a peer's state goes through here ---------------------------
    def _handshake_started(self, peer_id: str) -> None:
        """Count a handshake of ``peer_id`` in progress, opening an admitting session if none.
        A session stays in the table while any of its handshakes is in progress."""
        session = self._sessions.get(peer_id)
        if session is None:
            session = self._sessions[peer_id] = PeerSession(peer_id)
            self._session_event(SessionEvent(peer_id, "gone", "admitting"))
        session.pending += 1

    def _handshake_ended(self, peer_id: str) -> None:
        session = self._sessions.get(peer_id)
        if session is None:  # the agent closed meanwhile
            return
        session.pending -= 1
        if session.pending == 0 and session.phase == "admitting":
            self._forget(session, None)
        self._signal()

    def _check(self, conn: ControlConnection) -> Verdict:
        """Apply the pair rules to a completed handshake; raises :class:`AlreadyConnected`."""
        if self._closed:
            raise ClosedError("agent is closed")
        new = Connection(conn.info.nonce, conn.dialled_by)
        return admit(self.peer_id, self._sessions[conn.info.peer_id].current(), new, conn.info.peer_id)

    def _crossed(self, conn: ControlConnection) -> AlreadyConnected | None:
        """What the pair rules say of ``conn`` now, if it lost to a crossing handshake that
        joined the pair meanwhile; None otherwise.  The lane a peer offered in its answer is
        closed when its own crossing dial wins: connecting it then fails, and that failure is
        the crossing, not unusable agent metadata."""
        if self._closed:
            return None
        try:
            self._check(conn)
        except AlreadyConnected as exc:
            return exc
        return None

    def _commit(self, conn: ControlConnection, lane: Lane) -> None:
        """Join the pair through ``conn`` and ``lane`` (both connected), or raise
        :class:`AlreadyConnected`.  Synchronous: nothing moves between decision and effect."""
        verdict = self._check(conn)
        peer_id = conn.info.peer_id
        session = self._sessions[peer_id]
        if verdict != "join":
            why = "restarted" if verdict == "restart" else "reconnected through a crossing handshake"
            error = PeerLost(f"peer {peer_id!r} {why}")
            self.transport.remove_peer(peer_id, error)
            if verdict == "restart":  # the old incarnation is gone; the session starts over
                self._forget(session, error)
            else:
                log.info("peer %s %s", peer_id, why)
        self.transport.add_peer(conn.info, lane)
        self.control.install(conn)
        session.info, session.connection = conn.info, conn
        if session.phase == "admitting":
            self._session_event(session.move("joined"))

    async def _settled(self, peer_id: str) -> None:
        """Wait until no other handshake of ``peer_id`` is in progress (one that crossed ours
        may still replace the connection we joined with), for at most the handshake timeout:
        the pair is joined either way."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.handshake_timeout):
                while (session := self._sessions.get(peer_id)) is not None and session.pending > 0:
                    await self._changed.wait()

    def _leave(self, session: PeerSession, error: OmniAsyncError, *, orderly: bool, goodbye: str | None) -> None:
        """Remove a joined peer: fail its transfers, close (``orderly``: drain) its lane, let its
        control connection go (saying ``goodbye`` unless None)."""
        connection = session.connection
        self._session_event(session.move("leaving", error))
        self.transport.remove_peer(session.peer_id, error, orderly=orderly)
        if connection is not None:
            self.control.release(connection, goodbye)
        self._forget(session, error)

    def _forget(self, session: PeerSession, error: OmniAsyncError | None) -> None:
        """The session is gone; it starts over (admitting) if handshakes of the peer are in
        progress, else it leaves the table."""
        self._session_event(session.move("gone", error))
        if session.pending:
            self._session_event(session.move("admitting"))
        elif self._sessions.get(session.peer_id) is session:
            del self._sessions[session.peer_id]

    # -- callbacks from the control plane and the transport --------------------------------
    async def _accept(self, conn: ControlConnection) -> bytes:
        """Admit a peer's hello: vet and connect a new lane, then join the pair (or refuse).
        On any failure or cancellation the new lane is discarded and nothing else changes."""
        self._handshake_started(conn.info.peer_id)
        try:
            self._check(conn)  # early refusal, before a lane is opened
            lane = self.transport.open_lane()
            try:
                await self.transport.connect_lane(conn.info, lane)
                self._commit(conn, lane)
            except BaseException as exc:
                self.transport.discard_lane(lane, exc if isinstance(exc, OmniAsyncError) else None)
                if isinstance(exc, ProtocolError):
                    raise HandshakeRejected(f"unusable agent metadata: {exc}") from None
                raise
        finally:
            self._handshake_ended(conn.info.peer_id)
        return lane.address

    def _lost(self, peer_id: str, error: OmniAsyncError, orderly: bool) -> None:
        session = self._sessions.get(peer_id)
        if session is not None and session.phase == "joined":
            self._leave(session, error, orderly=orderly, goodbye=None)

    def _fault(self, peer_id: str, error: OmniAsyncError) -> None:
        level = logging.INFO if isinstance(error, PeerLost) else logging.WARNING
        log.log(level, "dropping peer %s: %s", peer_id, error)
        session = self._sessions.get(peer_id)
        if session is not None and session.phase == "joined":
            self._leave(session, error, orderly=False, goodbye=f"dropped: {error}")

    # -- helpers -----------------------------------------------------------------------------
    def _session_event(self, event: SessionEvent) -> None:
        """Tell the session listeners; a join or a leave (a joined session gone) is also a
        :class:`PeerEvent`, exactly as before sessions existed."""
        for listener in list(self._session_listeners):
            try:
                listener(event)
            except Exception:
                log.exception("session listener failed on %s", event)
        if event.new == "joined":
            self._emit(PeerEvent("joined", event.peer_id))
        elif event.new == "gone" and event.old in ("joined", "leaving") and not self._closed:
            error = event.error or PeerLost(f"peer {event.peer_id!r} left")
            self._emit(PeerEvent("left", event.peer_id, error))
        else:
            self._signal()

    def _emit(self, event: PeerEvent) -> None:
        reason = "" if event.error is None else event.error.code
        transport = self._transport
        peers = len(self.peers)
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

