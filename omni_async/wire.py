"""The wire format, free of I/O: message structs, limits, tags, encoding and validation.

Two families of messages travel between peers:

* control messages over ZeroMQ (:data:`ControlMessage`): the handshake, heartbeats and goodbye;
* data-plane headers over UCX tag messages (:data:`DataHeader`): a block write request, a
  chunk message header and the receiver's acknowledgement.  The payload bytes follow as separate
  UCX messages whose tags are built by :func:`data_tag`.

Every decoder accepts ``bytes`` and either returns a fully validated struct or raises
:class:`~omni_async.errors.ProtocolError`; nothing else escapes, whatever the input.
"""

from __future__ import annotations

import struct
from typing import Annotated, Final, TypeAlias, TypeVar

import msgspec

from .errors import ProtocolError

T = TypeVar("T")

PROTOCOL_VERSION: Final = 6

# -- limits ---------------------------------------------------------------------------------
MAX_CONTROL_BYTES: Final = 64 * 1024
"""Largest control message accepted from ZeroMQ: above the largest :class:`Hello` the bounds
below allow (~30 KiB: 255 layers, each with a region share; a 16 KiB bound made a region set
of 255 wrapped regions unable to join: ZeroMQ dropped its Hello)."""
MAX_METADATA_BYTES: Final = 4096
"""Largest agent metadata (a UCX worker address is ~100-200 bytes)."""
MAX_PEER_ID: Final = 256
MAX_REASON: Final = 1024
MAX_HEADER_BYTES: Final = 64 * 1024
"""Largest data-plane header (length prefix included); the receive buffer per peer."""
MAX_RUNS: Final = 4096
"""Most runs in one block write."""
MAX_FRAMES: Final = 1024
"""Most payload frames in one chunk message."""
MAX_KEY: Final = 1024
MAX_META_BYTES: Final = 48 * 1024
MAX_ACKS: Final = 1024
"""Most transfers one :class:`Acks` acknowledges."""
I64: Final = (1 << 63) - 1
RUNS_PER_REQUEST: Final = 3072
"""Most runs a sender puts in one :class:`WriteRequest`: the worst case (every number a
9-byte msgpack integer, 19 bytes a run) still fits in :data:`MAX_HEADER_BYTES`."""
MAX_PENDING_PAYLOADS: Final = 8192
"""Most payload messages a receiver holds state for per peer (announced by a header and not
received yet, or arrived before their header); a sender keeps its unacknowledged ones within."""
MIN_RECEIVE_BUDGET: Final = 64 << 20
"""Floor of a receiver's per-peer budget for chunk-message buffers (see ``limits.receive_budget``)."""
DEFAULT_MAX_WRITE_BLOCKS: Final = 1 << 20
"""A receiver's ``max_write_blocks`` when its Hello does not announce one."""
DEFAULT_MAX_MESSAGE_BYTES: Final = 1 << 30
"""A receiver's ``max_message_bytes`` when its Hello does not announce one."""
MAX_LAYERS: Final = 256
"""Most regions in a region set (a block index moves its block in each)."""
READ_RUNS_PER_REQUEST: Final = 2048
"""Most runs in one :class:`ReadRequest` (three 9-byte integers a run in the worst case)."""
MAX_NOTICE_RUNS: Final = 1 << 18
"""Most runs one write with a notice names once split into requests (its receiver keeps every
part's runs until the write is notified; so also its most parts): a sender refuses a larger
one locally (``InvalidBlocks``), a receiver drops a peer that sends one."""
NOTICE_BOOK_RUNS: Final = 4 * MAX_NOTICE_RUNS
"""Most runs a receiver keeps per peer for its writes with notices not notified yet (each part
counts its runs, at least one): four of the largest writes at once, ~64 MiB; more drops the peer."""
MAX_NOTICE_BYTES: Final = 4096
"""Largest notice a write request may carry (a worst-case request still fits
:data:`MAX_HEADER_BYTES` with it); a receiver announces its own limit, at most this."""

PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PEER_ID)]
Fingerprint = Annotated[str, msgspec.Meta(max_length=64)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON)]
Code = Annotated[str, msgspec.Meta(max_length=32)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=I64)]  # msgspec bounds stop at int64
Count = Annotated[int, msgspec.Meta(ge=1, le=I64)]


