"""The agent card: the opaque bytes of ``SyncDataTransport.get_agent_metadata()``.  No I/O.

A card tells a peer how to reach an agent: its control-plane address (with ``?key=`` and the
agent's CURVE public key when CURVE is on), its agent-level peer id and its config fingerprint.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

import msgspec

from ..errors import ProtocolError
from ..wire import MAX_METADATA_BYTES, MAX_PEER_ID, decode_bounded

__all__ = ["AgentCard", "decode_agent_metadata", "encode_agent_metadata"]

_ADDRESS = r"^tcp://[^\s?]+:\d+(\?key=\S{40})?$"
"""``tcp://host:port``, optionally followed by ``?key=`` and a 40-character Z85 public key."""


class _Card(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True, tag="omni-sync/1"):
    address: Annotated[str, msgspec.Meta(pattern=_ADDRESS, max_length=512)]
    peer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PEER_ID)]
    fingerprint: Annotated[str, msgspec.Meta(max_length=64)]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Card)


class AgentCard(NamedTuple):
    """Decoded agent metadata: the control-plane ``address``, the agent's ``peer_id`` and fingerprint."""

    address: str
    peer_id: str
    fingerprint: str


def encode_agent_metadata(card: AgentCard) -> bytes:
    """The bytes a peer decodes with :func:`decode_agent_metadata`.

    Raises :class:`ProtocolError` if the card would not decode (e.g. a malformed address)."""
    blob = _ENCODER.encode(_Card(card.address, card.peer_id, card.fingerprint))
    decode_agent_metadata(blob)
    return blob


def decode_agent_metadata(blob: bytes) -> AgentCard:
    """Decode bytes from ``SyncDataTransport.get_agent_metadata``.

    Raises :class:`ProtocolError` for anything else (wrong type, garbage, foreign format, oversize).
    """
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise ProtocolError(f"agent metadata must be bytes, got {type(blob).__name__}")
    card = decode_bounded(_DECODER, bytes(blob), MAX_METADATA_BYTES, "agent metadata")
    return AgentCard(card.address, card.peer_id, card.fingerprint)
