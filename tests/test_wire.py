"""The wire format: round trips, limits, and fuzzing (any input → valid struct or ProtocolError)."""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async import ProtocolError, wire
from omni_async.wire import (
    PROTOCOL_VERSION,
    Ack,
    Acks,
    Bye,
    Commit,
    Heartbeat,
    Hello,
    MessageHeader,
    Reject,
    Welcome,
    WriteRequest,
    data_tag,
    decode_control,
    decode_framed,
    decode_record,
    encode_control,
    encode_header,
    encode_record,
    validate_message,
    validate_write,
    with_length,
)

HELLO = Hello(
    version=PROTOCOL_VERSION, peer_id="p", nonce=7, agent_metadata=b"\x01" * 81, base_addr=0x7F0000000000,
    num_blocks=64, block_len=4096, fingerprint="abcd",
)
CONTROL = [HELLO, Welcome(**msgspec.structs.asdict(HELLO)), Reject(code="layout", reason="no"), Heartbeat(), Bye("done")]
HEADERS = [
    WriteRequest(transfer_id=1, seq=0, runs=[(0, 3), (9, 1)]),
    MessageHeader(transfer_id=2, seq=5, key="r:0:1", meta=b"m", frames=[10, 0, 4]),
    Ack(transfer_id=3),
    Ack(transfer_id=3, code="invalid_blocks", reason="bad"),
    WriteRequest(transfer_id=4, seq=0, runs=[(2, 2)], placed=True, notice=b"n", part=1, parts=2),  # an intent
    Commit(transfer_id=4, part=1),
    Acks(transfer_ids=[5, 6, 2**40]),
]


@pytest.mark.parametrize("msg", CONTROL, ids=lambda m: type(m).__name__)
def test_control_round_trip(msg):
    decoded = decode_control(encode_control(msg))
    assert decoded == msg and type(decoded) is type(msg)


@pytest.mark.parametrize("msg", HEADERS, ids=lambda m: type(m).__name__)
def test_header_round_trip(msg):
    buf = bytearray(wire.MAX_HEADER_BYTES)
    data = encode_header(msg)
    buf[: len(data)] = data
    assert decode_framed(buf) == (msg, len(data))  # and where it ends: what follows starts there


@pytest.mark.parametrize("msg", HEADERS, ids=lambda m: type(m).__name__)
def test_ring_record_is_the_bare_header(msg):
    """A same-host ring's header record is the header alone (the ring frames it); the lane's
    header is the same bytes behind their length."""
    record = encode_record(msg)
    assert decode_record(memoryview(record)) == msg
    assert encode_header(msg) == with_length(record)


@pytest.mark.parametrize(
    "payload",
    [encode_header(Ack(1)), encode_record(Ack(1)) + b"\x00", b"\xff" * 16, b"", b"\x91" + bytes(wire.MAX_HEADER_BYTES)],
    ids=["lane-framed", "trailing", "garbage", "empty", "oversized"],
)
def test_ring_record_garbage_is_a_protocol_error(payload):
    with pytest.raises(ProtocolError):
        decode_record(payload)


def test_exact_types():
    for bad in (
        HELLO.__class__(**{**msgspec.structs.asdict(HELLO), "num_blocks": True}),
        HELLO.__class__(**{**msgspec.structs.asdict(HELLO), "num_blocks": 0}),
        HELLO.__class__(**{**msgspec.structs.asdict(HELLO), "base_addr": -1}),
        HELLO.__class__(**{**msgspec.structs.asdict(HELLO), "peer_id": ""}),
        HELLO.__class__(**{**msgspec.structs.asdict(HELLO), "agent_metadata": b"x" * (wire.MAX_METADATA_BYTES + 1)}),
    ):
        with pytest.raises(ProtocolError):
            decode_control(msgspec.msgpack.encode(bad))


def test_layout_must_fit_64_bits():
    big = HELLO.__class__(**{**msgspec.structs.asdict(HELLO), "base_addr": wire.I64 - 10, "num_blocks": 4, "block_len": 4})
    with pytest.raises(ProtocolError, match="overflows"):
        decode_control(encode_control(big))