def bounded_reason(text: str) -> str:
    """``text`` cut to :data:`MAX_REASON` characters, as a :data:`Reason` must be (msgspec checks
    the bound only when the peer decodes: a longer one made its whole message undecodable)."""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True, tag_field="t"):
    pass


# -- control plane (ZeroMQ) ------------------------------------------------------------------
class RegionShare(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """How a peer on the same host may write this side's region with one copy.

    ``pid`` is the advertising process.  With ``fd >= 0`` and ``inode == 0``, ``fd`` and
    ``token`` name the sealed memfd its region lives in (:mod:`omni_async.memfd`), which the
    peer maps through ``/proc/<pid>/fd/<fd>`` after checking the token.  With ``fd >= 0`` and
    ``inode > 0``, ``fd`` is the tmpfs file (``inode``, sealed against shrinking) that a
    wrapped region is a shared mapping of, the region starting ``offset`` bytes into it, and ``proof_fd`` an empty memfd
    named by ``token`` that proves ``pid`` offers it (:class:`omni_async.memfd.SharedFile`).
    With ``fd == -1`` the peer may write the region at ``base_addr`` with
    ``process_vm_writev`` once it has read ``token`` at ``proof_addr`` in that process (proof
    that ``pid`` is the peer, not a process it names).  See :mod:`omni_async.transport.shared`.
    """

    pid: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    fd: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)] = -1
    token: Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{32})?$")] = ""
    proof_addr: NonNeg = 0
    inode: NonNeg = 0
    offset: NonNeg = 0
    proof_fd: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)] = -1


class Layer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One more region of a region set: its address, block length and same-host offer (the
    first region is described by the :class:`Hello` itself)."""

    base_addr: NonNeg
    block_len: Count
    region_share: RegionShare | None = None


class Hello(_Msg, tag="hello", frozen=True):
    """First message of a handshake; :class:`Welcome` is the same description of the other side.

    ``agent_metadata`` is the address of the UCX lane the sender opened for the receiver.
    ``nonce`` identifies one incarnation of a service: a restarted peer comes back with a new one.
    """

    version: int
    peer_id: PeerId
    nonce: NonNeg
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA_BYTES)]
    base_addr: NonNeg
    num_blocks: Count
    block_len: Count
    fingerprint: Fingerprint
    host_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    """Identifies the sender's machine (kernel boot id): peers on one host gather writes."""
    max_write_blocks: Count = DEFAULT_MAX_WRITE_BLOCKS
    """Most blocks the sender accepts in one incoming write request (its receive limit)."""
    max_message_bytes: Count = DEFAULT_MAX_MESSAGE_BYTES
    """Largest incoming chunk message the sender accepts (all frames together)."""
    region_share: RegionShare | None = None
    """Offered to peers with the same ``host_id`` (None: write through UCX only)."""
    max_notice_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_NOTICE_BYTES)] = 0
    """Largest notice the sender accepts on an incoming write (0: it takes none)."""
    allow_reads: bool = False
    """Peers may read the sender's region (``read_blocks``)."""
    layers: Annotated[list[Layer], msgspec.Meta(max_length=MAX_LAYERS - 1)] = []
    """The other regions of the sender's region set, in order (empty: one region)."""


class Welcome(Hello, tag="welcome", frozen=True):
    """Accepts a :class:`Hello`; describes the accepting side."""


class Reject(_Msg, tag="reject", frozen=True):
    """Refuses a :class:`Hello`; ``code`` names the error type (see :mod:`omni_async.errors`)."""

    code: Code
    reason: Reason


class Heartbeat(_Msg, tag="hb", frozen=True):
    """Liveness signal, sent every heartbeat interval in both directions."""


class Bye(_Msg, tag="bye", frozen=True):
    """Orderly goodbye: the sender is closing and forgets the receiver."""

    reason: Reason = ""


ControlMessage: TypeAlias = Hello | Welcome | Reject | Heartbeat | Bye


