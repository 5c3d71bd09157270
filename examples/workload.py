"""The demo workload, shared by sender and receiver so the receiver can verify every byte.

Chunks look like a thinker → talker stage: per request, a stream of chunks that each carry a
hidden-state slice (float16), token codes (int32) and a small dict of metadata.  KV blocks are
filled with a pattern derived from their index.  Everything is a pure function of
``(request, index)``, so the receiver recomputes what it should have received.
"""

from __future__ import annotations

import numpy as np

STAGE = "thinker-talker"
REQUESTS = 64
CHUNKS = 32
HIDDEN = 896
NUM_BLOCKS = 256
BLOCK_LEN = 64 * 1024


def make_chunk(request: int, index: int) -> dict[str, object]:
    """Chunk ``index`` of request ``request`` (sizes vary from ~2 KiB to ~60 KiB)."""
    rng = np.random.default_rng(request * 100_003 + index)
    tokens = 1 + (request + index) % 32
    return {
        "hidden": rng.standard_normal((tokens, HIDDEN)).astype(np.float16),
        "codes": rng.integers(0, 4096, size=(tokens, 8), dtype=np.int32),
        "meta": {"request": request, "index": index, "tokens": tokens},
    }


def block_pattern(block: int, block_len: int = BLOCK_LEN) -> np.ndarray:
    """The bytes KV block ``block`` holds on the sender."""
    return np.random.default_rng(1_000_000 + block).integers(0, 256, block_len, dtype=np.uint8)


def same_chunk(got: dict[str, object], want: dict[str, object]) -> bool:
    return (
        np.array_equal(got["hidden"], want["hidden"])  # type: ignore[arg-type]
        and np.array_equal(got["codes"], want["codes"])  # type: ignore[arg-type]
        and got["meta"] == want["meta"]
    )
