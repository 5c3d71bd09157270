"""The chunks a ``chunks`` run streams: deterministic, so the receiver can check every byte.

Chunk ``index`` of request number ``request`` looks like a thinker → talker hand-off: a hidden
state slice (``tokens × 896`` float16), token codes (``tokens × 8`` int32) and a small dict.
Every element of both arrays is a value derived from ``(request, index)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HIDDEN = 896
CODEBOOKS = 8


def chunk_value(request: int, index: int) -> int:
    """The value every element of the chunk's arrays holds (exact in float16)."""
    return (request * 131 + index) % 2039


def make_chunk(request: int, index: int, tokens: int) -> dict[str, Any]:
    v = chunk_value(request, index)
    return {
        "hidden": np.full((tokens, HIDDEN), v, dtype=np.float16),
        "codes": np.full((tokens, CODEBOOKS), v, dtype=np.int32),
        "meta": {"request": request, "index": index, "tokens": tokens},
    }


def chunk_nbytes(tokens: int) -> int:
    """Array bytes of one chunk (what GB/s figures count)."""
    return tokens * (HIDDEN * 2 + CODEBOOKS * 4)


def chunk_ok(data: dict[str, Any], request: int, index: int, tokens: int) -> bool:
    """True if a received chunk is exactly ``make_chunk(request, index, tokens)``.

    ``hidden`` is compared bit for bit as uint16: numpy has no vectorised float16 compare, and
    ``hidden == v`` took ~250 µs per 256 KiB chunk (~15 µs per 8.9 KiB), a cost both receivers
    (ours and the pyzmq baseline's) paid per chunk, which capped both rows' chunks/s.
    """
    v = chunk_value(request, index)
    hidden, codes = data.get("hidden"), data.get("codes")
    return (
        isinstance(hidden, np.ndarray) and hidden.dtype == np.float16 and hidden.shape == (tokens, HIDDEN)
        and isinstance(codes, np.ndarray) and codes.dtype == np.int32 and codes.shape == (tokens, CODEBOOKS)
        and bool((hidden.view(np.uint16) == np.float16(v).view(np.uint16)).all()) and bool((codes == v).all())
        and data.get("meta") == {"request": request, "index": index, "tokens": tokens}
    )
