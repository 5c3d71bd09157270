"""Region files: memory both the bench and a child process map (MAP_SHARED).

Each is a sealed memfd (:class:`~omni_async.memfd.SharedSegment`: it can never shrink, so a
peer's facade may map it, see docs/migration.md) that children open as
``/proc/<bench pid>/fd/<n>`` while the bench holds it.  The bench fills sources and checks
destinations through its own mapping while the children move the bytes, so verification needs
no extra protocol.  Nothing is named in the file system: the memory goes with the last mapping.
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

from omni_async.memfd import SharedSegment


class ShmFile:
    """A zero-filled ``nbytes`` sealed memfd, every page allocated, and the bench's mapping of
    it; ``path`` opens it in a child (only while this object is open)."""

    def __init__(self, nbytes: int) -> None:
        self._segment = SharedSegment(nbytes)
        os.posix_fallocate(self._segment.fd, 0, nbytes)  # no child meets a full tmpfs (SIGBUS)
        self.path = f"/proc/{os.getpid()}/fd/{self._segment.fd}"
        self.nbytes = nbytes
        self.flat: npt.NDArray[np.uint8] = self._segment.array

    def rows(self, block_len: int) -> npt.NDArray[np.uint8]:
        """The file as ``nbytes // block_len`` rows of ``block_len`` bytes: a plain ndarray view."""
        return self.flat.reshape(self.nbytes // block_len, block_len)

    def close(self) -> None:
        """Close the bench's descriptor (children can no longer open ``path``; every mapping
        stays valid until dropped).  Idempotent."""
        self._segment.close()


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
