"""Handshake rules, free of I/O: what a side says about itself and when two sides may pair.

The control plane sends a :class:`~omni_async.wire.Hello` built by :meth:`LocalIdentity.hello`,
and answers one with :func:`check_peer` (which raises the precise
:class:`~omni_async.errors.HandshakeRejected` subtype) before it admits the peer.

Which of several handshakes of one pair joins it is :func:`admit`'s decision (the agent asks it
for every handshake that completes, dialled or admitted); it is the only place that refuses a
handshake with :class:`~omni_async.errors.AlreadyConnected`.
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from .errors import (
    AlreadyConnected,
    FingerprintMismatch,
    HandshakeRejected,
    LayoutMismatch,
    VersionMismatch,
    error_from_code,
)
from .region import fingerprints_compatible
from .wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_WRITE_BLOCKS,
    PROTOCOL_VERSION,
    Hello,
    Layer,
    RegionShare,
    Reject,
    Welcome,
    bounded_reason,
)

H = TypeVar("H", bound=Hello)


@dataclass(frozen=True, slots=True)
class Description:
    """What a side says about itself in its Hello or Welcome: who it is (``peer_id``, this
    incarnation's ``nonce``, ``host_id``), the layout of its block region (and of the other
    regions of its set, ``layers``), its config ``fingerprint``, and its receive limits (a
    peer's sender keeps every request within them)."""

    peer_id: str
    base_addr: int
    num_blocks: int
    block_len: int
    fingerprint: str
    nonce: int = 0
    host_id: str = ""
    max_write_blocks: int = DEFAULT_MAX_WRITE_BLOCKS
    """Most blocks the side accepts in one write request."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest chunk message the side accepts."""
    region_share: RegionShare | None = None
    """The same-host lane the side offers (None: UCX only)."""
    max_notice_bytes: int = 0
    """Largest notice the side takes on a write (0: none)."""
    allow_reads: bool = False
    """The side lets peers read its region."""
    layers: tuple[Layer, ...] = ()
    """The other regions of a region set (see :class:`~omni_async.wire.Layer`)."""

    @property
    def block_lens(self) -> tuple[int, ...]:
        """Block length of each region of the set, the first one first."""
        return (self.block_len, *(layer.block_len for layer in self.layers))


@dataclass(frozen=True, slots=True)
class LocalIdentity(Description):
    """This side's description; a fresh one draws its incarnation's nonce."""

    def __post_init__(self) -> None:
        if not self.nonce:
            object.__setattr__(self, "nonce", secrets.randbits(63) or 1)
        if not self.host_id:
            object.__setattr__(self, "host_id", machine_id())

    def hello(self, agent_metadata: bytes) -> Hello:
        return self._describe(Hello, agent_metadata)

    def welcome(self, agent_metadata: bytes) -> Welcome:
        return self._describe(Welcome, agent_metadata)

    def _describe(self, kind: type[H], agent_metadata: bytes) -> H:
        said = {name: getattr(self, name) for name in _SAID}
        return kind(version=PROTOCOL_VERSION, agent_metadata=agent_metadata, **said, layers=list(self.layers))


@dataclass(frozen=True, slots=True)
class PeerInfo(Description):
    """What a successful handshake taught us about a peer."""

    agent_metadata: bytes = b""
    """The address of the UCX lane the peer opened for us."""

    def layer(self, index: int) -> PeerInfo:
        """The peer as if region ``index`` of its set were its only one."""
        if index == 0:
            return replace(self, layers=())
        layer = self.layers[index - 1]
        return replace(self, base_addr=layer.base_addr, block_len=layer.block_len,
                       region_share=layer.region_share, layers=())

    @classmethod
    def from_hello(cls, msg: Hello) -> PeerInfo:
        said = {name: getattr(msg, name) for name in _SAID}
        return cls(agent_metadata=msg.agent_metadata, **said, layers=tuple(msg.layers))


_SAID = tuple(name for name in Description.__dataclass_fields__ if name != "layers")
"""What a side says about itself in its Hello or Welcome, besides its lane address and layers."""


def machine_id() -> str:
    """This machine's identity for "same host?" decisions: the kernel boot id (shared by every
    network namespace of one kernel), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def check_peer(local: LocalIdentity, remote: Hello) -> None:
    """Raise the :class:`HandshakeRejected` subtype that forbids pairing, or return."""
    if remote.version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version {remote.version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    if remote.peer_id == local.peer_id:
        raise HandshakeRejected(f"peer id {remote.peer_id!r} is this side's own id")
    if len(remote.layers) != len(local.layers):
        raise LayoutMismatch(
            f"{remote.peer_id!r} has {len(remote.layers) + 1} regions, this side {len(local.layers) + 1}"
        )
    theirs = (remote.block_len, *(layer.block_len for layer in remote.layers))
    ours = local.block_lens
    for index, (their, our) in enumerate(zip(theirs, ours, strict=True)):
        if their != our:
            where = f" of region {index}" if len(ours) > 1 else ""
            raise LayoutMismatch(
                f"block_len {their}{where} of {remote.peer_id!r} differs from this side's {our}"
            )
    if not fingerprints_compatible(local.fingerprint, remote.fingerprint):
        raise FingerprintMismatch(
            f"config fingerprint {remote.fingerprint} of {remote.peer_id!r} differs from "
            f"this side's {local.fingerprint}"
        )


def reject_for(error: HandshakeRejected) -> Reject:
    """The message that tells the peer why it was refused."""
    return Reject(code=error.code, reason=bounded_reason(str(error)))


def rejection_error(msg: Reject) -> HandshakeRejected:
    """The error the connecting side raises for a :class:`Reject` it received."""
    error = error_from_code(msg.code, msg.reason)
    return error if isinstance(error, HandshakeRejected) else HandshakeRejected(msg.reason)


@dataclass(frozen=True, slots=True)
class Connection:
    """What the pair rules know of one handshake (or of the connection it made): the peer's
    incarnation (``nonce``) and which side dialled it (``dialled_by``, a peer id)."""

    nonce: int
    dialled_by: str


Verdict = Literal["join", "restart", "replace"]
"""How a completed handshake joins the pair: ``join`` (no connection yet), ``restart`` (the peer
came back as a new incarnation: the old one is gone), ``replace`` (two handshakes of the same
incarnation crossed and this one wins the tie-break: it takes over the old connection)."""


def keeps_dial_of(local_id: str, remote_id: str) -> str:
    """The simultaneous-dial tie-break: of two connections of one pair, dialled by either
    side, the one dialled by the smaller peer id is kept.  Both sides compute the same."""
    return min(local_id, remote_id)


def admit(local_id: str, current: Connection | None, new: Connection, remote_id: str) -> Verdict:
    """Decide whether the handshake ``new`` with ``remote_id`` may join the pair, given the
    pair's ``current`` connection (None: not joined); raise :class:`AlreadyConnected` if not.

    A new incarnation (another nonce) restarts the pair.  For the same incarnation, a second
    connection dialled by the same side is a repeated connect (refused); one dialled by the
    other side crossed the current one, and the one dialled by :func:`keeps_dial_of` wins.
    """
    if current is None:
        return "join"
    if new.nonce != current.nonce:
        return "restart"
    if new.dialled_by == current.dialled_by:
        raise AlreadyConnected(f"peer {remote_id!r} is already connected")
    if new.dialled_by != keeps_dial_of(local_id, remote_id):
        raise AlreadyConnected(
            f"peer {remote_id!r} is already connected (of two crossing handshakes the one "
            f"dialled by {keeps_dial_of(local_id, remote_id)!r} joins the pair)"
        )
    return "replace"


def hello_refusal(
    peer_id: str, *, admitting: bool, queued: bool, joined: bool, in_use: int, max_peers: int
) -> HandshakeRejected | None:
    """Whether a control plane refuses a hello from ``peer_id`` on arrival, before validating it.

    While a hello of ``peer_id`` is being admitted (``admitting``) one more waits for it (it may
    be a restart, or follow an abandoned handshake whose Bye is on its way); a further one
    (``queued``: one waits already) is refused with :class:`AlreadyConnected`.  A new peer id is
    refused once joined peers plus handshakes being admitted (``in_use``) reach ``max_peers``,
    so a flood cannot overshoot the limit.
    """
    if queued:
        return AlreadyConnected(f"a handshake with {peer_id!r} is in progress")
    if not admitting and not joined and in_use >= max_peers:
        return HandshakeRejected(f"peer limit of {max_peers} reached")
    return None
