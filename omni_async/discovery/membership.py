"""Whom to dial and what changed in the group: pure functions and a diffing set.  No I/O.

Each pair of agents is dialled once.  A side *wants* a peer when its ``connect`` rule selects
the peer's card; when both sides want each other the one with the smaller peer id dials and the
other waits for its handshake; when only one side wants the pair, that side dials.  Dialling
from both sides would be safe too (the agent joins crossing handshakes once, keeping the smaller
id's, :func:`omni_async.handshake.admit`): this rule only saves the second handshake.  Cards
that cannot work (another fingerprint or block size, a CURVE key that is not allow-listed) are
never dialled.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from .card import Card

__all__ = ["Change", "Membership", "incompatibility", "selects", "should_dial"]


def selects(rule: str, card: Card) -> bool:
    """Whether the connect ``rule`` (``all`` | ``none`` | ``role:NAME``) wants ``card``'s agent."""
    if rule == "all":
        return True
    if rule.startswith("role:"):
        return card.role == rule[len("role:") :]
    return False


def should_dial(me: Card, other: Card) -> bool:
    """Whether ``me`` dials ``other`` (False: nobody does, or ``other`` does)."""
    mine, theirs = selects(me.connect, other), selects(other.connect, me)
    if mine and theirs:
        return me.peer_id < other.peer_id
    return mine


def incompatibility(me: Card, other: Card, allowed_keys: Collection[str] | None) -> str | None:
    """Why ``other`` cannot be joined from ``me``, or None if it can.

    ``allowed_keys`` is this side's CURVE allow-list, None when CURVE is off here.
    """
    if other.fingerprint != me.fingerprint:
        return f"config fingerprint {other.fingerprint!r} differs from ours ({me.fingerprint!r})"
    if other.block_len != me.block_len:
        return f"block_len {other.block_len} differs from ours ({me.block_len})"
    key = other.public_key
    if allowed_keys is None:
        return None if key is None else "it runs with CURVE and we do not"
    if key is None:
        return "it runs without CURVE and we require it"
    if key not in allowed_keys:
        return f"its CURVE key {key[:8]}… is not in curve_allowed_keys"
    return None


@dataclass(frozen=True, slots=True)
class Change:
    """A card appeared, was replaced (``changed``: e.g. the agent restarted) or vanished."""

    kind: Literal["added", "changed", "removed"]
    peer_id: str
    card: Card | None = None


class Membership:
    """The cards of the group other than ``own_id``'s, as last seen in etcd."""

    def __init__(self, own_id: str) -> None:
        self.own_id = own_id
        self.cards: dict[str, Card] = {}

    def put(self, card: Card) -> list[Change]:
        """A card was written; returns what changed (nothing if it is ours or the same)."""
        if card.peer_id == self.own_id:
            return []
        old = self.cards.get(card.peer_id)
        self.cards[card.peer_id] = card
        if old is None:
            return [Change("added", card.peer_id, card)]
        return [] if old == card else [Change("changed", card.peer_id, card)]

    def delete(self, peer_id: str) -> list[Change]:
        """A card's key was deleted (or its lease expired)."""
        if self.cards.pop(peer_id, None) is None:
            return []
        return [Change("removed", peer_id)]

    def snapshot(self, cards: Mapping[str, Card]) -> list[Change]:
        """Replace everything with a fresh listing; returns the difference."""
        changes = [change for peer_id in list(self.cards) if peer_id not in cards for change in self.delete(peer_id)]
        for card in cards.values():
            changes += self.put(card)
        return changes
