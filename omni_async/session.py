"""One :class:`PeerSession` per peer: the single record of where a peer stands, free of I/O.

The :class:`~omni_async.agent.Agent` owns one session per peer id.  It holds the peer's joined
control connection (the control plane and the transport, which keeps the lane, only index what a
session installed) and moves through :data:`Phase`: admitting → joined → leaving → gone, or
straight to gone from admitting (no handshake joined) or joined (the peer restarted, or the
agent closed); a gone session starts over as admitting while a handshake of the peer is in
progress (:data:`NEXT`).

Every move returns a :class:`SessionEvent`, which the agent hands to its session listeners
(and, for joined / gone, to its :class:`~omni_async.agent.PeerEvent` listeners).  Which
handshake joins a pair is decided by :func:`omni_async.handshake.admit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .errors import OmniAsyncError
from .handshake import Connection, PeerInfo

if TYPE_CHECKING:
    from .control import ControlConnection

Phase = Literal["admitting", "joined", "leaving", "gone"]
"""``admitting``: handshakes are in progress, none has joined yet; ``joined``: one connection
and one lane carry the pair; ``leaving``: it is being removed (its lane drains); ``gone``:
forgotten; it starts over (admitting) if a handshake of the peer is in progress (e.g. the peer
restarted), else the agent drops it from its table."""

NEXT: dict[Phase, frozenset[Phase]] = {
    "admitting": frozenset({"joined", "gone"}),
    "joined": frozenset({"leaving", "gone"}),
    "leaving": frozenset({"gone"}),
    "gone": frozenset({"admitting"}),
}
"""The moves a session may make from each phase."""


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """A session moved from ``old`` to ``new``; ``error`` says why it left (gone)."""

    peer_id: str
    old: Phase
    new: Phase
    error: OmniAsyncError | None = None


@dataclass(eq=False)
class PeerSession:
    """Where one peer stands.  ``connection`` is set while joined or leaving (the transport
    keeps the peer's lane)."""

    peer_id: str
    phase: Phase = "admitting"
    info: PeerInfo | None = None
    """What the joining handshake said about the peer."""
    connection: ControlConnection | None = None
    pending: int = field(default=0)
    """Handshakes of this peer in progress (dialled or being admitted)."""

    def move(self, phase: Phase, error: OmniAsyncError | None = None) -> SessionEvent:
        """Go to ``phase``; raise :class:`ValueError` for a move :data:`NEXT` does not allow."""
        if phase not in NEXT[self.phase]:
            raise ValueError(f"session of {self.peer_id!r} cannot go from {self.phase} to {phase}")
        event = SessionEvent(self.peer_id, self.phase, phase, error)
        self.phase = phase
        if phase == "gone":
            self.connection = None
        return event

    def current(self) -> Connection | None:
        """The joined connection as the pair rules see it (None unless joined)."""
        if self.phase != "joined" or self.info is None or self.connection is None:
            return None
        return Connection(self.info.nonce, self.connection.dialled_by)
