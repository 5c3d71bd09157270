"""Vetting of untrusted UCX worker addresses in a disposable child process.

UCX trusts the worker addresses it is given: a malformed one can fail an assertion inside
``ucp_ep_create`` and abort the whole process (measured: a wrong version byte, some
truncations of a real address).  A peer's address arrives over the network, so before a lane
connects to it, :class:`AddressVetter` has a child process create an endpoint from it first.
If the child survives the address is used; if it dies the address is refused with
:class:`~omni_async.errors.ProtocolError` and a fresh child is started for the next one.

One child per process (per UCX setting) serves every agent: it is started on first use
(about half a second) and stopped at exit.  The child is :mod:`omni_async.transport.vet_child`.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import struct
import subprocess
import sys
import threading
from typing import IO, Final

from ..errors import ProtocolError

log = logging.getLogger(__name__)

_LEN: Final = struct.Struct("<I")
_OK: Final = b"\x01"  # keep in step with vet_child
_BAD: Final = b"\x00"


class AddressVetter:
    """Checks addresses in a child process; safe to share between loops and threads.

    The exchange with the child is a few blocking pipe operations, run in the loop's default
    executor so the loop never waits on them.
    """

    def __init__(self, tls: str, net_devices: str = "") -> None:
        self._ucx_args = [tls, net_devices]
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.refused = 0

    async def check(self, address: bytes) -> None:
        """Return if a UCX endpoint can be created from ``address``; else raise ProtocolError."""
        ok = await asyncio.get_running_loop().run_in_executor(None, self._check_blocking, address)
        if not ok:
            self.refused += 1
            raise ProtocolError(f"a {len(address)}-byte agent metadata is not a usable UCX worker address")

    def warm_up(self) -> None:
        """Start the child if it is not running (blocking; run it in an executor)."""
        with self._lock:
            try:
                self._pipes()
            except OSError as exc:  # the first check will retry and report
                log.warning("address vetting child did not start: %r", exc)

    def _check_blocking(self, address: bytes) -> bool:
        with self._lock:
            try:
                stdin, stdout = self._pipes()
                stdin.write(_LEN.pack(len(address)) + address)
                stdin.flush()
                verdict = stdout.read(1)
            except OSError as exc:
                verdict = b""
                log.warning("address vetting child failed: %r", exc)
            if verdict == _OK:
                return True
            if verdict != _BAD:  # the child died on this address
                log.warning("a %d-byte peer address crashed the vetting child", len(address))
                self._stop()
            return False

    def _pipes(self) -> tuple[IO[bytes], IO[bytes]]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "omni_async.transport.vet_child", *self._ucx_args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
            assert self._proc.stdout is not None
            if self._proc.stdout.read(1) != _OK:
                self._stop()
                raise OSError("address vetting child failed to start")
        assert self._proc.stdin is not None and self._proc.stdout is not None
        return self._proc.stdin, self._proc.stdout

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        """Stop the child (a later check starts a new one).  Idempotent."""
        with self._lock:
            self._stop()


_vetters: dict[tuple[str, str], AddressVetter] = {}
_vetters_lock = threading.Lock()


def shared_vetter(tls: str, net_devices: str = "") -> AddressVetter:
    """The process-wide vetter for this UCX setting; its child is stopped when the process exits."""
    with _vetters_lock:
        vetter = _vetters.get((tls, net_devices))
        if vetter is None:
            vetter = _vetters[(tls, net_devices)] = AddressVetter(tls, net_devices)
            atexit.register(vetter.close)
        return vetter
