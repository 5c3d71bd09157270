"""Anonymous, sealed shared memory for block regions: a ``memfd`` mapped ``MAP_SHARED``.

A :class:`SharedSegment` is never named in ``/dev/shm`` or anywhere else in the file system:
the kernel frees it when its last file descriptor and its last mapping are gone, so nothing
can leak when a process is killed.  Its size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW``):
a peer that maps it can rely on every page staying there (a shrunk file would raise SIGBUS
in the peer).  Its name is ``omni-<token>`` with a random 128-bit token, which a peer on the
same host checks before it maps the segment (see :mod:`omni_async.transport.shared`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import weakref
from typing import Final

import numpy as np
import numpy.typing as npt

NAME_PREFIX: Final = "omni-"
SIZE_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def link_name(token: str) -> str:
    """What ``readlink /proc/<pid>/fd/<fd>`` says for the segment named by ``token``."""
    return f"/memfd:{NAME_PREFIX}{token} (deleted)"


class SharedSegment:
    """``size`` zero-filled bytes in a sealed memfd, mapped here; ``array`` views them.

    The file descriptor stays open (close-on-exec) as long as this object lives, so that a
    peer can open it through ``/proc/<pid>/fd/<fd>``; :meth:`close` (or garbage collection)
    closes it.  The mapping lives as long as a view of it does (Python's ``mmap`` keeps its own
    duplicate of the descriptor until then, so the kernel frees the memory when the region's
    last view is gone, or when the process dies).
    """

    __slots__ = ("__weakref__", "_closer", "array", "fd", "token")

    def __init__(self, size: int) -> None:
        self.token = secrets.token_hex(16)
        fd = os.memfd_create(NAME_PREFIX + self.token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.array: npt.NDArray[np.uint8] = np.frombuffer(mapping, dtype=np.uint8)
        self._closer = weakref.finalize(self, os.close, fd)

    @property
    def shareable(self) -> bool:
        """True until :meth:`close`: peers can still open the segment."""
        return self._closer.alive

    def close(self) -> None:
        """Close the file descriptor (peers can no longer open the segment; existing mappings,
        ours and theirs, stay valid).  Idempotent."""
        self._closer()
