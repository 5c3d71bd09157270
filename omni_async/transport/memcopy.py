"""The same-host lane's copies: runs of rows into (and out of) a peer's region, frames into its
shared pool.

Where the C library was built at install (:mod:`.native`; ctypes releases the GIL around each
call), a write's runs are one call per region, not one numpy assignment per run (256
scattered blocks: one Python step instead of 256), and a copy of at
least :data:`STREAM_MIN` bytes uses streaming (non-temporal) stores: no read of each target
line before it is written (a third of the memory traffic of an ordinary copy), and neither
process's working set is evicted by the bytes passing through (the Python that handles the
acknowledgement afterwards runs with warm caches).  Smaller copies stay ordinary (a peer may
read them soon), in pieces of :data:`COPY_PIECE` bytes.

Without it (no C compiler at install; :func:`.native.built` is False) the same copies go
through numpy, run by run, in pieces of :data:`COPY_PIECE`: glibc's ``memcpy`` copies with
``rep movsb`` up to a size threshold and with a vector loop above it; on AMD CPUs that
threshold is the L2 cache size (glibc 2.33 on), where one copy of 1 MiB or more moved 14-20
GB/s and the same bytes in 256 KiB pieces 26-31 GB/s (docs/tuning.md).

Contract: arrays are C-contiguous and writable where written; the caller keeps them alive for
the call.  Runs are ``(local, remote, count)`` triples (:data:`~omni_async.region.Run`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from ..region import Run, run_table
from .iov import address_of
from .native import library

COPY_PIECE: Final = 256 * 1024
"""Most bytes one ordinary copy call moves: below every current x86 L2 size (Zen 2: 512 KiB)."""
STREAM_MIN: Final = 1 << 20
"""A copy (one call: a write's runs in one region, or one frame) of at least this many bytes
uses streaming stores, where the C library is built."""
LOCAL: Final = 0
"""The column of a run's index into our own rows."""
REMOTE: Final = 1
"""The column of a run's index into the peer's rows."""


class _Helper:
    """The row copier's C functions, declared with their C signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, u64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
        self.copy_runs = lib.omni_copy_runs
        self.copy_runs.restype = i32
        self.copy_runs.argtypes = (ptr, u64, i32, ptr, u64, i32, u64, ptr, ctypes.c_size_t, u64)
        self.copy = lib.omni_copy
        self.copy.restype = None
        self.copy.argtypes = (ptr, ptr, u64, u64)
        self.stream_min = STREAM_MIN if lib.omni_can_stream() else 0


@functools.cache
def _helper() -> _Helper | None:
    """The row copier's functions, or None where the C library is not built."""
    lib = library()
    return None if lib is None else _Helper(lib)


def copy_runs(
    dst: npt.NDArray[np.uint8], dst_col: int, src: npt.NDArray[np.uint8], src_col: int, runs: Sequence[Run]
) -> None:
    """For each run, ``count`` rows of ``src`` from its index in column ``src_col`` on go to
    ``dst`` from its index in column ``dst_col`` on (:data:`LOCAL` or :data:`REMOTE`); both
    2-D with rows of one length.  Raises :class:`ValueError` (nothing copied) if a run falls
    outside either array or the row lengths differ."""
    row = dst.shape[1]
    if src.shape[1] != row:
        raise ValueError(f"rows of {src.shape[1]} bytes copied into rows of {row}")
    if not runs:
        return
    if len(runs) == 1 and runs[0][2] == 1 and row <= COPY_PIECE:
        # One row (a small write): numpy's index and copy cost less than a foreign call.
        to, of = runs[0][dst_col], runs[0][src_col]
        if not (0 <= to < dst.shape[0] and 0 <= of < src.shape[0]):
            raise ValueError(f"row {of} of {src.shape[0]} copied to row {to} of {dst.shape[0]}")
        dst[to] = src[of]
        return
    helper = _native(dst, src)
    if helper is None:
        _numpy_runs(dst, dst_col, src, src_col, runs)
        return
    try:
        table = run_table(runs)
    except OverflowError:
        raise ValueError("a run with a negative index or count") from None
    status = helper.copy_runs(
        address_of(dst), dst.shape[0], dst_col, address_of(src), src.shape[0], src_col, row,
        table.__array_interface__["data"][0], len(runs), helper.stream_min,
    )
    if status:
        raise ValueError(f"a run outside {dst.shape[0]} rows (to) or {src.shape[0]} rows (from)")


def copy_into(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> None:
    """``dst[...] = src`` for C-contiguous byte arrays of the same size (``dst`` writable)."""
    nbytes = dst.nbytes
    if src.nbytes != nbytes:
        raise ValueError(f"{src.nbytes} bytes copied into {nbytes}")
    helper = _native(dst, src)
    if helper is not None and nbytes:
        helper.copy(address_of(dst), address_of(src), nbytes, helper.stream_min)
    else:
        to, of = dst.reshape(-1), src.reshape(-1)
        for at in range(0, nbytes, COPY_PIECE):
            to[at : at + COPY_PIECE] = of[at : at + COPY_PIECE]


def _native(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> _Helper | None:
    """The helper, if built and both arrays are C-contiguous and ``dst`` writable (else numpy
    copies, and refuses a read-only target)."""
    helper = _helper()
    if helper is None or not (dst.flags.writeable and dst.flags.c_contiguous and src.flags.c_contiguous):
        return None
    return helper


def _numpy_runs(
    dst: npt.NDArray[np.uint8], dst_col: int, src: npt.NDArray[np.uint8], src_col: int, runs: Sequence[Run]
) -> None:
    """:func:`copy_runs` through numpy, run by run: every run checked first, then copied."""
    dst_rows, src_rows = dst.shape[0], src.shape[0]
    for run in runs:
        to, of, count = run[dst_col], run[src_col], run[2]
        if to < 0 or of < 0 or count < 0 or to + count > dst_rows or of + count > src_rows:
            raise ValueError(f"a run outside {dst_rows} rows (to) or {src_rows} rows (from)")
    whole_rows = dst.shape[1] <= COPY_PIECE  # a row is one copy call
    for run in runs:
        to, of, count = run[dst_col], run[src_col], run[2]
        if count == 1 and whole_rows:  # a row by index: cheaper than a one-row slice
            dst[to] = src[of]
        else:
            copy_into(dst[to : to + count], src[of : of + count])
