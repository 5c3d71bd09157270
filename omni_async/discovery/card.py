"""The discovery card: what an agent publishes about itself in etcd.  No I/O.

A card is stored as JSON under ``{prefix}/{group}/{peer_id}`` (readable with ``etcdctl get``)
and tells the group how to reach the agent (its control address, with ``?key=`` under CURVE),
whether it is compatible (fingerprint, block layout) and whom it wants (``role``, ``connect``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ..auth import split_address
from ..config import CONNECT_RULE
from ..errors import ProtocolError
from ..wire import MAX_METADATA_BYTES, MAX_PEER_ID, decode_bounded

__all__ = ["Card", "card_key", "decode_card", "encode_card", "group_prefix", "peer_id_of"]

_ADDRESS = r"^tcp://[^\s?]+:\d+(\?key=\S{40})?$"


class Card(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One agent as the group sees it."""

    peer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PEER_ID, pattern=r"^[^/\s]+$")]
    address: Annotated[str, msgspec.Meta(pattern=_ADDRESS, max_length=512)]
    """Control address to pass to ``Agent.connect`` (ends in ``?key=PUBLIC_KEY`` under CURVE)."""
    fingerprint: Annotated[str, msgspec.Meta(max_length=64)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1)]
    block_len: Annotated[int, msgspec.Meta(ge=1)]
    role: Annotated[str, msgspec.Meta(max_length=64)] = ""
    connect: Annotated[str, msgspec.Meta(pattern=CONNECT_RULE)] = "all"

    @property
    def public_key(self) -> str | None:
        """The CURVE public key in :attr:`address`, or None when the agent runs without CURVE."""
        return split_address(self.address)[1]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Card)


def group_prefix(prefix: str, group: str) -> str:
    """``{prefix}/{group}/``: every card of the group lives under it."""
    return f"{prefix.rstrip('/')}/{group}/"


def card_key(prefix: str, group: str, peer_id: str) -> str:
    return group_prefix(prefix, group) + peer_id


def peer_id_of(key: str, prefix: str, group: str) -> str:
    """The peer id a card key names; raises :class:`ProtocolError` for a key outside the group."""
    head = group_prefix(prefix, group)
    if not key.startswith(head) or "/" in key[len(head) :] or len(key) == len(head):
        raise ProtocolError(f"key {key!r} is not a card of group {head!r}")
    return key[len(head) :]


def encode_card(card: Card) -> bytes:
    """JSON bytes that :func:`decode_card` turns back into ``card``."""
    return _ENCODER.encode(card)


def decode_card(blob: bytes, peer_id: str) -> Card:
    """Decode the value stored under ``peer_id``'s key.

    Raises :class:`ProtocolError` for anything but a valid card naming ``peer_id`` (garbage,
    foreign JSON, oversize, a card stored under another peer's key).
    """
    card = decode_bounded(_DECODER, blob, MAX_METADATA_BYTES, "card")
    if card.peer_id != peer_id:
        raise ProtocolError(f"card under key {peer_id!r} names peer {card.peer_id!r}")
    return card
