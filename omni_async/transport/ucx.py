"""The UCX data plane: block writes and chunk messages to peers, each over its own lane.

Protocol on a lane (tags from :mod:`omni_async.wire`):

* the sender posts a header (:class:`~omni_async.wire.WriteRequest` or
  :class:`~omni_async.wire.MessageHeader`) on ``HEADER_TAG``, then one payload message on
  ``data_tag(seq)`` gathered from every coalesced run or frame (an IOV send, see :mod:`.iov`);
  a block write to a peer on this host with a direct writer (:mod:`.shared`) copies the rows
  into the peer's region instead and sends only a ``placed`` header (with a notice: that
  header goes into the peer's ring *before* the copy, an intent, and a
  :class:`~omni_async.wire.Commit` follows it);
* between peers on one host, placed-write headers, acknowledgements and chunk messages that
  fit go through a shared-memory ring instead of the lane (:mod:`.samehost`, offered with a
  :class:`~omni_async.wire.RingOffer` right after connecting);
* to a peer without a same-host writer (tcp, other hosts) that offered its remote keys
  (:class:`~omni_async.wire.RkeyOffer`, right after connecting), a block write without a
  notice is put straight into its rows (:mod:`.rma`: a put per run and region, one flush),
  then announced with a ``placed`` header;
* the receiver takes each header as it arrives (no receive stays posted while idle, so closing
  a lane never leaves UCX requests behind); it validates a header *before* posting
  the payload receives, which land straight in its region rows (writes) or in fresh arrays
  (messages), so no byte of an invalid write reaches the region;
* once every payload receive completed the receiver sends an :class:`~omni_async.wire.Ack`
  (or a failed one with the reason); the sender's :class:`Transfer` settles on it, never on
  a local send completion.

Liveness is not UCX's job here (with endpoint error handling off it cannot tell): the owner
calls :meth:`UcxTransport.remove_peer` when the control plane loses a peer, and every transfer
has a deadline.  A header that cannot be decoded, or a message over the limits, is a protocol
violation: the transport reports it through ``fault`` and the owner drops the peer.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ..config import AgentConfig
from ..errors import (
    ClosedError,
    DeadlineExceeded,
    InvalidBlocks,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    ReadsNotAllowed,
    TransferCancelled,
    TransferFailed,
    UnknownPeer,
    error_from_code,
)
from ..handshake import PeerInfo
from ..metrics import Kind, Metrics
from ..region import BlockRegion, RegionSet, Run, as_region_set, plan_runs
from ..wire import (
    DATA_KIND,
    FULL_MASK,
    HEADER_TAG,
    KIND_MASK,
    MAX_HEADER_BYTES,
    MAX_PENDING_PAYLOADS,
    READ_RUNS_PER_REQUEST,
    RUNS_PER_REQUEST,
    SEQ_MASK,
    Abort,
    Ack,
    Acks,
    Commit,
    DataHeader,
    Goodbye,
    MessageHeader,
    ReadRequest,
    RingOffer,
    RkeyOffer,
    WriteRequest,
    data_tag,
    decode_header,
    decode_record,
    encode_header,
    encode_record,
    validate_message,
    validate_write,
    with_length,
)
from .iov import address_of, iov_of_runs
from .lane import Completion, Lane, new_context
from .limits import Window, check_message, check_notice, receive_budget, split_runs
from .notices import Notice, NoticeBook, NoticeQueue, sink_error
from .pool import ReceivePool
from .protocol import Deadlines, Drain, GiveUp, Inbox, Outbox
from .ring import RingError
from .rma import Registration
from .samehost import KIND_HEADER, KIND_MESSAGE, LINGER, RingReceiver, RingSender
from .shared import Refused, Writers, open_writers
from .transfer import CancelMode, Transfer
from .vetting import NotVetted, shared_vetter

log = logging.getLogger(__name__)

_GATHER_MAX_RUN = 256 * 1024
"""Writes whose runs average less than this many bytes are gathered into one message."""
PUT_MIN_BYTES = 64 * 1024
"""A write request of one payload message up to this size goes as a tag message even where
puts are on (one round trip; a put and its flush take two)."""
ANNOUNCE_BYTES = 1 << 20
"""A same-host write request (no notice) of at least this many bytes is announced with an
intent before its copy (some 100 µs or more): the receiver checks it and stays awake for its
commit meanwhile, instead of sleeping until a wake-up after the copy.  Smaller ones are
copied, then told (their copy is shorter than a wake-up)."""
INTENT_WAIT = 3e-3
"""Seconds a receiver polls its ring for the commit of an intent before it sleeps again
(the longest copy it stays awake for; a later commit wakes it as any record does)."""
DRAIN_TIMEOUT = 1.0
"""Seconds an orderly lane close waits for the peer's Goodbye and pending requests."""

Frames = list[npt.NDArray[np.uint8]]
_Message = tuple[int, str, bytes, list[int], Frames]
"""A chunk message to post: ``(transfer_id, key, meta, frame sizes, non-empty frames)``."""
MessageSink = Callable[[str, str, bytes, Frames], Awaitable[None] | None]
"""``sink(peer_id, key, meta, frames)``: a received message, its frames now owned by the sink
(large ones from a same-host ring are views of the receive pool, :mod:`.pool`: their memory
goes back to it when the last reference to them is dropped; nothing else releases it).

The acknowledgement (which settles the sender's transfer) is sent when the sink returns, or,
if it returns an awaitable, when that completes: a slow sink back-pressures the sender.
"""
FaultCallback = Callable[[str, OmniAsyncError], None]
"""``fault(peer_id, error)``: the transport dropped a peer on its own (protocol violation, a
broken lane, or the peer's Goodbye); the owner forgets it too."""


_U8 = np.dtype(np.uint8)
_FRAME_ALIGN = 64
"""Where each frame of a ring message starts in the receiver's copy (a dtype never needs more)."""
POOL_MIN = 64 * 1024
"""Ring messages with at least this many frame bytes are copied into the receive pool (below
it a fresh array costs less than the pool's bookkeeping)."""
RECEIVE_POOL_BYTES = 64 << 20
"""Size of the receive pool (one per transport, made when first needed)."""
ACK_BATCH = 16
"""Most acknowledgements held back while a ring batch is being taken: enough to spare most
records and wake-up checks, few enough that the sender's window keeps moving."""


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


class _Sent:
    """A transfer in flight: its kind and start time (for metrics)."""

    __slots__ = ("kind", "started", "transfer")

    def __init__(self, transfer: Transfer, kind: Kind, started: float) -> None:
        self.transfer = transfer
        self.kind = kind
        self.started = started


