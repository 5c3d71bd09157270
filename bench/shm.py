"""Region files in ``/dev/shm``: memory both the bench and a child process map (MAP_SHARED).

The bench fills sources and checks destinations through its own mapping while the children
move the bytes, so verification needs no extra protocol.  Files are removed by :meth:`close`.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import numpy.typing as npt

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmFile:
    """A zero-filled ``nbytes`` file in :data:`SHM_DIR` and the bench's shared mapping of it."""

    def __init__(self, tag: str, nbytes: int) -> None:
        fd, self.path = tempfile.mkstemp(prefix=f"omni-bench-{tag}-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.flat: npt.NDArray[np.uint8] = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(nbytes,))

    def rows(self, block_len: int) -> npt.NDArray[np.uint8]:
        """The file as ``nbytes // block_len`` rows of ``block_len`` bytes: a plain ndarray view.

        Plain, not ``np.memmap``: every slice of a memmap runs ``memmap.__array_finalize__`` in
        Python, which would add microseconds per block to whoever slices it.
        """
        return self.flat.view(np.ndarray).reshape(self.nbytes // block_len, block_len)

    def close(self) -> None:
        """Unlink the file (mappings stay valid until dropped).  Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def fill_random(array: npt.NDArray[np.uint8], seed: int) -> None:
    """Overwrite ``array`` with seeded random bytes (every page touched, so later runs don't fault)."""
    flat = array.reshape(-1)
    rng = np.random.default_rng(seed)
    step = 8 << 20
    for start in range(0, flat.size, step):
        chunk = flat[start : start + step]
        chunk[:] = rng.integers(0, 256, chunk.size, dtype=np.uint8)


def blocks_match(
    src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8], local: list[int], remote: list[int]
) -> bool:
    """True if every destination row ``remote[i]`` equals source row ``local[i]``."""
    return bool(np.array_equal(dst[remote], src[local]))
