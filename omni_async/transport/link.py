"""What the transport keeps per peer (:class:`PeerLink`, its transfers in flight among it), and
the types of chunk messages.  No I/O: plain records that the transport's
parts (:mod:`.core`, :mod:`.peers`, :mod:`.block_writes`, :mod:`.incoming_writes`, :mod:`.messages`) read and
update on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import (
    OmniAsyncError,
)
from ..handshake import PeerInfo
from ..wire import MAX_PENDING_PAYLOADS, RingOffer
from .lane import RNDV_THRESH_SHM, Completion, Lane
from .limits import Window
from .notices import NoticeBook
from .protocol import Deadlines, Drain, Inbox, Outbox
from .samehost import RingReceiver, RingSender
from .shared import Writers
from .transfer import Transfer

Frames = list[npt.NDArray[np.uint8]]
Message = tuple[int, str, bytes, list[int], Frames]
"""A chunk message to post: ``(transfer_id, key, meta, frame sizes, non-empty frames)``."""
MessageSink = Callable[[str, str, bytes, Frames], Awaitable[None] | None]
"""``sink(peer_id, key, meta, frames)``: a received message, its frames now owned by the sink
(large ones from a same-host ring are views of the receive pool, :mod:`.pool`: their memory
goes back to it when the last reference to them is dropped; nothing else releases it).

