"""The payload codec, free of I/O: a chunk becomes a msgpack header plus out-of-band frames.

A chunk is a mapping of ``str`` to values that are numpy arrays, ``bytes``, ``str``, ``int``,
``float``, ``bool``, ``None``, or lists and ``str``-keyed mappings of those.  Arrays and byte
strings are not serialized: they travel as separate frames (views of the caller's memory, no
pickle, no copy when the array is C-contiguous little-endian), and the header refers to them by
index.  Decoding checks the header's types, nesting, the dtype whitelist and that every
``shape × itemsize`` equals its frame's length; anything wrong raises
:class:`~omni_async.errors.ProtocolError`.  Decoded arrays are zero-copy views of the received
frames, which the decoder's caller hands over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt

from .errors import ProtocolError

Payload: TypeAlias = Mapping[str, Any]

MAX_DEPTH: Final = 32
MAX_NODES: Final = 100_000
MAX_NDIM: Final = 32
_EXT_ARRAY: Final = 1
_EXT_BYTES: Final = 2

#: dtypes that may travel, by their little-endian ``dtype.str``.
ALLOWED_DTYPES: Final = frozenset(
    np.dtype(name).newbyteorder("<").str
    for name in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)
_DTYPES: Final = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_WIRE: Final = {dtype: name for name, dtype in _DTYPES.items()}
"""An allowed dtype → its wire name (a dict lookup costs less than building ``dtype.str``)."""

_ArraySpec = tuple[str, list[int]]  # dtype.str, shape
_encoder = msgspec.msgpack.Encoder()


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    tree: Any
    arrays: list[tuple[str, list[int]]]
    """Per frame: ``(dtype, shape)`` for an array, ``("", [])`` for a byte string."""


def encode(payload: Payload) -> tuple[bytes, list[Any]]:
    """Return ``(header, frames)``; the frames borrow the payload's memory (byte views).

    Raises :class:`TypeError` for a value that cannot travel (and ``ValueError`` for nesting
    beyond :data:`MAX_DEPTH`).  The payload must not change until the send completes.
    """
    if type(payload) is not dict and not isinstance(payload, Mapping):  # (an ABC check costs more)
        raise TypeError(f"a payload must be a mapping of str to values, got {type(payload).__name__}")
    frames: list[Any] = []
    specs: list[_ArraySpec] = []
    tree = _encode_mapping(payload, frames, specs, 0)
    try:
        return _encoder.encode(_Header(tree, specs)), frames
    except (OverflowError, msgspec.EncodeError) as exc:  # e.g. an int beyond 64 bits
        raise TypeError(f"a payload value cannot travel: {exc}") from None


_SCALARS: Final = frozenset({type(None), bool, int, float, str})
"""Types that travel as they are (exact types: a subclass takes the slower checks below)."""


def _encode_value(value: Any, frames: list[Any], specs: list[_ArraySpec], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"payload nesting exceeds {MAX_DEPTH} levels")
    kind = type(value)
    if kind in _SCALARS:  # the common cases first, by exact type (an isinstance chain costs more)
        return value
    if kind is np.ndarray:
        return _encode_array(value, frames, specs)
    if kind is dict:
        return _encode_mapping(value, frames, specs, depth)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray):
        return _encode_array(value, frames, specs)
    if isinstance(value, (bytes, bytearray, memoryview)):
        view = memoryview(value)
        if not view.c_contiguous:
            raise TypeError("a memoryview in a payload must be C-contiguous")
        frames.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
        specs.append(("", []))
        return _frame_ref(_EXT_BYTES, len(frames) - 1)
    if isinstance(value, Mapping):
        return _encode_mapping(value, frames, specs, depth)
    if isinstance(value, (list, tuple)):
        return [_encode_value(item, frames, specs, depth + 1) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} in a payload")


def _encode_mapping(value: Mapping[Any, Any], frames: list[Any], specs: list[_ArraySpec], depth: int) -> Any:
    if depth >= MAX_DEPTH and value:  # what _encode_value says of any child (scalars are inlined)
        raise ValueError(f"payload nesting exceeds {MAX_DEPTH} levels")
    out = {}
    for key, item in value.items():
        if type(key) is not str and not isinstance(key, str):
            raise TypeError(f"payload keys must be str, got {type(key).__name__}")
        kind = type(item)  # the common cases without _encode_value's call (depth + 1 <= MAX_DEPTH here)
        if kind in _SCALARS:
            out[key] = item
        elif kind is np.ndarray:
            out[key] = _encode_array(item, frames, specs)
        elif kind is dict:
            out[key] = _encode_mapping(item, frames, specs, depth + 1)
        else:
            out[key] = _encode_value(item, frames, specs, depth + 1)
    return out


def _encode_array(array: npt.NDArray[Any], frames: list[Any], specs: list[_ArraySpec]) -> Any:
    shape = list(array.shape)  # before ascontiguousarray, which turns 0-d arrays into 1-d
    wire = _WIRE.get(array.dtype)
    if wire is None or not array.flags.c_contiguous:  # else already as it travels
        wire_dtype = array.dtype.newbyteorder("<")
        wire = wire_dtype.str
        if wire not in ALLOWED_DTYPES:
            raise TypeError(f"dtype {array.dtype} cannot travel (allowed: {sorted(ALLOWED_DTYPES)})")
        array = np.ascontiguousarray(array, dtype=wire_dtype)  # copies: layout or byte order differ
    frames.append(np.frombuffer(array, np.uint8))  # C-contiguous: its bytes, flat, no copy
    specs.append((wire, shape))
    return _frame_ref(_EXT_ARRAY, len(frames) - 1)


_REFS: Final = {
    kind: [msgspec.msgpack.Ext(kind, index.to_bytes(4, "little")) for index in range(64)]
    for kind in (_EXT_ARRAY, _EXT_BYTES)
}
"""The header's references to the first frames, built once (Ext objects are immutable)."""