# -- data plane headers (UCX) ----------------------------------------------------------------
class WriteRequest(_Msg, tag="w", frozen=True):
    """A block write: ``runs`` are ``(remote_start, count)``.

    ``gathered``: all runs travel as one payload message tagged ``seq``; otherwise run ``i`` is
    its own message tagged ``seq + i``.  ``placed``: no payload follows, the sender already
    copied the rows into the receiver's region (same host, see
    :mod:`omni_async.transport.shared`); the receiver checks the runs and acknowledges.

    ``notice``: the receiver's application is told (with this data) once every request of the
    transfer is in place, before the acknowledgement that settles it; a transfer split into
    ``parts`` requests carries it on each, numbered by ``part``.

    A request that is both ``placed`` and carries a ``notice`` (or sets ``intent``) is an
    *intent*: it announces the rows before the sender copies into them (through the same-host
    ring, so that the receiver knows of it even if the sender dies during the copy); a
    :class:`Commit` finishes it.  A large write without a notice is announced too (``intent``),
    so that the receiver is awake for its commit rather than woken after the copy.

    ``tail``: a placed request without a notice, not an intent, alone in its transfer, whose
    sender takes the receiver's consumption of its ring record as the acknowledgement (the ring's tail passing
    it, once every record before it was handled): taken from the ring and valid, it is
    answered by no :class:`Ack` (unless the receiver cannot wake the sender through the
    sender's own ring: then as any other); taken from the ring and invalid, it breaks the
    protocol (the sender checked it against the receiver's layout).  Over the lane it is
    answered as any other.
    """

    transfer_id: NonNeg
    seq: NonNeg
    runs: Annotated[list[tuple[NonNeg, Count]], msgspec.Meta(min_length=1, max_length=MAX_RUNS)]
    gathered: bool = True
    placed: bool = False
    notice: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTICE_BYTES)] | None = None
    part: NonNeg = 0
    parts: Count = 1
    intent: bool = False
    tail: bool = False

    @property
    def announced(self) -> bool:
        """Whether this is an intent (a :class:`Commit` follows the copy)."""
        return self.placed and (self.intent or self.notice is not None)


class MessageHeader(_Msg, tag="m", frozen=True):
    """A chunk message: opaque ``meta`` plus frames of the given sizes; the non-empty frames
    travel as one payload message tagged ``seq``."""

    transfer_id: NonNeg
    seq: NonNeg
    key: Annotated[str, msgspec.Meta(max_length=MAX_KEY)]
    meta: Annotated[bytes, msgspec.Meta(max_length=MAX_META_BYTES)]
    frames: Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_FRAMES)]


class Ack(_Msg, tag="a", frozen=True):
    """The receiver's verdict on one transfer: ``code == ""`` means the data is in place."""

    transfer_id: NonNeg
    code: Code = ""
    reason: Reason = ""


class Acks(_Msg, tag="as", frozen=True):
    """Successful acknowledgements of several transfers at once (each what an :class:`Ack`
    with an empty ``code`` says of one): the chunk messages a receiver delivered from one
    batch of same-host ring records, answered with one record instead of one each."""

    transfer_ids: Annotated[list[NonNeg], msgspec.Meta(min_length=1, max_length=MAX_ACKS)]


class ReadRequest(_Msg, tag="r", frozen=True):
    """Asks the peer to write its rows into ours: ``runs`` are ``(peer_start, our_start,
    count)``.  The peer answers with an ordinary block write of those rows, then, once that
    write is acknowledged, an :class:`Ack` for ``transfer_id`` (or a failed one: reads not
    allowed, rows out of range).  A read with more runs is several requests of one transfer."""

    transfer_id: NonNeg
    runs: Annotated[
        list[tuple[NonNeg, NonNeg, Count]], msgspec.Meta(min_length=1, max_length=READ_RUNS_PER_REQUEST)
    ]


class Abort(_Msg, tag="x", frozen=True):
    """The sender gave up a write with a notice after posting some of it (deadline, cancel):
    the receiver reports it failed, with ``code`` and ``reason``, once the requests it has
    seen are in (their payload may still be landing)."""

    transfer_id: NonNeg
    code: Code = ""
    reason: Reason = ""


class Commit(_Msg, tag="c", frozen=True):
    """The rows that request ``part`` of write ``transfer_id`` announced (an intent: a placed
    :class:`WriteRequest` with a notice or ``intent``) are copied: the receiver answers it now.  A commit
    with no intent before it is a protocol violation."""

    transfer_id: NonNeg
    part: NonNeg = 0


class Goodbye(_Msg, tag="g", frozen=True):
    """The sender's last message on a lane: it sends nothing more.  Both sides send one when a
    peer leaves in order, and close the lane once they have the other's and nothing is pending."""


