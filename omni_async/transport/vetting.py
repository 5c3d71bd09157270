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

A check talks to its server through the calling loop's socket methods; only the requests to the
zygote (a new server, a restart) run in the loop's default executor.

One vetter per process (per UCX setting) serves every agent: it is started on first use and
stopped at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Final

from ..errors import ProtocolError
from .vet_child import BAD, LENGTH, OK, REQUEST

log = logging.getLogger(__name__)

DEADLINE: Final = 2.0
"""Default seconds a check may take, waiting included."""
WORKERS: Final = 2
"""Checks that run at once (each on its own server process)."""
MAX_PENDING: Final = 256
"""Checks that may wait; more are refused at once."""
SERVER_CHECKS: Final = 32
"""Checks one server makes before it is retired: each check leaves an endpoint its worker never
progresses (closing it would wait on the peer), so a server's UCX resources only grow."""
_START_TIMEOUT: Final = 30.0  # seconds the zygote may take to import ucxx

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class NotVetted(ProtocolError):
    """A check that reached no verdict: it timed out, or too many checks were waiting."""


class AddressVetter:
    """Checks addresses in child processes; safe to share between loops and threads.

    Every exchange with a server runs on the checking loop (non-blocking sockets); what may
    block, the requests to the zygote and starting it, runs in the loop's default executor.
    """

    def __init__(self, tls: str, net_devices: str = "", *, workers: int = WORKERS,
                 max_pending: int = MAX_PENDING) -> None:
        self._ucx_args = [tls, net_devices]
        self._workers = workers
        self._max_pending = max_pending
        self._lock = threading.Lock()  # guards everything below
        self._running = 0
        self._waiting: list[_Waiter] = []  # a stack: newest first
        self._idle: list[socket.socket] = []  # servers ready for a check
        self._checks: dict[socket.socket, int] = {}  # checks each live server has made
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_sock: socket.socket | None = None
        self._zygote_start = threading.RLock()  # starting, stopping or writing to the zygote
        self.refused = 0

    async def check(self, address: bytes, timeout: float = DEADLINE, *, keys: Sequence[bytes] = ()) -> None:
        """Return if a UCX endpoint can be created from ``address`` (and, with ``keys``, each
        packed remote key unpacked on it: :mod:`.rma`); else raise ProtocolError (unusable),
        or its :class:`NotVetted` (not vetted within ``timeout`` seconds, too many checks
        waiting, or no vetting child could be started: our failure, not the address's)."""
        verdict: bool | None = None
        what = "remote keys" if keys else f"a {len(address)}-byte agent metadata"
        unvetted = f"{'were' if keys else 'was'} not vetted within {timeout}s"
        try:
            async with asyncio.timeout(timeout):
                await self._acquire()
                try:
                    verdict = await self._vet(address, b"".join(LENGTH.pack(len(key)) + key for key in keys))
                finally:
                    self._release()
        except TimeoutError:
            log.warning("vetting a %d-byte peer address did not finish within %ss", len(address), timeout)
        except OSError as exc:  # (from _new_server: the zygote or a fresh server failed)
            log.warning("address vetting child could not be started: %r", exc)
            unvetted = f"{'were' if keys else 'was'} not vetted: the vetting child could not be started ({exc})"
        if not verdict:
            with self._lock:
                self.refused += 1
            why = "are not usable UCX remote keys" if keys else "is not a usable UCX worker address"
            if verdict is None:
                why = unvetted
            raise (NotVetted if verdict is None else ProtocolError)(f"{what} {why}")

    @property
    def fds(self) -> set[int]:
        """The descriptors this vetter holds: its sockets to the zygote and to live servers.
        They belong to the process (shared by every agent of this UCX setting) and outlive
        the agents that used them."""
        with self._lock:
            sockets = [*self._idle, *self._checks]
        zygote = self._zygote_sock
        if zygote is not None:
            sockets.append(zygote)
        return {fd for fd in (sock.fileno() for sock in sockets) if fd >= 0}

    def warm_up(self) -> None:
        """Start the zygote if it is not running (blocking; run it in an executor)."""
        try:
            self._zygote_socket()
        except OSError as exc:  # the first check will retry and report
            log.warning("address vetting child did not start: %r", exc)

    def close(self) -> None:
        """Stop the zygote and the idle servers (one busy with a check returns to the pool when
        the check ends, and is stopped by the next close).  Idempotent; a later check starts
        them again."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._checks.clear()
        for server in idle:
            server.close()  # the server reads EOF and exits
        with self._zygote_start:
            self._stop_zygote()

    # -- the concurrency bound -------------------------------------------------------------------
    async def _acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._running < self._workers:
                self._running += 1
                return
            if len(self._waiting) >= self._max_pending:
                self.refused += 1
                raise NotVetted(f"address vetting is saturated ({self._max_pending} checks waiting)")
            granted: asyncio.Future[None] = loop.create_future()
            self._waiting.append((loop, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # the slot came just as this check gave up: hand it on
            raise

    def _release(self) -> None:
        """Hand this slot to the newest waiting check, or free it."""
        with self._lock:
            while self._waiting:
                loop, granted = self._waiting.pop()
                try:
                    loop.call_soon_threadsafe(self._grant, granted)
                except RuntimeError:  # that loop is closed
                    continue
                return
            self._running -= 1

    def _grant(self, granted: asyncio.Future[None]) -> None:
        if granted.done():  # it gave up meanwhile
            self._release()
        else:
            granted.set_result(None)

    # -- one check -------------------------------------------------------------------------------
    async def _vet(self, address: bytes, keys: bytes) -> bool:
        with self._lock:
            server = self._idle.pop() if self._idle else None
        verdict = await self._vet_on(server, address, keys)
        if verdict is None and server is not None:  # a reused server died: a fresh one decides
            verdict = await self._vet_on(None, address, keys)
        if verdict is None:
            log.warning("a %d-byte peer address (%d bytes of keys) crashed the vetting child", len(address), len(keys))
        return bool(verdict)

    async def _vet_on(self, server: socket.socket | None, address: bytes, keys: bytes) -> bool | None:
        """The verdict of ``server`` (None: fork a fresh one), or None if it died or failed
        with the address.  Raises :class:`OSError` if no fresh server could be started (the
        zygote's failure: no verdict on the address)."""
        loop = asyncio.get_running_loop()
        if server is None:
            server = await self._new_server()
        try:
            await loop.sock_sendall(server, REQUEST.pack(len(address), len(keys)) + address + keys)
            answer = await loop.sock_recv(server, 1)
        except OSError as exc:
            log.warning("address vetting child failed: %r", exc)
            answer = b""
        except BaseException:  # timed out or cancelled mid-exchange: the server's state is unknown
            with self._lock:
                self._checks.pop(server, None)
            server.close()
            raise
        if answer in (OK, BAD):
            with self._lock:
                checks = self._checks[server] = self._checks.get(server, 0) + 1
                if checks < SERVER_CHECKS:
                    self._idle.append(server)
                else:  # retired: it reads EOF and exits; the next check forks a fresh one
                    del self._checks[server]
                    server.close()
            return answer == OK
        with self._lock:
            self._checks.pop(server, None)
        server.close()
        return None

    async def _new_server(self) -> socket.socket:
        """A fresh server forked by the zygote, ready to vet.

        The request to the zygote goes from the loop's default executor: it takes the lock
        that guards the zygote, which another thread may hold for as long as a restart takes
        (a vetter is shared by every loop of the process), and it restarts a zygote that died
        meanwhile; neither may block the loop."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()

        def ask_zygote() -> None:  # owns ``theirs``: the forked server has its own copy
            try:
                with self._zygote_start:
                    try:
                        socket.send_fds(self._zygote_socket(), [b"s"], [theirs.fileno()])
                    except TimeoutError:  # it takes no requests (stopped, hung): the next one restarts it
                        self._stop_zygote()
                        raise OSError("the address vetting child takes no requests") from None
                    except ConnectionError:  # it died (its end closes before it can be reaped): a new one
                        self._stop_zygote()
                        socket.send_fds(self._zygote_socket(), [b"s"], [theirs.fileno()])
            finally:
                theirs.close()

        try:
            # Shielded: a check that gives up meanwhile lets the request finish in its thread
            # (closing ``theirs`` under it could hand the zygote a reused descriptor); the
            # server it forks then reads EOF on its socket and exits.
            request = loop.run_in_executor(None, ask_zygote)
            request.add_done_callback(_retrieved)
            await asyncio.shield(request)
            ours.setblocking(False)
            if await loop.sock_recv(ours, 1) != OK:
                raise OSError("address vetting server failed to start")
        except BaseException:
            ours.close()
            raise
        return ours

    # -- the zygote ------------------------------------------------------------------------------
    def _zygote_alive(self) -> bool:
        return self._zygote is not None and self._zygote.poll() is None and self._zygote_sock is not None

    def _zygote_socket(self) -> socket.socket:
        """The socket to the zygote, started (blocking, up to ``_START_TIMEOUT``) if needed."""
        with self._zygote_start:
            if self._zygote_alive():
                assert self._zygote_sock is not None
                return self._zygote_sock
            self._stop_zygote()
            ours, theirs = socket.socketpair()
            env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
            try:
                zygote = subprocess.Popen(
                    [sys.executable, "-m", "omni_async.transport.vet_child", *self._ucx_args],
                    stdin=theirs.fileno(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                )
            finally:
                theirs.close()
            ours.settimeout(DEADLINE)  # a send to a zygote that reads nothing gives up (ask_zygote)
            self._zygote, self._zygote_sock = zygote, ours
            assert zygote.stdout is not None
            started, _, _ = select.select([zygote.stdout], [], [], _START_TIMEOUT)
            if not started or zygote.stdout.read(1) != OK:
                self._stop_zygote()
                raise OSError("address vetting child failed to start")
            return ours

    def _stop_zygote(self) -> None:
        zygote, sock = self._zygote, self._zygote_sock
        self._zygote = self._zygote_sock = None
        if sock is not None:
            sock.close()  # the zygote reads EOF and exits
        if zygote is not None:
            zygote.kill()
            zygote.wait()
            if zygote.stdout is not None:
                zygote.stdout.close()


def _retrieved(request: asyncio.Future[None]) -> None:
    """Done callback of a request to the zygote: marks its failure retrieved.  The check that
    made it reports it (:meth:`AddressVetter.check` logs why), or gave up first and reported
    that; nobody else awaits it (else: "exception was never retrieved")."""
    if not request.cancelled():
        request.exception()


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


def shared_vetter_fds() -> set[int]:
    """The descriptors every shared vetter of this process holds (see :attr:`AddressVetter.fds`)."""
    with _vetters_lock:
        vetters = list(_vetters.values())
    return set().union(*(vetter.fds for vetter in vetters))
