"""The payload codec, free of I/O: a chunk becomes a msgpack header plus out-of-band frames.

A chunk is a mapping of ``str`` to values that are numpy arrays, ``bytes``, ``str``, ``int``,
``float``, ``bool``, ``None``, or lists and ``str``-keyed mappings of those.  Arrays and byte
strings are not serialized: they travel as separate frames (views of the caller's memory, no
pickle, no copy when the array is C-contiguous little-endian).  The header is ``[tree, frames]``:
the payload with ``None`` where each frame goes, and per frame its dtype (``""`` for a byte
string), shape and *path* (the keys and list indices from the top mapping to its place).

Decoding checks the header's types, nesting, the dtype whitelist, that every ``shape ×
itemsize`` equals its frame's length and that every path ends at a ``None`` of the tree;
anything wrong raises :class:`~omni_async.errors.ProtocolError`.  Decoded arrays are zero-copy
views of the received frames, which the decoder's caller hands over.  The common payload (at
most :data:`TYPED_LEVELS` levels of nesting) is checked entirely by msgspec, in C, and its
frames are put in place by their paths: no walk over the tree in Python.  A deeper one is
decoded loosely and walked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeAlias, Union

import msgspec
import numpy as np
import numpy.typing as npt

from .errors import ProtocolError

Payload: TypeAlias = Mapping[str, Any]

MAX_DEPTH: Final = 32
MAX_NODES: Final = 100_000
MAX_NDIM: Final = 32
DECODED_PER_HEADER_BYTE: Final = 96
"""The most memory the decoded values take per header byte: two msgpack bytes, a mapping of
one entry with an empty key, become a 184-byte dict and its 8-byte slot in its parent (nested
ones measured 91 B per byte with ``tracemalloc``; an empty mapping 72, an empty list 64,
strings and numbers far less)."""
TYPED_LEVELS: Final = 8
"""Levels of nesting below the top mapping that the typed decoder checks in C (its type is
built level by level, and grows with 2**levels); deeper payloads take the loose decoder."""

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

if TYPE_CHECKING:
    _FrameSpec: TypeAlias = tuple[str, list[int], list[str | int]]
else:  # what msgspec checks of each: an allowed dtype ("" for a byte string), a shape, a path
    _FrameSpec = tuple[
        Literal[("", *sorted(ALLOWED_DTYPES))],
        Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_NDIM)],
        Annotated[list[str | int], msgspec.Meta(min_length=1, max_length=MAX_DEPTH + 1)],
    ]
_encoder = msgspec.msgpack.Encoder()

_Scalar: TypeAlias = bool | int | float | str | None


def _typed_tree(levels: int) -> Any:
    """The tree's type, ``levels`` levels of lists and str-keyed mappings deep."""
    node: Any = _Scalar
    for _ in range(levels):
        node = Union[bool, int, float, str, None, list[node], dict[str, node]]  # noqa: UP007 (a runtime type)
    return dict[str, node]


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The header as msgspec checks it in C (the common case)."""

    tree: _typed_tree(TYPED_LEVELS)  # type: ignore[valid-type]
    frames: list[_FrameSpec]


class _LooseHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The header of a deeper (or malformed) payload: its tree is checked in Python."""

    tree: Any
    frames: list[_FrameSpec]


def encode(payload: Payload) -> tuple[bytes, list[Any]]:
    """Return ``(header, frames)``; the frames borrow the payload's memory (byte views).

    Raises :class:`TypeError` for a value that cannot travel (and ``ValueError`` for nesting
    beyond :data:`MAX_DEPTH`).  The payload must not change until the send completes.
    """
    if type(payload) is not dict and not isinstance(payload, Mapping):  # (an ABC check costs more)
        raise TypeError(f"a payload must be a mapping of str to values, got {type(payload).__name__}")
    frames: list[Any] = []
    specs: list[tuple[str, list[int], list[str | int]]] = []
    tree = _encode_mapping(payload, frames, specs, 0, ())
    try:
        return _encoder.encode([tree, specs]), frames
    except (OverflowError, msgspec.EncodeError) as exc:  # e.g. an int beyond 64 bits
        raise TypeError(f"a payload value cannot travel: {exc}") from None


_Specs: TypeAlias = list[tuple[str, list[int], list[str | int]]]
_At: TypeAlias = tuple[str | int, ...]
"""Where a value sits: the keys and indices from the top mapping to it."""

_SCALARS: Final = frozenset({type(None), bool, int, float, str})
"""Types that travel as they are (exact types: a subclass takes the slower checks below)."""


def _encode_value(value: Any, frames: list[Any], specs: _Specs, depth: int, at: _At) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"payload nesting exceeds {MAX_DEPTH} levels")
    kind = type(value)
    if kind in _SCALARS:  # the common cases first, by exact type (an isinstance chain costs more)
        return value
    if kind is np.ndarray:
        _encode_array(value, frames, specs, at)
        return None  # the frame's place in the tree
    if kind is dict:
        return _encode_mapping(value, frames, specs, depth, at)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray):
        _encode_array(value, frames, specs, at)
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        view = memoryview(value)
        if not view.c_contiguous:
            raise TypeError("a memoryview in a payload must be C-contiguous")
        frames.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
        specs.append(("", [], list(at)))
        return None  # the frame's place in the tree
    if isinstance(value, Mapping):
        return _encode_mapping(value, frames, specs, depth, at)
    if isinstance(value, (list, tuple)):
        return [_encode_value(item, frames, specs, depth + 1, (*at, i)) for i, item in enumerate(value)]
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} in a payload")


