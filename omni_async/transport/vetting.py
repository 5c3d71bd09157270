"""Vetting of untrusted UCX worker addresses in disposable child processes.

UCX trusts the worker addresses it is given: a malformed one can fail an assertion inside
``ucp_ep_create`` and abort the whole process (measured: a wrong version byte, some
truncations and byte changes of a real address).  A peer's address arrives over the network,
so before a lane connects to it, :class:`AddressVetter` has a child process create an endpoint
from it first.  If the child survives the address is used; if it dies the address is refused
with :class:`~omni_async.errors.ProtocolError`.

Bounded, so that a flood of crash-inducing addresses cannot hold up legitimate handshakes:

* a crash is cheap: servers are forked from a zygote that imported ucxx once (see
  :mod:`.vet_child`), so replacing a dead one costs tens of milliseconds, not a Python start;
* at most ``workers`` checks run at once (one server each) and at most ``max_pending`` wait;
  beyond that a check is refused at once;
* every check has a deadline: one that could not finish in time is refused;
* waiting checks are served newest first: under overload the ones whose handshake may still
  succeed go first, and old ones expire instead of delaying everything behind them.

One vetter per process (per UCX setting) serves every agent: it is started on first use and
stopped at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Final

from ..errors import ProtocolError
from .vet_child import BAD, LENGTH, OK

log = logging.getLogger(__name__)

DEADLINE: Final = 2.0
"""Default seconds a check may take, waiting included."""
WORKERS: Final = 2
"""Checks run at once (each in its own server process)."""
MAX_PENDING: Final = 256
"""Checks that may wait; more are refused at once."""
_START_TIMEOUT: Final = 30.0  # seconds the zygote may take to import ucxx


@dataclass(eq=False)
class _Job:
    address: bytes
    deadline: float
    result: concurrent.futures.Future[bool | None] = field(default_factory=concurrent.futures.Future)


class AddressVetter:
    """Checks addresses in child processes; safe to share between loops and threads.

    The exchanges with the children are blocking socket operations on the vetter's own
    ``workers`` threads, so no event loop ever waits on them.  Use :meth:`close` to stop
    threads and children (a later check starts them again).
    """

    def __init__(self, tls: str, net_devices: str = "", *, workers: int = WORKERS,
                 max_pending: int = MAX_PENDING) -> None:
        self._ucx_args = [tls, net_devices]
        self._workers = workers
        self._max_pending = max_pending
        self._cond = threading.Condition()
        self._waiting: list[_Job] = []  # a stack: newest first
        self._threads: list[threading.Thread] = []
        self._servers: set[socket.socket] = set()
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_sock: socket.socket | None = None
        self._zygote_lock = threading.Lock()
        self._closed = False
        self.refused = 0

    async def check(self, address: bytes, timeout: float = DEADLINE) -> None:
        """Return if a UCX endpoint can be created from ``address``; else raise ProtocolError
        (unusable, or not vetted within ``timeout`` seconds, or too many checks waiting)."""
        job = _Job(address, time.monotonic() + timeout)
        with self._cond:
            if len(self._waiting) >= self._max_pending:
                self.refused += 1
                raise ProtocolError(f"address vetting is saturated ({self._max_pending} checks waiting)")
            self._closed = False
            self._waiting.append(job)
            self._start_threads()
            self._cond.notify()
        try:
            verdict = await asyncio.wait_for(asyncio.wrap_future(job.result), timeout)
        except TimeoutError:
            verdict = None
        if verdict is None:
            self.refused += 1
            raise ProtocolError(f"a {len(address)}-byte agent metadata was not vetted within {timeout}s")
        if not verdict:
            self.refused += 1
            raise ProtocolError(f"a {len(address)}-byte agent metadata is not a usable UCX worker address")

    def warm_up(self) -> None:
        """Start the zygote if it is not running (blocking; run it in an executor)."""
        with self._zygote_lock:
            try:
                self._zygote_socket()
            except OSError as exc:  # the first check will retry and report
                log.warning("address vetting child did not start: %r", exc)

    def close(self) -> None:
        """Stop the worker threads and every child.  Idempotent."""
        with self._cond:
            self._closed = True
            threads, self._threads = self._threads, []
            self._cond.notify_all()
        for thread in threads:
            thread.join(DEADLINE + 1)
        with self._zygote_lock:
            if self._zygote_sock is not None:
                self._zygote_sock.close()
                self._zygote_sock = None
            if self._zygote is not None:
                self._zygote.kill()
                self._zygote.wait()
                if self._zygote.stdout is not None:
                    self._zygote.stdout.close()
                self._zygote = None

    # -- worker threads --------------------------------------------------------------------------
    def _start_threads(self) -> None:
        while len(self._threads) < self._workers:
            thread = threading.Thread(target=self._work, name=f"omni-vet-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _work(self) -> None:
        server: socket.socket | None = None
        try:
            while True:
                with self._cond:
                    while not self._waiting and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        for job in self._waiting:  # refused: not vetted
                            if job.result.set_running_or_notify_cancel():
                                job.result.set_result(None)
                        self._waiting.clear()
                        return
                    job = self._waiting.pop()
                if not job.result.set_running_or_notify_cancel():
                    continue  # its awaiter gave up
                verdict: bool | None = None
                try:
                    if time.monotonic() < job.deadline:
                        server, verdict = self._vet(server, job)
                finally:
                    job.result.set_result(verdict)
        finally:
            if server is not None:
                self._drop_server(server)

    def _vet(self, server: socket.socket | None, job: _Job) -> tuple[socket.socket | None, bool | None]:
        """Vet ``job`` on ``server`` (a new one if None); return the server to keep and the verdict."""
        try:
            if server is None:
                server = self._new_server(job.deadline)
            server.settimeout(max(job.deadline - time.monotonic(), 0.001))
            server.sendall(LENGTH.pack(len(job.address)) + job.address)
            answer = server.recv(1)
        except TimeoutError:  # a server hung inside UCX ends itself (vet_child.HANG_LIMIT)
            log.warning("vetting a %d-byte peer address timed out", len(job.address))
            answer = None
        except OSError as exc:
            log.warning("address vetting child failed: %r", exc)
            answer = b""
        if answer in (OK, BAD):
            return server, answer == OK
        if server is not None:
            self._drop_server(server)
        if answer == b"":
            log.warning("a %d-byte peer address crashed the vetting child", len(job.address))
            return None, False
        return None, None

    # -- children --------------------------------------------------------------------------------
    def _new_server(self, deadline: float) -> socket.socket:
        """A fresh server forked by the zygote, ready to vet (raises OSError or TimeoutError)."""
        ours, theirs = socket.socketpair()
        try:
            with self._zygote_lock:
                socket.send_fds(self._zygote_socket(), [b"s"], [theirs.fileno()])
            ours.settimeout(max(deadline - time.monotonic(), 0.001))
            if ours.recv(1) != OK:
                raise OSError("address vetting server failed to start")
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        with self._cond:
            self._servers.add(ours)
        return ours

    def _drop_server(self, server: socket.socket) -> None:
        with self._cond:
            self._servers.discard(server)
        server.close()  # the server reads EOF and exits

    def _zygote_socket(self) -> socket.socket:
        """The socket to the zygote, started (blocking, up to ``_START_TIMEOUT``) if needed."""
        if self._zygote is not None and self._zygote.poll() is None and self._zygote_sock is not None:
            return self._zygote_sock
        if self._zygote_sock is not None:
            self._zygote_sock.close()
        ours, theirs = socket.socketpair()
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        try:
            self._zygote = subprocess.Popen(
                [sys.executable, "-m", "omni_async.transport.vet_child", *self._ucx_args],
                stdin=theirs.fileno(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            )
        finally:
            theirs.close()
        self._zygote_sock = ours
        assert self._zygote.stdout is not None
        started, _, _ = select.select([self._zygote.stdout], [], [], _START_TIMEOUT)
        if not started or self._zygote.stdout.read(1) != OK:
            self._zygote.kill()
            self._zygote.wait()
            raise OSError("address vetting child failed to start")
        return ours


_vetters: dict[tuple[str, str], AddressVetter] = {}
_vetters_lock = threading.Lock()


def shared_vetter(tls: str, net_devices: str = "") -> AddressVetter:
    """The process-wide vetter for this UCX setting; its children are stopped when the process exits."""
    with _vetters_lock:
        vetter = _vetters.get((tls, net_devices))
        if vetter is None:
            vetter = _vetters[(tls, net_devices)] = AddressVetter(tls, net_devices)
            atexit.register(vetter.close)
        return vetter
