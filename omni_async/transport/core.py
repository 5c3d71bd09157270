"""The transport's core: its transfers in flight (deadlines, settling, cancelling) and what
arrives on a lane or a ring (headers dispatched by type, payloads matched to their headers,
acknowledgements, sent back in batches from a ring).

:class:`TransportCore` holds all of the transport's state; the peers (:mod:`.peers`), block
writes (:mod:`.block_writes`), incoming writes (:mod:`.incoming_writes`) and chunk messages
(:mod:`.messages`) extend it, and :class:`~.ucx.UcxTransport` puts them together.  The
methods it leaves abstract are the ones the core calls into those parts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from ..config import AgentConfig
from ..errors import (
    ClosedError,
    DeadlineExceeded,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferCancelled,
    UnknownPeer,
    error_from_code,
)
from ..handshake import PeerInfo
from ..metrics import Kind, Metrics
from ..region import BlockRegion, RegionSet, as_region_set
from ..wire import (
    DATA_KIND,
    HEADER_TAG,
    KIND_MASK,
    MAX_HEADER_BYTES,
    SEQ_MASK,
    Abort,
    Ack,
    Acks,
    Commit,
    DataHeader,
    Goodbye,
    MessageHeader,
    WriteRequest,
    bounded_reason,
    decode_framed,
    decode_record,
    encode_header,
    encode_record,
    with_length,
)
from .lane import Completion, Lane, new_context
from .link import MessageRetract, MessageSink, PeerLink
from .notices import NoticeQueue, sink_error
from .pool import ReceivePool
from .protocol import GiveUp
from .ring import Part, RingError
from .rma import Registration
from .samehost import KIND_HEADER, KIND_MESSAGE, KIND_POOLED, RingSender
from .sink_tasks import SinkTasks
from .transfer import CancelMode, Transfer
from .turns import Handoffs, TurnBudget
from .vetting import shared_vetter

log = logging.getLogger(__name__)

ACK_BATCH = 16
"""Most acknowledgements held back while a ring batch is being taken: enough to spare most
records and wake-up checks, few enough that the sender's window keeps moving."""
RECEIVING: Final = object()
"""The outcome of a header in :attr:`PeerLink.headers` whose receive has not completed yet."""
FaultCallback = Callable[[str, OmniAsyncError], None]
"""``fault(peer_id, error)``: the transport dropped a peer on its own (protocol violation, a
broken lane, or the peer's Goodbye); the owner forgets it too."""


