"""What a sender may put on the wire, given the receiver's limits.  No I/O.

The receiver refuses a header over a wire limit as a protocol violation (and drops the peer),
so a legitimate call must never produce one: block writes too large for one request are split
into several that settle as one transfer (:func:`split_runs`); a chunk message that cannot be
carried fails locally before anything is sent (:func:`check_message`).

The receiver also bounds what it holds per peer (payload messages pending, bytes of chunk
buffers allocated for payloads not received yet) and drops a peer that exceeds it; the
sender's :class:`Window` keeps its unacknowledged requests within the same bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidBlocks, InvalidMessage, InvalidNotice
from ..region import Run
from ..wire import (
    MAX_FRAMES,
    MAX_KEY,
    MAX_META_BYTES,
    MAX_NOTICE_RUNS,
    MAX_PENDING_PAYLOADS,
    MIN_RECEIVE_BUDGET,
    RUNS_PER_REQUEST,
)


def receive_budget(max_message_bytes: int) -> int:
    """Bytes of chunk-message buffers a receiver with this ``max_message_bytes`` allocates per
    peer for payloads announced and not received yet (a sender computes it from the Hello)."""
    return max(max_message_bytes, MIN_RECEIVE_BUDGET)


class Window:
    """The sender's account of what the receiver holds for it: payload messages and chunk
    bytes of requests sent and not acknowledged.  A request is sent only if it
    :meth:`fits`; each request on its own always fits an empty window (its payload messages
    are at most ``RUNS_PER_REQUEST``, its bytes at most ``max_message_bytes``)."""

    __slots__ = ("_shares", "max_bytes", "max_messages", "messages", "nbytes")

    def __init__(self, max_message_bytes: int, max_messages: int = MAX_PENDING_PAYLOADS) -> None:
        self.max_messages = max_messages
        self.max_bytes = receive_budget(max_message_bytes)
        self.messages = 0
        self.nbytes = 0
        self._shares: dict[int, list[tuple[int, int]]] = {}

    def fits(self, messages: int, nbytes: int) -> bool:
        return self.messages + messages <= self.max_messages and self.nbytes + nbytes <= self.max_bytes

    def take(self, transfer_id: int, messages: int, nbytes: int) -> None:
        """Account a request of ``transfer_id`` just sent."""
        self.messages += messages
        self.nbytes += nbytes
        self._shares.setdefault(transfer_id, []).append((messages, nbytes))

    def release(self, transfer_id: int) -> None:
        """An acknowledgement for ``transfer_id`` arrived: release one of its requests (the
        smallest: the answers of a split write may come in any order, and releasing too little
        is safe; the last answer releases the rest).  Unknown ids are ignored."""
        shares = self._shares.get(transfer_id)
        if not shares:
            return
        smallest = min(shares)
        shares.remove(smallest)
        if not shares:
            del self._shares[transfer_id]
        self.messages -= smallest[0]
        self.nbytes -= smallest[1]


def split_runs(
    runs: Sequence[Run], max_blocks: int, max_runs: int = RUNS_PER_REQUEST, blocks: int | None = None
) -> list[list[Run]]:
    """Split ``runs`` (in order) into requests of at most ``max_runs`` runs and ``max_blocks``
    blocks each; a run longer than ``max_blocks`` is cut at block boundaries.  Every block of
    ``runs`` is in exactly one request, in the same order.  ``blocks``: the runs' total length,
    if the caller knows it (else it is summed)."""
    if max_blocks < 1 or max_runs < 1:
        raise ValueError(f"limits must be positive, got max_blocks={max_blocks} max_runs={max_runs}")
    if blocks is None:
        blocks = sum(run[2] for run in runs)
    if len(runs) <= max_runs and blocks <= max_blocks:
        return [list(runs)] if runs else []  # the common case: one request, no run cut
    requests: list[list[Run]] = []
    batch: list[Run] = []
    blocks = 0
    for run in runs:
        local, remote, length = run
        while length:
            if len(batch) == max_runs or blocks == max_blocks:
                requests.append(batch)
                batch, blocks = [], 0
            take = min(length, max_blocks - blocks)
            batch.append((local, remote, take))
            blocks += take
            local, remote, length = local + take, remote + take, length - take
    if batch:
        requests.append(batch)
    return requests


def check_notice_runs(runs: Sequence[Run], blocks: int, max_blocks: int) -> None:
    """Raise :class:`~omni_async.errors.InvalidBlocks` unless a write with a notice of ``runs``
    (``blocks`` in all) has at most :data:`~omni_async.wire.MAX_NOTICE_RUNS` runs once
    :func:`split_runs` splits it for a receiver of ``max_blocks`` (a run is cut only where a
    request reached ``max_blocks`` blocks: at most ``blocks // max_blocks`` cuts)."""
    most = len(runs) + blocks // max_blocks
    if most > MAX_NOTICE_RUNS:
        raise InvalidBlocks(f"a write with a notice of {most} runs exceeds {MAX_NOTICE_RUNS}")


def check_key(key: Any) -> None:
    """Raise unless ``key`` can name a chunk message: :class:`TypeError` if it is not a
    ``str``; :class:`~omni_async.errors.InvalidMessage` if it is over :data:`MAX_KEY`
    characters or has no UTF-8 form (a lone surrogate), which the wire could not carry."""
    if not isinstance(key, str):
        raise TypeError(f"a message key must be a str, got {type(key).__name__}")
    if len(key) > MAX_KEY:
        raise InvalidMessage(f"message key of {len(key)} characters exceeds {MAX_KEY}")
    if not key.isascii():
        try:
            key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidMessage(f"message key {key!r} has no UTF-8 form: {exc.reason}") from None


def check_message(key: Any, meta: Any, sizes: Sequence[int], max_bytes: int) -> None:
    """Raise unless a chunk message fits the wire and the receiver's ``max_bytes``.

    :class:`TypeError` for a key that is not a ``str`` or meta that is not bytes-like;
    :class:`~omni_async.errors.InvalidMessage` for one over a limit.
    """
    check_key(key)
    if not isinstance(meta, bytes | bytearray | memoryview):
        raise TypeError(f"message meta must be bytes, got {type(meta).__name__}")
    if memoryview(meta).nbytes > MAX_META_BYTES:
        raise InvalidMessage(f"message meta of {memoryview(meta).nbytes} bytes exceeds {MAX_META_BYTES}")
    if len(sizes) > MAX_FRAMES:
        raise InvalidMessage(f"message of {len(sizes)} frames exceeds {MAX_FRAMES}")
    total = sum(sizes)
    if total > max_bytes:
        raise InvalidMessage(f"message of {total} bytes exceeds the receiver's limit of {max_bytes}")


def check_notice(notice: Any, max_bytes: int) -> bytes:
    """The notice of a write as bytes, or raise: :class:`TypeError` if it is not bytes-like,
    :class:`~omni_async.errors.InvalidNotice` if it exceeds the receiver's ``max_bytes``
    (0: the receiver takes no notices)."""
    if not isinstance(notice, bytes | bytearray | memoryview):
        raise TypeError(f"a notice must be bytes, got {type(notice).__name__}")
    data = bytes(notice)
    if not max_bytes:
        raise InvalidNotice("the receiver takes no notices (its max_notice_bytes is 0)")
    if len(data) > max_bytes:
        raise InvalidNotice(f"notice of {len(data)} bytes exceeds the receiver's limit of {max_bytes}")
    return data
