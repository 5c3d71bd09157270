"""The control plane: handshakes, heartbeats and the peer table over ZeroMQ (``zmq.asyncio``).

Each control plane binds one ROUTER; :meth:`ControlPlane.connect` opens one DEALER per peer
it dials.  After a handshake both sides know each other, whoever dialled.  Which handshake joins
a pair is the owner's decision (its :class:`~omni_async.session.PeerSession`): a completed
handshake yields a :class:`ControlConnection` that the owner installs (:meth:`ControlPlane.install`)
or lets go (:meth:`ControlPlane.release`).  The plane owns:

* the index of installed connections (peer id -> connection, ROUTER identity -> peer id);
* liveness: heartbeats both ways every ``heartbeat_interval``; a peer silent for
  ``heartbeat_timeout``, whose DEALER connection drops, who says :class:`~omni_async.wire.Bye`
  or who sends a malformed message is *lost*: removed, and reported once through ``lost``.
  A dialled connection gets heartbeats from the welcome on, before it is installed: the far
  side installed it before welcoming us, and counts our silence while the owner finishes
  joining (vetting the peer's address);
* limits: message size (ZeroMQ ``MAXMSGSIZE`` and the decoder), ``max_peers``.

Admission is delegated: ``accept(connection)`` is called for every valid incoming hello; it
installs the connection and returns the agent metadata to welcome the peer with, or raises
:class:`HandshakeRejected`.
Rules and wire format live in :mod:`omni_async.handshake` and :mod:`omni_async.wire`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .auth import CurveGate, join_address, public_key, split_address
from .config import AgentConfig
from .errors import (
    AlreadyConnected,
    ClosedError,
    HandshakeError,
    HandshakeRejected,
    HandshakeTimeout,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
)
from .handshake import LocalIdentity, PeerInfo, check_peer, hello_refusal, reject_for, rejection_error
from .wire import (
    MAX_CONTROL_BYTES,
    Bye,
    ControlMessage,
    Heartbeat,
    Hello,
    Reject,
    Welcome,
    bounded_reason,
    decode_control,
    encode_control,
)

log = logging.getLogger(__name__)

AcceptPeer = Callable[["ControlConnection"], Awaitable[bytes]]
"""Admit a peer that passed the handshake rules: install its connection (or raise
:class:`HandshakeRejected`) and return the metadata to welcome it with."""
PeerLostCallback = Callable[[str, OmniAsyncError, bool], None]
"""Told once when a joined peer is gone: ``lost(peer_id, reason, orderly)``; ``orderly`` when
it said goodbye (it is alive and closing), False when it died or broke the protocol."""

_HEARTBEAT = encode_control(Heartbeat())
_LINGER_MS = 200  # time for a goodbye to leave on close
_MAX_OWNERS = 4096  # peer id -> CURVE key bindings kept (those of joined peers are never evicted)
_MAX_LOGGED = 4096  # connections remembered as logged (see ControlPlane._first_from)
_TURN_MESSAGES = 64
"""Control messages a receive loop handles before it yields to the event loop: pyzmq's receive
returns a finished future while messages are queued, so a flooding peer (or anyone who can
reach the port, before any hello) held the loop for as long as it sent."""


@dataclass(eq=False)
class ControlConnection:
    """One completed handshake: the peer's description and how to reach it.  Owned by the
    control plane once installed; until then by whoever holds it (install or release it)."""

    info: PeerInfo
    dialled_by: str
    """The peer id of the side that dialled (sent the hello)."""
    ident: bytes | None = None  # ROUTER routing id when the peer dialled us
    dealer: zmq.asyncio.Socket | None = None  # our DEALER when we dialled the peer
    key: str | None = None  # the peer's CURVE public key, when CURVE is on
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class ControlStats:
    """Counters of what the control plane refused."""

    protocol_errors: int = 0
    rejected: int = 0
    lost: int = 0


class ControlPlane:
    """Handshakes and liveness for one agent.  Use ``await start()`` then ``await close()``."""

    def __init__(
        self,
        identity: LocalIdentity,
        config: AgentConfig,
        *,
        accept: AcceptPeer,
        lost: PeerLostCallback,
    ) -> None:
        self.identity = identity
        self.config = config
        self.stats = ControlStats()
        self._accept = accept
        self._lost = lost
        self._ctx = zmq.asyncio.Context()
        self._router: zmq.asyncio.Socket | None = None
        self._gate: CurveGate | None = None
        self._public_key = public_key(config.curve_secret_key) if config.curve_secret_key else None
        self.address = ""
        """``tcp://host:port`` peers connect to (``?key=PUBLIC_KEY`` appended when CURVE is on);
        empty until :meth:`start`."""
        self._peers: dict[str, ControlConnection] = {}  # installed connections
        self._joining: dict[int, ControlConnection] = {}  # dialled, welcomed, not installed or released yet (by id())
        self._by_ident: dict[bytes, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._logged: OrderedDict[bytes, None] = OrderedDict()  # connections whose bad input or refusal was logged
        self._handshakes: dict[bytes, asyncio.Task[None]] = {}  # hellos being handled, by ident
        self._admitting: dict[str, asyncio.Task[None]] = {}  # peer id -> the handshake admitting it
        self._queued: dict[str, asyncio.Task[None]] = {}  # peer id -> one handshake waiting for it
        self._owners: dict[str, str] = {}  # peer id -> the CURVE public key that first used it
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind the ROUTER and start the receive and heartbeat tasks; return the address.
        Raises :class:`ClosedError` once closed."""
        if self._closed:
            raise ClosedError("control plane is closed")
        router = self._socket(zmq.ROUTER)
        if self._public_key is not None:
            self._gate = CurveGate(self._ctx, frozenset(self.config.curve_allowed_keys))
            self._gate.start()
            router.curve_secretkey = self.config.curve_secret_key.encode("ascii")
            router.curve_server = True
        router.bind(f"tcp://{self.config.host}:{self.config.port}")
        self._router = router
        bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.advertise_host:
            bound = f"tcp://{self.config.advertise_host}:{bound.rsplit(':', 1)[1]}"
        self.address = join_address(bound, self._public_key)
        self._spawn(self._router_loop(router), "omni-control-router")
        self._spawn(self._heartbeat_loop(), "omni-control-heartbeat")
        log.info("control plane of %s listening on %s", self.identity.peer_id, self.address)
        return self.address

    @property
    def unauthenticated(self) -> int:
        """Control connections refused by CURVE authentication."""
        return self._gate.refused if self._gate is not None else 0

    @property
    def peers(self) -> dict[str, PeerInfo]:
        """Joined peers by id (a copy)."""
        return {pid: peer.info for pid, peer in self._peers.items()}

    def last_seen(self, peer_id: str) -> float | None:
        """``time.monotonic()`` when the peer was last heard from; None if not joined.  Thread-safe."""
        peer = self._peers.get(peer_id)
        return None if peer is None else peer.last_seen

    async def close(self) -> None:
        """Say goodbye to every peer, stop all tasks and close the sockets.  Idempotent.

        Peers are forgotten without calling ``lost``: the owner is closing and fails its own
        transfers.
        """
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            self.release(peer, "closing")
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._gate is not None:
            await self._gate.close()
        # Closes the ROUTER and any socket left, letting goodbyes leave for up to the linger.
        self._ctx.destroy(linger=_LINGER_MS)

    # -- dialling ----------------------------------------------------------------------------
    async def connect(self, address: str, agent_metadata: bytes) -> ControlConnection:
        """Handshake with the control plane at ``address``; return the connection, not installed.

        The caller owns it: :meth:`install` it, or :meth:`release` it (the far side may have
        admitted it); until then it gets heartbeats (the far side counts our silence from its
        welcome on: the caller may take a while to join, vetting the peer's address).
        Raises :class:`HandshakeTimeout`, the :class:`HandshakeRejected` subtype the peer sent
        (or that this side found), or :class:`ProtocolError` for a garbled answer.
        A failed handshake leaves nothing behind.
        """
        if self._closed:
            raise ClosedError("control plane is closed")
        endpoint, server_key = split_address(address)
        if self._public_key is not None and server_key is None:
            raise HandshakeRejected(f"CURVE is on: {address!r} must end in ?key=<the peer's public key>")
        dealer = self._socket(zmq.DEALER)
        hello_sent = False
        try:
            if self._public_key is not None:
                dealer.curve_secretkey = self.config.curve_secret_key.encode("ascii")
                dealer.curve_publickey = self._public_key.encode("ascii")
                dealer.curve_serverkey = server_key.encode("ascii")  # type: ignore[union-attr]
            dealer.connect(endpoint)
            hello = encode_control(self.identity.hello(agent_metadata))
            hello_sent = True
            try:  # the send too: a DEALER whose connection was refused (CURVE) blocks on send
                reply = await asyncio.wait_for(self._exchange(dealer, hello), self.config.handshake_timeout)
            except TimeoutError:
                raise HandshakeTimeout(
                    f"no answer from {address} within {self.config.handshake_timeout}s"
                ) from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed and (task is None or not task.cancelling()):
                    # Our close destroyed the socket's context, which cancels its pending
                    # receive: nobody cancelled the caller, who must hear why.
                    raise ClosedError("control plane closed during the handshake") from None
                raise
            msg = decode_control(reply)
            if isinstance(msg, Reject):
                hello_sent = False  # refused: the far side keeps nothing
                raise rejection_error(msg)
            if not isinstance(msg, Welcome):
                raise ProtocolError(f"expected a welcome from {address}, got {type(msg).__name__}")
            check_peer(self.identity, msg)
            self._check_owner(msg.peer_id, server_key)
        except BaseException as exc:
            if hello_sent:  # the far side may have admitted us: tell it we gave up
                _send_now(dealer, encode_control(Bye(reason=bounded_reason(f"handshake abandoned: {_describe(exc)}"))))
            dealer.close(linger=_LINGER_MS)
            raise
        log.info("handshake with %s at %s done", msg.peer_id, address)
        conn = ControlConnection(PeerInfo.from_hello(msg), self.identity.peer_id, dealer=dealer, key=server_key)
        self._joining[id(conn)] = conn  # heartbeats until installed or released
        return conn

    def install(self, peer: ControlConnection) -> None:
        """Make ``peer`` the peer's connection: heartbeats, liveness and ``lost`` now watch it.

        A connection installed before for the same peer id is let go without a goodbye and
        without calling ``lost`` (the owner replaced it).  Raises :class:`ClosedError` once closed.
        """
        if self._closed:
            raise ClosedError("control plane is closed")
        peer_id = peer.info.peer_id
        self._joining.pop(id(peer), None)
        self._drop(peer_id)
        self._peers[peer_id] = peer
        peer.last_seen = time.monotonic()
        if peer.ident is not None:
            self._by_ident[peer.ident] = peer_id
        if peer.key is not None:
            self._bind_owner(peer_id, peer.key)
        if peer.dealer is not None:
            peer.tasks.append(self._spawn(self._dealer_loop(peer, peer.dealer), f"omni-control-dealer-{peer_id}"))
            peer.tasks.append(self._spawn(self._monitor_loop(peer, peer.dealer), f"omni-control-monitor-{peer_id}"))
        log.info("joined peer %s (dialled by %s)", peer_id, peer.dialled_by)

    def release(self, peer: ControlConnection, goodbye: str | None = None) -> None:
        """Let ``peer`` go (uninstalling it if installed), saying ``goodbye`` first unless None.

        No await, so it also runs in a cancelled task.  ``lost`` is not called.
        """
        self._joining.pop(id(peer), None)
        if goodbye is not None:
            self._send_nowait(peer, encode_control(Bye(reason=bounded_reason(goodbye))))
        if self._peers.get(peer.info.peer_id) is peer:
            self._drop(peer.info.peer_id)
        elif peer.dealer is not None:
            peer.dealer.close(linger=_LINGER_MS)

    def is_admitting(self, peer_id: str) -> bool:
        """True while an incoming handshake from ``peer_id`` is being admitted."""
        return peer_id in self._admitting

    @staticmethod
    async def _exchange(dealer: zmq.asyncio.Socket, message: bytes) -> bytes:
        await dealer.send(message)
        reply: bytes = await dealer.recv()
        return reply


    # -- tasks ----------------------------------------------------------------------------------
    async def _router_loop(self, router: zmq.asyncio.Socket) -> None:
        handled = 0
        while True:
            handled += 1
            if handled % _TURN_MESSAGES == 0:
                await asyncio.sleep(0)  # a receive that finds a message queued does not yield
            frames = await router.recv_multipart(copy=False)
            ident = frames[0].bytes
            if len(frames) != 2:
                self._bad_input(ident, ProtocolError(f"expected 2 frames, got {len(frames)}"))
                continue
            try:
                msg = decode_control(frames[1].bytes)
            except ProtocolError as exc:
                self._bad_input(ident, exc)
                continue
            # With CURVE on, ZAP (CurveGate) set the connection's User-Id to the client's key.
            user_id = frames[1].get("User-Id") if self._gate is not None else None
            key = user_id if isinstance(user_id, str) else None
            await self._on_router_message(router, ident, msg, key)

    async def _on_router_message(
        self, router: zmq.asyncio.Socket, ident: bytes, msg: ControlMessage, key: str | None = None
    ) -> None:
        peer_id = self._by_ident.get(ident)
        if isinstance(msg, Heartbeat):
            if peer_id is not None:
                self._peers[peer_id].last_seen = time.monotonic()
        elif isinstance(msg, Bye):
            if peer_id is not None:
                self._lose(peer_id, PeerLost(f"peer {peer_id!r} left: {msg.reason}"), orderly=True)
            elif ident in self._handshakes:  # the dialler gave up: roll its handshake back
                self._handshakes[ident].cancel()
        elif isinstance(msg, Welcome | Reject):
            self._bad_input(ident, ProtocolError(f"unexpected {type(msg).__name__} on the listener"))
        elif isinstance(msg, Hello):
            # Admission awaits the owner (address vetting); the loop keeps reading meanwhile.
            # Handshakes in progress count against max_peers, so a flood cannot overshoot it.
            # One more hello for a peer being admitted waits for that handshake (which may be an
            # abandoned one whose Bye is on its way); any further one is refused.
            if ident in self._handshakes:  # its tables are keyed by connection: one at a time
                self._bad_input(ident, ProtocolError("a second hello during this connection's handshake"))
                return
            running = self._admitting.get(msg.peer_id)
            error = hello_refusal(
                msg.peer_id,
                admitting=running is not None,
                queued=msg.peer_id in self._queued,
                joined=msg.peer_id in self._peers,
                in_use=len(self._peers) + len(self._admitting),
                max_peers=self.config.max_peers,
            )
            if error is not None:
                self.stats.rejected += 1
                if self._first_from(ident):
                    log.warning("rejected peer %r: %s", msg.peer_id, error)
                await router.send_multipart([ident, encode_control(reject_for(error))])
                return
            task = self._spawn(
                self._handshake(router, ident, msg, key, running), f"omni-control-handshake-{msg.peer_id}"
            )
            self._handshakes[ident] = task
            (self._admitting if running is None else self._queued)[msg.peer_id] = task
            # Not a ``finally``: a task cancelled before it started never runs its body.
            task.add_done_callback(partial(self._handshake_done, ident, msg.peer_id))

    async def _handshake(
        self, router: zmq.asyncio.Socket, ident: bytes, msg: Hello, key: str | None, after: asyncio.Task[None] | None
    ) -> None:
        """Admit ``msg`` (once the handshake ``after``, for the same peer id, ended) and answer
        it.  Cancelled (the dialler said Bye, or closing) while the owner's ``accept`` runs, the
        owner rolls its half back and nothing is admitted."""
        this = asyncio.current_task()
        if after is not None:
            await asyncio.wait([after])
            if self._queued.get(msg.peer_id) is this:
                del self._queued[msg.peer_id]
            self._admitting[msg.peer_id] = cast("asyncio.Task[None]", this)
        reply = await self._admit(ident, msg, key)
        self._handshake_done(ident, msg.peer_id, this)
        await router.send_multipart([ident, encode_control(reply)])

    def _handshake_done(self, ident: bytes, peer_id: str, task: object) -> None:
        """``task``, the handshake of ``peer_id`` on connection ``ident``, is over: out of the
        tables, where it is itself (its done callback may run after a later hello of the same
        connection took its place there: that one's entries stay, or they would never go)."""
        if self._handshakes.get(ident) is task:
            del self._handshakes[ident]
        for table in (self._admitting, self._queued):
            if table.get(peer_id) is task:
                del table[peer_id]

    async def _admit(self, ident: bytes, msg: Hello, key: str | None) -> Welcome | Reject:
        """Validate ``msg`` completely, then let the owner's ``accept`` decide and install it:
        a known connection of the same peer id is replaced only by a whole handshake."""
        try:
            if ident in self._by_ident:
                raise HandshakeRejected("this connection already completed a handshake")
            check_peer(self.identity, msg)
            self._check_owner(msg.peer_id, key)
            peer = ControlConnection(PeerInfo.from_hello(msg), msg.peer_id, ident=ident, key=key)
            metadata = await self._accept(peer)
        except OmniAsyncError as exc:
            refusal = exc if isinstance(exc, HandshakeRejected) else HandshakeRejected(str(exc))
            self.stats.rejected += 1
            crossed = isinstance(refusal, AlreadyConnected)  # expected when both sides dial
            if crossed or self._first_from(ident):
                log.log(logging.INFO if crossed else logging.WARNING, "rejected peer %r: %s", msg.peer_id, refusal)
            return reject_for(refusal)
        log.info("accepted peer %s", msg.peer_id)
        return self.identity.welcome(metadata)

    def _check_owner(self, peer_id: str, key: str | None) -> None:
        """With CURVE on, a peer id belongs to the public key that first joined with it."""
        owner = self._owners.get(peer_id)
        if key is not None and owner is not None and owner != key:
            raise HandshakeRejected(f"peer id {peer_id!r} belongs to another CURVE key")

    def _bind_owner(self, peer_id: str, key: str) -> None:
        self._owners.pop(peer_id, None)
        self._owners[peer_id] = key
        if len(self._owners) > _MAX_OWNERS:  # forget the oldest binding of a peer that is gone
            stale = next((pid for pid in self._owners if pid not in self._peers), None)
            if stale is not None:
                del self._owners[stale]

    async def _dealer_loop(self, peer: ControlConnection, dealer: zmq.asyncio.Socket) -> None:
        peer_id = peer.info.peer_id
        handled = 0
        while True:
            handled += 1
            if handled % _TURN_MESSAGES == 0:
                await asyncio.sleep(0)  # (as in _router_loop)
            payload = await dealer.recv()
            try:
                msg = decode_control(payload)
            except ProtocolError as exc:
                self._bad_input(peer_id.encode(), exc)
                self._lose(peer_id, exc)
                return
            if isinstance(msg, Heartbeat):
                peer.last_seen = time.monotonic()
            elif isinstance(msg, Bye):
                self._lose(peer_id, PeerLost(f"peer {peer_id!r} left: {msg.reason}"), orderly=True)
                return
            else:
                error = ProtocolError(f"unexpected {type(msg).__name__} from joined peer {peer_id!r}")
                self._bad_input(peer_id.encode(), error)
                self._lose(peer_id, error)
                return

    async def _monitor_loop(self, peer: ControlConnection, dealer: zmq.asyncio.Socket) -> None:
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._lose(peer.info.peer_id, PeerLost(f"control connection to {peer.info.peer_id!r} dropped"))
        finally:
            end_monitor(dealer, monitor)

    async def _heartbeat_loop(self) -> None:
        interval, timeout = self.config.heartbeat_interval, self.config.heartbeat_timeout
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for peer_id, peer in list(self._peers.items()):
                if now - peer.last_seen > timeout:
                    self._lose(peer_id, PeerLost(f"peer {peer_id!r} silent for {timeout}s"))
                else:
                    self._send_nowait(peer, _HEARTBEAT)
            for peer in self._joining.values():  # their liveness starts once installed
                self._send_nowait(peer, _HEARTBEAT)

    # -- peer table ------------------------------------------------------------------------------
    def _lose(self, peer_id: str, error: OmniAsyncError, *, orderly: bool = False) -> None:
        if self._drop(peer_id) is None:
            return
        self.stats.lost += 1
        log.log(logging.INFO if orderly else logging.WARNING, "lost peer %s: %s", peer_id, error)
        self._lost(peer_id, error, orderly)

    def _send_nowait(self, peer: ControlConnection, payload: bytes) -> None:
        """Send without ever blocking: a message a dead or slow peer cannot take is dropped."""
        if peer.dealer is not None:
            sent = _send_now(peer.dealer, payload)
        elif peer.ident is not None and self._router is not None:
            sent = _send_now(self._router, payload, peer.ident)
        else:
            sent = False
        if not sent:  # the peer may be gone already; liveness handles it
            log.debug("message to %s not sent", peer.info.peer_id)

    def _drop(self, peer_id: str) -> ControlConnection | None:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return None
        if peer.ident is not None:
            self._by_ident.pop(peer.ident, None)
        current = asyncio.current_task()
        for task in peer.tasks:
            if task is not current:
                task.cancel()
        if peer.dealer is not None:
            # Its monitor first (see end_monitor): the closed DEALER keeps its connection for
            # the linger, and may still report that it dropped (a goodbye to a dead peer).
            if not peer.dealer.closed:
                peer.dealer.disable_monitor()
            peer.dealer.close(linger=_LINGER_MS)  # cancels its pending receive
        return peer

    def _bad_input(self, source: bytes, error: ProtocolError) -> None:
        self.stats.protocol_errors += 1
        if self._first_from(source):
            log.warning("rejected bad control input from %r: %s", source[:64], error)
        peer_id = self._by_ident.get(source)
        if peer_id is not None:
            self._lose(peer_id, error)

    def _first_from(self, source: bytes) -> bool:
        """Whether nothing of connection ``source`` was logged yet (bad input and refused hellos
        are logged once per connection; the last :data:`_MAX_LOGGED` are remembered: once more
        connections than that misbehaved, each was logged on every message)."""
        if source in self._logged:
            return False
        self._logged[source] = None
        if len(self._logged) > _MAX_LOGGED:
            self._logged.popitem(last=False)
        return True

    # -- helpers ---------------------------------------------------------------------------------
    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        # Dead TCP connections are torn down by the kernel's keepalive, not by ZeroMQ's own
        # heartbeats (HEARTBEAT_IVL/TIMEOUT): their timeout firing on a connection whose input
        # ZeroMQ paused (its queue full: a peer flooding us) aborts the process in libzmq 4.3.5
        # (`Assertion failed: !_io_error`, stream_engine_base.cpp).  Liveness is ours (Heartbeat).
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        idle_s = min(max(1, math.ceil(self.config.heartbeat_timeout)), 32767)  # (Linux takes at most 32767)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        return sock

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("control task %s failed", task.get_name(), exc_info=task.exception())


