"""Chunk messages, both directions: a message (opaque meta and frames) put whole into a
same-host peer's ring (a large one's frames copied straight into the peer's shared pool, its
header into the ring), waiting in order for room in it, or sent over the lane, whole as one
UCX message when small, else as a header and one payload; received ones handed out where they
lie (pooled), copied out of the ring record or whole lane message (into the receive pool when
large) or received into fresh arrays, handed to the sink and acknowledged (ring ones in
batches).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import (
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferCancelled,
    TransferFailed,
)
from ..wire import (
    HEADER_TAG,
    MAX_HEADER_BYTES,
    MessageHeader,
    data_tag,
    encode_header,
    validate_message,
)
from .core import ACK_BATCH, TransportCore, carry_out
from .limits import check_message
from .link import Frames, Message, PeerLink
from .pool import PoolWriter, ReceivePool, frame_slots
from .ring import RingError
from .samehost import KIND_MESSAGE, KIND_POOLED
from .transfer import Transfer

log = logging.getLogger(__name__)

_U8 = np.dtype(np.uint8)
POOL_MIN = 64 * 1024
"""Ring messages with at least this many frame bytes go through a pool: copied by the sender
into the receiver's shared pool when it has room, else copied out of the ring into the receive
pool (below it a fresh array costs less than the pool's bookkeeping)."""
WHOLE_MAX = MAX_HEADER_BYTES
"""Lane messages whose encoded header and frames together fit in this go as one UCX message on
the header tag (the receiver copies the frames out, as from a ring record); larger ones as a
header and a payload message received straight into the frames (one UCX send and receive more
each, ~10 µs each over tcp)."""
BATCH_RING_BYTES = 1 << 20
"""Bytes a batch of payloads (:mod:`omni_async.batch`) to a peer with a ring may hold: one ring
record, through the shared pool (measured: chunk_8k 32k chunks/s with 64 KiB batches, 45-60k
with 256 KiB; 256.5 KiB chunks three to a batch at 1 MiB: 10 % less of the sender's CPU per
chunk than one each; docs/tuning.md)."""
BATCH_LANE_BYTES = WHOLE_MAX - 1024
"""Bytes a batch to a peer over UCX may hold: it goes eagerly, as one message (or, if its
header is long, as a header and an eager payload), never by rendezvous: a larger one went as a
header and a rendezvous payload of many frames, after which 256 KiB messages over tcp ran a
third slower (docs/tuning.md)."""
RECEIVE_POOL_BYTES = 64 << 20
"""Size of the receive pool (one per transport, made when first needed)."""


class Messages(TransportCore):
    """The chunk-message methods of :class:`~.ucx.UcxTransport`."""

    def send_message(self, peer_id: str, key: str, meta: bytes, frames: Sequence[Any]) -> Transfer:
        """Send a chunk message: opaque ``meta`` plus frames (C-contiguous buffers).

        The frames are borrowed, not copied: keep them unchanged until the transfer settles.
        Raises at once, before anything is sent: :class:`TypeError` (a key that is not a str,
        meta that is not bytes, a frame without the buffer protocol), :class:`InvalidMessage`
        (over a wire limit or the receiver's ``max_message_bytes``), :class:`UnknownPeer`,
        :class:`ClosedError`.
        """
        self._check_open()
        link = self._link(peer_id)
        views = [_byte_view(frame) for frame in frames]
        sizes = [int(view.nbytes) for view in views]
        check_message(key, meta, sizes, link.peer.max_message_bytes)
        transfer = self._new_transfer(link, sum(sizes), "messages")
        payload = [view for view in views if view.nbytes]
        post = partial(self._post_message, link, transfer.id, key, meta, sizes, payload)
        # Abortable: given up once sent, the receiver lets it go if its sink still holds it.
        carry_out(link.outbox.submit(transfer.id, [(1 if payload else 0, transfer.nbytes, post)], abortable=True))
        return transfer

    def batch_bytes(self, peer_id: str) -> int:
        """The most bytes (frames and meta) one message of a batch of payloads to the peer may
        hold, so that it travels whole (see :data:`BATCH_RING_BYTES`, :data:`BATCH_LANE_BYTES`)
        and within the peer's ``max_message_bytes``.  Raises :class:`UnknownPeer`."""
        link = self._link(peer_id)
        whole = BATCH_RING_BYTES if link.ring_out is not None else BATCH_LANE_BYTES
        return min(whole, link.peer.max_message_bytes)

    def _post_message(
        self, link: PeerLink, transfer_id: int, key: str, meta: bytes, sizes: list[int], payload: Frames
    ) -> None:
        message = (transfer_id, key, meta, sizes, payload)
        if link.ring_out is not None and not link.parked:
            outcome = self._ring_message(link, message)
            if outcome == "sent":
                return
            if outcome == "full" and self._may_park(link, 1):
                link.parked.append(message)
                return
        elif link.parked and (link.unparking or self._may_park(link, len(link.parked) + 1)):
            # Behind the messages waiting for room in the ring; always while they are being
            # posted (a done-callback run by a settle inside that posting sends this): the
            # posting under way takes it in turn.
            link.parked.append(message)
            return
        self._lane_message(link, message)

    def _lane_message(self, link: PeerLink, message: Message) -> None:
        transfer_id, key, meta, sizes, payload = message
        seq = link.outbox.take_seq(0)  # the next one: taken below if a payload message follows
        data = encode_header(MessageHeader(transfer_id, seq, key, meta, sizes))
        on_sent = partial(self._sent, link, transfer_id)
        if not payload or len(data) + sum(sizes) <= WHOLE_MAX:
            link.lane.send_many([np.frombuffer(data, np.uint8), *payload], HEADER_TAG, on_sent)  # whole
            return
        link.outbox.take_seq(1)
        link.lane.send(data, HEADER_TAG, on_sent)
        link.lane.send_many(payload, data_tag(seq), on_sent)  # all frames in one message

    @staticmethod
    def _may_park(link: PeerLink, waiting: int) -> bool:
        """A message may wait for room in the ring only while some other transfer awaits an
        answer: the answers free room (and run :meth:`_unpark`), so a wait always ends."""
        return len(link.sent) > waiting

    def _unpark(self, link: PeerLink) -> None:
        """Post the messages waiting for room in the ring, in order, as far as it has room;
        through the lane once nothing else is awaited (or the ring is gone).  Not re-entered: a
        put that finds the ring closed drops it, which settles the writes the peer consumed,
        and their settling unparks; the call under way goes on with the rest, in order (a
        nested call sent them all over the lane, the one just put into the ring too, and the
        outer call then failed on the emptied queue, leaving the write being settled unsettled)."""
        if link.unparking:
            return
        link.unparking = True
        try:
            self._post_parked(link)
        finally:
            link.unparking = False

    def _post_parked(self, link: PeerLink) -> None:
        parked = link.parked
        while parked:
            message = parked[0]
            transfer_id = message[0]
            if transfer_id not in link.sent:  # settled while it waited: never sent, so no Ack
                parked.popleft()  # will free its window share: release it here
                carry_out(link.outbox.withdraw(transfer_id))
                continue
            outcome = self._ring_message(link, message) if link.ring_out is not None else "lane"
            if outcome == "full" and self._may_park(link, len(parked)):
                return
            if self._links.get(link.peer.peer_id) is not link:
                return  # the peer was dropped (its removal failed what was parked)
            parked.popleft()
            if outcome != "sent":
                self._lane_message(link, message)

    def _ring_message(self, link: PeerLink, message: Message) -> str:
        """Put a chunk message (header and frames, one record) into the peer's ring.  Returns
        ``"sent"`` (or failed: the peer broke the ring and is dropped), ``"full"`` (no room
        now) or ``"lane"`` (too large, or the ring is gone: send it over UCX)."""
        ring = link.ring_out
        transfer_id, key, meta, sizes, payload = message
        if ring is None:
            return "lane"
        data = encode_header(MessageHeader(transfer_id, link.outbox.take_seq(0), key, meta, sizes))
        nbytes = sum(sizes)
        try:
            if nbytes >= POOL_MIN and ring.pool is not None and self._pooled(link, ring.pool, data, sizes, payload):
                sent = True
            elif link.ring_out is not ring or len(data) + nbytes > ring.max_payload:
                return "lane"
            else:
                sent = self._ring_put(link, KIND_MESSAGE, [data, *payload])  # flat uint8 frames: no memoryview each
        except RingError as exc:
            self._drop(link, exc)  # first: its removal fails what it was sent (this one too, if it was current)
            self._settle(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} broke the ring: {exc}"))
            return "sent"
        if link.ring_out is not ring:  # the put found the ring closed and dropped it
            return "sent" if sent else "lane"  # (one put before: its answer comes with the peer's removal)
        return "sent" if sent else "full"

    def _pooled(self, link: PeerLink, pool: PoolWriter, data: bytes, sizes: list[int], payload: Frames) -> bool:
        """Copy the frames into the peer's shared pool and put the header into its ring; False
        (nothing announced) if either has no room now.  Raises :class:`RingError`."""
        slots, total = frame_slots(sizes)
        start = pool.reserve(total)
        if start is None:
            return False
        pool.write(start, payload, sizes, slots)
        if not self._ring_put(link, KIND_POOLED, (data,)):
            return False  # the piece stays free: the next reserve hands out the same one
        pool.commit()
        return True

    def _on_message(self, link: PeerLink, hdr: MessageHeader) -> None:
        try:
            nbytes = validate_message(hdr, self.config.max_message_bytes)
        except ProtocolError as exc:
            self._drop(link, exc)
            return
        if not self._admit(link, hdr.seq, 1 if nbytes else 0, nbytes):
            return
        frames = [np.empty(size, np.uint8) for size in hdr.frames]
        receiving = [frame for frame in frames if frame.nbytes]
        deliver = partial(self._deliver, link, hdr, frames, nbytes)
        if receiving:
            link.arriving[hdr.transfer_id] = False  # (an Abort before its payload marks it)
            self._expect(link, hdr.seq, receiving, deliver)  # one message scattered over the frames
        else:
            deliver(None)

    def _on_whole_message(
        self, link: PeerLink, hdr: MessageHeader, record: memoryview, offset: int, *, pooled: bool = False,
        batched: bool = True,
    ) -> None:
        """A chunk message whose header came with its frames, in a ring record (``batched``:
        acknowledged with its ring batch) or one lane message: its frames follow its header
        from ``offset`` on (copy them out: the record is valid only during this call), or lie
        in our shared pool (``pooled``: the pool's next piece, handed out as it is).  Deliver.
        Raises ProtocolError.

        Every message's frames lie in one piece of memory, each in its own 64-byte aligned
        slice (a sink that keeps one frame keeps the message's bytes alive): the pooled piece;
        else, for messages of ``POOL_MIN`` bytes or more, one from the receive pool (memory
        that stays mapped, reused once the frames are dropped), else a fresh array."""
        nbytes = validate_message(hdr, self.config.max_message_bytes)
        expected = offset + (0 if pooled else nbytes)
        if expected != len(record):
            raise ProtocolError(f"message of {len(record)} bytes with its header, which announced {expected}")
        link.inbox.admit(hdr.seq, 0, nbytes)
        starts, total = frame_slots(hdr.frames)
        if pooled:
            pool = link.ring_in.pool if link.ring_in is not None else None
            if pool is None or not nbytes:
                raise ProtocolError("a pooled message without a shared pool, or without frames")
            piece = pool.place(total)
            self._deliver(link, hdr, [piece[at : at + size] for at, size in zip(starts, hdr.frames, strict=True)],
                          nbytes, None, ring=batched)
            return
        body = None
        if nbytes >= POOL_MIN:
            if self._pool is None:
                self._pool = ReceivePool(RECEIVE_POOL_BYTES)
            body = self._pool.take(total)
        if body is None:
            body = np.empty(total, np.uint8)
        out, sizes = body.data, hdr.frames
        if starts and starts[-1] + sizes[-1] == nbytes:  # every frame but the last fills its slots: no gap
            out[:nbytes] = record[offset:]  # one copy for all
        else:
            for at, size in zip(starts, sizes, strict=True):
                out[at : at + size] = record[offset : offset + size]
                offset += size
        frames = [body[at : at + size] for at, size in zip(starts, sizes, strict=True)]
        self._deliver(link, hdr, frames, nbytes, None, ring=batched)

    def _deliver(
        self, link: PeerLink, hdr: MessageHeader, frames: Frames, nbytes: int, error: BaseException | None,
        *, ring: bool = False,
    ) -> None:
        """Hand a received message to the sink and answer it: when the sink returns (from a
        ring batch, ``ring``: with the batch's other acknowledgements, see :meth:`_flush_acks`),
        or when the awaitable it returned completes."""
        link.inbox.received(nbytes)  # received (or failed): the sink owns the frames now
        transfer_id = hdr.transfer_id
        if link.arriving.pop(transfer_id, False):  # its sender gave it up before it arrived
            error = TransferCancelled("the sender gave the message up")
        if error is not None or self._links.get(link.peer.peer_id) is not link:
            self._answer(link, transfer_id, "messages", nbytes, error)  # a leaving or removed peer's: not acknowledged
            return
        sink = self.message_sink
        if sink is None:
            self._answer(link, transfer_id, "messages", nbytes, TransferFailed("the receiver takes no messages"))
            return
        self._handoffs.handed()  # (what the sink wakes runs on the coming loop turns)
        try:
            pending = sink(link.peer.peer_id, hdr.key, hdr.meta, frames)
        except OmniAsyncError as exc:
            self._answer(link, transfer_id, "messages", nbytes, exc)
            return
        except Exception as exc:  # a sink bug (or its decoder's) fails this message, not the lane
            log.error("message sink failed on %r from %s", hdr.key, link.peer.peer_id, exc_info=exc)
            self._answer(link, transfer_id, "messages", nbytes, TransferFailed(f"the receiver failed: {exc!r}"))
            return
        if pending is not None and inspect.isawaitable(pending):
            answer = partial(self._answer, link, transfer_id, "messages", nbytes)
            sink_task = self.sink_tasks.start(pending, f"omni-message-sink-{link.peer.peer_id}")
            link.sinking[transfer_id] = (hdr.key, sink_task)
            sink_task.add_done_callback(partial(self._sink_done, link, transfer_id, answer))
        elif ring:
            self.metrics.answered("messages", nbytes, "ok", link.peer.peer_id)
            link.acks.append(transfer_id)
            if len(link.acks) >= ACK_BATCH:
                self._flush_acks(link)
        else:
            self._answer(link, transfer_id, "messages", nbytes, None)

    def _retract_message(self, link: PeerLink, transfer_id: int) -> None:
        """The sender gave message ``transfer_id`` up (its ``Abort``), so it is not delivered
        after its sender was told it failed: one whose payload has not arrived is answered as
        cancelled when it does; if the sink's awaitable for one delivered is still pending (e.g.
        the connector holds its acknowledgement back while its buffer is full),
        :attr:`message_retract` is told."""
        if transfer_id in link.arriving:  # (one that came through the ring was taken before: see _follows_ring)
            link.arriving[transfer_id] = True
            return
        sinking = link.sinking.get(transfer_id)
        retract = self.message_retract
        if sinking is None or retract is None:
            return
        key, pending = sinking
        try:
            retract(link.peer.peer_id, key, pending)
        except Exception:  # the application's callback fails only itself
            log.exception("message retract callback failed on %r from %s", key, link.peer.peer_id)

    @staticmethod
    def _sink_done(
        link: PeerLink, transfer_id: int, answer: Callable[[BaseException | None], None], task: asyncio.Future[None]
    ) -> None:
        link.sinking.pop(transfer_id, None)
        if task.cancelled():
            answer(TransferFailed("the receiver cancelled the message"))
            return
        error = task.exception()
        if error is not None and not isinstance(error, OmniAsyncError):
            log.error("message sink failed", exc_info=error)
            error = TransferFailed(f"the receiver failed: {error!r}")
        answer(error)


def _byte_view(buffer: Any) -> npt.NDArray[np.uint8]:
    """A flat uint8 view of a C-contiguous buffer, without copying."""
    if type(buffer) is np.ndarray and buffer.dtype == _U8 and buffer.ndim == 1 and buffer.flags.c_contiguous:
        return buffer  # already one (what serde.encode makes of an array)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(f"a frame must support the buffer protocol, got {type(buffer).__name__}") from None
    if not view.c_contiguous:
        raise TypeError("a frame must be C-contiguous")
    return np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8)