def _encode_mapping(value: Mapping[Any, Any], frames: list[Any], specs: _Specs, depth: int, at: _At) -> Any:
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
            _encode_array(item, frames, specs, (*at, key))
            out[key] = None  # the frame's place in the tree
        elif kind is dict:
            out[key] = _encode_mapping(item, frames, specs, depth + 1, (*at, key))
        else:
            out[key] = _encode_value(item, frames, specs, depth + 1, (*at, key))
    return out


def _encode_array(array: npt.NDArray[Any], frames: list[Any], specs: _Specs, at: _At) -> None:
    """Add the array's frame (its bytes as they travel) and its spec, its path ``at``."""
    shape = list(array.shape)  # before ascontiguousarray, which turns 0-d arrays into 1-d
    wire = _WIRE.get(array.dtype)
    if wire is None or not array.flags.c_contiguous:  # else already as it travels
        wire_dtype = array.dtype.newbyteorder("<")
        wire = wire_dtype.str
        if wire not in ALLOWED_DTYPES:
            raise TypeError(f"dtype {array.dtype} cannot travel (allowed: {sorted(ALLOWED_DTYPES)})")
        array = np.ascontiguousarray(array, dtype=wire_dtype)  # copies: layout or byte order differ
    frames.append(np.frombuffer(array, np.uint8))  # C-contiguous: its bytes, flat, no copy
    specs.append((wire, shape, list(at)))


_typed: Final = msgspec.msgpack.Decoder(_Header)
_loose: Final = msgspec.msgpack.Decoder(_LooseHeader)


def decode(header: bytes, frames: Sequence[npt.NDArray[np.uint8]]) -> dict[str, Any]:
    """Rebuild a payload from a header and its frames (taken over, not copied).

    Raises :class:`ProtocolError` for anything malformed, out of the whitelist or inconsistent.
    """
    decoded: _Header | _LooseHeader | None = None
    if len(header) <= MAX_NODES:  # a longer header may hold more values: the loose decoder counts them
        try:
            decoded = _typed.decode(header)
        except Exception:  # deeper than the typed levels, or malformed: the loose decoder says which
            decoded = None
    if decoded is None:
        try:
            decoded = _loose.decode(header)
        except Exception as exc:  # a trust boundary: every decoder failure is a ProtocolError
            raise ProtocolError(f"invalid payload header: {exc}") from None
        if type(decoded.tree) is not dict:
            raise ProtocolError("a payload must be a mapping at the top")
        _check_children(decoded.tree, 0, [MAX_NODES - 1])  # the top mapping is one node
    specs = decoded.frames
    if len(specs) != len(frames):
        raise ProtocolError(f"payload header names {len(specs)} frames, {len(frames)} arrived")
    tree: dict[str, Any] = decoded.tree
    for (dtype_str, shape, path), frame in zip(specs, frames, strict=True):
        _place(tree, path, _decode_frame(dtype_str, shape, frame))
    return tree


def _decode_frame(dtype_str: str, shape: list[int], frame: npt.NDArray[np.uint8]) -> Any:
    """A frame as the value it stands for (its dtype and shape checked by msgspec already)."""
    if not dtype_str:
        if shape:
            raise ProtocolError("a byte-string frame has no shape")
        return frame.tobytes()
    dtype = _DTYPES[dtype_str]
    if math.prod(shape) * dtype.itemsize != frame.nbytes:
        raise ProtocolError(
            f"array of shape {shape} and dtype {dtype_str} needs {math.prod(shape) * dtype.itemsize} bytes, "
            f"its frame has {frame.nbytes}"
        )
    try:
        return np.ndarray(shape, dtype, frame)  # a view of the frame (cheaper than view+reshape)
    except ValueError as exc:  # e.g. a zero-length shape whose other dimensions overflow numpy
        raise ProtocolError(f"invalid array shape {shape!r}: {exc}") from None


def _place(tree: dict[str, Any], path: list[str | int], value: Any) -> None:
    """Put a frame's value where its path leads: to a ``None`` in a mapping or list of the tree."""
    node: Any = tree
    for step in path[:-1]:
        node = _child(node, step)
        if node is None:
            break
    last = path[-1]
    free = (type(node) is dict and type(last) is str and node.get(last, 0) is None) or (
        type(node) is list and type(last) is int and 0 <= last < len(node) and node[last] is None
    )
    if not free:
        raise ProtocolError(f"a frame's path {path!r} does not lead to a free place in the payload")
    node[last] = value


def _child(node: Any, step: str | int) -> Any:
    """The child ``step`` names of a mapping or list, or None if there is none."""
    if type(node) is dict:
        return node.get(step) if type(step) is str else None
    if type(node) is list and type(step) is int and 0 <= step < len(node):
        return node[step]
    return None


def _check_children(node: list[Any] | dict[Any, Any], depth: int, budget: list[int]) -> None:
    """Check a loosely decoded list or mapping at ``depth`` (its children counted in
    ``budget`` at once): str keys, values of the payload's types only, nesting within
    :data:`MAX_DEPTH`, at most :data:`MAX_NODES` values."""
    budget[0] -= len(node)
    if budget[0] < 0:
        raise ProtocolError(f"payload has more than {MAX_NODES} values")
    if node and depth >= MAX_DEPTH:
        raise ProtocolError(f"payload nesting exceeds {MAX_DEPTH} levels")
    if type(node) is dict:
        for key in node:
            if type(key) is not str:
                raise ProtocolError(f"payload keys must be str, got {type(key).__name__}")
        items: Any = node.values()
    else:
        items = node
    for item in items:
        kind = type(item)  # the decoder makes exact types only
        if kind is list or kind is dict:
            _check_children(item, depth + 1, budget)
        elif kind not in _SCALARS:
            raise ProtocolError(f"unexpected {kind.__name__} in a payload")
