"""The limit: numpy copying the same blocks between two arrays in one process.

:func:`time_copies` is the reference the ratios use: ``dst[remote] = src[local]`` (fancy
indexing: numpy gathers the source rows into a temporary, then scatters them, so each byte is
copied twice).  With ``per_block`` it copies each block once, one Python step per block ("rows
copy"); it is reported alongside, because a transfer that copies once can beat the fancy-index
figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt


def _timed(copy: Callable[[], None], iters: int, warmup: int) -> list[int]:
    """Nanoseconds of each of ``iters`` calls of ``copy``, after ``warmup`` untimed ones."""
    clock = time.perf_counter_ns
    samples: list[int] = []
    for i in range(warmup + iters):
        t0 = clock()
        copy()
        t1 = clock()
        if i >= warmup:
            samples.append(t1 - t0)
    return samples


def time_copies(
    src: npt.NDArray[np.uint8],
    dst: npt.NDArray[np.uint8],
    local: list[int],
    remote: list[int],
    iters: int,
    warmup: int,
    *,
    per_block: bool = False,
) -> list[int]:
    """Nanoseconds of each of ``iters`` copies of rows ``local`` of ``src`` to rows ``remote`` of ``dst``.

    ``per_block=False``: one fancy-indexed ``dst[remote] = src[local]`` (the memcpy reference).
    ``per_block=True``: one ``dst[r] = src[l]`` per block, each byte copied once (fancy indexing
    copies it twice, gather then scatter), at a Python step per block ("rows copy").
    """
    if per_block:
        pairs = list(zip(local, remote, strict=True))

        def copy() -> None:
            for l_idx, r_idx in pairs:
                dst[r_idx] = src[l_idx]

    else:
        lidx = np.asarray(local, dtype=np.intp)
        ridx = np.asarray(remote, dtype=np.intp)

        def copy() -> None:
            dst[ridx] = src[lidx]

    return _timed(copy, iters, warmup)