MIN_RING_CAPACITY: Final = 1 << 18
"""Smallest ring a :class:`RingOffer` may offer: one whose records carry any data header (a
record's payload is at most half the ring less its 8-byte frame; the largest, a pooled
message's header, is a length-prefixed header of up to :data:`MAX_HEADER_BYTES`)."""
MAX_POOL_BYTES: Final = (1 << 30) + 64
"""Largest shared pool a :class:`RingOffer` may offer: a 1 GiB arena (``shared_pool_mib``'s
largest) and its 64-byte control line."""


class RingOffer(_Msg, tag="ring", frozen=True):
    """A peer on this host offers a ring for the headers this side sends it (see
    :mod:`omni_async.transport.samehost`): the sealed memfd ``fd`` of process ``pid`` named by
    ``token`` holds a ring of ``capacity`` data bytes; ``wake_fd`` is the write end of the pipe
    it sleeps on; large chunk frames may be copied straight into its ``pool``.  A ring below
    :data:`MIN_RING_CAPACITY` breaks the protocol (the offer does not decode)."""

    pid: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    fd: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
    token: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    wake_fd: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
    capacity: Annotated[int, msgspec.Meta(ge=MIN_RING_CAPACITY, le=1 << 30)]
    pool: Annotated[int, msgspec.Meta(ge=0, le=MAX_POOL_BYTES)] = 0
    """Bytes of a shared receive pool after the ring in the same memfd (its control line and
    arena, :class:`~omni_async.transport.pool.SharedPool`); 0: none."""


MAX_RKEY_BYTES: Final = 4096
"""Largest packed UCX remote key a :class:`RkeyOffer` may carry (tcp's are tens of bytes)."""


class RkeyOffer(_Msg, tag="rkey", frozen=True):
    """A peer without a same-host writer offers one-sided puts into its region set: the packed
    UCX remote key of each region, in order (see :mod:`omni_async.transport.rma`).  The
    receiver may then write rows with puts and a flush, and send a ``placed``
    :class:`WriteRequest` once the flush completed."""

    keys: Annotated[list[Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_RKEY_BYTES)]],
                    msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]


class ProofRequest(_Msg, tag="proof?", frozen=True):
    """A peer on this host asks which process this side is (see
    :mod:`omni_async.transport.pid_proof`): hold open an empty memfd named
    ``proof_name(nonce, <its peer id>)`` for the link's life, then answer :class:`ProofReady`.
    One per link: a second breaks the protocol."""

    nonce: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class ProofReady(_Msg, tag="proof", frozen=True):
    """The answer to this side's :class:`ProofRequest` of ``nonce``: the proof is held, at
    descriptor ``fd`` of the answering process (-1: it could not be made).  One that answers no
    request of ours breaks the protocol."""

    nonce: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    fd: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)] = -1


DataHeader: TypeAlias = (
    WriteRequest | ReadRequest | MessageHeader | Ack | Acks | Abort | Commit | Goodbye | RingOffer | RkeyOffer
    | ProofRequest | ProofReady
)

_control_decoder: msgspec.msgpack.Decoder[ControlMessage] = msgspec.msgpack.Decoder(ControlMessage)
_data_decoder: msgspec.msgpack.Decoder[DataHeader] = msgspec.msgpack.Decoder(DataHeader)
_encoder = msgspec.msgpack.Encoder()
_LEN = struct.Struct("<I")
_MAX_BODY: Final = MAX_HEADER_BYTES - _LEN.size


def encode_control(msg: ControlMessage) -> bytes:
    """Encode a control message for ZeroMQ."""
    return _encoder.encode(msg)


def decode_control(data: bytes) -> ControlMessage:
    """Decode and validate one control message; raise :class:`ProtocolError` on anything wrong."""
    msg: ControlMessage = decode_bounded(_control_decoder, data, MAX_CONTROL_BYTES, "control message")
    if isinstance(msg, Hello):  # Welcome too; the version is checked by the handshake
        check_layout(msg.base_addr, msg.num_blocks, msg.block_len)
        for layer in msg.layers:
            check_layout(layer.base_addr, msg.num_blocks, layer.block_len)
    return msg


def check_layout(base_addr: int, num_blocks: int, block_len: int) -> None:
    """A region layout must fit in the (signed) 64-bit address space."""
    if base_addr + num_blocks * block_len > I64 + 1:
        raise ProtocolError(
            f"region at {base_addr:#x} of {num_blocks}x{block_len} bytes overflows the 63-bit address space"
        )


def encode_header(msg: DataHeader) -> bytes:
    """Encode a data-plane header with its 4-byte length prefix (the receiver's buffer is fixed)."""
    return with_length(encode_record(msg))