def _frame_ref(kind: int, index: int) -> msgspec.msgpack.Ext:
    refs = _REFS[kind]
    return refs[index] if index < len(refs) else msgspec.msgpack.Ext(kind, index.to_bytes(4, "little"))


def decode(header: bytes, frames: Sequence[npt.NDArray[np.uint8]]) -> dict[str, Any]:
    """Rebuild a payload from a header and its frames (taken over, not copied).

    Raises :class:`ProtocolError` for anything malformed, out of the whitelist or inconsistent.
    """
    try:
        decoded = _decoder.decode(header)  # frame references stay Ext objects: no Python hook per frame
    except Exception as exc:  # a trust boundary: every decoder failure is a ProtocolError
        raise ProtocolError(f"invalid payload header: {exc}") from None
    if len(decoded.arrays) != len(frames):
        raise ProtocolError(f"payload header names {len(decoded.arrays)} frames, {len(frames)} arrived")
    values = [_decode_frame(spec, frame) for spec, frame in zip(decoded.arrays, frames, strict=True)]
    if not isinstance(decoded.tree, dict):
        raise ProtocolError("a payload must be a mapping at the top")
    budget = [MAX_NODES - 1]  # the top mapping is one node
    result = _resolve_children(decoded.tree, values, 0, budget)
    assert isinstance(result, dict)
    return result


_Ext: Final = msgspec.msgpack.Ext
_decoder: Final = msgspec.msgpack.Decoder(_Header)


def _decode_frame(spec: tuple[str, list[int]], frame: npt.NDArray[np.uint8]) -> Any:
    dtype_str, shape = spec
    if not dtype_str:
        if shape:
            raise ProtocolError("a byte-string frame has no shape")
        return frame.tobytes()
    dtype = _DTYPES.get(dtype_str)
    if dtype is None:
        raise ProtocolError(f"dtype {dtype_str!r} is not allowed")
    if len(shape) > MAX_NDIM:
        raise ProtocolError(f"invalid array shape {shape!r}")
    count = 1
    for n in shape:
        if type(n) is not int or n < 0:
            raise ProtocolError(f"invalid array shape {shape!r}")
        count *= n
    if count * dtype.itemsize != frame.nbytes:
        raise ProtocolError(
            f"array of shape {shape} and dtype {dtype_str} needs {count * dtype.itemsize} bytes, "
            f"its frame has {frame.nbytes}"
        )
    try:
        return np.ndarray(shape, dtype, frame)  # a view of the frame (cheaper than view+reshape)
    except ValueError as exc:  # e.g. a zero-length shape whose other dimensions overflow numpy
        raise ProtocolError(f"invalid array shape {shape!r}: {exc}") from None


def _resolve(node: Any, values: list[Any], depth: int, budget: list[int]) -> Any:
    """One node that is not a scalar (the caller counted it in ``budget``)."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"payload nesting exceeds {MAX_DEPTH} levels")
    kind = type(node)  # the decoder makes exact types only: no isinstance needed
    if kind is _Ext:
        return _frame_value(node, values)
    if kind is list or kind is dict:
        return _resolve_children(node, values, depth, budget)
    raise ProtocolError(f"unexpected {type(node).__name__} in a payload")


def _frame_value(ref: msgspec.msgpack.Ext, values: list[Any]) -> Any:
    """The decoded frame a reference (an Ext of kind array or bytes holding a u32 index)
    names, checked to exist and to be of its kind."""
    code, data = ref.code, memoryview(ref.data)
    if code not in (_EXT_ARRAY, _EXT_BYTES) or data.nbytes != 4:
        raise ProtocolError(f"payload holds an unknown extension {code}")
    index = int.from_bytes(data, "little")
    if index >= len(values):
        raise ProtocolError(f"payload refers to frame {index} of {len(values)}")
    value = values[index]
    if (code == _EXT_BYTES) != (type(value) is bytes):
        raise ProtocolError(f"frame {index} is referred to as the wrong kind")
    return value


def _resolve_children(node: list[Any] | dict[Any, Any], values: list[Any], depth: int, budget: list[int]) -> Any:
    """A list or mapping at ``depth``, resolved in place (the decoder made it for us): its
    children counted in ``budget`` at once, scalars left as they are, frame references
    replaced by their frames, the rest resolved one level deeper."""
    budget[0] -= len(node)
    if budget[0] < 0:
        raise ProtocolError(f"payload has more than {MAX_NODES} values")
    if node and depth >= MAX_DEPTH:
        raise ProtocolError(f"payload nesting exceeds {MAX_DEPTH} levels")
    if isinstance(node, list):  # exact types only (see _resolve)
        for i, item in enumerate(node):
            if type(item) not in _SCALARS:
                node[i] = _resolve(item, values, depth + 1, budget)
        return node
    for key, item in node.items():  # values of existing keys are replaced: the size never changes
        if type(key) is not str:
            raise ProtocolError(f"payload keys must be str, got {type(key).__name__}")
        kind = type(item)  # a frame without _resolve's call (depth + 1 <= MAX_DEPTH here)
        if kind is _Ext:
            node[key] = _frame_value(item, values)
        elif kind not in _SCALARS:
            node[key] = _resolve(item, values, depth + 1, budget)
    return node