The acknowledgement (which settles the sender's transfer) is sent when the sink returns, or,
if it returns an awaitable, when that completes: a slow sink back-pressures the sender.
"""
MessageRetract = Callable[[str, str, "asyncio.Future[Any]"], None]
"""``retract(peer_id, key, pending)``: the peer gave up (deadline, cancel) the message it sent
under ``key`` while ``pending`` has not completed, and was told it failed: drop what is held of
that message (not a later one under the same key), and complete, fail or cancel ``pending``,
which sends the answer.  ``pending`` runs what the sink returned for the message: that
awaitable itself if it was a future, else its task."""


@dataclass(eq=False)
class PeerLink:
    """Everything the transport keeps about one peer (read-only outside the transport: see
    :attr:`~.ucx.UcxTransport.links`)."""

    peer: PeerInfo
    lane: Lane
    deadlines: Deadlines
    """When the transfers to the peer run out of time (one timer for all: :attr:`timer`)."""
    inbox: Inbox[tuple[list[npt.NDArray[np.uint8]], Completion]] = field(init=False)
    """Payload messages matched to their headers: each goes to (buffers, done); the buffers
    may be shorter than the announced length (a refused write's payload is received into a
    1-byte scratch buffer: UCX truncates it)."""
    sent: dict[int, Transfer] = field(default_factory=dict)
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
    headers: deque[list[Any]] = field(default_factory=deque)
    """The headers probed on the lane and not handled yet, in arrival order: ``[buffer,
    outcome]`` each, ``outcome`` :data:`~.core.RECEIVING` until its receive completes, then its
    error or None.  Handled from the front only, so in tag order (a rendezvous header completes
    after smaller ones that arrived behind it); a closing lane fails every receive, emptying it."""
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
    ring_offered: bool = False
    """The peer offered its ring (one offer per link: a second breaks the protocol)."""
    ring_offer: RingOffer | None = None
    """The peer's ring offer, kept until its process is proven (:attr:`proof`)."""
    proof: str = ""
    """The memfd name (:func:`~.pid_proof.proof_name`) of our :class:`~omni_async.wire.ProofRequest`
    to a peer on this host, once sent; "" if none was."""
    proof_at: int = -1
    """The descriptor the peer said holds our proof, in its process (-1: none)."""
    proving: asyncio.Future[None] | None = None
    """Done once the peer answered our ProofRequest (:attr:`proven`), or the link ended (None:
    none was sent)."""
    proof_asked: bool = False
    """The peer sent its ProofRequest (one per link)."""
    proof_fd: int = -1
    """The memfd that answers the peer's ProofRequest, held while the link lives; -1: none."""
    parked: deque[Message] = field(default_factory=deque)
    """Chunk messages waiting, in order, for room in the peer's ring (see ``_may_park``)."""
    unparking: bool = False
    """True while :meth:`~.messages.Messages._unpark` posts the parked messages (it is not
    re-entered: see there)."""
    remote_keys: list[int] | None = None
    """The peer's remote keys (one per region, unpacked on the lane, which owns them) once it
    offered them and they passed vetting: block writes without a notice go as puts (see
    :mod:`.rma`); None: as tag messages."""
    keying: asyncio.Task[None] | None = None
    """Vetting and unpacking the peer's offered keys, while it runs."""
    flushing: dict[int, int] = field(default_factory=dict)
    """Put requests posted to the peer whose flush has not completed yet, by transfer."""
    early_answers: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    """The peer's answers to a transfer in :attr:`flushing`, held until its flushes completed
    (a put write's ``placed`` header goes before its puts: the answer may come first)."""
    reads_served: int = 0
    """The peer's read requests this side serves now (writes to it not settled yet)."""
    reads_refused: int = 0
    """The peer's read requests refused because :data:`~.block_writes.MAX_SERVED_READS` were
    being served, or for asking for more blocks than its region has rows (the first is logged)."""
    sinking: dict[int, tuple[str, asyncio.Future[Any]]] = field(default_factory=dict)
    """The peer's chunk messages whose sink returned an awaitable not completed yet (their
    answer waits for it): key and the future running that awaitable, by transfer.  An
    ``Abort`` retracts them."""
    arriving: dict[int, bool] = field(default_factory=dict)
    """The peer's chunk messages whose header was handled and whose payload has not arrived,
    by transfer: True once the peer gave it up (its ``Abort``): then it is answered as
    cancelled when it arrives, never delivered."""
    tail_acked: list[int] = field(default_factory=list)
    """The peer's writes that its ring records' consumption answers, handled in the ring
    batch being taken: at its end we wake the peer if it sleeps (or acknowledge them, where
    we cannot), and count them in the metrics."""
    tail_bytes: int = 0
    """The bytes of :attr:`tail_acked`: counted at the batch's end, after the records were
    given back (the peer waits for that, not for our metrics)."""
    acks: list[int] = field(default_factory=list)
    """Chunk messages from the peer's ring delivered (and their sink done) in the ring batch
    being taken: acknowledged together, at most ``ACK_BATCH`` to an :class:`~omni_async.wire.Acks`."""

    receive_bytes: InitVar[int] = 0
    """The receiver's budget for this peer's chunk buffers (``receive_budget``)."""

    @property
    def proven(self) -> bool:
        """The peer answered our ProofRequest (on a live link): a process holding :attr:`proof`
        at :attr:`proof_at` is the peer's."""
        return self.proving is not None and self.proving.done()

    def __post_init__(self, receive_bytes: int) -> None:
        self.outbox = Outbox(Window(self.peer.max_message_bytes))
        # A gathering lane is a same-host one (shared memory): a header may go by rendezvous.
        self.inbox = Inbox(receive_bytes, rendezvous_bytes=RNDV_THRESH_SHM if self.gather else None)
        self.drain = Drain(self.inbox)
        # The sender's window counts each request with a notice as a payload message.
        self.notices = NoticeBook(self.peer.peer_id, 2 * MAX_PENDING_PAYLOADS)


def awaits_answer(link: PeerLink) -> bool:
    """Whether an answer from the peer is due and may come while this thread spins: a transfer
    awaits its acknowledgement and the peer runs in another process (one in this process
    cannot answer while we spin: a spin there only delays it)."""
    return bool(link.sent) and peer_elsewhere(link)


def peer_elsewhere(link: PeerLink) -> bool:
    """Whether the peer runs in another process, as far as its ring says (no ring: unknown,
    False)."""
    ring = link.ring_out
    return ring is not None and not ring.in_this_process