def test_oversized_control_rejected():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_control(b"\x00" * (wire.MAX_CONTROL_BYTES + 1))


def test_header_length_prefix_checked():
    with pytest.raises(ProtocolError):
        decode_framed(b"\x01\x00")
    with pytest.raises(ProtocolError):
        decode_framed(b"\xff\xff\x00\x00" + b"\x00" * 10)
    with pytest.raises(ProtocolError):
        encode_header(WriteRequest(transfer_id=1, seq=0, runs=[(1 << 40, 1 << 40)] * 10_000))


def test_commit_names_a_request_by_exact_non_negative_ints():
    assert decode_framed(encode_header(Commit(7)))[0] == Commit(7, 0)  # part 0 unless said
    for bad in (Commit(-1), Commit(1, -1), Commit(1, True), Commit("1")):  # type: ignore[arg-type]
        with pytest.raises(ProtocolError):
            decode_framed(encode_header(bad))


def test_acks_name_one_to_max_acks_non_negative_ints():
    ids = [wire.I64] * wire.MAX_ACKS  # the largest legitimate one fits a header
    assert decode_framed(encode_header(Acks(ids)))[0] == Acks(ids)
    for bad in (Acks([]), Acks([1] * (wire.MAX_ACKS + 1)), Acks([-1]), Acks([True]), Acks(["1"])):  # type: ignore[list-item]
        with pytest.raises(ProtocolError):
            decode_framed(encode_header(bad))


def test_validate_write_bounds_and_limit():
    assert validate_write(WriteRequest(1, 0, [(0, 4), (60, 4)]), 64, 100) == 8
    with pytest.raises(ProtocolError, match="exceeds the region"):
        validate_write(WriteRequest(1, 0, [(61, 4)]), 64, 100)
    with pytest.raises(ProtocolError, match="limit"):
        validate_write(WriteRequest(1, 0, [(0, 64)]), 64, 10)


def test_validate_message_limit():
    assert validate_message(MessageHeader(1, 0, "k", b"", [3, 4]), 10) == 7
    with pytest.raises(ProtocolError):
        validate_message(MessageHeader(1, 0, "k", b"", [8, 4]), 10)


def test_tags_are_distinct():
    assert data_tag(0) != wire.HEADER_TAG
    assert data_tag(1) != data_tag(2)
    assert data_tag((1 << 60) + 5) == data_tag(5)


# -- fuzzing --------------------------------------------------------------------------------
def _decode_control_or_protocol_error(data: bytes) -> None:
    try:
        msg = decode_control(data)
    except ProtocolError:
        return
    assert isinstance(msg, (Hello, Welcome, Reject, Heartbeat, Bye))


def _decode_header_or_protocol_error(data: bytes) -> None:
    try:
        msg = decode_framed(data)[0]
    except ProtocolError:
        return
    assert isinstance(msg, (WriteRequest, MessageHeader, Ack, Acks, Commit))


@given(st.binary(max_size=512))
def test_fuzz_control_random_bytes(data):
    _decode_control_or_protocol_error(data)


@given(st.binary(max_size=512))
def test_fuzz_header_random_bytes(data):
    _decode_header_or_protocol_error(data)


@st.composite
def mutated(draw, messages, encode):
    data = bytearray(encode(draw(st.sampled_from(messages))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@given(mutated(CONTROL, encode_control))
def test_fuzz_control_mutations(data):
    _decode_control_or_protocol_error(data)


@given(mutated(HEADERS, encode_header))
def test_fuzz_header_mutations(data):
    _decode_header_or_protocol_error(data)


@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10) | st.binary(max_size=10),
    lambda children: st.lists(children, max_size=12) | st.dictionaries(st.text(max_size=5), children, max_size=5),
    max_leaves=40,
))
def test_fuzz_structured_values(value):
    """Well-formed msgpack of the wrong shape is a ProtocolError too."""
    data = msgspec.msgpack.encode(value)
    _decode_control_or_protocol_error(data)
    _decode_header_or_protocol_error(len(data).to_bytes(4, "little") + data)


