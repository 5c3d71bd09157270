"""The same-host lane: block writes that copy each byte once, straight into the peer's rows.

Between two processes on one host, UCX's shared-memory rendezvous copies every byte twice
(sender into UCX's segment, receiver out of it).  Here the sender copies the rows itself:

* into the peer's region mapped into this process (:class:`MappedRegion`), when the peer's
  region lives in a sealed memfd (every region made by ``BlockRegion.allocate``).  The peer
  advertises ``(pid, fd, token)`` in its handshake (:class:`~omni_async.wire.RegionShare`);
  we open ``/proc/<pid>/fd/<fd>``, check it is the memfd named by the token, of exactly the
  handshake's ``num_blocks × block_len`` bytes and sealed against shrinking, map it and
  close the fd at once.  Why ``/proc`` rather than passing the fd over a unix socket with
  ``SCM_RIGHTS``: no second connection to set up, authenticate and tear down next to the
  control plane, and the kernel applies the same rule as for ``process_vm_writev`` (ptrace
  read access to the peer), so both variants need the same permission;
* into the peer's region mapped into this process (:class:`MappedFile`), when the peer's
  region is a caller's buffer that is itself a shared mapping of a tmpfs file sealed against
  shrinking (a memfd with ``F_SEAL_SHRINK``: :class:`~omni_async.memfd.SharedFile`).  The peer
  advertises ``(pid, fd, inode, offset, token, proof_fd)``; we check that
  ``/proc/<pid>/fd/<proof_fd>`` is the empty memfd named by the token (proof that ``pid`` is
  the peer: a file's own name proves nothing, and the peer could otherwise point our writes at
  a file of a process it cannot write itself) and that the peer holds ``fd`` open read-write
  (``/proc/<pid>/fdinfo``: reopening it through ``/proc`` uses our credentials), open
  ``/proc/<pid>/fd/<fd>``, check on that descriptor that it is a regular tmpfs file with that
  inode, holding the region's bytes at ``offset`` and sealed against shrinking, and map that
  range.  A file that could shrink (a plain ``/dev/shm`` file) is neither offered nor mapped:
  a copy into a page past its end would kill the copying process (SIGBUS);
* else with ``process_vm_writev`` into the peer's region at its ``base_addr``
  (:class:`~.vmwrite.VmWriter`), once the peer proved the pid is its own: we read, in that
  process, the random token it advertised at the address it advertised (so a peer cannot
  point our writes at another process of the same user).

Either way the transport then sends a small ``placed`` header over the UCX lane; the receiver
checks the runs against its region and acknowledges as for any write, so a transfer still
settles only on the receiver's acknowledgement.  No message makes the receiver write anything.

Failure rules: our mapping keeps the peer's pages alive, so a peer killed mid-copy costs
nothing here (its awaiters fail with PeerLost from the control plane, as over UCX); a memfd
is never named in ``/dev/shm``, so a killed process leaks nothing (a shared tmpfs file is the
caller's: we create none and only hold a descriptor and a mapping of it while the peer is).

Trust model: a peer that maps our region (or may ``process_vm_writev`` into us) can write
any row of it at any time, as a process that may ptrace us could.  The lane is only offered
to peers with our ``host_id`` that passed the handshake (authenticated with CURVE, or a
loopback demo), and ``AgentConfig.same_host_lane = False`` turns it off.  A peer's share is
used only once the process it names proved it is the peer (:mod:`.pid_proof`): the proofs
above are one per process, handed to every peer, and could be replayed by another.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from ..handshake import PeerInfo
from ..memfd import SIZE_SEALS, link_name, open_sealed_file
from ..region import BlockRegion, Run
from ..wire import RegionShare
from .memcopy import LOCAL, REMOTE, copy_runs
from .vmwrite import VmWriter, permit_writers, proof

log = logging.getLogger(__name__)


class DirectWriter(Protocol):
    """Places blocks straight into one peer's region (see the module docstring)."""

    @property
    def kind(self) -> str:
        """How (``memfd``, ``file`` or ``process_vm_writev``), for logs and tests."""

    @property
    def num_blocks(self) -> int:
        """Blocks of the peer's region this writer reaches (checked at connection)."""

    def place(self, src: npt.NDArray[np.uint8], runs: Sequence[Run]) -> None:
        """Copy each run's blocks of ``src`` into the peer's blocks; the runs are already
        bounded by both layouts.  Raises :class:`OSError` if the peer cannot be written."""

    def close(self) -> None:
        """Release what the writer holds (mapping, fds).  Idempotent."""


class Refused(Exception):
    """The peer's advertised region cannot be mapped; the message says why."""


