"""The payload codec: round trips (hypothesis), zero copy, and every bad input → ProtocolError."""

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from omni_async import ProtocolError, serde

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


def travel(payload):
    """Encode, copy every frame as the transport would into fresh receive buffers, decode."""
    header, frames = serde.encode(payload)
    received = [np.frombuffer(bytes(memoryview(f)), np.uint8).copy() for f in frames]
    return serde.decode(header, received)


def same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype.newbyteorder("<") == b.dtype and a.shape == b.shape and (
            np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (bytes, bytearray, memoryview)):
        return b == bytes(a)
    if isinstance(a, float) and a != a:
        return b != b
    return a == b and type(a) is type(b)


arrays = st.sampled_from(DTYPES).flatmap(
    lambda d: hnp.arrays(np.dtype(d), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))
leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=16) | arrays
values = st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4), max_leaves=12)


@given(st.dictionaries(st.text(max_size=6), values, max_size=5))
def test_round_trip(payload):
    assert same(payload, travel(payload))


def test_arrays_are_zero_copy_both_ways():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    header, frames = serde.encode({"x": array})
    assert np.shares_memory(frames[0], array)
    received = [np.frombuffer(bytes(frames[0]), np.uint8).copy()]
    out = serde.decode(header, received)["x"]
    assert np.shares_memory(out, received[0]) and out.shape == (3, 4)


def test_non_contiguous_and_big_endian_are_normalised():
    array = np.arange(20, dtype=">i4").reshape(4, 5)[:, ::2]
    out = travel({"x": array})["x"]
    assert out.dtype == np.dtype("<i4") and np.array_equal(out, array)



def test_many_frames_and_subclassed_values_travel():
    """Past the codec's prebuilt frame references (64) and through its slower, non-exact-type
    checks (subclasses of dict and int; a big-endian contiguous array) the payload still
    round-trips."""
    from collections import OrderedDict
    from enum import IntEnum

    class Level(IntEnum):
        HIGH = 7

    payload = {f"b{i}": bytes([i]) * 3 for i in range(70)}
    payload.update({f"a{i}": np.full(2, i, np.int16) for i in range(70)})
    payload["nested"] = OrderedDict(level=Level.HIGH, big=np.arange(3, dtype=">f8"))
    header, frames = serde.encode(payload)
    assert len(frames) == 141
    out = travel(payload)
    assert [out[f"b{i}"] for i in range(70)] == [bytes([i]) * 3 for i in range(70)]
    assert all(np.array_equal(out[f"a{i}"], np.full(2, i, np.int16)) for i in range(70))
    assert out["nested"]["level"] == 7
    assert out["nested"]["big"].dtype == np.dtype("<f8") and np.array_equal(out["nested"]["big"], [0.0, 1.0, 2.0])

@pytest.mark.parametrize("bad", [{"x": object()}, {1: 2}, {"x": np.array([object()])}, {"x": {3: 1}}, [1],
                                 {"x": 2**70}, {"x": [-(2**64)]}])
def test_encode_refuses(bad):
    with pytest.raises(TypeError):
        serde.encode(bad)


def _header(tree, frames):
    return msgspec.msgpack.encode([tree, frames])


def nested(levels, leaf):
    """``leaf`` inside ``levels`` lists."""
    for _ in range(levels):
        leaf = [leaf]
    return leaf


F4 = [np.zeros(4, np.uint8)]  # one frame: one float32


@pytest.mark.parametrize(
    "header,frames",
    [
        (b"\xc1", []),
        (_header({"x": None}, [["<f4", [3], ["x"]]]), [np.zeros(8, np.uint8)]),  # 12 bytes needed
        (_header({"x": None}, [["|O", [1], ["x"]]]), [np.zeros(8, np.uint8)]),  # dtype not allowed
        (_header({"x": None}, [["<f4", [-1], ["x"]]]), F4),
        (_header({"x": None}, [["<f4", [1], ["x"]]]), []),  # frame count
        (_header({"x": None}, [["<f4", [1]]]), F4),  # no path
        (_header({"x": None}, [["<f4", [1], []]]), F4),  # an empty path
        (_header({"x": 1}, [["<f4", [1], ["x"]]]), F4),  # the path leads to a value, not a free place
        (_header({"x": None}, [["<f4", [1], ["y"]]]), F4),  # to no key
        (_header({"x": [None]}, [["<f4", [1], ["x", 1]]]), F4),  # past a list's end
        (_header({"x": [None]}, [["<f4", [1], ["x", -1]]]), F4),  # a negative index
        (_header({"x": [None]}, [["<f4", [1], ["x", "0"]]]), F4),  # a key into a list
        (_header({"x": {"0": None}}, [["<f4", [1], ["x", 0]]]), F4),  # an index into a mapping
        (_header({"x": None}, [["<f4", [1], ["x"]], ["<f4", [1], ["x"]]]), F4 * 2),  # one place, two frames
        (_header({"x": None}, [["<f4", [1], ["x"]], ["<f4", [1], ["x", 0]]]), F4 * 2),  # through a frame
        (_header({"x": None}, [["", [1], ["x"]]]), F4),  # a byte string with a shape
        (_header({"x": msgspec.msgpack.Ext(1, b"1234")}, []), []),  # no extension types
        (_header({"x": b"raw"}, []), []),  # no bin in the tree: byte strings are frames
        (_header([1, 2], []), []),
        (_header({"x": {3: 1}}, []), []),  # a key that is not a str (typed decoder)
        (_header({"x": nested(20, {3: 1})}, []), []),  # ... and deeper (loose decoder)
        (_header({"x": nested(40, 1)}, []), []),
        (_header({"x": nested(20, msgspec.msgpack.Ext(1, b"1234"))}, []), []),
        (_header({"x": None}, [["<f8", [0, 2**62, 2**62], ["x"]]]), [np.zeros(0, np.uint8)]),  # numpy refuses
    ],
)
def test_decode_rejects(header, frames):
    with pytest.raises(ProtocolError):
        serde.decode(header, frames)