class TransportCore(ABC):
    """The transport's state and the methods every part of it uses (see the module doc); the
    transport itself is :class:`~.ucx.UcxTransport`.  All methods run on the agent's event loop."""

    _HANDLERS: ClassVar[dict[type[DataHeader], Callable[..., None]]]
    """Each data header's handler ``(self, link, header)``: every type of ``DataHeader``."""
    _RING_HANDLERS: ClassVar[dict[type[DataHeader], Callable[..., None]]]
    """The handlers of the headers a peer may put into its ring as ``KIND_HEADER`` records."""

    def __init__(
        self,
        region: BlockRegion | RegionSet,
        config: AgentConfig,
        fault: FaultCallback,
        metrics: Metrics,
        host_id: str = "",
        *,
        peer_id: str,
    ) -> None:
        self.regions = as_region_set(region)
        self.region = self.regions.regions[0]
        self.num_blocks = self.regions.num_blocks
        """Blocks of our region (of each region of the set): fixed for the transport's life."""
        self._arrays = self.regions.arrays
        self.host_id = host_id
        self.peer_id = peer_id
        """This agent's peer id (what peers on this host name the proofs they make for us)."""
        self.config = config
        self.metrics = metrics
        self.message_sink: MessageSink | None = None
        self.message_retract: MessageRetract | None = None
        self.sink_tasks = SinkTasks()
        """The tasks of async notice and message sinks (ended by :meth:`close`)."""
        self._handoffs = Handoffs()
        """Work handed to the application lately (a spin would hold it back: see :class:`~.turns.Handoffs`)."""
        self.notices = NoticeQueue(config.notice_queue, self.sink_tasks, self._handoffs.handed)
        """Notices of incoming writes, for the application (see :mod:`.notices`)."""
        self._fault = fault
        self._loop = asyncio.get_running_loop()
        self._turn_budget = TurnBudget(self._loop)
        self._context = new_context(config.ucx_tls, config.ucx_net_devices)
        self._links: dict[str, PeerLink] = {}
        self._ids = itertools.count(1)
        self._vetter = shared_vetter(config.ucx_tls, config.ucx_net_devices)
        self._closing: set[Lane] = set()
        self._drains: set[asyncio.Task[None]] = set()
        self._closed = False
        self._pool: ReceivePool | None = None
        self._registration: Registration | None = None  # our regions mapped for puts, once offered
        self._keyings: set[asyncio.Task[None]] = set()  # cancelled key vettings of removed peers

    @property
    def receive_pool(self) -> ReceivePool | None:
        """Where large chunk messages from same-host rings are copied (see :mod:`.pool`);
        None until the first one came."""
        return self._pool

    def _ring_record(self, link: PeerLink, kind: int, payload: memoryview) -> None:
        """One record from the peer's ring (raises ProtocolError: the ring breaks)."""
        header: DataHeader
        if kind == KIND_HEADER:  # the header alone, no length prefix (the ring frames it)
            header = decode_record(payload)
            handler = self._RING_HANDLERS.get(type(header))  # Goodbye and RingOffer come only over the lane
            if handler is not None:
                handler(self, link, header)
                return
        elif kind in (KIND_MESSAGE, KIND_POOLED):  # a length-prefixed message header (then its frames)
            header, end = decode_framed(payload)
            if isinstance(header, MessageHeader):
                self._on_whole_message(link, header, payload, end, pooled=kind == KIND_POOLED)
                return
        else:
            raise ProtocolError(f"ring record of unknown kind {kind}")
        raise ProtocolError(f"ring record of kind {kind} holds a {type(header).__name__}")

    def _ring_broke(self, link: PeerLink, error: ProtocolError) -> None:
        link.ring_in = None
        self._drop(link, error)

    def _send_header(
        self, link: PeerLink, header: DataHeader, transfer_id: int | None = None, tail_of: int | None = None
    ) -> bool:
        """Send a header through the peer's ring if there is one with room, else over UCX
        (``tail_of``: see :meth:`_ring_put`; over UCX the header is answered as any other,
        and a failed send loses the peer, failing ``transfer_id`` if given).  True if it
        went into the ring."""
        body = encode_record(header)
        try:
            if self._ring_put(link, KIND_HEADER, (body,), tail_of):
                return True
        except RingError as exc:
            self._drop(link, exc)
            return False
        done = ignore if transfer_id is None else partial(self._sent, link, transfer_id)
        link.lane.send(with_length(body), HEADER_TAG, done)
        return False

    def _ring_put(self, link: PeerLink, kind: int, parts: Sequence[Part], tail_of: int | None = None) -> bool:
        """Put one record (``parts`` concatenated: a header from
        :func:`~omni_async.wire.encode_record`, or a chunk message) into the peer's ring, where
        the peer sees it on return, and spin for the answer rather than sleep; False if there
        is no ring, no room, or it broke (send it another way: a ring found broken is dropped
        here, see :meth:`_drop_ring_out`).  ``tail_of``: the transfer the peer's consumption
        of this record answers (its ``tail`` write request: see
        :meth:`.RingReceiver.answers_from`).  Raises :class:`RingError` if the peer corrupted
        the ring."""
        ring = link.ring_out
        if ring is None:
            return False
        sent = ring.send(kind, parts, tail_of)
        self._ring_sent(link, ring, sent)
        return sent

    def _ring_sent(self, link: PeerLink, ring: RingSender, sent: bool) -> None:
        """After a put into ``ring`` (the link's): with something awaited, our ring spins for the
        answer rather than sleep; a ring whose wake-up failed (the peer closed it: it exited,
        or is leaving) is dropped (see :meth:`_drop_ring_out`)."""
        if sent and link.sent and link.ring_in is not None:
            link.ring_in.kick()
        if ring.broken is not None:
            self._drop_ring_out(link)

    @property
    def ucx_config(self) -> dict[str, str]:
        """The UCX context's effective configuration (e.g. ``["TLS"]``, the transports allowed)."""
        return dict(self._context.config)

    @property
    def peer_ids(self) -> list[str]:
        return list(self._links)

    @property
    def links(self) -> Mapping[str, PeerLink]:
        """The live per-peer state, by peer id: a read-only view for diagnostics and tests
        (which lane, ring or same-host writer a peer uses).  Never modify what it holds."""
        return MappingProxyType(self._links)

    def peer(self, peer_id: str) -> PeerInfo:
        return self._link(peer_id).peer

    def same_host(self, peer_id: str) -> bool:
        """Whether the peer's lane is a same-host one (shared memory, gathered writes)."""
        return self._link(peer_id).gather

    def lane(self, peer_id: str) -> Lane:
        """The joined peer's lane (e.g. to read its ``wakeups``); raises :class:`UnknownPeer`."""
        return self._link(peer_id).lane

    def direct_kind(self, peer_id: str) -> str | None:
        """How blocks reach the joined peer's region in one copy (``"memfd"``, ``"file"``, ``"vm"``, see
        :mod:`.shared`), or None when they travel through UCX; raises :class:`UnknownPeer`."""
        direct = self._link(peer_id).direct
        return None if direct is None else direct.kind

    def in_flight_count(self, peer_id: str) -> int:
        """How many transfers to the peer are sent and not settled yet (0 for a peer not
        joined).  Safe from any thread (a metrics scrape's): it only reads."""
        link = self._links.get(peer_id)
        return 0 if link is None else len(link.sent)

    def in_flight(self, peer_id: str | None = None) -> list[Transfer]:
        """Transfers sent and not settled yet (to one peer, or to all)."""
        links = [self._link(peer_id)] if peer_id is not None else list(self._links.values())
        return [transfer for link in links for transfer in link.sent.values()]

    @staticmethod
    def _drop_direct(link: PeerLink) -> None:
        direct, link.direct = link.direct, None
        if direct is not None:
            direct.close()

    def _drop_ring_out(self, link: PeerLink) -> None:
        """Stop writing into the peer's ring and close our side of it: on the peer's removal,
        or once a wake-up found its pipe closed (it exited, or it is leaving: an orderly
        removal closes the ring before its goodbye comes over the lane, so the peer is not
        dropped for it).  The writes whose records the peer consumed by now settle as done
        (that was their answer: see :meth:`.RingReceiver.answers_from`); those still awaiting
        it never get it, and fail with the peer's removal (its goodbye, or its loss seen by
        the control plane) or at their deadline, so whoever is told the peer is lost finds
        it gone."""
        ring, link.ring_out = link.ring_out, None
        if ring is None:
            return
        if link.ring_in is not None:
            link.ring_in.stop_answers()
        try:
            consumed = list(ring.consumed())
        except RingError:  # the peer broke its tail: nothing it says counts
            consumed = []
        ring.close()
        for transfer_id in consumed:
            self._answered(link, transfer_id)
            self._settle(link, transfer_id, None)  # (a removed peer's outbox forgot it: settled here)

    def _drop_rings(self, link: PeerLink) -> None:
        self._drop_ring_out(link)
        ring, link.ring_in = link.ring_in, None
        if ring is not None:
            ring.close()

    def _answer_in_awaiter(self, transfer: Transfer) -> bool:
        """Take the answer to a write that the peer's consumption of its ring record answers in
        the task that awaits it (:meth:`.Transfer.answer_in_awaiter`): poll our ring for it
        briefly (:meth:`.RingReceiver.take_answers_until`).  True if it settled and the
        awaiter may go on without a loop turn (:class:`~.turns.TurnBudget`)."""
        link = self._links.get(transfer.peer_id)
        if link is not None and link.ring_in is not None:
            link.ring_in.take_answers_until(transfer.done)
        return transfer.done() and self._turn_budget.may_skip()

    def _new_transfer(self, link: PeerLink, nbytes: int, kind: Kind, transfer_id: int | None = None) -> Transfer:
        """A transfer to the peer, in flight from now (``transfer_id``: one taken from
        :attr:`_ids` already, for a request put into the peer's ring before this)."""
        now = self._loop.time()
        if transfer_id is None:
            transfer_id = next(self._ids)
        transfer = Transfer(transfer_id, link.peer.peer_id, nbytes, self._on_cancel, kind, now)
        link.sent[transfer.id] = transfer
        due = link.deadlines.start(now)
        if due is not None:
            link.timer = self._loop.call_at(due, self._deadlines_due, link)
        return transfer

    def _sent(self, link: PeerLink, transfer_id: int, error: BaseException | None) -> None:
        """A payload or header send completed; a failed one means the lane to the peer broke."""
        if error is None or self._links.get(link.peer.peer_id) is not link:
            return
        self._lose(link, transfer_id, PeerLost(f"data plane to {link.peer.peer_id!r} broke: {error}"))

    def _lose(self, link: PeerLink, transfer_id: int, lost: PeerLost) -> None:
        """The peer of ``link`` is gone (seen by a write to it): drop it first, so that its leave
        event comes before any failure it causes (a caller told a write failed with
        ``PeerLost`` finds the peer gone), then fail the write if the drop did not."""
        self._drop(link, lost)
        self._settle(link, transfer_id, lost)

    def _deadlines_due(self, link: PeerLink) -> None:
        """The link's deadline timer went off: arm it for the next deadline, expire what is due."""
        in_flight = ((transfer_id, transfer.started) for transfer_id, transfer in link.sent.items())
        expired, due = link.deadlines.fired(self._loop.time(), in_flight)  # (read before any settles)
        link.timer = None if due is None else self._loop.call_at(due, self._deadlines_due, link)
        for transfer_id in expired:
            self._settle(link, transfer_id, DeadlineExceeded(f"no acknowledgement within {link.deadlines.timeout}s"))

    def _settle(self, link: PeerLink, transfer_id: int, error: OmniAsyncError | None) -> None:
        """Settle a transfer: acknowledged (``error`` None), answered with a failure, or given
        up here (deadline, a failed send, the peer's removal)."""
        transfer = self._end(link, transfer_id, error)
        if transfer is None:
            return
        if transfer.set_done() if error is None else transfer.set_failed(error):
            self._handoffs.handed()  # (its awaiters run on the coming loop turns)

    def _end(
        self, link: PeerLink, transfer_id: int, error: OmniAsyncError | None, mode: CancelMode = "immediate"
    ) -> Transfer | None:
        """Carry out what the lane protocol decides for a transfer that ends here (``error``:
        given up, or answered with it; a cancel in ``mode``): nothing yet, or forget it (after
        an ``Abort`` if told to).  Returns the transfer, to settle it; None if it was
        settled already or is kept (a ``"wait"`` cancel)."""
        transfer = link.sent.get(transfer_id)
        if transfer is None:
            return None  # settled already (cancelled, expired, acknowledged)
        current = self._links.get(link.peer.peer_id) is link
        if error is not None and current:  # given up here: the lane protocol says how
            action = link.outbox.give_up(transfer_id, mode)
            if action is GiveUp.KEEP:
                return None
            del link.sent[transfer_id]  # first: what runs below sees it settled (and that it never expires)
            if action is GiveUp.ABORT:  # the receiver's application gets a failed notice
                abort = Abort(transfer_id, error.code, bounded_reason(str(error)))
                link.lane.send(encode_header(abort), HEADER_TAG, ignore)
            carry_out(link.outbox.forget(transfer_id))  # (an acknowledged one left it with its last answer)
        else:  # acknowledged, or its peer is gone: settled (no Enum member read: ~0.13 µs each on 3.11)
            del link.sent[transfer_id]
        if current and link.parked:
            self._unpark(link)  # an answer freed room in the ring (or nothing else is awaited)
        outcome = "ok" if error is None else error.code
        self.metrics.settled(
            transfer.kind, transfer.nbytes, outcome, self._loop.time() - transfer.started, link.peer.peer_id
        )
        return transfer

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode = "immediate") -> list[int]:
        """Cancel transfers by id with the seed's semantics; unknown ids are ignored.

        ``"immediate"``: each settles now with :class:`TransferCancelled`; returns ``[]``.
        ``"wait"``: returns the ids still draining; each settles (as cancelled) once the
        receiver answered or the peer is lost.
        """
        wanted = set(transfer_ids)
        draining = []
        for link in list(self._links.values()):
            for transfer_id in wanted.intersection(link.sent):
                if link.sent[transfer_id].cancel(mode):
                    draining.append(transfer_id)
        return draining

    def _on_cancel(self, transfer: Transfer, mode: CancelMode) -> bool:
        """``transfer.cancel(mode)``: True if it is kept, draining (the handle settles itself
        otherwise)."""
        link = self._links.get(transfer.peer_id)
        if link is None or transfer.id not in link.sent:
            return False
        return self._end(link, transfer.id, TransferCancelled("the sender cancelled the write"), mode) is None

    def _header_arrived(self, link: PeerLink, _tag: int, length: int, message: Any) -> None:
        if length > MAX_HEADER_BYTES:
            self._drop(link, ProtocolError(f"header of {length} bytes exceeds {MAX_HEADER_BYTES}"))
            return
        buffer = np.empty(length, np.uint8)
        slot = [buffer, RECEIVING]
        link.headers.append(slot)  # its place in arrival order
        link.lane.recv_arrived(buffer, message, partial(self._header_received, link, slot))

    def _data_arrived(self, link: PeerLink, tag: int, length: int, message: Any) -> None:
        try:
            take = link.inbox.arrived(tag & SEQ_MASK, length, message)
        except ProtocolError as exc:
            self._drop(link, exc)
            return
        if take is not None:
            message, (buffers, done) = take
            link.lane.recv_arrived_many(buffers, message, done)

    def _stray_arrived(self, link: PeerLink, tag: int, length: int, message: Any) -> None:
        """A message no watch took: a header or payload that arrived after its watch looked
        is handled as such; one on a tag this protocol never uses is taken (truncated into
        scratch) and is a violation."""
        if tag & KIND_MASK == DATA_KIND:
            self._data_arrived(link, tag, length, message)
        elif tag == HEADER_TAG:
            self._header_arrived(link, tag, length, message)
        else:
            link.lane.recv_arrived_many([link.scratch], message, ignore)
            self._drop(link, ProtocolError(f"message of {length} bytes on unknown tag {tag:#x}"))

    def _admit(self, link: PeerLink, seq: int, messages: int, nbytes: int) -> bool:
        """Account a header's payload messages (``seq`` on) and chunk bytes against the
        per-peer bounds (which the peer's sender window respects); a peer over them broke the
        protocol and is dropped (returns False)."""
        try:
            link.inbox.admit(seq, messages, nbytes)
        except ProtocolError as exc:
            self._drop(link, exc)
            return False
        return True

    def _expect(
        self, link: PeerLink, seq: int, buffers: list[npt.NDArray[np.uint8]], done: Completion, length: int = -1
    ) -> bool:
        """Receive payload message ``seq`` scattered over ``buffers`` when it arrives (or now);
        False if that broke the protocol (the peer is dropped).

        ``length`` is the announced size when the buffers are shorter (a truncated drain)."""
        announced = sum(buffer.nbytes for buffer in buffers) if length < 0 else length
        done = partial(_lost_if_broken, link.peer.peer_id, done)
        try:
            take = link.inbox.expect(seq, announced, (buffers, done))
        except ProtocolError as exc:
            self._drop(link, exc)
            return False
        if take is not None:
            link.lane.recv_arrived_many(buffers, take[0], done)
        return True

    def _header_received(self, link: PeerLink, slot: list[Any], error: BaseException | None) -> None:
        """A header's receive completed (``error``: it failed; a closing lane fails every one):
        it, and the completed ones behind it, are handled once every header that arrived before
        it was, so headers are handled in tag order, however long each receive took (a header
        of 8 KiB or more goes by rendezvous over shared memory and completes after the smaller
        ones that arrived behind it)."""
        slot[1] = error
        headers = link.headers
        while headers and headers[0][1] is not RECEIVING:
            buffer, outcome = headers.popleft()
            try:
                self._on_header(link, buffer, outcome)
            except Exception:  # a handler's bug must not leave the headers behind it waiting
                log.exception("handling a header from %s failed", link.peer.peer_id)

    def _on_header(self, link: PeerLink, buffer: npt.NDArray[np.uint8], error: BaseException | None) -> None:
        """One header received over the lane (``error``: its receive failed), in arrival order."""
        if error is not None:
            return  # the lane is closing; liveness is the control plane's job
        try:
            header, end = decode_framed(buffer.data)
            if buffer.nbytes != end:  # frames follow it
                if not isinstance(header, MessageHeader):
                    raise ProtocolError(f"a {type(header).__name__} followed by {buffer.nbytes} bytes in all")
                self._on_whole_message(link, header, buffer.data, end, batched=False)
                return
        except ProtocolError as exc:
            self._drop(link, exc)
            return
        if link.ring_in is not None and _follows_ring(header):
            link.ring_in.drain()  # the intents the peer put into its ring before this come first
        self._handle_header(link, header)

    def _handle_header(self, link: PeerLink, header: DataHeader) -> None:
        """A header from the peer, over UCX or through its ring: to its handler, by type."""
        self._HANDLERS[type(header)](self, link, header)

    def _on_goodbye(self, link: PeerLink, _goodbye: Goodbye) -> None:
        """The peer leaves (what it put into the ring before was taken first, see
        :func:`_follows_ring`); a peer that leaves first is removed (its lane drains) and the
        owner told."""
        if link.drain.goodbye():
            gone = PeerLost(f"peer {link.peer.peer_id!r} is closing")
            self.remove_peer(link.peer.peer_id, gone, orderly=True)
            self._fault(link.peer.peer_id, gone)

    def _on_ack(self, link: PeerLink, ack: Ack) -> None:
        self._answered(link, ack.transfer_id, ack.code, ack.reason)

    def _on_acks(self, link: PeerLink, acks: Acks) -> None:
        for transfer_id in acks.transfer_ids:
            self._answered(link, transfer_id)

    def _answered(self, link: PeerLink, transfer_id: int, code: str = "", reason: str = "") -> None:
        """The peer's answer to one of our requests (``code`` empty: done); held while some
        put of the transfer is not flushed (the bytes may not be in the peer's memory yet).
        (The defaults: a ring's consumption answers with ``partial(_answered, link)``, which
        calls 0.35 µs faster than a partial that binds keywords.)"""
        if transfer_id in link.flushing:
            link.early_answers.setdefault(transfer_id, []).append((code, reason))
            return
        due = link.notice_answers.get(transfer_id)
        if due is not None:
            if due > 1:
                link.notice_answers[transfer_id] = due - 1
            else:
                del link.notice_answers[transfer_id]
                link.lane_noticed.discard(transfer_id)
        settled, error, posts = link.outbox.answered(transfer_id, code, reason)
        if settled:
            self._settle(link, transfer_id, error_from_code(*error) if error else None)
        if link.held:
            self._release_held(link)  # before the posts the answer released: they came later
        if posts:
            carry_out(posts)

    def _rows(self, runs: Sequence[tuple[int, int]]) -> list[npt.NDArray[np.uint8]]:
        """The flat rows of ``(start, count)`` runs in every region of the set, run by run: the
        order of a write's payload messages (or of its gathered one).  A one-block run is the
        row by index (half the cost of a slice and a reshape)."""
        arrays = self._arrays
        return [
            array[start] if count == 1 else array[start : start + count].reshape(-1)
            for start, count in runs
            for array in arrays
        ]

    def _answer(self, link: PeerLink, transfer_id: int, kind: Kind, nbytes: int, error: BaseException | None) -> None:
        """Acknowledge an incoming transfer, or report why it failed, unless the lane is gone."""
        if self._links.get(link.peer.peer_id) is not link:
            return
        failed = None if error is None else sink_error(error)
        ack = Ack(transfer_id) if failed is None else Ack(transfer_id, failed.code, bounded_reason(str(failed)))
        self._send_header(link, ack)  # first: the sender waits for it, not for our metrics
        self.metrics.answered(kind, nbytes, "ok" if failed is None else failed.code, link.peer.peer_id)

    def _flush_acks(self, link: PeerLink) -> None:
        """Send the acknowledgements held in :attr:`PeerLink.acks` (end of a ring batch, or
        ``ACK_BATCH`` of them): one :class:`Ack`, or one :class:`Acks` for several.  At the end
        of a batch, the peer's writes its consumption answered (:attr:`PeerLink.tail_acked`)
        were consumed: the peer is woken if it sleeps, or, where it cannot be woken through
        its ring (we have none, or it broke), they are acknowledged with the others."""
        if link.tail_acked:
            ids = self._count_tail_acked(link)
            if not _woke_for_tail(link):
                link.acks.extend(ids)
        if not link.acks:
            return
        ids, link.acks = link.acks, []
        if self._links.get(link.peer.peer_id) is link:
            self._send_header(link, Ack(ids[0]) if len(ids) == 1 else Acks(ids))

    def _count_tail_acked(self, link: PeerLink) -> list[int]:
        """Count in the metrics the writes the consumption of the peer's ring records answered
        (:attr:`PeerLink.tail_acked`: at the end of their batch, or when the peer is removed
        within it) and take them; returns their ids."""
        ids, link.tail_acked = link.tail_acked, []
        nbytes, link.tail_bytes = link.tail_bytes, 0
        if ids:
            self.metrics.answered("blocks", nbytes, "ok", link.peer.peer_id, len(ids))
        return ids

    def _drop(self, link: PeerLink, error: OmniAsyncError) -> None:
        """Tell the owner to drop the peer of ``link`` (it broke the protocol, or its lane or
        process is gone), unless the link was removed already: what a removed link still
        handles (its draining lane, the ring records drained on removal) drops nobody."""
        if self._links.get(link.peer.peer_id) is link:
            self._fault(link.peer.peer_id, error)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("transport is closed")

    def _link(self, peer_id: str) -> PeerLink:
        try:
            return self._links[peer_id]
        except KeyError:
            raise UnknownPeer(f"no peer {peer_id!r} (known: {sorted(self._links)})") from None

    # -- what the other parts provide ------------------------------------------------------
    @abstractmethod
    def remove_peer(self, peer_id: str, error: OmniAsyncError | None = None, *, orderly: bool = False) -> bool:
        """Fail the peer's transfers and close its lane (:mod:`.peers`)."""

    @abstractmethod
    def _release_held(self, link: PeerLink) -> None:
        """Post the held requests with a notice that may go now (:mod:`.block_writes`)."""

    @abstractmethod
    def _unpark(self, link: PeerLink) -> None:
        """Post the chunk messages waiting for room in the peer's ring (:mod:`.messages`)."""

    @abstractmethod
    def _on_whole_message(
        self, link: PeerLink, hdr: MessageHeader, record: memoryview, offset: int, *, pooled: bool = False,
        batched: bool = True,
    ) -> None:
        """A chunk message whose header came with its frames (from ``offset`` of ``record`` on):
        a ring record (``batched``), its frames in it or (``pooled``) in our shared pool, or one
        lane message (:mod:`.messages`)."""