@dataclass(eq=False)
class PeerLink:
    """Everything the transport keeps about one peer (read-only outside this module: see
    :attr:`UcxTransport.links`)."""

    peer: PeerInfo
    lane: Lane
    deadlines: Deadlines
    """When the transfers to the peer run out of time (one timer for all: :attr:`timer`)."""
    inbox: Inbox[tuple[list[npt.NDArray[np.uint8]], Completion]] = field(init=False)
    """Payload messages matched to their headers: each goes to (buffers, done); the buffers
    may be shorter than the announced length (a refused write's payload is received into a
    1-byte scratch buffer: UCX truncates it)."""
    sent: dict[int, _Sent] = field(default_factory=dict)
    """Transfers sent to the peer and not acknowledged yet."""
    outbox: Outbox[Callable[[], None]] = field(init=False)
    """Sequence numbers, requests waiting for the peer's window, answers awaited, cancels."""
    drain: Drain = field(init=False)
    """Goodbyes and what is still pending: when the lane may be released."""
    timer: asyncio.TimerHandle | None = None
    """The deadline timer, armed when :attr:`deadlines` says so; None: nothing to expire."""
    scratch: npt.NDArray[np.uint8] = field(default_factory=lambda: np.empty(1, np.uint8))
    """Where refused or stray payloads go (UCX truncates them: nothing is allocated)."""
    gather: bool = False
    """Send each block write as one gathered message (peers on this host over shared memory:
    measured faster; over tcp one message per run is faster, see docs/tuning.md)."""
    direct: Writers | None = None
    """Write blocks straight into the peer's regions, one per region of its set (same host,
    see :mod:`.shared`); None: block payloads go through UCX."""
    notice_answers: dict[int, int] = field(default_factory=dict)
    """Requests with a notice posted to the peer and not answered yet, by transfer."""
    lane_noticed: set[int] = field(default_factory=set)
    """Transfers of ``notice_answers`` that sent a header with a notice over the lane: until
    they are answered, no intent goes into the ring (it could overtake them)."""
    held: deque[tuple[int, bool, Callable[[], None]]] = field(default_factory=deque)
    """Requests with a notice waiting, in order, for ``lane_noticed`` to empty."""
    intents: dict[tuple[int, int], tuple[Completion, OmniAsyncError | None]] = field(default_factory=dict)
    """The peer's intents (placed requests with a notice, or large ones) by ``(transfer,
    part)``, awaiting their :class:`~omni_async.wire.Commit`: what answers each, and the
    refusal if invalid."""
    notices: NoticeBook[Callable[[], None]] = field(init=False)
    """The peer's incoming writes with notices not notified yet; the held acknowledgements."""
    ring_in: RingReceiver | None = None
    """The ring this peer writes headers and chunk messages into (same host, see
    :mod:`.samehost`); None: they come over UCX."""
    ring_out: RingSender | None = None
    """The peer's ring, once it offered one and we mapped it; None: send over UCX."""
    parked: deque[_Message] = field(default_factory=deque)
    """Chunk messages waiting, in order, for room in the peer's ring (see ``_may_park``)."""
    remote_keys: list[int] | None = None
    """The peer's remote keys (one per region, unpacked on the lane, which owns them) once it
    offered them and they passed vetting: block writes without a notice go as puts (see
    :mod:`.rma`); None: as tag messages."""
    keying: asyncio.Task[None] | None = None
    """Vetting and unpacking the peer's offered keys, while it runs."""
    acks: list[int] = field(default_factory=list)
    """Chunk messages from the peer's ring delivered (and their sink done) in the ring batch
    being taken: acknowledged together, at most ``ACK_BATCH`` to an :class:`~omni_async.wire.Acks`."""

    receive_bytes: InitVar[int] = 0
    """The receiver's budget for this peer's chunk buffers (``receive_budget``)."""

    def __post_init__(self, receive_bytes: int) -> None:
        self.outbox = Outbox(Window(self.peer.max_message_bytes))
        self.inbox = Inbox(receive_bytes)
        self.drain = Drain(self.inbox)
        # The sender's window counts each request with a notice as a payload message.
        self.notices = NoticeBook(self.peer.peer_id, 2 * MAX_PENDING_PAYLOADS)


