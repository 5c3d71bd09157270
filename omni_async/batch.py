"""Batches of payloads: several keyed payloads as one chunk message.  No I/O.

A connector sends the payloads queued behind its caller's window together, as many to a
message as the transport carries whole to that peer (``Agent.batch_bytes``): one transfer, one
ring record or UCX message and one acknowledgement for all, so that per payload only its codec
work remains.  The message's key is :data:`BATCH_KEY` (no caller's key may start with
:data:`RESERVED`); its meta is the list of items, each ``[key, header, frames]`` (the
payload's :mod:`~omni_async.serde` header and how many of the message's frames are its own, in
order); its frames are the items' frames, one item's after the other's.

Whole or not at all: the receiver takes a batch only if it takes every item at once (each
acknowledged, none held back, none refused); otherwise it takes none and answers
:class:`~omni_async.errors.BatchRefused`, and the sender sends each item alone, so each gets
its own outcome as if it had never been batched.  :func:`plan` says which payloads go
together, :func:`encode` and :func:`decode` make and check the meta.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final

import msgspec

from .errors import ProtocolError
from .wire import MAX_FRAMES, MAX_KEY, MAX_META_BYTES

RESERVED: Final = "\x00"
"""Keys starting with this are the connector's own; a caller's ``put`` refuses them."""
BATCH_KEY: Final = "\x00batch"
"""The key of a batch message."""
MAX_ITEMS: Final = 32
"""Most payloads in one batch."""
MAX_META: Final = MAX_META_BYTES // 2
"""Meta bytes (keys and headers) a batch's items may hold together: its meta stays well within
the wire's ``MAX_META_BYTES``."""


class Item(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True, gc=False):
    """One payload of a batch: its key, its codec header and its number of frames."""

    key: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY)]
    header: bytes
    frames: Annotated[int, msgspec.Meta(ge=0, le=MAX_FRAMES)]


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(Annotated[list[Item], msgspec.Meta(min_length=2, max_length=MAX_ITEMS)])


def plan(sizes: Sequence[tuple[int, int, int]], max_bytes: int) -> list[int]:
    """Where to cut payloads, in order, into batches: ``sizes`` holds each payload's ``(frame
    bytes, meta bytes, frames)`` (its meta: its key and header); returns the index at which
    each group after the first starts.  A group holds at most :data:`MAX_ITEMS` payloads,
    ``max_bytes`` bytes (frames and meta: what the transport carries whole to that peer),
    :data:`MAX_META` meta bytes and the wire's ``MAX_FRAMES`` frames, unless a single payload
    exceeds them (it goes alone)."""
    cuts: list[int] = []
    count = nbytes = meta = frames = 0
    for index, (frame_bytes, meta_bytes, frame_count) in enumerate(sizes):
        if count and (
            count == MAX_ITEMS
            or nbytes + frame_bytes + meta_bytes > max_bytes
            or meta + meta_bytes > MAX_META
            or frames + frame_count > MAX_FRAMES
        ):
            cuts.append(index)
            count = nbytes = meta = frames = 0
        count += 1
        nbytes += frame_bytes + meta_bytes
        meta += meta_bytes
        frames += frame_count
    return cuts


def encode(items: Sequence[Item]) -> bytes:
    """The meta of a batch of two or more items."""
    return _encoder.encode(items)


def decode(meta: bytes, frames: int) -> list[Item]:
    """Check and decode a batch's meta, whose message carried ``frames`` frames.  Raises
    :class:`ProtocolError` for anything malformed: not a list of 2 to :data:`MAX_ITEMS` items,
    a key the connector reserves, a key twice, frame counts that do not add up."""
    try:
        items = _decoder.decode(meta)
    except Exception as exc:  # a trust boundary: every decoder failure is a ProtocolError
        raise ProtocolError(f"invalid batch: {exc}") from None
    named = sum(item.frames for item in items)
    if named != frames:
        raise ProtocolError(f"a batch's items name {named} frames, {frames} arrived")
    keys = {item.key for item in items}
    if len(keys) != len(items):
        raise ProtocolError("a batch names a key twice")
    if any(key.startswith(RESERVED) for key in keys):
        raise ProtocolError("a batch holds a key the connector reserves")
    return items


__all__ = ["BATCH_KEY", "MAX_ITEMS", "MAX_META", "RESERVED", "Item", "decode", "encode", "plan"]
