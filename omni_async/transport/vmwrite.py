"""Single-copy block writes into another process's memory with ``process_vm_writev``.

The fallback of the same-host lane (see :mod:`.shared`) for a peer whose region is not in
shared memory (a wrapped caller buffer): the kernel copies each run straight from our region
into the peer's, at the ``base_addr`` it gave in the handshake.  A write to a process that is
gone, or that we may not write, fails with an errno (ESRCH, EPERM, EFAULT): it never aborts
this process (unlike UCX's cma transport, which calls ``abort()`` on the same errors).

Writing needs ptrace permission over the peer (same user, and with Yama's
``ptrace_scope = 1`` the peer's consent: :func:`permit_writers`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import select
from collections.abc import Sequence
from itertools import chain
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ..region import Run

log = logging.getLogger(__name__)

IOV_MAX: Final = 1024
"""Most iovecs the kernel takes in one call."""
_PR_SET_PTRACER: Final = 0x59616D61
_PR_SET_PTRACER_ANY: Final = ctypes.c_ulong(-1).value
_YAMA_SCOPE: Final = "/proc/sys/kernel/yama/ptrace_scope"
_EXIT_GRACE_MS: Final = 20
"""After a failed write, how long to wait for the pidfd to tell whether the peer is exiting
(a killed process loses its memory a moment before its pidfd says it exited)."""

_libc = ctypes.CDLL(None, use_errno=True)
_writev = _libc.process_vm_writev
_writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_writev.restype = ctypes.c_ssize_t
_writev_holding_gil = ctypes.PyDLL(None, use_errno=True).process_vm_writev
"""The same call, keeping the GIL: for a short write (a few µs) that is cheaper than letting
another thread take the GIL and waiting to get it back (a facade's caller thread, mostly)."""
_writev_holding_gil.argtypes = _writev.argtypes
_writev_holding_gil.restype = ctypes.c_ssize_t
_SHORT_WRITE: Final = 1 << 20
"""Writes up to this many bytes keep the GIL; longer ones let other threads run meanwhile."""
_FEW_RUNS: Final = 8
"""Up to this many runs, the iovecs are filled in Python (numpy's set-up costs more)."""
_readv = _libc.process_vm_readv
_readv.argtypes = _writev.argtypes
_readv.restype = ctypes.c_ssize_t
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def permit_writers() -> bool:
    """Let same-user peers write this process's memory where Yama would forbid it
    (``ptrace_scope = 1``: ``PR_SET_PTRACER_ANY``).  Returns False if writes stay forbidden
    (scope 2 or 3: peers then fall back to UCX), True otherwise."""
    try:
        with open(_YAMA_SCOPE) as f:
            scope = f.read().strip()
    except OSError:
        return True  # no Yama: the usual same-user rule applies
    if scope == "0":
        return True
    if scope != "1":
        return False
    if _prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
        log.info("PR_SET_PTRACER failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


_proof: ctypes.Array[ctypes.c_char] | None = None


def proof() -> tuple[str, int]:
    """This process's random token and the address of its bytes here (kept for the process's
    life): a peer that reads the token at that address in our pid knows the pid is ours."""
    global _proof
    if _proof is None:
        _proof = ctypes.create_string_buffer(secrets.token_hex(16).encode(), 32)
    return _proof.raw.decode(), ctypes.addressof(_proof)


def read_token(pid: int, address: int) -> bytes:
    """The 32 bytes at ``address`` in process ``pid`` (raises :class:`OSError`)."""
    buffer = ctypes.create_string_buffer(32)
    local = _Iovec(ctypes.addressof(buffer), 32)
    remote = _Iovec(address, 32)
    got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != 32:
        code = ctypes.get_errno() if got < 0 else errno.EIO
        raise OSError(code, f"cannot read process {pid}'s proof: {os.strerror(code)}")
    return buffer.raw


def _iovecs(
    src: npt.NDArray[np.uint8], runs: Sequence[Run], base_addr: int
) -> tuple[Any, Any, int, int]:
    """The local and remote iovec arrays of ``runs`` (at most ``IOV_MAX``) from the 2-D region
    ``src`` to the peer's region at ``base_addr``: ``(local, remote, count, bytes)``; the
    arrays must stay referenced until the call that uses them returned."""
    block_len = src.shape[1]
    src_addr = src.__array_interface__["data"][0]
    count = len(runs)
    if count <= _FEW_RUNS:
        local, remote = (_Iovec * count)(), (_Iovec * count)()
        want = 0
        for i, (src_block, dst_block, length) in enumerate(runs):
            nbytes = length * block_len
            local[i].base, local[i].len = src_addr + src_block * block_len, nbytes
            remote[i].base, remote[i].len = base_addr + dst_block * block_len, nbytes
            want += nbytes
        return local, remote, count, want
    # from one flat iterator: a quarter of the cost of np.array over the list of runs
    table = np.fromiter(chain.from_iterable(runs), np.uint64, 3 * count).reshape(-1, 3)
    lengths = table[:, 2] * np.uint64(block_len)
    local_np = np.empty((count, 2), np.uint64)
    remote_np = np.empty((count, 2), np.uint64)
    local_np[:, 0] = np.uint64(src_addr) + table[:, 0] * np.uint64(block_len)
    remote_np[:, 0] = np.uint64(base_addr) + table[:, 1] * np.uint64(block_len)
    local_np[:, 1] = remote_np[:, 1] = lengths
    pointer = ctypes.c_void_p
    return local_np.ctypes.data_as(pointer), remote_np.ctypes.data_as(pointer), count, int(lengths.sum())


class VmWriter:
    """Writes runs of our region into the region of ``num_blocks`` blocks of process ``pid``
    at ``base_addr``.

    The caller bounds the runs by both layouts (:func:`~omni_async.region.plan_runs`)
    before calling :meth:`place`.  Construction checks that ``pid`` holds ``token`` at
    ``proof_addr`` (see :func:`proof`): a peer cannot make us write into another process it
    names.  A pidfd taken first tells whether the peer process still exists before each write,
    so a write never lands in an unrelated process that reused the pid after the peer exited.
    Raises :class:`OSError` if the process is gone or the proof is wrong.
    """

    kind: Final = "process_vm_writev"

    def __init__(self, pid: int, base_addr: int, num_blocks: int, token: str, proof_addr: int) -> None:
        self.pid = pid
        self.base_addr = base_addr
        self.num_blocks = num_blocks
        self._pidfd = os.pidfd_open(pid)  # ProcessLookupError if it is gone already
        try:
            if len(token) != 32 or read_token(pid, proof_addr) != token.encode():
                raise OSError(errno.EACCES, f"process {pid} did not prove it is the peer")
        except BaseException:
            os.close(self._pidfd)
            raise
        self._poll = select.poll()
        self._poll.register(self._pidfd, select.POLLIN)

    def place(self, src: npt.NDArray[np.uint8], runs: Sequence[Run]) -> None:
        """Copy each run's blocks of ``src`` (a 2-D region) into the peer's blocks.

        Raises :class:`OSError` (``ESRCH`` if the peer exited, also in the middle of the
        write; ``EPERM``; ``EFAULT``; ``EIO`` for a short write); some runs may have landed.
        """
        if self._pidfd < 0 or self._poll.poll(0):
            raise OSError(errno.ESRCH, f"process {self.pid} exited")
        try:
            self._write(src, runs)
        except OSError:
            if self._poll.poll(_EXIT_GRACE_MS):  # only on this failure path
                raise OSError(errno.ESRCH, f"process {self.pid} exited during the write") from None
            raise

    def _write(self, src: npt.NDArray[np.uint8], runs: Sequence[Run]) -> None:
        for start in range(0, len(runs), IOV_MAX):
            local, remote, count, want = _iovecs(src, runs[start : start + IOV_MAX], self.base_addr)
            writev = _writev_holding_gil if want <= _SHORT_WRITE else _writev
            got = writev(self.pid, local, count, remote, count, 0)
            if got < 0:
                code = ctypes.get_errno()
                raise OSError(code, f"process_vm_writev to {self.pid}: {os.strerror(code)}")
            if got != want:
                raise OSError(errno.EIO, f"process_vm_writev to {self.pid} wrote {got} of {want} bytes")

    def close(self) -> None:
        """Release the pidfd.  Idempotent."""
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
