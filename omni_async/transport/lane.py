"""One UCX worker and one endpoint to one peer, progressed on the running asyncio loop.

Why one worker per peer: with endpoint error handling off (needed for UCX's shared-memory
transports), UCX never reports a dead peer, and a worker with sends stuck towards a dead peer
can never be armed again, so its event fd would keep the loop busy.  Giving each peer its own
worker lets :meth:`Lane.close` destroy exactly the stuck state, and gives every peer its own tag
space.

Progress is event driven: the worker's event fd is registered with ``loop.add_reader``; when it
fires (or after work is posted) the lane progresses the worker, completes finished requests and
re-arms the worker.  Nothing polls, nothing sleeps, and an idle lane costs no CPU.

Threading: a lane must only be used from the thread running its loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ..errors import PeerLost, ProtocolError
from . import iov, rma
from .turns import NextTurn, SpinGate, spin

log = logging.getLogger(__name__)

Completion = Callable[[BaseException | None], None]
"""Called once when a posted request ends: ``None`` on success, else the error."""
Arrival = Callable[[int, int, Any], None]
"""``on_arrival(tag, length, message)``: a message arrived that nobody posted a receive for."""

_MAX_ROUNDS = 8  # progress rounds per wake-up before yielding to the loop
_MAX_PROGRESS = 64  # worker progress calls per round
_MAX_ARRIVALS = 64  # messages taken per watch per round: a flooding peer cannot hold the loop
_FULL_REAP_EVERY = 16  # wake-ups between scans of every pending request (the front is checked always)
_SPIN = 50e-6  # seconds a lane that expects an answer polls before sleeping on its event fd
_HOT = 200e-6  # seconds a lane that stays hot polls after its last activity (measured, docs/tuning.md)
_MIN_ADDRESS = 16  # bytes; real worker addresses are ~80-200
_CLOSE_GRACE = 5.0  # seconds an endpoint close may take before the lane is released anyway
_CLOSE_LINGER = 0.05  # seconds a closed endpoint's worker keeps answering the peer's close
_CLOSE_TICK = 0.005  # progress interval while (and only while) an endpoint is closing


RNDV_THRESH_SHM = 8192
"""Bytes from which a message goes by rendezvous over shared memory."""
_RNDV_THRESH_TCP = 64 * 1024 + 1
"""Bytes from which a message goes by rendezvous over tcp: one 64 KiB block still goes eagerly."""
_TCP_SEGMENTS = {"TCP_TX_SEG_SIZE": "72K", "TCP_RX_SEG_SIZE": "72K"}
"""UCX's tcp segments (8 KiB by default) hold an eager 64 KiB message and its headers whole."""

_HERE: weakref.WeakValueDictionary[bytes, Lane] = weakref.WeakValueDictionary()
"""The open lanes of this process, by worker address: a peer among them cannot answer while
a lane of this thread spins (see :attr:`Lane.stay_hot`)."""

ucx_api: Any = None
"""ucxx's ``libucxx`` module once :func:`load_ucxx` ran (first context or lane), else None."""
_load_lock = threading.Lock()


_PRESET_ENV: Final = {"UCX_LOG_FILE": "stderr", "UCX_MEM_MMAP_HOOK_MODE": "none"}
"""UCX settings read when its libraries load, set unless the environment has them."""


def load_ucxx() -> Any:
    """Import ucxx on first use (never at import) and return its ``libucxx`` module.

    Unless set (they take effect only if UCX is not loaded yet): ``UCX_LOG_FILE=stderr``, as
    UCX logs to stdout by default, where it would mix with a program's own output; and
    ``UCX_MEM_MMAP_HOOK_MODE=none``: UCX's default patches libc's ``mmap`` family in place
    when it loads, 0.4 s of CPU per process here (``sched_yield`` in a loop), for memory
    events only a registration cache of host memory uses (InfiniBand's; none of the
    transports this wheel has: shared memory, cma, tcp; GPU memory has hooks of its own).
    Importing
    ucxx writes UCX_* tunings for GPUs (UCX_RNDV_THRESH, UCX_RNDV_FRAG_MEM_TYPE=cuda,
    UCX_MAX_RNDV_RAILS, and UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows) into
    os.environ, where every UCX context and every child process would pick them up: they are
    undone; our contexts get what they need through :func:`new_context`'s config.
    """
    global ucx_api
    with _load_lock:
        if ucx_api is None:
            for key, value in _PRESET_ENV.items():
                os.environ.setdefault(key, value)
            before = {key: value for key, value in os.environ.items() if key.startswith("UCX_")}
            import ucxx._lib.libucxx as api

            for key in [key for key in os.environ if key.startswith("UCX_") and key not in before]:
                del os.environ[key]
            os.environ.update(before)
            ucx_api = api
    return ucx_api