class MappedRegion:
    """A peer's memfd region mapped into this process (``MAP_SHARED``)."""

    kind: Final = "memfd"

    def __init__(self, share: RegionShare, num_blocks: int, block_len: int) -> None:
        """Open, check and map the memfd the peer advertised; raise :class:`Refused`."""
        self.num_blocks = num_blocks
        if share.fd < 0 or not share.token:
            raise Refused("the peer's region is not in a memfd")
        self._mapping: mmap.mmap | None = map_memfd(share.pid, share.fd, share.token, num_blocks * block_len)
        self._rows: npt.NDArray[np.uint8] | None = np.frombuffer(self._mapping, np.uint8).reshape(
            num_blocks, block_len
        )

    @property
    def rows(self) -> npt.NDArray[np.uint8]:
        """The peer's region as a 2-D array (only while open)."""
        if self._rows is None:
            raise OSError("the peer's region is unmapped")
        return self._rows

    def place(self, src: npt.NDArray[np.uint8], runs: Sequence[Run]) -> None:
        rows = self._rows  # (not the property: a call less on every write)
        if rows is None:
            raise OSError("the peer's region is unmapped")
        try:
            copy_runs(rows, REMOTE, src, LOCAL, runs)
        except ValueError as exc:  # (the planning bounds them: a bug, failed as a write error)
            raise OSError(errno.EINVAL, f"write outside the peer's mapped region: {exc}") from None

    def fetch(self, dst: npt.NDArray[np.uint8], runs: Sequence[Run]) -> None:
        """Copy the peer's blocks of each run (``remote``) into ``dst`` (``local``); the runs
        are already bounded by both layouts (else :class:`OSError`, nothing copied)."""
        try:
            copy_runs(dst, LOCAL, self.rows, REMOTE, runs)
        except ValueError as exc:
            raise OSError(errno.EINVAL, f"read outside the peer's mapped region: {exc}") from None

    def close(self) -> None:
        self._rows = None
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()


class MappedFile(MappedRegion):
    """A peer's region that is a shared mapping of a sealed tmpfs file, mapped here.

    The file is sealed against shrinking (checked on the descriptor we open, not taken from
    the offer), so no page of our mapping can vanish under a copy (SIGBUS); the descriptor is
    closed once the range is mapped, as for a memfd region.
    """

    kind: Final = "file"  # type: ignore[misc]

    def __init__(self, share: RegionShare, num_blocks: int, block_len: int) -> None:
        """Open, check and map the file the peer advertised; raise :class:`Refused`."""
        self.num_blocks = num_blocks
        end = share.offset + num_blocks * block_len
        if share.proof_fd < 0 or not share.token:
            raise Refused("the peer offered a file without proof that it is the peer's")
        check_link(f"/proc/{share.pid}/fd/{share.proof_fd}", link_name(share.token))
        path = f"/proc/{share.pid}/fd/{share.fd}"
        try:
            fd = open_sealed_file(path, share.inode, end)
        except OSError as exc:
            raise Refused(f"cannot map {path}: {exc.strerror or exc}") from None
        try:
            _check_writable(share.pid, share.fd)
            start = share.offset - share.offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, end - start, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                                offset=start)
        finally:
            os.close(fd)  # the mapping holds the file
        try:
            rows = np.frombuffer(mapping, np.uint8, num_blocks * block_len, share.offset - start)
        except BaseException:
            mapping.close()
            raise
        self._mapping = mapping
        self._rows = rows.reshape(num_blocks, block_len)


def _check_writable(pid: int, fd: int) -> None:
    """Raise :class:`Refused` unless process ``pid`` holds ``fd`` open for writing: opening
    ``/proc/<pid>/fd/<fd>`` reopens the file with *our* credentials, so a peer could otherwise
    have us write a file it may only read."""
    path = f"/proc/{pid}/fdinfo/{fd}"
    try:
        with open(path) as info:
            flags = next((int(line.split()[1], 8) for line in info if line.startswith("flags:")), None)
    except (OSError, ValueError, IndexError) as exc:
        raise Refused(f"cannot read {path}: {exc}") from None
    if flags is None or flags & os.O_ACCMODE != os.O_RDWR:
        raise Refused(f"the peer's descriptor {fd} is not open for reading and writing ({path})")