def _woke_for_tail(link: PeerLink) -> bool:
    """Wake the peer if it sleeps, after a batch that consumed writes it awaits (see
    :attr:`PeerLink.tail_acked`); False if it cannot be woken through its ring (none, or
    broken: acknowledge them instead)."""
    ring = link.ring_out
    if ring is None or ring.broken is not None:
        return False
    if ring.producer.wants_wake():
        ring.wake()
    return ring.broken is None


def _follows_ring(header: DataHeader) -> bool:
    """Whether a header that came over UCX may refer to records the peer put into its ring
    before it: a commit, an abort, a write with a notice (write order), a goodbye (what the peer
    put into the ring before it left comes first)."""
    return isinstance(header, Commit | Abort | Goodbye) or (
        isinstance(header, WriteRequest) and header.notice is not None
    )


def _lost_if_broken(peer_id: str, done: Completion, error: BaseException | None) -> None:
    """A payload receive's completion: UCX failing it (an ``OSError``: the connection reset,
    the peer died mid-message) means the lane to the peer broke, reported as
    :class:`PeerLost` as a send to it would be, not as a failure of this side."""
    if isinstance(error, OSError):
        error = PeerLost(f"peer {peer_id!r} lost: receive failed: {error}")
    done(error)


def carry_out(posts: list[Callable[[], None]]) -> None:
    """Post the requests the lane protocol released, in order."""
    for post in posts:
        post()


def ignore(_error: BaseException | None) -> None:
    """Completion of a best-effort send (an acknowledgement)."""
