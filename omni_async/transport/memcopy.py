"""Large copies in pieces that stay on the C library's fastest copy path.

glibc's ``memcpy`` copies with ``rep movsb`` up to a size threshold and with a vector loop
above it; on AMD CPUs that threshold is the L2 cache size (glibc 2.33 on; 2.36 and 1 MiB per
core on the AMD EPYC machine of docs/performance.md), where one copy of 1 MiB or more moved
14-20 GB/s and the same bytes in 256 KiB pieces 26-31 GB/s (ctypes ``memcpy`` over a 16 MiB
buffer, piece sizes alternated; docs/tuning.md).  Rows copied into a peer's region (and out
of it) and frames copied into its shared pool go through :func:`copy_into`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

COPY_PIECE = 256 * 1024
"""Most bytes one copy call moves: below every current x86 L2 size (Zen 2: 512 KiB)."""


def copy_into(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> None:
    """``dst[...] = src`` for C-contiguous byte arrays of the same shape (``dst`` writable),
    in pieces of at most :data:`COPY_PIECE` bytes."""
    nbytes = dst.nbytes
    if nbytes <= COPY_PIECE:
        dst[...] = src
        return
    to, of = dst.reshape(-1), src.reshape(-1)
    for at in range(0, nbytes, COPY_PIECE):
        to[at : at + COPY_PIECE] = of[at : at + COPY_PIECE]