def map_memfd(pid: int, fd: int, token: str, size: int) -> mmap.mmap:
    """Map (shared, read-write) the sealed memfd ``fd`` of process ``pid`` named by ``token``
    (:mod:`omni_async.memfd`), of exactly ``size`` bytes; raise :class:`Refused` otherwise.
    No descriptor stays open."""
    expected = link_name(token)
    path = f"/proc/{pid}/fd/{fd}"
    check_link(path, expected)  # before opening: never open something else (a device, a fifo)
    try:
        opened = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise Refused(f"cannot open {path}: {exc.strerror}") from None
    try:
        check_link(f"/proc/self/fd/{opened}", expected)  # the fd number was not reused meanwhile
        info = os.fstat(opened)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise Refused(f"{path} holds {info.st_size} bytes, the peer announced {size}")
        if fcntl.fcntl(opened, fcntl.F_GET_SEALS) & SIZE_SEALS != SIZE_SEALS:
            raise Refused(f"{path} is not sealed against resizing")
        return mmap.mmap(opened, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(opened)


def open_pipe(pid: int, fd: int) -> int:
    """Open the write end of a pipe that process ``pid`` holds as ``fd`` (non-blocking,
    close-on-exec); raise :class:`Refused` if that is not a pipe with a reader."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError as exc:
        raise Refused(f"cannot read {path}: {exc.strerror}") from None
    if not target.startswith("pipe:["):
        raise Refused(f"{path} is {target!r}, not a pipe")
    try:
        opened = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise Refused(f"cannot open {path}: {exc.strerror}") from None
    if not stat.S_ISFIFO(os.fstat(opened).st_mode):
        os.close(opened)
        raise Refused(f"{path} is not a pipe")
    return opened


def check_link(path: str, expected: str) -> None:
    """Raise :class:`Refused` unless the ``/proc`` link at ``path`` reads ``expected`` (a
    memfd's :func:`~omni_async.memfd.link_name`), or if it cannot be read."""
    try:
        target = os.readlink(path)
    except OSError as exc:
        raise Refused(f"cannot read {path}: {exc.strerror}") from None
    if target != expected:
        raise Refused(f"{path} is {target!r}, not the advertised memfd")


def advertise(region: BlockRegion) -> RegionShare | None:
    """What this process offers same-host peers for ``region``: its memfd if it has one, the
    tmpfs file a wrapped region maps if there is one, else ``process_vm_writev`` access (None
    if the kernel forbids even that)."""
    segment = region.segment
    if segment is not None and segment.shareable:
        return RegionShare(pid=os.getpid(), fd=segment.fd, token=segment.token)
    file = region.shared_file()
    if file is not None and file.shareable:
        return RegionShare(pid=os.getpid(), fd=file.fd, token=file.token, inode=file.inode, offset=file.offset,
                           proof_fd=file.proof_fd)
    if not permit_writers():
        return None
    token, address = proof()
    return RegionShare(pid=os.getpid(), token=token, proof_addr=address)


class Writers:
    """The direct writers of every region of a peer's region set, in order (one for a single
    region); ``kind`` and ``num_blocks`` are the first one's (the set shares ``num_blocks``)."""

    def __init__(self, writers: Sequence[DirectWriter]) -> None:
        self.writers = list(writers)
        self.kind: str = self.writers[0].kind
        self.num_blocks: int = self.writers[0].num_blocks  # (read on every write: an attribute)

    @property
    def mapped(self) -> bool:
        """Every region is mapped here, so it can be read as well (:meth:`fetch`)."""
        return all(isinstance(writer, MappedRegion) for writer in self.writers)

    def place(self, srcs: Sequence[npt.NDArray[np.uint8]], runs: Sequence[Run]) -> None:
        """Copy each run's blocks of every source region into the peer's (see ``DirectWriter.place``)."""
        for writer, src in zip(self.writers, srcs, strict=True):
            writer.place(src, runs)

    def fetch(self, dsts: Sequence[npt.NDArray[np.uint8]], runs: Sequence[Run]) -> None:
        """Copy the peer's blocks into ``dsts`` (only if :attr:`mapped`; else :class:`OSError`)."""
        for writer, dst in zip(self.writers, dsts, strict=True):
            if not isinstance(writer, MappedRegion):
                raise OSError("the peer's region is not mapped here")
            writer.fetch(dst, runs)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def share_pids(peer: PeerInfo) -> set[int]:
    """The processes the peer's region shares name (one per region of its set that has a share)."""
    layers = (peer.layer(index) for index in range(len(peer.layers) + 1))
    return {layer.region_share.pid for layer in layers if layer.region_share is not None}


def open_writers(peer: PeerInfo, host_id: str) -> Writers | None:
    """Direct writers for every region of the peer's set, or None (UCX) unless all open."""
    writers = [open_writer(peer.layer(i), host_id) for i in range(len(peer.layers) + 1)]
    if all(writers):
        return Writers([writer for writer in writers if writer is not None])
    for writer in writers:
        if writer is not None:
            writer.close()
    return None


def open_writer(peer: PeerInfo, host_id: str) -> DirectWriter | None:
    """The direct writer for ``peer`` if it is on this host and offered one, else None (UCX).

    Never raises: a refused offer is logged once (for this peer) and the lane stays on UCX.
    """
    share = peer.region_share
    if share is None or not host_id or peer.host_id != host_id:
        return None
    try:
        if share.fd >= 0 and share.inode:
            return MappedFile(share, peer.num_blocks, peer.block_len)
        if share.fd >= 0:
            return MappedRegion(share, peer.num_blocks, peer.block_len)
        return VmWriter(share.pid, peer.base_addr, peer.num_blocks, share.token, share.proof_addr)
    except (Refused, OSError) as exc:
        log.warning("peer %s: no same-host lane, writing through UCX (%s)", peer.peer_id, exc)
        return None
