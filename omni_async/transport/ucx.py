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

The transport is put together from one module per concept: :mod:`.link` (what it keeps per
peer), :mod:`.core` (transfers, arrivals), :mod:`.peers` (adding, removing, draining peers),
:mod:`.block_writes` (writes and reads, sending), :mod:`.incoming_writes` (writes, receiving)
and :mod:`.messages` (chunk messages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from ..wire import (
    Abort,
    Ack,
    Acks,
    Commit,
    DataHeader,
    Goodbye,
    MessageHeader,
    ProofReady,
    ProofRequest,
    ReadRequest,
    RingOffer,
    RkeyOffer,
    WriteRequest,
)
from .block_writes import BlockWrites
from .core import TransportCore
from .incoming_writes import IncomingWrites
from .link import PeerLink
from .messages import Messages
from .peers import Peers


class UcxTransport(Peers, BlockWrites, IncomingWrites, Messages):
    """Data plane of one agent over ``region`` (or a region set: every block index names its
    block in each region, and moves in all of them).  All methods run on the agent's event loop.

    ``fault(peer_id, error)`` is called when a peer broke the protocol; the owner should drop
    it (``remove_peer``).  Chunk messages go to :attr:`message_sink` (unset: refused).
    """

    def _on_abort(self, link: PeerLink, abort: Abort) -> None:
        """The peer gave a transfer up: a write of its with a notice fails, a message of its
        that a sink still holds is let go."""
        self._abort_write(link, abort)
        self._retract_message(link, abort.transfer_id)

    _HANDLERS: ClassVar[dict[type[DataHeader], Callable[..., None]]] = {
        Goodbye: TransportCore._on_goodbye,
        Ack: TransportCore._on_ack,
        Acks: TransportCore._on_acks,
        WriteRequest: IncomingWrites._on_write,
        RingOffer: Peers._on_ring_offer,
        ProofRequest: Peers._on_proof_request,
        ProofReady: Peers._on_proof_ready,
        RkeyOffer: Peers._on_rkey_offer,
        ReadRequest: BlockWrites._on_read,
        Commit: IncomingWrites._on_commit,
        Abort: _on_abort,
        MessageHeader: Messages._on_message,
    }
    _RING_HANDLERS: ClassVar[dict[type[DataHeader], Callable[..., None]]] = {
        WriteRequest: IncomingWrites._on_ring_write,
        Ack: TransportCore._on_ack,
        Acks: TransportCore._on_acks,
        Commit: IncomingWrites._on_commit,
    }