def test_worst_case_headers_fit():
    """A sender's largest legitimate headers encode within MAX_HEADER_BYTES."""
    from omni_async.wire import I64, MAX_FRAMES, MAX_KEY, MAX_META_BYTES, RUNS_PER_REQUEST

    write = WriteRequest(I64, I64, [(I64 - 1, I64)] * RUNS_PER_REQUEST, False)
    assert isinstance(decode_framed(encode_header(write))[0], WriteRequest)
    message = MessageHeader(I64, I64, "\U0010ffff" * MAX_KEY, b"m" * MAX_META_BYTES, [I64] * MAX_FRAMES)
    assert isinstance(decode_framed(encode_header(message))[0], MessageHeader)


def test_the_largest_shared_pool_the_config_allows_is_a_valid_offer():
    """``shared_pool_mib``'s largest value makes an offer the peer's decoder accepts (it was
    refused: the peer dropped the link right after joining)."""
    import secrets

    from omni_async.config import AgentConfig
    from omni_async.transport.pool import shared_pool_bytes
    from omni_async.wire import RingOffer, decode_framed

    mib = 1024  # shared_pool_mib's largest: the config refuses more
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"shared_pool_mib": mib + 1}, AgentConfig)
    assert msgspec.convert({"shared_pool_mib": mib}, AgentConfig).shared_pool_mib == mib
    offer = RingOffer(pid=1234, fd=5, token=secrets.token_hex(16), wake_fd=6, capacity=8 << 20,
                      pool=shared_pool_bytes(mib))
    assert decode_framed(encode_header(offer))[0] == offer



def test_the_largest_hello_the_bounds_allow_fits_a_control_message():
    """A Hello (and a Welcome) at every bound of its fields (metadata, ids, 255 layers each
    with a region share, integers of nine bytes where the region's bounds allow) encodes within ``MAX_CONTROL_BYTES`` and
    decodes back (16 KiB did not hold it: a set of 255 wrapped regions could not join)."""
    from omni_async.wire import (
        MAX_CONTROL_BYTES,
        MAX_LAYERS,
        MAX_METADATA_BYTES,
        MAX_NOTICE_BYTES,
        MAX_PEER_ID,
        Layer,
        RegionShare,
    )

    big = (1 << 63) - 1
    share = RegionShare(pid=(1 << 31) - 1, fd=(1 << 31) - 1, token="f" * 32, proof_addr=big, inode=big,
                        offset=big, proof_fd=(1 << 31) - 1)
    fields = {
        "version": PROTOCOL_VERSION, "peer_id": "p" * MAX_PEER_ID, "nonce": big,
        "agent_metadata": b"\xff" * MAX_METADATA_BYTES, "base_addr": 1 << 46, "num_blocks": 1 << 33,
        "block_len": 1 << 28,  # (the largest region the 63-bit address space holds, roughly)
        "fingerprint": "f" * 64, "host_id": "h" * 128, "max_write_blocks": big, "max_message_bytes": big,
        "region_share": share, "max_notice_bytes": MAX_NOTICE_BYTES, "allow_reads": True,
        "layers": [Layer(base_addr=1 << 46, block_len=1 << 28, region_share=share)] * (MAX_LAYERS - 1),
    }
    for kind in (Hello, Welcome):
        msg = kind(**fields)
        data = encode_control(msg)
        assert len(data) <= MAX_CONTROL_BYTES, (kind.__name__, len(data))
        assert decode_control(data) == msg



def test_reasons_longer_than_the_wire_allows_are_cut_not_made_undecodable():
    """A rejection or goodbye whose reason is built from a long text (a peer id full of
    characters ``repr`` expands, a long error) is cut to ``MAX_REASON``: the peer decodes it
    (msgspec checks the bound only on decode: the whole message was undecodable, and the peer
    saw a ProtocolError instead of the typed rejection)."""
    from omni_async.errors import HandshakeRejected
    from omni_async.handshake import reject_for
    from omni_async.wire import MAX_REASON, bounded_reason

    long = repr("\x00" * 400)  # 1,602 characters
    for msg in (reject_for(HandshakeRejected(f"peer {long} refused")), Bye(reason=bounded_reason(long))):
        decoded = decode_control(encode_control(msg))
        assert len(decoded.reason) == MAX_REASON and decoded.reason.endswith("…")
    assert bounded_reason("short") == "short"