class _Countdown:
    """Calls ``finish(first error or None)`` once ``count`` parts are done."""

    __slots__ = ("error", "finish", "remaining")

    def __init__(self, count: int, finish: Completion) -> None:
        self.remaining = count
        self.error: BaseException | None = None
        self.finish = finish

    def done(self, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.remaining -= 1
        if self.remaining == 0:
            self.finish(self.error)


class UcxTransport:
    """Data plane of one agent over ``region`` (or a region set: every block index names its
    block in each region, and moves in all of them).  All methods run on the agent's event loop.

    ``fault(peer_id, error)`` is called when a peer broke the protocol; the owner should drop
    it (``remove_peer``).  Chunk messages go to :attr:`message_sink` (unset: refused).
    """

    def __init__(
        self,
        region: BlockRegion | RegionSet,
        config: AgentConfig,
        fault: FaultCallback,
        metrics: Metrics,
        host_id: str = "",
    ) -> None:
        self.regions = as_region_set(region)
        self.region = self.regions.regions[0]
        self._arrays = self.regions.arrays
        self.host_id = host_id
        self.config = config
        self.metrics = metrics
        self.message_sink: MessageSink | None = None
        self.notices = NoticeQueue(config.notice_queue)
        """Notices of incoming writes, for the application (see :mod:`.notices`)."""
        self._fault = fault
        self._loop = asyncio.get_running_loop()
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

    # -- peers -----------------------------------------------------------------------------
    async def warm_up(self) -> None:
        """Start the address-vetting child now (about half a second, once per process) rather
        than inside the first handshake, whose timeout it would eat into."""
        await asyncio.get_running_loop().run_in_executor(None, self._vetter.warm_up)

    def open_lane(self) -> Lane:
        """A fresh lane whose address goes into a handshake; pass it to :meth:`add_peer`."""
        self._check_open()
        return Lane(self._context, self._loop, close_grace=self.config.lane_close_grace)

    async def connect_lane(self, peer: PeerInfo, lane: Lane) -> None:
        """Connect ``lane`` to the peer's lane (the first half of adding a peer; :meth:`add_peer`
        is the second).  The peer's address is vetted first (see :mod:`.vetting`); an unusable
        one raises :class:`ProtocolError`.  Nothing is added: on failure discard the lane."""
        self._check_open()
        lane.check_address(peer.agent_metadata)  # cheap structural check first
        await self._vetter.check(peer.agent_metadata)
        lane.connect(peer.agent_metadata)
        self._check_open()

    def add_peer(self, peer: PeerInfo, lane: Lane) -> None:
        """Start sending to and receiving from the peer over ``lane`` (connected by
        :meth:`connect_lane`).  The owner removed any previous link of the peer id first."""
        self._check_open()
        if peer.peer_id in self._links:
            raise RuntimeError(f"peer {peer.peer_id!r} still has a lane")  # the owner's bug
        link = PeerLink(
            peer,
            lane,
            Deadlines(self.config.transfer_timeout),
            gather=peer.host_id == self.host_id and self.config.ucx_tls != "tcp",
            receive_bytes=receive_budget(self.config.max_message_bytes),
        )
        if self.config.same_host_lane:
            link.direct = open_writers(peer, self.host_id)
        self._links[peer.peer_id] = link
        lane.watch(HEADER_TAG, FULL_MASK, partial(self._header_arrived, link))
        lane.watch(DATA_KIND, KIND_MASK, partial(self._data_arrived, link))
        lane.on_stray = partial(self._stray_arrived, link)
        # Acknowledgements come through the ring once there is one: the lane need not spin.
        lane.expecting = lambda: (bool(link.sent) and link.ring_out is None) or link.inbox.expecting
        # Not once removed: a draining lane has no rings left, yet nothing to stay hot for.
        lane.stay_hot = lambda: link.ring_out is None and link.ring_in is None and self._links.get(peer.peer_id) is link
        self._offer_ring(link)
        self._offer_keys(link)

    def _offer_ring(self, link: PeerLink) -> None:
        """Offer a peer on this host a ring for what it sends us (see :mod:`.samehost`)."""
        if not (self.config.same_host_lane and self.host_id and link.peer.host_id == self.host_id):
            return
        try:
            ring = RingReceiver(
                self._loop,
                partial(self._ring_record, link),
                partial(self._ring_broke, link),
                partial(_awaits_answer, link),
                batch_done=partial(self._flush_acks, link),
            )
        except OSError as exc:
            log.warning("no same-host ring for %s: %s", link.peer.peer_id, exc)
            return
        link.ring_in = ring
        link.lane.send(encode_header(ring.offer()), HEADER_TAG, _ignore)

    def _on_ring_offer(self, link: PeerLink, offer: RingOffer) -> None:
        """The peer offers its ring: send through it from now on (if it can be mapped)."""
        if link.ring_out is not None or link.ring_in is None:
            log.warning("ignored a ring offer from %s (not a same-host link, or a second one)", link.peer.peer_id)
            return
        try:
            link.ring_out = RingSender(offer)
        except (Refused, OSError, ValueError) as exc:
            log.warning("peer %s: no same-host ring, headers go through UCX (%s)", link.peer.peer_id, exc)
            return
        if not link.ring_out.in_this_process:  # its next record may come while we poll
            link.ring_in.linger = LINGER

    def _offer_keys(self, link: PeerLink) -> None:
        """Offer a peer without a same-host lane puts into our regions (mapped on first use)."""
        if not self.config.ucx_puts or link.gather:
            return
        if self._registration is None:
            try:
                self._registration = Registration(self._context, self._arrays)
            except OSError as exc:
                log.warning("regions not mapped for UCX puts, writes to us go as tag messages: %s", exc)
                return
        link.lane.send(encode_header(RkeyOffer(list(self._registration.keys))), HEADER_TAG, _ignore)

    def _on_rkey_offer(self, link: PeerLink, offer: RkeyOffer) -> None:
        """The peer offers puts into its regions: vet its keys in a child, then unpack them."""
        if not self.config.ucx_puts:
            return  # puts are off here: writes to the peer go as tag messages
        if link.gather or link.remote_keys is not None or link.keying is not None:
            log.warning("ignored a remote key offer from %s (a same-host link, or a second one)", link.peer.peer_id)
            return
        if len(offer.keys) != len(self._arrays):
            self._drop(link, ProtocolError(f"{len(offer.keys)} remote keys offered for {len(self._arrays)} regions"))
            return
        link.keying = self._loop.create_task(self._take_keys(link, offer.keys), name=f"omni-rkeys-{link.peer.peer_id}")

    async def _take_keys(self, link: PeerLink, keys: list[bytes]) -> None:
        """Vet the peer's offered keys in a child, then unpack them on its lane: from then on
        writes to it go as puts.  Keys UCX refuses drop the peer; a check with no verdict (the
        vetter is saturated or slow) leaves it on tag messages."""
        try:
            await self._vetter.check(link.peer.agent_metadata, keys=keys)
            if self._links.get(link.peer.peer_id) is link:
                link.remote_keys = link.lane.unpack_keys(keys)
        except NotVetted as exc:
            log.warning("peer %s: writes go as tag messages: %s", link.peer.peer_id, exc)
        except ProtocolError as exc:
            log.warning("peer %s: %s", link.peer.peer_id, exc)
            self._drop(link, exc)
        except PeerLost:
            pass  # the lane closed meanwhile
        except OSError as exc:  # the vetting child could not be run: no puts to this peer
            log.warning("peer %s: remote keys not vetted, writes go as tag messages: %s", link.peer.peer_id, exc)
        finally:
            link.keying = None

    def _ring_record(self, link: PeerLink, kind: int, payload: memoryview) -> None:
        """One record from the peer's ring (raises ProtocolError: the ring breaks)."""
        header: DataHeader
        if kind == KIND_HEADER:  # the header alone, no length prefix (the ring frames it)
            header = decode_record(payload)
            handler = self._RING_HANDLERS.get(type(header))  # Goodbye and RingOffer come only over the lane
            if handler is not None:
                handler(self, link, header)
                return
        elif kind == KIND_MESSAGE:  # a length-prefixed message header, then its frames
            header = decode_header(payload)
            if isinstance(header, MessageHeader):
                self._on_ring_message(link, header, payload)
                return
        else:
            raise ProtocolError(f"ring record of unknown kind {kind}")
        raise ProtocolError(f"ring record of kind {kind} holds a {type(header).__name__}")

    def _ring_broke(self, link: PeerLink, error: ProtocolError) -> None:
        link.ring_in = None
        self._drop(link, error)

    def _send_header(self, link: PeerLink, header: DataHeader, done: Completion) -> None:
        """Send a header through the peer's ring if there is one with room, else over UCX."""
        body = encode_record(header)
        try:
            if self._ring_put(link, body):
                return
        except RingError as exc:
            self._drop(link, exc)
            return
        link.lane.send(with_length(body), HEADER_TAG, done)

    def _ring_put(self, link: PeerLink, data: bytes) -> bool:
        """Put one header (:func:`~omni_async.wire.encode_record`) into the peer's ring, where
        the peer sees it on return; False if there is no ring, no room, or it broke (send it
        another way).  Raises
        :class:`RingError` if the peer corrupted the ring."""
        ring = link.ring_out
        if ring is None:
            return False
        if ring.send(KIND_HEADER, (data,)):
            if link.sent and link.ring_in is not None:
                link.ring_in.kick()  # spin for the answer rather than sleep
            return True
        if ring.broken is not None:
            self._drop_ring_out(link)
        return False

    def remove_peer(self, peer_id: str, error: OmniAsyncError | None = None, *, orderly: bool = False) -> bool:
        """Fail the peer's in-flight transfers with ``error`` and close its lane.

        ``orderly`` (the peer is alive: it said goodbye, or this side is closing or removing it)
        drains the lane first: both sides send a :class:`~omni_async.wire.Goodbye` and close
        once they have the other's and nothing is pending, so no UCX request is left behind
        (a send to a peer that stopped progressing could never complete, and would pin the
        lane's worker).  Draining is bounded by ``DRAIN_TIMEOUT``.  Returns False if unknown.
        """
        link = self._links.pop(peer_id, None)
        if link is None:
            return False
        if link.ring_in is not None:
            # What the peer put into its ring before it was lost counts (an intent above all:
            # its rows may be changing); acknowledgements settle, nothing is answered.
            link.ring_in.drain()
        error = error or PeerLost(f"peer {peer_id!r} removed")
        for notice in link.notices.lost(error):  # the writes it was sending us fail
            self.notices.offer(notice, _nothing)
        link.outbox.clear()
        link.parked.clear()
        link.held.clear()
        link.intents.clear()
        link.remote_keys = None  # the lane owns them: destroyed before its worker
        if link.keying is not None:
            link.keying.cancel()
            self._keyings.add(link.keying)
            link.keying.add_done_callback(self._keyings.discard)
        self._drop_direct(link)
        self._drop_rings(link)
        for transfer_id in list(link.sent):
            self._settle(link, transfer_id, error)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        if orderly:
            link.drain.leave()
            link.lane.send(encode_header(Goodbye()), HEADER_TAG, _ignore)
            task = self._loop.create_task(self._drain_lane(link, error), name=f"omni-drain-{peer_id}")
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        else:
            self._release_link(link, error)
        return True

    def _release_link(self, link: PeerLink, error: OmniAsyncError) -> None:
        """Let go of everything a removed peer owned: payload messages whose header never came
        are taken (truncated into scratch), so UCX is not left holding probed messages nobody
        received; the buffers announced for it are dropped; its lane closes."""
        for message in link.inbox.release():
            link.lane.recv_arrived_many([link.scratch], message, _ignore)
        self.discard_lane(link.lane, error)

    async def _drain_lane(self, link: PeerLink, error: OmniAsyncError) -> None:
        """Release the lane once the lane protocol says it drained (:class:`.protocol.Drain`:
        the peer's Goodbye is here and nothing is pending), or after ``DRAIN_TIMEOUT``.
        Event-driven: the lane reports each progress pass; nothing polls."""
        lane = link.lane
        drained = self._loop.create_future()

        def progress() -> None:
            if link.drain.progress(lane.in_flight):
                drained.set_result(None)

        lane.on_progress = progress
        try:
            progress()  # the peer may have left already, and the Goodbye be sent
            async with asyncio.timeout(DRAIN_TIMEOUT):
                await drained
        except TimeoutError:
            if link.drain.expire():
                log.info("lane to %s closed before it drained (%.1fs)", link.peer.peer_id, DRAIN_TIMEOUT)
        finally:
            lane.on_progress = None
            self._release_link(link, error)

    def discard_lane(self, lane: Lane, error: BaseException | None = None) -> None:
        """Close a lane (of a removed peer, or of a failed handshake); :meth:`close` waits for it."""
        lane.close(error)
        self._closing = {other for other in self._closing if not other.released}
        self._closing.add(lane)

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

    def in_flight(self, peer_id: str | None = None) -> list[Transfer]:
        """Transfers sent and not settled yet (to one peer, or to all)."""
        links = [self._link(peer_id)] if peer_id is not None else list(self._links.values())
        return [sent.transfer for link in links for sent in link.sent.values()]

    # -- sending ---------------------------------------------------------------------------
    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int], *, notice: bytes | None = None
    ) -> Transfer:
        """Write local blocks into the peer's blocks; the returned transfer settles on its ack.

        Raises at once, before any byte moves: :class:`UnknownPeer`, :class:`InvalidBlocks`
        (unequal lengths, an index out of range or not an int), :class:`InvalidNotice` (a
        ``notice`` over the peer's ``max_notice_bytes``), :class:`TypeError` (a notice that is
        not bytes), :class:`ClosedError`.
        A write larger than the receiver takes in one request goes out as several.
        The local blocks must not change until the transfer settles.

        With ``notice`` the peer's application gets a :class:`~.notices.Notice` with this data
        once every row is in place, before the transfer settles (one per write, however it is
        split); if the write fails or is given up after some of it was sent, a failed one.
        A write of no blocks sends nothing and notifies nobody.
        """
        self._check_open()
        link = self._link(peer_id)
        if notice is not None:
            notice = check_notice(notice, link.peer.max_notice_bytes)
        runs = plan_runs(local_idxs, remote_idxs, self.region.num_blocks, link.peer.num_blocks)
        return self._write_runs(link, runs, len(local_idxs), notice)

    def _write_runs(self, link: PeerLink, runs: list[Run], blocks: int, notice: bytes | None) -> Transfer:
        """Write checked runs (``local``: our rows, ``remote``: the peer's) to the peer."""
        block_bytes = self.regions.block_bytes
        layers = len(self._arrays)
        transfer = self._new_transfer(link, blocks * block_bytes, "blocks")
        if not runs:
            self._settle(link, transfer.id, None)  # nothing to move: done, and not left in flight
            return transfer
        # More runs or blocks than one request may carry (the receiver's limits): several
        # requests under the same transfer id, settled by the last acknowledgement.
        direct = link.direct
        placed = direct is not None and (
            direct.num_blocks >= link.peer.num_blocks  # the runs are bounded by the peer's layout
            or max(remote + length for _local, remote, length in runs) <= direct.num_blocks
        )
        # A write with a notice is placed only behind an intent in the peer's ring (see _place_announced).
        placed = placed and (notice is None or link.ring_out is not None)
        # Puts: a write without a notice to a peer that offered its keys (tcp, other hosts).
        put = direct is None and notice is None and link.remote_keys is not None
        # A run is one payload message per region unless gathered: keep a request within the
        # receiver's bound on payload messages pending.
        max_runs = min(RUNS_PER_REQUEST, MAX_PENDING_PAYLOADS // layers)
        if (
            placed
            and notice is None
            and blocks * block_bytes < ANNOUNCE_BYTES
            and blocks <= link.peer.max_write_blocks
            and len(runs) <= max_runs
        ):  # the common small write: one placed request, copied then told (as the loop below makes it)
            _carry_out(link.outbox.submit(transfer.id, [(0, 0, partial(self._place, link, transfer.id, runs))]))
            return transfer
        requests: list[tuple[int, int, Callable[[], None]]] = []
        split = split_runs(runs, link.peer.max_write_blocks, max_runs, blocks)
        announced = False
        for part, request in enumerate(split):
            tag = None if notice is None else _Tag(notice, part, len(split))
            if placed:  # same host: copied straight into the peer's rows, no payload message
                # An intent counts as a payload message: the receiver's bound on intents
                # pending is the window's.
                if tag is not None:
                    place = partial(self._place_announced, link, transfer.id, request, tag, part)
                    requests.append((1, 0, partial(self._gate, link, transfer.id, True, place)))
                elif (
                    link.ring_out is not None
                    and _request_blocks(request, blocks, len(split)) * block_bytes >= ANNOUNCE_BYTES
                ):
                    announced = True
                    announce = partial(self._place_announced, link, transfer.id, request, None, part, len(split))
                    requests.append((1, 0, announce))
                else:
                    requests.append((0, 0, partial(self._place, link, transfer.id, request)))
                continue
            nbytes = sum(run[2] for run in request) * block_bytes
            messages = len(request) * layers
            # One eager message (up to a 64 KiB block) goes faster as a tag: puts need a flush,
            # one more round trip (measured, docs/tuning.md).
            if put and (messages > 1 or nbytes > PUT_MIN_BYTES):
                requests.append((0, 0, partial(self._put_write, link, transfer.id, request)))
                continue
            # Many small runs: one gathered message (Python cost per message dominates).  Large
            # runs: one message each, which UCX pipelines better (measured, docs/tuning.md).
            gather = link.gather and messages > 1 and nbytes < _GATHER_MAX_RUN * messages
            post = partial(self._post_write, link, transfer.id, request, gather, tag)
            if tag is not None:
                post = partial(self._gate, link, transfer.id, False, post)
            requests.append((1 if gather else messages, 0, post))
        # An announced write given up is aborted, as one with a notice: its intents fail.
        _carry_out(link.outbox.submit(transfer.id, requests, noticed=notice is not None or announced))
        return transfer

    def read_blocks(self, peer_id: str, remote_idxs: Sequence[int], local_idxs: Sequence[int]) -> Transfer:
        """Copy the peer's blocks ``remote_idxs`` into ours ``local_idxs``; the returned
        transfer settles once every row is in place (or fails, and says why).

        Raises at once, before any I/O: :class:`ReadsNotAllowed` (the peer's ``allow_reads``
        is off), :class:`UnknownPeer`, :class:`InvalidBlocks`, :class:`ClosedError`.  A peer
        on this host whose region is mapped here is copied from directly (settled on return);
        otherwise a :class:`~omni_async.wire.ReadRequest` asks the peer to write the rows
        into ours.  Deadlines, cancel modes and peer loss as for writes; after
        ``cancel("immediate")`` the peer may still write the requested rows for a moment,
        and no other row of ours is ever written.
        """
        self._check_open()
        link = self._link(peer_id)
        if not link.peer.allow_reads:
            raise ReadsNotAllowed(f"peer {peer_id!r} does not allow reads of its region")
        runs = plan_runs(local_idxs, remote_idxs, self.region.num_blocks, link.peer.num_blocks)
        transfer = self._new_transfer(link, len(local_idxs) * self.regions.block_bytes, "blocks")
        direct = link.direct
        if not runs:
            self._settle(link, transfer.id, None)
            return transfer
        if direct is not None and direct.mapped and max(r + n for _l, r, n in runs) <= direct.num_blocks:
            try:
                direct.fetch(self._arrays, runs)
            except OSError as exc:  # unmapped meanwhile: cannot happen on the loop, but say why
                self._settle(link, transfer.id, TransferFailed(f"same-host read failed: {exc}"))
            else:
                self._settle(link, transfer.id, None)
            return transfer
        requests: list[tuple[int, int, Callable[[], None]]] = []
        for first in range(0, len(runs), READ_RUNS_PER_REQUEST):
            pairs = [(remote, local, length) for local, remote, length in runs[first : first + READ_RUNS_PER_REQUEST]]
            header = encode_header(ReadRequest(transfer.id, pairs))
            requests.append((0, 0, partial(link.lane.send, header, HEADER_TAG, partial(self._sent, link, transfer.id))))
        _carry_out(link.outbox.submit(transfer.id, requests))
        return transfer

    def _on_read(self, link: PeerLink, req: ReadRequest) -> None:
        """A peer asks for our rows: write them into its region, then acknowledge the read
        once that write is acknowledged (or refuse it, with the reason)."""
        if self._closed or self._links.get(link.peer.peer_id) is not link:
            return  # leaving: no new writes to it
        block_bytes = self.regions.block_bytes
        refuse = partial(self._answer, link, req.transfer_id, "blocks", 0)
        if not self.config.allow_reads:
            log.warning("refused read %d from %s: reads are not allowed", req.transfer_id, link.peer.peer_id)
            refuse(ReadsNotAllowed("this peer does not allow reads of its region"))
            return
        runs: list[Run] = [(src, dst, count) for src, dst, count in req.runs]
        for src, dst, count in runs:
            if src + count > self.region.num_blocks or dst + count > link.peer.num_blocks:
                refuse(InvalidBlocks(f"read of {count} blocks from {src} into {dst} leaves a region"))
                return
        blocks = sum(run[2] for run in runs)
        write = self._write_runs(link, runs, blocks, None)
        answer = partial(self._answer, link, req.transfer_id, "blocks", blocks * block_bytes)
        write.add_done_callback(lambda done: answer(done.error()))

    def _post_write(self, link: PeerLink, transfer_id: int, runs: list[Run], gather: bool, tag: _Tag | None) -> None:
        """Send one write request (within the receiver's limits) and its payload."""
        seq = link.outbox.take_seq(1 if gather else len(runs) * len(self._arrays))
        header = _write_request(transfer_id, seq, runs, tag, gathered=gather)
        if tag is not None:
            self._count_noticed(link, transfer_id, lane=True)
        on_sent = partial(self._sent, link, transfer_id)
        lane = link.lane
        lane.send(encode_header(header), HEADER_TAG, on_sent)
        if gather:  # one message, gathered from the rows (two or more: see _write_runs)
            lane.send_iov(iov_of_runs(self._arrays, runs), self._arrays, data_tag(seq), on_sent)
        else:
            for i, row in enumerate(self._rows([(local, length) for local, _remote, length in runs])):
                lane.send(row, data_tag(seq + i), on_sent)

    def _put_write(self, link: PeerLink, transfer_id: int, runs: list[Run]) -> None:
        """Put one write request's rows into the peer's region (one put per run and region,
        inside the region the peer announced: ``plan_runs`` checked the indices), then, once
        the flush completed, tell the peer with a ``placed`` header.  A failed put or flush
        (the peer died) fails the transfer with :class:`PeerLost` and drops the peer."""
        keys = link.remote_keys
        if keys is None:  # the peer was removed while this waited for its window
            self._settle(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} removed"))
            return
        peer = link.peer
        bases = (peer.base_addr, *(layer.base_addr for layer in peer.layers))
        lens = self.regions.block_lens
        rows = self._rows([(local, length) for local, _remote, length in runs])
        puts: list[tuple[int, int, int, int]] = []
        layers = len(lens)
        for i, row in enumerate(rows):
            remote, layer = runs[i // layers][1], i % layers
            puts.append((address_of(row), row.nbytes, bases[layer] + remote * lens[layer], keys[layer]))
        link.lane.put(puts, rows, partial(self._flushed, link, transfer_id, runs))

    def _flushed(self, link: PeerLink, transfer_id: int, runs: list[Run], error: BaseException | None) -> None:
        if error is not None:
            self._sent(link, transfer_id, error)
            return
        header = _write_request(transfer_id, link.outbox.take_seq(0), runs, None, placed=True)
        self._send_header(link, header, partial(self._sent, link, transfer_id))

    def _place(self, link: PeerLink, transfer_id: int, runs: list[Run]) -> None:
        """Copy the runs straight into the peer's region, then tell it with a ``placed`` header
        (a write without a notice: nobody but the sender awaits it).  If the copy fails nothing
        is sent, so no answer will come: the request's window share is withdrawn here."""
        if self._copy(link, transfer_id, runs):
            header = _write_request(transfer_id, link.outbox.take_seq(0), runs, None, placed=True)
            self._send_header(link, header, partial(self._sent, link, transfer_id))
        else:
            _carry_out(link.outbox.withdraw(transfer_id))

    def _place_announced(
        self, link: PeerLink, transfer_id: int, runs: list[Run], tag: _Tag | None, part: int, parts: int = 1
    ) -> None:
        """A request to a peer on this host announced before its copy: its intent (the
        ``placed`` header) goes into the peer's ring before any byte is copied and a
        :class:`~omni_async.wire.Commit` follows the copy.  With a notice (``tag``), so that the
        peer knows of the write even if this process dies during the copy; without one (a
        large write), so that the peer checks the runs during the copy and is awake, polling
        its ring, when the commit comes (see :data:`ANNOUNCE_BYTES`).  With no room in a ring
        (none, full, broken) a request with a notice travels over UCX behind its header (one
        gathered message: the window share it took), one without is copied and then told.
        ``part`` of ``parts``: which request of the write this is (a notice's tag says so too)."""
        seq = link.outbox.take_seq(0)
        intent = _write_request(transfer_id, seq, runs, tag, placed=True, intent=tag is None, part=part, parts=parts)
        try:
            in_ring = link.direct is not None and self._ring_put(link, encode_record(intent))
        except RingError as exc:
            self._settle(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} broke the ring: {exc}"))
            self._drop(link, exc)
            return
        if not in_ring:
            if tag is None:
                self._place(link, transfer_id, runs)
            else:
                self._post_write(link, transfer_id, runs, True, tag)
            return
        if tag is not None:
            self._count_noticed(link, transfer_id, lane=False)
        if self._copy(link, transfer_id, runs):
            self._send_header(link, Commit(transfer_id, part), partial(self._sent, link, transfer_id))

    def _copy(self, link: PeerLink, transfer_id: int, runs: list[Run]) -> bool:
        """Copy the runs into the peer's region (same host); False if that failed.

        A peer process that exited fails the transfer with PeerLost and is dropped (reported
        through ``fault``, like a broken lane); any other failure (no permission) fails this
        transfer only, with TransferFailed, and later writes go through UCX.  A request posted
        after the lane was closed (a later part of the same write, or one queued for the
        window) fails the same way.  On False the request's window share is the caller's to
        free: withdrawn if nothing was sent, answered by the peer if its intent is in the ring
        (the transfer's ``Abort`` fails the intent).
        """
        direct = link.direct
        if direct is None:
            self._settle(link, transfer_id, TransferFailed("the same-host lane to the peer was closed"))
            return False
        try:
            direct.place(self._arrays, runs)
        except OSError as exc:
            self._drop_direct(link)
            if exc.errno == errno.ESRCH:  # the peer process is gone: as a broken lane
                self._lose(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} exited: {exc}"))
            else:
                log.warning("same-host write to %s failed, using UCX from now on: %s", link.peer.peer_id, exc)
                self._settle(link, transfer_id, TransferFailed(f"same-host write failed: {exc}"))
            return False
        return True

    def _gate(self, link: PeerLink, transfer_id: int, ring: bool, post: Callable[[], None]) -> None:
        """Post a request with a notice in write order: behind the ones held already and, if it
        goes into the ring (``ring``), only once every such header sent over the lane is
        answered (a ring record could overtake it, and notices follow write order)."""
        if link.held or (ring and link.lane_noticed):
            link.held.append((transfer_id, ring, post))
        else:
            post()

    def _release_held(self, link: PeerLink) -> None:
        """Post the held requests that may go now, in order (see :meth:`_gate`)."""
        held = link.held
        while held and not (held[0][1] and link.lane_noticed):
            transfer_id, _ring, post = held.popleft()
            if transfer_id in link.sent:
                post()
            else:  # settled while it waited: never sent, so never answered; free its share
                _carry_out(link.outbox.withdraw(transfer_id))

    @staticmethod
    def _count_noticed(link: PeerLink, transfer_id: int, *, lane: bool) -> None:
        """A request with a notice is posted (``lane``: its header went over UCX)."""
        link.notice_answers[transfer_id] = link.notice_answers.get(transfer_id, 0) + 1
        if lane:
            link.lane_noticed.add(transfer_id)

    @staticmethod
    def _drop_direct(link: PeerLink) -> None:
        direct, link.direct = link.direct, None
        if direct is not None:
            direct.close()

    @staticmethod
    def _drop_ring_out(link: PeerLink) -> None:
        ring, link.ring_out = link.ring_out, None
        if ring is not None:
            ring.close()

    def _drop_rings(self, link: PeerLink) -> None:
        self._drop_ring_out(link)
        ring, link.ring_in = link.ring_in, None
        if ring is not None:
            ring.close()

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
        _carry_out(link.outbox.submit(transfer.id, [(1 if payload else 0, transfer.nbytes, post)]))
        return transfer

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
        elif link.parked and self._may_park(link, len(link.parked) + 1):
            link.parked.append(message)  # behind the messages waiting for room in the ring
            return
        self._lane_message(link, message)

    def _lane_message(self, link: PeerLink, message: _Message) -> None:
        transfer_id, key, meta, sizes, payload = message
        seq = link.outbox.take_seq(1)
        header = MessageHeader(transfer_id, seq, key, meta, sizes)
        on_sent = partial(self._sent, link, transfer_id)
        link.lane.send(encode_header(header), HEADER_TAG, on_sent)
        if payload:
            link.lane.send_many(payload, data_tag(seq), on_sent)  # all frames in one message

    @staticmethod
    def _may_park(link: PeerLink, waiting: int) -> bool:
        """A message may wait for room in the ring only while some other transfer awaits an
        answer: the answers free room (and run :meth:`_unpark`), so a wait always ends."""
        return len(link.sent) > waiting

    def _unpark(self, link: PeerLink) -> None:
        """Post the messages waiting for room in the ring, in order, as far as it has room;
        through the lane once nothing else is awaited (or the ring is gone)."""
        parked = link.parked
        while parked:
            message = parked[0]
            transfer_id = message[0]
            if transfer_id not in link.sent:  # settled while it waited: never sent, so no Ack
                parked.popleft()  # will free its window share: release it here
                _carry_out(link.outbox.withdraw(transfer_id))
                continue
            outcome = self._ring_message(link, message) if link.ring_out is not None else "lane"
            if outcome == "full" and self._may_park(link, len(parked)):
                return
            parked.popleft()
            if outcome != "sent":
                self._lane_message(link, message)

    def _ring_message(self, link: PeerLink, message: _Message) -> str:
        """Put a chunk message (header and frames, one record) into the peer's ring.  Returns
        ``"sent"`` (or failed: the peer broke the ring and is dropped), ``"full"`` (no room
        now) or ``"lane"`` (too large, or the ring is gone: send it over UCX)."""
        ring = link.ring_out
        transfer_id, key, meta, sizes, payload = message
        if ring is None:
            return "lane"
        data = encode_header(MessageHeader(transfer_id, link.outbox.take_seq(0), key, meta, sizes))
        if len(data) + sum(sizes) > ring.max_payload:
            return "lane"
        try:
            if ring.send(KIND_MESSAGE, [data, *payload]):  # flat uint8 frames: no memoryview each
                if link.ring_in is not None:
                    link.ring_in.kick()  # spin for the answer rather than sleep
                return "sent"
        except RingError as exc:
            self._settle(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} broke the ring: {exc}"))
            self._drop(link, exc)
            return "sent"
        if ring.broken is not None:
            self._drop_ring_out(link)
            return "lane"
        return "full"

    def _new_transfer(self, link: PeerLink, nbytes: int, kind: Kind) -> Transfer:
        transfer = Transfer(next(self._ids), link.peer.peer_id, nbytes, on_cancel=self._on_cancel)
        now = self._loop.time()
        link.sent[transfer.id] = _Sent(transfer, kind, now)
        due = link.deadlines.start(transfer.id, now)
        if due is not None:
            link.timer = self._loop.call_at(due, self._deadlines_due, link)
        self.metrics.started(link.peer.peer_id)
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
        expired, due = link.deadlines.fired(self._loop.time())
        link.timer = None if due is None else self._loop.call_at(due, self._deadlines_due, link)
        for transfer_id in expired:
            self._settle(link, transfer_id, DeadlineExceeded(f"no acknowledgement within {link.deadlines.timeout}s"))

    def _settle(self, link: PeerLink, transfer_id: int, error: OmniAsyncError | None) -> None:
        """Settle a transfer: acknowledged (``error`` None), answered with a failure, or given
        up here (deadline, a failed send, the peer's removal)."""
        sent = self._end(link, transfer_id, error)
        if sent is None:
            return
        if error is None:
            sent.transfer.set_done()
        else:
            sent.transfer.set_failed(error)

    def _end(
        self, link: PeerLink, transfer_id: int, error: OmniAsyncError | None, mode: CancelMode = "immediate"
    ) -> _Sent | None:
        """Carry out what the lane protocol decides for a transfer that ends here (``error``:
        given up, or answered with it; a cancel in ``mode``): nothing yet, or forget it (after
        an ``Abort`` if told to).  Returns its record, to settle its handle; None if it was
        settled already or is kept (a ``"wait"`` cancel)."""
        sent = link.sent.get(transfer_id)
        if sent is None:
            return None  # settled already (cancelled, expired, acknowledged)
        current = self._links.get(link.peer.peer_id) is link
        action = GiveUp.SETTLE if error is None or not current else link.outbox.give_up(transfer_id, mode)
        if action is GiveUp.KEEP:
            return None
        del link.sent[transfer_id]  # first: what runs below sees it settled
        link.deadlines.settle(transfer_id)
        if current:
            if action is GiveUp.ABORT and error is not None:  # the receiver's application gets a failed notice
                abort = Abort(transfer_id, error.code, str(error)[:1000])
                link.lane.send(encode_header(abort), HEADER_TAG, _ignore)
            if error is not None:  # (an acknowledged one left the outbox with its last answer, or never entered it)
                _carry_out(link.outbox.forget(transfer_id))
            if link.parked:
                self._unpark(link)  # an answer freed room in the ring (or nothing else is awaited)
        outcome = "ok" if error is None else error.code
        self.metrics.settled(
            sent.kind, sent.transfer.nbytes, outcome, self._loop.time() - sent.started, link.peer.peer_id
        )
        return sent

    # -- cancelling ------------------------------------------------------------------------
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
                if link.sent[transfer_id].transfer.cancel(mode):
                    draining.append(transfer_id)
        return draining

    def _on_cancel(self, transfer: Transfer, mode: CancelMode) -> bool:
        """``transfer.cancel(mode)``: True if it is kept, draining (the handle settles itself
        otherwise)."""
        link = self._links.get(transfer.peer_id)
        if link is None or transfer.id not in link.sent:
            return False
        return self._end(link, transfer.id, TransferCancelled("the sender cancelled the write"), mode) is None

    # -- receiving -------------------------------------------------------------------------
    def _header_arrived(self, link: PeerLink, _tag: int, length: int, message: Any) -> None:
        if length > MAX_HEADER_BYTES:
            self._drop(link, ProtocolError(f"header of {length} bytes exceeds {MAX_HEADER_BYTES}"))
            return
        buffer = np.empty(length, np.uint8)
        link.lane.recv_arrived(buffer, message, partial(self._on_header, link, buffer))

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
            link.lane.recv_arrived_many([link.scratch], message, _ignore)
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
        try:
            take = link.inbox.expect(seq, announced, (buffers, done))
        except ProtocolError as exc:
            self._drop(link, exc)
            return False
        if take is not None:
            link.lane.recv_arrived_many(buffers, take[0], done)
        return True

    def _on_header(self, link: PeerLink, buffer: npt.NDArray[np.uint8], error: BaseException | None) -> None:
        if error is not None:
            return  # the lane is closing; liveness is the control plane's job
        try:
            header: DataHeader = decode_header(buffer.data)
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
            self._answered(link, transfer_id, "", "")

    def _answered(self, link: PeerLink, transfer_id: int, code: str, reason: str) -> None:
        """The peer's answer to one of our requests (``code`` empty: done)."""
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
            _carry_out(posts)

    def _on_write(self, link: PeerLink, req: WriteRequest) -> None:
        """A block write: each run's rows of every region of the set, run by run (gathered:
        one payload message; else one per run and region, in that order).  From a removed peer
        whose lane still drains, a payload is taken into scratch: no row is written (a placed
        write's rows the peer wrote itself: it is still recorded, for its failed notice)."""
        if not req.placed and self._links.get(link.peer.peer_id) is not link:
            self._drain(link, req, InvalidBlocks("the peer was removed"), _ignore)
            return
        messages = 1 if req.gathered else len(req.runs) * len(self._arrays)
        try:
            blocks = validate_write(req, self.region.num_blocks, self.config.max_write_blocks)
        except ProtocolError as exc:
            refuse = self._answerer(link, req, 0, valid=False)
            if refuse is None:
                return
            if req.placed:  # nothing to drain: no payload follows
                log.warning("refused placed write %d from %s: %s", req.transfer_id, link.peer.peer_id, exc)
                if not req.announced:
                    refuse(InvalidBlocks(str(exc)))
                else:
                    self._intend(link, req, refuse, InvalidBlocks(str(exc)))
            else:
                self._drain(link, req, InvalidBlocks(str(exc)), refuse)
            return
        if req.placed and req.notice is None and not req.intent:  # copied already, no notice: answered now
            self._answer(link, req.transfer_id, "blocks", blocks * self.regions.block_bytes, None)
            return
        finish = self._answerer(link, req, blocks * self.regions.block_bytes, valid=True)
        if finish is None:
            return
        if req.placed:  # an intent: the rows will be copied, answered on its commit
            self._intend(link, req, finish, None)
            return
        if not self._admit(link, req.seq, messages, 0):
            return
        rows = self._rows(req.runs)
        if req.gathered:
            self._expect(link, req.seq, rows, finish)  # scattered straight into the region rows
        else:
            parts = _Countdown(len(rows), finish)
            for i, row in enumerate(rows):
                if not self._expect(link, req.seq + i, [row], parts.done):
                    return

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

    def _intend(self, link: PeerLink, req: WriteRequest, answer: Completion, refusal: InvalidBlocks | None) -> None:
        """An intent: the sender copies its rows now; it is answered (``refusal``, or done)
        on its commit, or fails on the write's abort or the peer's loss."""
        if len(link.intents) >= MAX_PENDING_PAYLOADS:
            self._drop(link, ProtocolError(f"over {MAX_PENDING_PAYLOADS} intents awaiting a commit"))
            return
        if (req.transfer_id, req.part) in link.intents:
            error = ProtocolError(f"a second intent of write {req.transfer_id} part {req.part} before its commit")
            self._drop(link, error)
            return
        first = not link.intents
        link.intents[req.transfer_id, req.part] = (answer, refusal)
        # The sender copies now: its commit is near.  Armed once per pending intent (a peer that
        # keeps announcing intents it does not commit cannot keep us polling), and not for a
        # peer in this process (it cannot copy while we poll).
        if first and link.ring_in is not None and _peer_elsewhere(link):
            link.ring_in.stay_awake(INTENT_WAIT)

    def _on_commit(self, link: PeerLink, commit: Commit) -> None:
        """The rows of an intent are copied: answer it (a commit with no intent: dropped)."""
        intent = link.intents.pop((commit.transfer_id, commit.part), None)
        if intent is None:
            error = ProtocolError(f"commit of write {commit.transfer_id} part {commit.part}, which announced no intent")
            self._drop(link, error)
            return
        answer, refusal = intent
        if not link.intents and link.ring_in is not None:
            link.ring_in.stay_awake(0)  # no other commit is due
        answer(refusal)

    def _on_abort(self, link: PeerLink, abort: Abort) -> None:
        """The sender gave a write with a notice up: it fails once the requests seen are in;
        its intents with no commit (a copy that failed) fail now."""
        error = error_from_code(abort.code, abort.reason or "the sender gave the write up")
        self._queue_notices(link.notices.aborted(abort.transfer_id, error))
        for key in [key for key in link.intents if key[0] == abort.transfer_id]:
            answer, _refusal = link.intents.pop(key)
            answer(error)
        if not link.intents and link.ring_in is not None:
            link.ring_in.stay_awake(0)

    def _answerer(self, link: PeerLink, req: WriteRequest, nbytes: int, *, valid: bool) -> Completion | None:
        """What answers this write request: its acknowledgement, through the peer's notice
        book if it carries a notice (``valid``: its rows may be written).  None if the request
        broke the protocol (the peer is dropped)."""
        answer = partial(self._answer, link, req.transfer_id, "blocks", nbytes)
        if req.notice is None:
            return answer
        limit = self.config.max_notice_bytes
        try:
            if not limit or len(req.notice) > limit:
                raise ProtocolError(f"notice of {len(req.notice)} bytes exceeds this side's limit of {limit}")
            link.notices.seen(req.transfer_id, req.part, req.parts, req.runs if valid else [], req.notice)
        except ProtocolError as exc:
            self._drop(link, exc)
            return None
        return partial(self._answer_noticed, link, req.transfer_id, answer)

    def _answer_noticed(
        self, link: PeerLink, transfer_id: int, answer: Completion, error: BaseException | None
    ) -> None:
        """A request of a write with a notice is done: the acknowledgement that completes
        the write waits until its notice is queued (and the notices before it)."""
        if self._links.get(link.peer.peer_id) is not link:
            return  # the peer is gone: its notice book already failed the write
        failed = None if error is None else sink_error(error)
        held, ready = link.notices.done(transfer_id, failed, partial(answer, error))
        if not held:
            answer(error)
        self._queue_notices(ready)

    def _queue_notices(self, ready: list[tuple[Notice, list[Callable[[], None]]]]) -> None:
        for notice, acks in ready:
            self.notices.offer(notice, partial(_carry_out, acks))

    def _drain(self, link: PeerLink, req: WriteRequest, reason: InvalidBlocks, refuse: Completion) -> None:
        """Take a refused write's payload (truncated into scratch: nothing is allocated, nothing
        lingers in UCX's queues), then send the refusal."""
        lens = self.regions.block_lens
        sizes = [count * block_len for _, count in req.runs for block_len in lens]
        if not self._admit(link, req.seq, 1 if req.gathered else len(sizes), 0):
            return
        log.warning("refused write %d from %s: %s", req.transfer_id, link.peer.peer_id, reason)
        parts = _Countdown(1 if req.gathered else len(sizes), lambda _error: refuse(reason))
        if req.gathered:
            self._expect(link, req.seq, [link.scratch], parts.done, sum(sizes))
        else:
            for i, size in enumerate(sizes):
                if not self._expect(link, req.seq + i, [link.scratch], parts.done, size):
                    return

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
            self._expect(link, hdr.seq, receiving, deliver)  # one message scattered over the frames
        else:
            deliver(None)

    def _on_ring_message(self, link: PeerLink, hdr: MessageHeader, record: memoryview) -> None:
        """A chunk message whose frames follow its header in a ring record: copy them out
        (the record is valid only during this call) and deliver.  Raises ProtocolError.

        One allocation for all the frames, each copied once into its own 64-byte aligned
        slice of it (a sink that keeps one frame keeps the message's bytes alive): from the
        receive pool for messages of ``POOL_MIN`` bytes or more (memory that stays mapped,
        reused once the frames are dropped), else a fresh array."""
        nbytes = validate_message(hdr, self.config.max_message_bytes)
        offset = 4 + int.from_bytes(record[:4], "little")  # past the header's length prefix
        if offset + nbytes != len(record):
            raise ProtocolError(f"ring message of {len(record)} bytes, its header announced {offset + nbytes}")
        link.inbox.admit(hdr.seq, 0, nbytes)
        slots = [-(-size // _FRAME_ALIGN) * _FRAME_ALIGN for size in hdr.frames]
        total = sum(slots)
        body = None
        if nbytes >= POOL_MIN:
            if self._pool is None:
                self._pool = ReceivePool(RECEIVE_POOL_BYTES)
            body = self._pool.take(total)
        if body is None:
            body = np.empty(total, np.uint8)
        out = body.data
        frames, start = [], 0
        for size, slot in zip(hdr.frames, slots, strict=True):
            out[start : start + size] = record[offset : offset + size]
            frames.append(body[start : start + size])
            offset += size
            start += slot
        self._deliver(link, hdr, frames, nbytes, None, ring=True)

    def _deliver(
        self, link: PeerLink, hdr: MessageHeader, frames: Frames, nbytes: int, error: BaseException | None,
        *, ring: bool = False,
    ) -> None:
        """Hand a received message to the sink and answer it: when the sink returns (from a
        ring batch, ``ring``: with the batch's other acknowledgements, see :meth:`_flush_acks`),
        or when the awaitable it returned completes."""
        link.inbox.received(nbytes)  # received (or failed): the sink owns the frames now
        transfer_id = hdr.transfer_id
        if error is not None or self._links.get(link.peer.peer_id) is not link:
            self._answer(link, transfer_id, "messages", nbytes, error)  # a leaving or removed peer's: not acknowledged
            return
        sink = self.message_sink
        if sink is None:
            self._answer(link, transfer_id, "messages", nbytes, TransferFailed("the receiver takes no messages"))
            return
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
            asyncio.ensure_future(pending).add_done_callback(partial(self._sink_done, answer))
        elif ring:
            self.metrics.answered("messages", nbytes, "ok", link.peer.peer_id)
            link.acks.append(transfer_id)
            if len(link.acks) >= ACK_BATCH:
                self._flush_acks(link)
        else:
            self._answer(link, transfer_id, "messages", nbytes, None)

    @staticmethod
    def _sink_done(answer: Callable[[BaseException | None], None], task: asyncio.Future[None]) -> None:
        if task.cancelled():
            answer(TransferFailed("the receiver cancelled the message"))
            return
        error = task.exception()
        if error is not None and not isinstance(error, OmniAsyncError):
            log.error("message sink failed", exc_info=error)
            error = TransferFailed(f"the receiver failed: {error!r}")
        answer(error)

    def _answer(self, link: PeerLink, transfer_id: int, kind: Kind, nbytes: int, error: BaseException | None) -> None:
        """Acknowledge an incoming transfer, or report why it failed, unless the lane is gone."""
        if self._links.get(link.peer.peer_id) is not link:
            return
        failed = None if error is None else sink_error(error)
        ack = Ack(transfer_id) if failed is None else Ack(transfer_id, failed.code, str(failed)[:1000])
        self._send_header(link, ack, _ignore)  # first: the sender waits for it, not for our metrics
        self.metrics.answered(kind, nbytes, "ok" if failed is None else failed.code, link.peer.peer_id)

    def _flush_acks(self, link: PeerLink) -> None:
        """Send the acknowledgements held in :attr:`PeerLink.acks` (end of a ring batch, or
        ``ACK_BATCH`` of them): one :class:`Ack`, or one :class:`Acks` for several."""
        if not link.acks:
            return
        ids, link.acks = link.acks, []
        if self._links.get(link.peer.peer_id) is link:
            self._send_header(link, Ack(ids[0]) if len(ids) == 1 else Acks(ids), _ignore)

    # -- lifecycle -------------------------------------------------------------------------
    _HANDLERS: ClassVar[dict[type[DataHeader], Callable[..., None]]] = {
        Goodbye: _on_goodbye,
        Ack: _on_ack,
        Acks: _on_acks,
        WriteRequest: _on_write,
        RingOffer: _on_ring_offer,
        RkeyOffer: _on_rkey_offer,
        ReadRequest: _on_read,
        Commit: _on_commit,
        Abort: _on_abort,
        MessageHeader: _on_message,
    }
    """Each data header's handler ``(self, link, header)``: every type of ``DataHeader``."""
    _RING_HANDLERS: ClassVar[dict[type[DataHeader], Callable[..., None]]] = {
        WriteRequest: _on_write,
        Ack: _on_ack,
        Acks: _on_acks,
        Commit: _on_commit,
    }
    """The handlers of the headers a peer may put into its ring as ``KIND_HEADER`` records."""

    async def close(self) -> None:
        """Fail every in-flight transfer with :class:`ClosedError`, drain and close all lanes
        and wait until UCX released them.  Idempotent."""
        if not self._closed:
            self._closed = True
            for peer_id in list(self._links):
                self.remove_peer(peer_id, ClosedError("transport closed"), orderly=True)
            self.notices.close()
        await asyncio.gather(*list(self._drains))
        await asyncio.gather(*(lane.wait_closed() for lane in list(self._closing)))
        if self._keyings:
            await asyncio.wait(list(self._keyings))
        registration, self._registration = self._registration, None
        if registration is not None:  # no lane is left to put into the regions
            registration.close()

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


@dataclass(frozen=True, slots=True)
class _Tag:
    """The notice of a write and which of its requests this is."""

    data: bytes
    part: int
    parts: int


def _write_request(
    transfer_id: int,
    seq: int,
    runs: list[Run],
    tag: _Tag | None,
    *,
    gathered: bool = True,
    placed: bool = False,
    intent: bool = False,
    part: int = 0,
    parts: int = 1,
) -> WriteRequest:
    """A write request's header; ``part`` of ``parts`` unless the notice's ``tag`` says."""
    pairs = [(remote, length) for _local, remote, length in runs]
    if tag is None:
        return WriteRequest(transfer_id, seq, pairs, gathered, placed, part=part, parts=parts, intent=intent)
    return WriteRequest(transfer_id, seq, pairs, gathered, placed, tag.data, tag.part, tag.parts)


def _request_blocks(request: list[Run], blocks: int, requests: int) -> int:
    """Blocks of one request of a write of ``blocks`` split into ``requests``."""
    return blocks if requests == 1 else sum(run[2] for run in request)


def _awaits_answer(link: PeerLink) -> bool:
    """Whether an answer from the peer is due and may come while this thread spins: a transfer
    awaits its acknowledgement and the peer runs in another process (one in this process
    cannot answer while we spin: a spin there only delays it)."""
    return bool(link.sent) and _peer_elsewhere(link)


def _peer_elsewhere(link: PeerLink) -> bool:
    """Whether the peer runs in another process, as far as its ring says (no ring: unknown,
    False)."""
    ring = link.ring_out
    return ring is not None and not ring.in_this_process


def _follows_ring(header: DataHeader) -> bool:
    """Whether a header that came over UCX may refer to records the peer put into its ring
    before it: a commit, an abort, a write with a notice (write order), a goodbye (what the peer
    put into the ring before it left comes first)."""
    return isinstance(header, Commit | Abort | Goodbye) or (
        isinstance(header, WriteRequest) and header.notice is not None
    )


def _nothing() -> None:
    """Release of a notice with no acknowledgement held (its sender is gone)."""


def _carry_out(posts: list[Callable[[], None]]) -> None:
    """Post the requests the lane protocol released, in order."""
    for post in posts:
        post()


def _ignore(_error: BaseException | None) -> None:
    """Completion of a best-effort send (an acknowledgement)."""