def end_monitor(sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
    """Stop ``sock`` reporting events to ``monitor`` (unless closed: then it was stopped
    before), then close ``monitor``, in that order.  libzmq reports an event with a blocking
    send from its I/O thread: one reported after the monitor's reading end closed blocks that
    thread for good, and with it every socket of the context (measured: after a peer's kill -9
    its DEALER, lingering to send our goodbye, reported the drop; no handshake of this process
    got through again)."""
    if not sock.closed:
        sock.disable_monitor()
    monitor.close(linger=0)


def _send_now(sock: zmq.asyncio.Socket, payload: bytes, ident: bytes | None = None) -> bool:
    """Send without awaiting (so it also works from a cancelled task); a message the socket
    cannot take now is dropped.  False if it was refused at once.

    Through the asyncio socket, not a shadow: its wrapper must see every operation, or a
    pending receive can miss ZeroMQ's edge-triggered wake-up.
    """
    sending = sock.send(payload, zmq.NOBLOCK) if ident is None else sock.send_multipart([ident, payload], zmq.NOBLOCK)
    sent = cast("asyncio.Future[Any]", sending)  # zmq.asyncio returns a Future, typed as an Awaitable
    sent.add_done_callback(_retrieve)
    return not (sent.done() and _retrieve(sent) is not None)


def _retrieve(future: asyncio.Future[Any]) -> BaseException | None:
    """The future's exception, marked as retrieved (a dropped send is not an error)."""
    return None if future.cancelled() else future.exception()


def _describe(exc: BaseException) -> str:
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else str(exc) or type(exc).__name__


__all__ = ["ControlPlane", "ControlStats", "HandshakeError"]