def encode_record(msg: DataHeader) -> bytes:
    """Encode a data-plane header without a length prefix: a same-host ring record's payload
    (the ring frames it), or, through :func:`with_length`, a header for the UCX lane.  Raises
    :class:`ProtocolError` if it would not fit the lane's header buffer either."""
    body = _encoder.encode(msg)
    if len(body) > _MAX_BODY:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {_MAX_BODY}")
    return body


def with_length(body: bytes) -> bytes:
    """A header from :func:`encode_record` as the UCX lane carries it: its length, then it."""
    return _LEN.pack(len(body)) + body


def decode_record(payload: bytes | memoryview) -> DataHeader:
    """Decode a data-plane header that fills ``payload`` (a ring record's, no length prefix);
    raise :class:`ProtocolError` on anything wrong."""
    if len(payload) > _MAX_BODY:
        raise ProtocolError(f"header of {len(payload)} bytes exceeds {_MAX_BODY}")
    try:
        header: DataHeader = _data_decoder.decode(payload)
    except Exception as exc:  # a trust boundary: every failure becomes a ProtocolError
        raise ProtocolError(f"invalid data header: {exc}") from None
    return header


def decode_framed(buffer: bytes | bytearray | memoryview) -> tuple[DataHeader, int]:
    """Decode a length-prefixed data-plane header (:func:`encode_header`) from a receive
    buffer, which may be longer; returns it and where it ends in ``buffer`` (the offset of what
    follows it: a chunk message's frames, when it came whole)."""
    view = memoryview(buffer)
    if len(view) < _LEN.size:
        raise ProtocolError("header shorter than its length prefix")
    (length,) = _LEN.unpack_from(view)
    end = _LEN.size + length
    if end > len(view):
        raise ProtocolError(f"header claims {length} bytes, buffer holds {len(view) - _LEN.size}")
    header: DataHeader = _decode(_data_decoder, view[_LEN.size : end], "data header")
    return header, end


def _decode(decoder: msgspec.msgpack.Decoder[T] | msgspec.json.Decoder[T], data: bytes | memoryview, what: str) -> T:
    try:
        return decoder.decode(data)
    except Exception as exc:  # a trust boundary: every failure becomes a ProtocolError
        raise ProtocolError(f"invalid {what}: {exc}") from None


def decode_bounded(
    decoder: msgspec.msgpack.Decoder[T] | msgspec.json.Decoder[T], data: bytes, limit: int, what: str
) -> T:
    """Decode untrusted ``data`` of at most ``limit`` bytes; anything wrong is a :class:`ProtocolError`."""
    if len(data) > limit:
        raise ProtocolError(f"{what} of {len(data)} bytes exceeds {limit}")
    return _decode(decoder, data, what)


def validate_write(req: WriteRequest, num_blocks: int, max_blocks: int) -> int:
    """Check a write against the receiving region; return its block count.

    Raises :class:`ProtocolError` if a run leaves ``[0, num_blocks)`` or the write names more
    than ``max_blocks`` blocks.
    """
    total = 0
    for start, count in req.runs:
        if start + count > num_blocks:
            raise ProtocolError(
                f"run of {count} blocks at {start} exceeds the region's {num_blocks} blocks"
            )
        total += count
    if total > max_blocks:
        raise ProtocolError(f"write of {total} blocks exceeds the limit of {max_blocks}")
    return total


def validate_message(hdr: MessageHeader, max_bytes: int) -> int:
    """Check a chunk message header; return its payload size in bytes."""
    total = sum(hdr.frames)
    if total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_bytes}")
    return total


# -- UCX tags --------------------------------------------------------------------------------
# Each peer has its own UCX worker (a lane), so tags only need to tell headers from payload
# messages: kind in the top 4 bits, a 60-bit sequence number below.
KIND_MASK: Final = 0xF << 60
"""Tag mask that selects the kind bits."""
FULL_MASK: Final = (1 << 64) - 1
HEADER_TAG: Final = 1 << 60
"""Tag of every data-plane header."""
DATA_KIND: Final = 2 << 60
"""Kind bits of payload messages (match with :data:`KIND_MASK`)."""
SEQ_MASK: Final = (1 << 60) - 1


def data_tag(seq: int) -> int:
    """Tag of payload message number ``seq`` on a lane."""
    return DATA_KIND | (seq & SEQ_MASK)
