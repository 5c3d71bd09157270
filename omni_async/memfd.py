"""Shared memory for block regions: an anonymous, sealed ``memfd`` mapped ``MAP_SHARED``, or
the sealed tmpfs file a caller's buffer already maps (:class:`SharedFile`).

A :class:`SharedSegment` is never named in ``/dev/shm`` or anywhere else in the file system:
the kernel frees it when its last file descriptor and its last mapping are gone, so nothing
can leak when a process is killed.  Its size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW``):
a peer that maps it can rely on every page staying there (a shrunk file would raise SIGBUS
in the peer).  Its name is ``omni-<token>`` with a random 128-bit token, which a peer on the
same host checks before it maps the segment (see :mod:`omni_async.transport.shared`).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import stat
import weakref
from typing import Final

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

NAME_PREFIX: Final = "omni-"
SIZE_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
TMPFS_MAGIC: Final = 0x01021994
"""``statfs.f_type`` of tmpfs (``/dev/shm``, memfds): memory, never a disk (no I/O errors)."""


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


class SharedFile:
    """The tmpfs file that a caller's buffer is a ``MAP_SHARED`` mapping of, opened here so
    that peers on this host can map it too: only a file that can never shrink (a memfd sealed
    with ``F_SEAL_SHRINK``), since a copy into a page past a file's end kills the copying
    process (SIGBUS), and a peer must not be able to do that to us, nor we to it.

    :meth:`find` looks the buffer up in ``/proc/self/maps``; the descriptor it opens names
    the file by ``inode`` (checked against the mapping), and the buffer starts ``offset``
    bytes into it.  Every page of the buffer's range is allocated at once
    (``posix_fallocate``), so a peer's write can never meet a full tmpfs (SIGBUS either).

    A file's name proves nothing about who offers it, so next to it an empty memfd named by a
    random ``token`` (:func:`link_name`) stays open as ``proof_fd``: a peer that finds that
    name at ``/proc/<pid>/fd/<proof_fd>`` knows ``pid`` offered the file, not a process the
    other side named (reading another process's descriptors needs the same access as opening
    them).  Both descriptors stay open (close-on-exec) until :meth:`close` or garbage
    collection; nothing is named in the file system.
    """

    __slots__ = ("__weakref__", "_closer", "fd", "inode", "offset", "proof_fd", "token")

    def __init__(self, fd: int, inode: int, offset: int) -> None:
        self.token = secrets.token_hex(16)
        self.proof_fd = os.memfd_create(NAME_PREFIX + self.token, os.MFD_CLOEXEC)
        self.fd = fd
        self.inode = inode
        self.offset = offset
        self._closer = weakref.finalize(self, _close_both, fd, self.proof_fd)

    @classmethod
    def find(cls, address: int, size: int) -> SharedFile | None:
        """The sealed tmpfs file mapped shared and writable at ``[address, address + size)``
        in this process, opened (see :func:`open_sealed_file`); None if that range is not one
        such mapping (private memory, a disk file, a read-only or private mapping, several
        mappings), the file may shrink (a plain ``/dev/shm`` file, an unsealed memfd) or it
        cannot be opened and allocated (logged)."""
        found = _mapping_of(address, size)
        if found is None:
            return None
        start, file_offset, device, inode, path = found
        offset = file_offset + address - start
        # Reopened from a descriptor of this process that holds it (a memfd, or a file a
        # mapping keeps open), else from its path.
        candidates = [f"/proc/self/fd/{name}" for name in os.listdir("/proc/self/fd")]
        if path.startswith("/") and not path.endswith(" (deleted)"):
            candidates.append(path)
        why = f"no descriptor of {path!r} (inode {inode})"
        for candidate in candidates:
            try:
                info = os.stat(candidate)
            except OSError:
                continue
            if (info.st_dev, info.st_ino) != (device, inode):
                continue
            try:
                fd = open_sealed_file(candidate, inode, offset + size, device)
            except OSError as exc:
                why = str(exc)
                continue
            try:
                os.posix_fallocate(fd, offset, size)
            except OSError as exc:
                os.close(fd)
                log.info("no shared file for the region at %#x: %s", address, exc)
                return None
            return cls(fd, inode, offset)
        log.info("no shared file for the region at %#x: %s", address, why)
        return None

    @property
    def shareable(self) -> bool:
        """True until :meth:`close`: peers can still open the file through our descriptor."""
        return self._closer.alive

    def close(self) -> None:
        """Close the descriptor (mappings, ours and peers', stay valid).  Idempotent."""
        self._closer()


def _close_both(fd: int, proof_fd: int) -> None:
    os.close(fd)
    os.close(proof_fd)


def _mapping_of(address: int, size: int) -> tuple[int, int, int, int, str] | None:
    """``(start, file offset, device, inode, path)`` of the shared, writable file mapping
    of this process that holds all of ``[address, address + size)``, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            span, perms, file_offset, dev, inode = fields[:5]
            low, _, high = span.partition("-")
            start, end = int(low, 16), int(high, 16)
            if not start <= address < end:
                continue
            if address + size > end or not perms.startswith("rw") or perms[3] != "s" or inode == "0":
                return None
            major, _, minor = dev.partition(":")
            path = fields[5].rstrip("\n") if len(fields) > 5 else ""
            device = os.makedev(int(major, 16), int(minor, 16))
            return start, int(file_offset, 16), device, int(inode), path
    return None


def open_sealed_file(path: str, inode: int, size: int, device: int | None = None) -> int:
    """Open ``path`` (read-write, close-on-exec) if it is the regular tmpfs file ``inode`` (on
    ``device`` if given) of at least ``size`` bytes, sealed against shrinking: a file a peer
    may map, since no page of it can vanish under a mapping (SIGBUS).  The path is checked
    before it is opened (never open something else: a device, a fifo) and everything again on
    the descriptor opened here (never trust an offer: the seals are the file's, read here).
    Raises :class:`OSError` saying why otherwise."""

    def same(info: os.stat_result) -> bool:
        return stat.S_ISREG(info.st_mode) and info.st_ino == inode and device in (None, info.st_dev)

    if not same(os.stat(path)):
        raise OSError(f"{path} is not the regular file with inode {inode}")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)  # the same file still (a descriptor number may have been reused)
        if not same(info) or fs_type(fd) != TMPFS_MAGIC:
            raise OSError(f"{path} is not the tmpfs file with inode {inode}")
        if info.st_size < size:
            raise OSError(f"{path} holds {info.st_size} bytes, the region needs {size}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # a file system without seals
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise OSError(f"{path} is not sealed against shrinking (F_SEAL_SHRINK): a peer may not map it")
    except BaseException:
        os.close(fd)
        raise
    return fd


class _StatFs(ctypes.Structure):
    _fields_ = (("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112))


_fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
_fstatfs.argtypes = [ctypes.c_int, ctypes.POINTER(_StatFs)]
_fstatfs.restype = ctypes.c_int


def fs_type(fd: int) -> int:
    """``f_type`` of the file system holding ``fd`` (``fstatfs``)."""
    result = _StatFs()
    if _fstatfs(fd, ctypes.byref(result)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result.f_type) & 0xFFFFFFFF