@pytest.mark.parametrize("levels", [serde.TYPED_LEVELS - 1, serde.TYPED_LEVELS, serde.TYPED_LEVELS + 1, serde.MAX_DEPTH - 2])
def test_frames_at_every_depth_the_codec_allows_round_trip(levels):
    """Both decoders (the typed one up to TYPED_LEVELS, the loose one past it) put every frame
    in its place, in lists and mappings, and keep a None of the payload a None."""
    payload = {"deep": nested(levels, {"a": np.arange(3, dtype=np.int16), "b": b"xy", "n": None}), "n": None}
    out = travel(payload)
    assert same(payload, out)
    leaf = out["deep"]
    for _ in range(levels):
        leaf = leaf[0]
    assert leaf["n"] is None and out["n"] is None


def test_a_header_of_more_bytes_than_values_allowed_is_counted():
    payload = {"many": list(range(serde.MAX_NODES + 1)), "x": np.ones(2, np.uint8)}
    header, frames = serde.encode(payload)
    with pytest.raises(ProtocolError, match="more than"):
        serde.decode(header, [np.frombuffer(bytes(f), np.uint8) for f in frames])
    fewer = {"many": list(range(serde.MAX_NODES // 2)), "x": np.ones(2, np.uint8)}
    header, frames = serde.encode(fewer)
    assert len(serde.decode(header, [np.frombuffer(bytes(f), np.uint8) for f in frames])["many"]) == serde.MAX_NODES // 2


@given(st.binary(max_size=256), st.lists(st.binary(max_size=16), max_size=3))
def test_fuzz_decode_random(header, frames):
    try:
        serde.decode(header, [np.frombuffer(f, np.uint8).copy() for f in frames])
    except ProtocolError:
        pass


@given(st.data())
def test_fuzz_decode_mutated(data):
    payload = {"a": np.arange(4, dtype=np.int16), "b": [b"xy", {"c": 1.5}]}
    header, frames = serde.encode(payload)
    mutated = bytearray(header)
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(mutated) - 1))
        mutated[pos] = data.draw(st.integers(0, 255))
    received = [np.frombuffer(bytes(memoryview(f)), np.uint8).copy() for f in frames]
    try:
        serde.decode(bytes(mutated), received)
    except ProtocolError:
        pass


@pytest.mark.parametrize("values", ["mappings", "one-key mappings", "chains", "lists", "nested", "strings", "ints",
                                    "small"])
def test_a_buffered_payloads_charge_bounds_what_its_header_decodes_into(values):
    """``connector.charge`` counts, past the first ``FREE_HEADER_BYTES`` of a header,
    ``DECODED_PER_HEADER_BYTE`` per byte: at least what the decoded values take (measured with
    tracemalloc), whatever their shape."""
    import tracemalloc

    from omni_async.connector import FREE_HEADER_BYTES, charge

    chain: dict[str, object] = {}
    for _ in range(7):
        chain = {"": chain}
    value = {"mappings": [{}] * 4000, "one-key mappings": [{"": {}}] * 4000, "chains": [chain] * 500,
             "lists": [[]] * 4000, "nested": [[[{}]]] * 1000,
             "strings": [f"s{i}" for i in range(4000)], "ints": list(range(4000)), "small": [{}]}[values]
    header, frames = serde.encode({"k": value, "x": np.zeros(8, np.uint8)})
    arrays = [np.frombuffer(memoryview(frame).cast("B"), np.uint8) for frame in frames]
    tracemalloc.start()
    try:
        payload = serde.decode(header, arrays)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(payload["k"]) == len(value)
    free = FREE_HEADER_BYTES * serde.DECODED_PER_HEADER_BYTE  # a small header's values go uncharged
    assert used <= charge(header, arrays) - sum(a.nbytes for a in arrays) + free, (used, len(header))
    assert charge(header, arrays) >= sum(a.nbytes for a in arrays)