def new_context(tls: str, net_devices: str = "") -> Any:
    """A UCX context with the given ``UCX_TLS`` (and ``UCX_NET_DEVICES`` when set).

    Thresholds (measured, docs/tuning.md): over shared memory, messages from 8 KiB on go by
    rendezvous, received straight into the target rows (the default threshold sends 64 KiB
    blocks eagerly through bounce buffers: ~10x slower).  Over tcp (``tls="tcp"``, and between
    hosts otherwise) messages up to one 64 KiB block go eagerly, each in one tcp segment: a
    rendezvous costs two more hand-offs per message (ready-to-receive, then the data), which
    over tcp cost more than the receiver's copy out of UCX's buffer.
    """
    load_ucxx()
    config = {"TLS": tls, "RNDV_THRESH": f"intra:{RNDV_THRESH_SHM},inter:{_RNDV_THRESH_TCP}", **_TCP_SEGMENTS}
    if tls == "tcp":  # tcp only, even on one host
        config["RNDV_THRESH"] = str(_RNDV_THRESH_TCP)
        config["RNDV_SCHEME"] = "put_zcopy"  # the receiver-pull default is ~3x slower here
    if net_devices:
        config["NET_DEVICES"] = net_devices
    return ucx_api.UCXContext(config)


class Lane:
    """A UCX worker with (after :meth:`connect`) one endpoint, driven by the asyncio loop.

    Buffers passed to :meth:`send` and :meth:`recv` are borrowed: the caller must keep them
    alive and unchanged until the completion runs.  The lane keeps a reference meanwhile.
    ``close_grace`` bounds how long :meth:`close` waits for the endpoint's close (seconds).
    """

    def __init__(self, context: Any, loop: asyncio.AbstractEventLoop, *, close_grace: float = _CLOSE_GRACE) -> None:
        self._loop = loop
        self._close_grace = close_grace
        load_ucxx()
        self._worker: Any = ucx_api.UCXWorker(
            context, enable_delayed_submission=False, enable_python_future=False
        )
        self._worker.init_blocking_progress_mode()
        self._fd: int = self._worker.epoll_file_descriptor
        self._endpoint = 0  # a UCP endpoint handle (:mod:`.iov`), 0 until connected
        self._pending: deque[tuple[_RawRequest, Completion, object]] = deque()
        self._watches: list[tuple[int, int, Arrival]] = []
        self._probe_info = iov.RecvInfo()
        # One queued drive at a time, cleared only when it runs (not by the event fd's drives):
        # under load, the calls queued per loop iteration stay bounded.
        self._next_turn = NextTurn(loop)
        self._spin_gate = SpinGate()
        self._hot_gate = SpinGate()
        self._active_at = 0.0  # perf_counter of the last post, completion or arrival
        self._window = -1.0  # the _active_at whose window _window_hot decided
        self._window_hot = False
        self._peer_here = False
        self._closed = False
        self._close_reason: BaseException = PeerLost("lane closed")
        self._endpoint_done = False
        self._closing = _RawRequest(0)  # the endpoint's flush-close, once started
        self._orphans: list[tuple[_RawRequest, Completion, object]] = []
        self._keys: list[int] = []  # remote keys unpacked on the endpoint (:meth:`unpack_keys`)
        self._close_deadline = 0.0
        self._released: asyncio.Future[None] = loop.create_future()
        self.wakeups = 0
        """How many times the lane ran its progress engine (for idle-CPU tests)."""
        loop.add_reader(self._fd, self._drive)
        _HERE[self.address] = self

    @property
    def address(self) -> bytes:
        """This worker's UCX address, the agent metadata a peer needs to reach this lane."""
        return bytes(self._worker.address.tobytes())

    @property
    def in_flight(self) -> int:
        """Requests posted and not completed yet."""
        return len(self._pending)

    def check_address(self, remote_address: bytes) -> None:
        """Raise :class:`ProtocolError` unless ``remote_address`` looks like a worker address of
        this UCX build (version byte, plausible length).  Necessary, not sufficient: see
        :mod:`.vetting` for the full check."""
        own = self._worker.address.tobytes()
        if not _MIN_ADDRESS <= len(remote_address) <= 4 * len(own) or remote_address[:1] != own[:1]:
            raise ProtocolError(
                f"agent metadata of {len(remote_address)} bytes is not a UCX worker address of this build"
            )

    def connect(self, remote_address: bytes) -> None:
        """Create the endpoint to the peer lane at ``remote_address`` (no round trip).

        The address must have been vetted (:meth:`check_address`, then
        :class:`~.vetting.AddressVetter`): UCX aborts the process on some malformed ones.
        """
        self._peer_here = remote_address in _HERE
        try:
            self._endpoint = iov.connect(self._worker, remote_address)
        except OSError as exc:  # UCX refused the address (unreachable, bad parameter, ...)
            raise ProtocolError(f"cannot reach the peer's UCX worker: {exc}") from None

    def send(self, buffer: Any, tag: int, done: Completion) -> None:
        """Post a tagged send of ``buffer`` (any C-contiguous buffer, borrowed until ``done`` runs).

        On a closed lane ``done`` runs at once with the reason it was closed.  Sends go through
        :mod:`.iov`, never through ucxx: a ucxx request that UCX can never finish (a rendezvous
        send to a peer that died or stopped) would keep its endpoint and worker alive for good.
        """
        view = np.frombuffer(buffer, np.uint8)
        address = iov.address_of(view)
        self._post(lambda: iov.send_bytes(self._endpoint, tag, address, view.nbytes), view, done)

    def watch(self, tag: int, mask: int, on_arrival: Arrival) -> None:
        """Hand every message whose tag matches ``tag`` under ``mask`` to ``on_arrival``.

        Nothing stays posted for such messages, so closing the lane never leaves a receive
        behind.  ``on_arrival`` must take each message (a UCP message handle, see :mod:`.iov`)
        with :meth:`recv_arrived` or :meth:`recv_arrived_many`.
        """
        self._watches.append((tag, mask, on_arrival))
        self._next_turn(self._drive)

    def send_many(self, buffers: list[Any], tag: int, done: Completion) -> None:
        """Post one tagged send gathering ``buffers`` (C-contiguous byte arrays, borrowed until
        ``done`` runs)."""
        if len(buffers) == 1:  # one buffer: UCX's contiguous path, and no IOV to build
            self.send(buffers[0], tag, done)
            return
        self.send_iov(iov.iov_of(buffers), buffers, tag, done)

    def send_iov(self, vector: npt.NDArray[np.uint64], keepalive: object, tag: int, done: Completion) -> None:
        """Post one tagged send gathering the ``(address, length)`` rows of ``vector`` (two or
        more, see :mod:`.iov`); ``keepalive`` keeps the memory they name alive until ``done``
        runs."""
        self._post(lambda: iov.send(self._endpoint, tag, vector), (keepalive, vector), done)

    def recv_arrived_many(self, buffers: list[Any], message: int, done: Completion) -> None:
        """Receive a message taken by a watch, scattered over ``buffers`` (their sizes must add
        up to its length; borrowed until ``done`` runs)."""
        if len(buffers) == 1:
            self.recv_arrived(buffers[0], message, done)
            return
        vector = iov.iov_of(buffers)
        self._post(lambda: iov.recv(self._worker, message, vector), (buffers, vector), done)

    def _post(self, post: Callable[[], int], keepalive: object, done: Completion) -> None:
        """Post a :mod:`.iov` request and track it until it completes (``keepalive``: the
        buffers it names, referenced until then)."""
        if self._closed:
            _run(done, self._close_reason)
            return
        self._active_at = time.perf_counter()
        try:
            handle = post()
        except OSError as exc:  # handed on without its traceback, which holds this lane's frames
            _run(done, exc.with_traceback(None))
            return
        self._track(_RawRequest(handle), done, keepalive)

    def unpack_keys(self, packed: list[bytes]) -> list[int]:
        """Remote keys for the connected endpoint from the peer's packed ones (vetted first,
        see :mod:`.rma`), owned by the lane: destroyed before its worker.  Raises
        :class:`ProtocolError` if UCX refuses one, :class:`PeerLost` on a closed lane."""
        if self._closed or not self._endpoint:
            raise PeerLost("lane closed")
        keys: list[int] = []
        try:
            for packed_key in packed:
                keys.append(rma.unpack_key(self._endpoint, packed_key))
        except OSError as exc:
            for key in keys:
                rma.destroy_key(key)
            raise ProtocolError(f"the peer's remote key is unusable: {exc}") from None
        self._keys.extend(keys)
        return keys

    def put(self, puts: npt.NDArray[np.uint64], keepalive: object, done: Completion) -> None:
        """Post one put per row ``[local address, length, remote address, key]`` (a key from
        :meth:`unpack_keys`; :func:`.rma.puts_of_runs`), then one flush; ``done`` runs when the
        flush completed (every put is in the peer's memory) or failed.  The local bytes are
        borrowed until then (``keepalive`` is referenced meanwhile)."""

        def post() -> int:
            rma.put_all(self._endpoint, puts)
            return rma.flush(self._endpoint)

        self._post(post, (keepalive, puts), done)

    def recv_arrived(self, buffer: Any, message: int, done: Completion) -> None:
        """Receive a message taken by a watch into ``buffer`` (any writable C-contiguous buffer
        of at least its length, borrowed until ``done`` runs)."""
        view = np.frombuffer(buffer, np.uint8)
        address = iov.address_of(view)
        self._post(lambda: iov.recv_bytes(self._worker, message, address, view.nbytes), view, done)

    def _track(self, request: _RawRequest, done: Completion, keepalive: object) -> None:
        if request.completed:
            _run(done, request.take_error())
            return
        self._pending.append((request, done, keepalive))
        self._next_turn(self._drive)

    def _drive(self) -> None:
        """Progress the worker (:meth:`_progress`), then tell ``on_progress``."""
        if self._closed:
            return
        self._progress()
        if self.on_progress is not None and not self._closed:
            _run(self.on_progress)

    on_progress: Callable[[], None] | None = None
    """Set by the owner while it waits for the lane to go quiet (a drain): called after every
    progress pass, once that pass's completions and arrivals ran.  A request that completes as
    it is posted never counts in :attr:`in_flight` and causes no pass: an owner that posts
    outside a pass looks at the lane itself afterwards."""

    def _progress(self) -> None:
        """Progress the worker, complete finished requests, re-arm; yield if UCX stays busy."""
        self.wakeups += 1
        worker = self._worker
        started = time.perf_counter()
        for round_ in range(_MAX_ROUNDS):
            moved = False
            for _ in range(_MAX_PROGRESS):
                if not worker.progress_once():
                    break
                moved = True
            if moved:
                self._active_at = time.perf_counter()
            if self._pending:
                self._reap(everything=round_ == 0 and self.wakeups % _FULL_REAP_EVERY == 0)
            more = False if self._closed else self._take_arrivals()
            if self._closed:  # a completion closed the lane
                return
            if more:
                break  # arrivals left in UCX's queue: come back after the loop's other work
            if self._hot():
                # Poll in slices, the loop's other callbacks running between them, until
                # something moves or the window since the last activity passed.  What this
                # pass did may have woken callbacks (a settled transfer's awaiter, which may
                # post the next one): they run first.
                if self._active_at > started:
                    self._next_turn(self._drive)
                    return
                if spin(worker.progress_once, _SPIN):
                    self._hot_gate.record(True)
                    self._active_at = time.perf_counter()
                    continue
                if time.perf_counter() - self._active_at < _HOT:
                    self._next_turn(self._drive)
                    return
                self._hot_gate.record(False)  # a whole window passed with nothing
            # Spinning pays only when the peer answers within the window (another core); after
            # a few misses (a peer on this thread, or a slow one) the gate spaces the tries out.
            elif self._expects() and self._spin_gate.may() and self._spin_gate.spin(worker.progress_once, _SPIN):
                continue  # something moved while we waited briefly: handle it now
            if worker.arm():
                return
        # UCX still has work (a large transfer, a flood of arrivals, or sends stuck towards a
        # dead peer until the control plane notices): come back after the loop has run its
        # other callbacks (other lanes, heartbeats), so no peer can starve the others.
        self._next_turn(self._drive)

    stay_hot: Callable[[], bool] | None = None
    """Set by the owner: True while the peer's requests and answers come over this lane (not
    through a ring).  The lane then keeps polling the worker for up to ``_HOT`` seconds after
    its last post, completion or arrival before it sleeps on its event fd, in slices of
    ``_SPIN`` between which the loop runs its other callbacks: back-to-back transfers and
    their answers pay no wake-up.  Only while no request of its own is in flight (a transfer
    in progress wakes the lane anyway, and polling then took CPU its peer needed on a busy
    host), never while idle (the window starts at activity), never for a peer in this process
    (it cannot answer while we poll), and after a few windows that caught nothing only now
    and then (a :class:`~.turns.SpinGate`)."""

    def _hot(self) -> bool:
        """Whether to poll now rather than sleep (see :attr:`stay_hot`).  Decided once per
        window (per last activity): a retry of the gate gets a whole window, not one slice."""
        if self._pending or self._peer_here or self.stay_hot is None or time.perf_counter() - self._active_at >= _HOT:
            return False
        if self._window != self._active_at:
            self._window = self._active_at
            try:
                self._window_hot = self.stay_hot() and self._hot_gate.may()
            except Exception:  # guarded like every callback: the lane just does not poll
                log.exception("a callback of a lane failed: %r", self.stay_hot)
                self._window_hot = False
        return self._window_hot

    expecting: Callable[[], bool] | None = None
    """Set by the owner: True while an answer is expected soon (a transfer awaits its ack or
    its payload).  The lane then polls the worker for up to ``_SPIN`` seconds before sleeping
    on the event fd, which saves a wake-up per hop; an idle lane never polls."""

    def _expects(self) -> bool:
        try:
            return self.expecting is not None and self.expecting()
        except Exception:  # guarded like every callback: the lane just does not spin
            log.exception("a callback of a lane failed: %r", self.expecting)
            return False

    on_stray: Arrival | None = None
    """Set by the owner: takes every message no watch matches (with :meth:`recv_arrived_many`),
    so none stays in UCX's unexpected queue; unset, such messages are left there."""

    def _take_arrivals(self) -> bool:
        """Hand arrived messages to their watches (or ``on_stray``), at most ``_MAX_ARRIVALS``
        per watch (and as many strays) per round in all; True if some may be left (the caller
        comes back before sleeping).

        With ``on_stray`` set every message is taken, so one probe for any tag takes them in
        arrival order (one fruitless probe per round, not one per watch)."""
        stray = self.on_stray
        if stray is None:
            more = False
            for tag, mask, on_arrival in self._watches:
                more = self._take(tag, mask, on_arrival) or more
            return more
        watches = self._watches
        worker, info = self._worker, self._probe_info
        for _ in range(_MAX_ARRIVALS * (len(watches) + 1)):
            if self._closed:
                return False
            found = iov.probe(worker, 0, 0, info)
            if found is None:
                return False
            handle, sender_tag, length = found
            take = next((watch[2] for watch in watches if sender_tag & watch[1] == watch[0]), stray)
            _run(take, sender_tag, length, handle)
        return True

    def _take(self, tag: int, mask: int, on_arrival: Arrival) -> bool:
        for _ in range(_MAX_ARRIVALS):
            if self._closed:
                return False
            found = iov.probe(self._worker, tag, mask, self._probe_info)
            if found is None:
                return False
            handle, sender_tag, length = found
            _run(on_arrival, sender_tag, length, handle)
        return True

    def _reap(self, everything: bool) -> None:
        """Run the completions of finished requests.

        Requests mostly finish in the order they were posted, so each round only pops finished
        ones off the front (O(finished)); a full scan every ``_FULL_REAP_EVERY`` wake-ups catches
        the rest.  Scanning everything every round made a 256-message write quadratic.
        """
        pending = self._pending
        finished: list[tuple[_RawRequest, Completion, object]] = []
        while pending and pending[0][0].completed:
            finished.append(pending.popleft())
        if everything and pending:
            still: deque[tuple[_RawRequest, Completion, object]] = deque()
            for item in pending:
                (finished if item[0].completed else still).append(item)
            self._pending = still
        for request, done, _ in finished:
            _run(done, request.take_error())

    def close(self, reason: BaseException | None = None) -> None:
        """Fail every pending request with ``reason``, then close the endpoint in the background.

        Idempotent and never blocks.  From now on no completion runs; borrowed buffers stay
        referenced until the lane is released (UCX may still fill a posted receive while the
        close is progressed).  The endpoint close is a UCX flush-close that completes within
        milliseconds, but only while the worker is progressed and the peer's worker answers:
        the lane progresses it every few milliseconds (for at most ``close_grace`` seconds),
        then releases the worker.  Await :meth:`wait_closed` to know it is released.  Released
        means destroyed, whatever UCX still holds (rendezvous sends to a peer that died or is
        stopped, the close itself): no request of a lane is a ucxx object, so nothing keeps the
        worker alive (see :mod:`.iov`).
        """
        if self._closed:
            return
        self._closed = True
        if reason is not None:
            self._close_reason = reason
        self._loop.remove_reader(self._fd)
        _HERE.pop(self.address, None)
        pending, self._pending = list(self._pending), deque()
        # UCX may still complete these requests while the close is progressed: their buffers
        # stay referenced until the lane is released, or UCX would write into freed memory.
        self._orphans = pending
        for _request, done, _ in pending:
            _run(done, self._close_reason)
        if not self._endpoint:
            self._release()
            return
        self._close_deadline = self._loop.time() + self._close_grace
        try:
            self._closing = _RawRequest(iov.close(self._endpoint))
        except OSError as exc:  # the worker is destroyed anyway, and the endpoint with it
            log.info("UCX refused to close an endpoint (%s); releasing the lane", exc)
            self._close_deadline = self._loop.time()
        self._endpoint = 0
        self._close_tick()

    @property
    def released(self) -> bool:
        """True once a closed lane has let go of its UCX worker."""
        return self._released.done()

    async def wait_closed(self) -> None:
        """Wait until :meth:`close` has released the worker (at most ``close_grace`` seconds)."""
        await asyncio.shield(self._released)

    def _close_tick(self) -> None:
        if self._released.done():
            return
        worker = self._worker
        while worker.progress_once():
            pass
        if not self._endpoint_done and self._closing.completed:
            # Keep answering the peer a little longer: its own close still needs this worker,
            # and destroying it at once makes UCX log "connection reset" errors on its side.
            self._endpoint_done = True
            self._close_deadline = min(self._close_deadline, self._loop.time() + _CLOSE_LINGER)
        if self._loop.time() > self._close_deadline:
            if not self._endpoint_done:
                log.warning("UCX endpoint close did not finish in %ss; releasing the lane anyway", self._close_grace)
            self._release()
        else:
            self._loop.call_later(_CLOSE_TICK, self._close_tick)

    def _release(self) -> None:
        for request, _done, _keep in self._orphans:
            request.release()
        self._closing.release()
        keys, self._keys = self._keys, []
        for key in keys:  # allocated from the worker: destroyed before it
            rma.destroy_key(key)
        # Destroys the UCP worker with its endpoint and every request UCX still holds (UCX
        # warns about those: "was not returned to mpool"), before the borrowed buffers below
        # are let go: nothing can write into them any more.
        self._worker = None
        self._orphans = []
        if not self._released.done():
            self._released.set_result(None)


class _RawRequest:
    """A UCP request made through :mod:`.iov`, shaped like a ucxx request for the lane."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle  # 0: completed when posted

    @property
    def completed(self) -> bool:
        return not self.handle or iov.status(self.handle) != iov.UCS_INPROGRESS

    def take_error(self) -> OSError | None:
        """The request's error, if any; releases the request (call once, when completed).

        Returned, never raised: a caught error's traceback holds the lane's frames (its
        progress pass has the worker in hand), and a completion may keep the error for good.
        """
        if not self.handle:
            return None
        code = iov.status(self.handle)
        self.release()
        return None if code == iov.UCS_OK else iov.error(code)

    def release(self) -> None:
        if self.handle:
            iov.free(self.handle)
            self.handle = 0


def _run(callback: Callable[..., None], *args: Any) -> None:
    """Call a completion or arrival callback.  Whatever it raises is logged and stops there:
    it never unwinds through the lane's progress, which serves every other request."""
    try:
        callback(*args)
    except Exception:
        log.exception("a callback of a lane failed: %r", callback)
