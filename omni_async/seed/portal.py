"""The portal between synchronous callers and an event loop that runs in a thread of its own.

Like anyio's ``BlockingPortal``: a :class:`Portal` owns one event loop (uvloop if asked for and
installed) run by a daemon thread, runs coroutines and plain calls on it for callers in other
threads, and hands completions back to them through books guarded by :attr:`Portal.lock`.

A caller may also run the loop itself (:meth:`Portal.driving`, :meth:`Portal.turn`): the hot
path of the block facade does, so that a write starts and its acknowledgement is taken in the
caller's own thread, with no hand-over between threads (each cost 30-100 µs of wake-ups here,
and under a caller that holds the GIL between polls the loop thread could not run at all until
the next poll).  One thread runs the loop at a time (it holds the drive lock, see
:meth:`Portal.driving`).  After a caller's last turn the loop stays with the callers for :data:`LEASE_S`; then the
daemon thread takes it back and runs it until a caller wants it again (which asks it to stop:
one hand-over per burst of calls, not per call).  So the loop never goes unrun for longer than
that lease (heartbeats, handshakes and peers' writes keep moving while the caller does other
work), and an idle portal costs nothing: its daemon thread sleeps in the loop's poll.

The thread-safe hand-offs remain for everything else, and for a caller that cannot drive (a
thread running an event loop of its own).  A caller that finds nothing new while work is
outstanding waits on :meth:`Portal.wait_for_news` there: a condition wait, which releases the
GIL and ends as soon as the loop calls :meth:`Portal.notify` (something settled), or after
:data:`NEWS_WAIT_S` at most.  (Without it, the loop thread had to win the GIL back from a
caller thread that never blocks, which took up to ``sys.getswitchinterval()``, 5 ms, each time:
one 64 KiB write took ~80 ms.)  Nothing sleeps for a fixed time.
"""

from __future__ import annotations

import _signal as _raw_signal  # type: ignore[import-not-found]
import asyncio
import concurrent.futures
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Self, TypeVar, cast

from ..errors import ClosedError, DeadlineExceeded
from ..eventloop import new_event_loop

__all__ = ["LEASE_S", "NEWS_WAIT_S", "Facade", "Portal", "sigint_held"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NEWS_WAIT_S = 0.002
"""The longest a drain (``poll()``, ``get_finished_requests()``) waits for news while work is
outstanding and nothing settled since the previous drain.  It ends at once when something
settles; the bound only keeps a caller that polls between other work from stalling long."""

LEASE_S = 0.002
"""How long the loop stays with the callers after a caller's last turn (or after the end of a
call that held the loop and came within the lease of a turn) before the daemon thread runs it
again: the longest the loop goes unrun while its callers do other work."""

_SIGINT = int(signal.SIGINT)


class Portal:
    """An event loop in a daemon thread, bounded hand-offs to it, and completions handed back.

    ``owner`` names the facade in errors.  Fields of the owner's books are guarded by
    :attr:`lock` (the loop writes them, callers drain them); :attr:`closed` too.  Whoever runs
    the loop holds the drive lock: the daemon thread, or a caller within :meth:`driving`; lock
    order: the drive lock before :attr:`lock`.  Every method may be called from any thread
    except one that runs the loop now, where a call that waits for the loop would deadlock and
    raises :class:`RuntimeError` instead.
    """

    def __init__(self, name: str, owner: str, *, use_uvloop: bool) -> None:
        self.owner = owner
        self.lock = threading.Lock()
        self.closed = False  # locked
        self._news = threading.Condition(self.lock)
        self.loop = new_event_loop(use_uvloop=use_uvloop)
        self._drive = threading.Lock()  # held by the thread that runs the loop now
        self._driver: threading.Thread | None = None  # that thread (written with _drive held)
        self._until_news = False  # the running turn ends at the next notify() (driver's thread)
        self._lease = threading.Condition()  # the daemon thread waits on it while callers drive
        self._wanted = 0  # under _lease: callers waiting for the drive lock
        self._last_turn = 0.0  # monotonic start of the callers' lease: their last turn (or a call extending it)
        self._last_run = 0.0  # monotonic end of the callers' last turn of the loop (only turn() sets it)
        self._last_call = 0.0  # monotonic start of the callers' last call that asked burst_wait()
        self._ended = False  # under _lease: the daemon thread leaves once its loop stops
        self._stopping = threading.Lock()  # held by the caller stopping the portal (others wait)
        self._closing: concurrent.futures.Future[tuple[bool, Any]] | None = None  # the owner's close, once handed over
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            while True:
                with self._drive:
                    if time.monotonic() - self._last_turn >= LEASE_S:  # (else a caller took it back meanwhile)
                        self._driver = self.thread
                        try:
                            loop.run_forever()
                        finally:
                            self._driver = None
                if not self._wait_for_callers():
                    break
        finally:
            with self._drive:
                self._driver = self.thread
                try:
                    loop.stop()  # one pass first: it takes the stop requests callers left queued
                    loop.run_forever()
                    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
                    for task in tasks:
                        task.cancel()
                    _run_to_end(loop, asyncio.gather(*tasks, return_exceptions=True))
                    _run_to_end(loop, loop.shutdown_asyncgens())
                    _run_to_end(loop, loop.shutdown_default_executor())  # its threads too
                finally:
                    asyncio.set_event_loop(None)
                    loop.close()

    def _wait_for_callers(self) -> bool:
        """Daemon thread, between its runs of the loop: wait while callers drive it (until
        :data:`LEASE_S` after their last turn, looking again once a lease while a caller holds
        it, or at once when one lets go of it after the lease); False once the portal ended."""
        with self._lease:
            while not self._ended:
                if self._wanted:
                    self._lease.wait()
                    continue
                left = LEASE_S if self._drive.locked() else self._last_turn + LEASE_S - time.monotonic()
                if left <= 0:
                    return True
                self._lease.wait(left)
            return False

    def _hand_back(self) -> None:
        """Let the daemon thread run the loop now (a caller about to wait for it)."""
        with self._lease:
            self._last_turn = self._last_run = 0.0
            self._lease.notify_all()

    # -- callers running the loop ----------------------------------------------------------------
    @contextmanager
    def driving(self, wait: float = 0.0) -> Iterator[bool]:
        """Hold the loop in this thread for the ``with`` block: True, and :meth:`turn` may run
        it; False where it is not held: the thread runs the loop already or another event loop,
        the portal is ending, or another thread runs it and did not let go within ``wait``
        seconds (0: do not ask, do not wait).  Use the thread-safe hand-offs then.

        With ``wait``, whoever runs the loop is asked to let go: the daemon thread stops it
        (one hand-over), another caller's turn ends (at once, if it waits for news).

        In the main thread a SIGINT that comes during the whole block is held, then raised once
        the loop is let go (:func:`sigint_held`): a ``KeyboardInterrupt`` landing between taking
        the drive lock and the ``try`` that gives it back left the loop held by nobody for good,
        and one within the block could split the caller's books (a write queued, never posted).
        Every block is short (a call of the facade: a poll waits at most ``NEWS_WAIT_S``).
        """
        with sigint_held():
            yield from self._driving(wait)

    def _driving(self, wait: float) -> Iterator[bool]:
        me = threading.current_thread()
        runs_a_loop = me is self.thread or self._driver is me or asyncio._get_running_loop() is not None
        if runs_a_loop or not self._take_drive(wait):
            yield False
            return
        self._driver = me
        entered = time.monotonic()
        try:
            yield True
        finally:
            in_rhythm = entered - self._last_run < LEASE_S
            if in_rhythm:
                # A caller in its rhythm of calls (it ran the loop within the lease before this
                # one): the lease runs from the end of this call, not from that turn, so a call
                # that held the loop longer than the lease (a large write's copy) does not cost
                # the next poll a hand-over.  Only a turn opens that window, so calls that do
                # not run the loop (a burst of writes) cannot keep it unrun: at most one call
                # after the lease of the turn before it.
                self._last_turn = time.monotonic()
            self._driver = None
            self._drive.release()
            if not in_rhythm and time.monotonic() - self._last_turn >= LEASE_S:
                self._lease_ran_out()

    def _lease_ran_out(self) -> None:
        """A caller let go of the loop after the callers' lease ran out: wake the daemon thread
        now, while the loop is free.  (Looking once a lease, it could find a burst of such calls
        holding the loop look after look, and leave the loop unrun for many leases.)"""
        with self._lease:
            self._lease.notify_all()

    def _take_drive(self, wait: float) -> bool:
        """Take the drive lock within ``wait`` seconds, asking whoever runs the loop to let go
        (if ``wait``); False if not taken (or the portal ended)."""
        if not self._drive.acquire(blocking=False):
            if wait <= 0:
                return False
            with self._lease:
                if self._ended:
                    return False
                self._wanted += 1
                self.loop.call_soon_threadsafe(self.loop.stop)  # (the loop closes only once ended)
            try:
                if not self._drive.acquire(timeout=wait):
                    return False
            finally:
                with self._lease:
                    self._wanted -= 1
                    self._lease.notify_all()
        if self._ended:
            self._drive.release()
            return False
        return True

    def turn(self, wait: float) -> None:
        """Run the loop in this thread (inside :meth:`driving`, which returned True) until
        :meth:`notify` (something settled), another thread's :meth:`driving` asks for it, or
        ``wait`` seconds passed; blocked in the loop's poll meanwhile (the GIL released).  The
        loop stays with the callers for :data:`LEASE_S` after it.  No callback of the loop is
        cut in half by a ``KeyboardInterrupt``: :meth:`driving` holds a SIGINT until the
        caller lets go of the loop."""
        loop = self.loop
        timer = loop.call_later(wait, loop.stop)
        self._until_news = True
        try:
            loop.run_forever()
        finally:
            self._until_news = False
            timer.cancel()
            self._last_turn = self._last_run = time.monotonic()

    def burst_wait(self) -> float:
        """How long a caller's call may wait to take the loop (``driving(portal.burst_wait())``):
        :data:`NEWS_WAIT_S` if the previous such call came within the interpreter's switch
        interval (a burst of calls), else 0 (then, without the loop, the call hands its work
        to the loop's thread).  During a burst the loop's thread may not get the GIL back
        until the burst ends (the calling thread gives it up only for moments, each waking
        that thread too late to take it): so the callers keep the loop, taking it back if
        that thread had it.  Between sparse calls that thread gets the GIL in time."""
        now = time.monotonic()
        burst = now - self._last_call < sys.getswitchinterval()
        self._last_call = now
        return NEWS_WAIT_S if burst else 0.0

    def catch_up(self) -> None:
        """Inside :meth:`driving` (which returned True), after a call that did not turn the
        loop: if no caller turned it for :data:`LEASE_S`, run one pass of it now, without
        waiting (ready callbacks, due timers, I/O ready now).  A caller whose calls hold the
        loop without turning it (a burst of writes, no poll) so keeps it moving (heartbeats,
        peers' writes): the daemon thread cannot be relied on then, as it may not get the GIL
        back for as long as the caller's thread gives it up only for moments."""
        if time.monotonic() - self._last_run >= LEASE_S:
            self.turn(0.0)

    # -- checks --------------------------------------------------------------------------------
    def check_caller(self) -> None:
        """Raise :class:`RuntimeError` in a thread that runs the loop (waiting there would deadlock)."""
        if self._runs_loop():
            raise RuntimeError(f"{self.owner} must not be called from its own event-loop thread")

    def _runs_loop(self) -> bool:
        me = threading.current_thread()
        return me is self.thread or self._driver is me

    def check_open(self) -> None:
        """Raise :class:`ClosedError` once :meth:`stop` began."""
        if self.closed:
            raise ClosedError(f"{self.owner} is closed")

    # -- hand-offs to the loop -----------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run ``coro`` on the loop and wait up to ``timeout`` s (None: no limit here).

        Returns its result or raises its own error unchanged (a ``TimeoutError`` subclass such
        as :class:`DeadlineExceeded` included); raises :class:`DeadlineExceeded` if this wait
        ran out (the coroutine is then cancelled) and :class:`ClosedError` if the loop cancelled
        it while stopping.
        """
        self.check_caller()
        future = self._submit(coro)
        self._hand_back()
        try:
            ok, value = future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"{what} did not finish within {timeout:.1f}s") from None
        except concurrent.futures.CancelledError:
            raise ClosedError(f"{what} was cancelled: the {self.owner} is closing") from None
        if not ok:
            raise value
        return cast(T, value)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[tuple[bool, Any]]:
        """Hand ``coro`` to the loop; :class:`ClosedError` (and ``coro`` closed) once the
        portal ended.  (Handed over before that, the daemon thread's last pass of the loop
        starts it and cancels it: its waiter gets :class:`ClosedError` too.  Handed over after,
        it might never run: a caller waiting without a timeout would wait forever.)"""
        boxed = _boxed(coro)
        with self._lease:
            if not self._ended:
                try:
                    return asyncio.run_coroutine_threadsafe(boxed, self.loop)
                except RuntimeError:  # the loop closed (its thread ended without a stop)
                    pass
        boxed.close()
        coro.close()
        raise ClosedError(f"{self.owner} is closed")

    def call(self, fn: Callable[..., T], *args: Any, timeout: float, what: str) -> T:
        """Run the plain function ``fn(*args)`` on the loop and wait (bounded) for its result.

        Raises what ``fn`` raised, :class:`DeadlineExceeded` past ``timeout`` (``fn`` then does
        not run if it had not started) or :class:`ClosedError` if the loop is gone.
        """
        self.check_caller()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def invoke() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)

        self.post(invoke)
        self._hand_back()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.cancel():
                raise DeadlineExceeded(f"{what} did not finish within {timeout:.1f}s") from None
            return future.result()  # it started meanwhile: it is a plain call, it ends soon

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand ``fn(*args)`` to the loop without waiting (call order is kept).

        Raises :class:`ClosedError` once the portal ended (as :meth:`_submit`: handed over
        after the daemon thread's last pass of the loop, ``fn`` would never run, and a caller
        waiting for it would wait out its own timeout)."""
        with self._lease:
            if not self._ended:
                try:
                    self.loop.call_soon_threadsafe(fn, *args)
                    return
                except RuntimeError:  # the loop closed (its thread ended without a stop)
                    pass
        raise ClosedError(f"{self.owner} is closed")

    # -- completions handed back -----------------------------------------------------------------
    def notify(self) -> None:
        """Wake callers waiting in :meth:`wait_for_news`, and end a :meth:`turn` waiting for
        news.  On the loop, with :attr:`lock` held."""
        self._news.notify_all()
        if self._until_news:
            self.loop.stop()

    def wait_for_news(self) -> None:
        """Release the GIL (and :attr:`lock`) until :meth:`notify` or :data:`NEWS_WAIT_S` passed.

        Caller's thread, with :attr:`lock` held; the caller re-reads its books afterwards.
        Call it only when work is outstanding and nothing new was found.  In a thread that
        runs the loop it returns at once (nothing could settle while it waited).
        """
        if not self._runs_loop():
            self._news.wait(NEWS_WAIT_S)

    # -- stopping --------------------------------------------------------------------------------
    def stop(self, close: Callable[[], Coroutine[Any, Any, None]] | None, timeout: float) -> None:
        """Mark closed, run ``close()`` on the loop to its end, stop the loop and join its thread.

        ``close()`` is never cancelled by this wait (a cut-short close leaves sockets bound and
        UCX workers alive): ``timeout`` is a safety bound far above the bounded close it waits
        for, logged if passed.  Idempotent, and whole when it returns: a second thread's call
        waits for the first one's, and a call cut short (a ``KeyboardInterrupt`` while it
        waits) leaves the rest to the next one, which waits for the same ``close()`` rather
        than starting another.  In a thread that runs the loop (a finalizer run there)
        nothing may wait, so the close then finishes on the loop, run by the daemon thread.
        """
        with self.lock:
            self.closed = True
            self._news.notify_all()
        if self._runs_loop():
            self.loop.create_task(self._close_and_stop(close), name=f"{self.owner}-close")
            return
        with self._stopping:
            if not self.thread.is_alive() or self.loop.is_closed():
                return
            if close is not None:
                if self._closing is None:
                    self._closing = asyncio.run_coroutine_threadsafe(_boxed(close()), self.loop)
                self._hand_back()
                try:
                    ok, error = self._closing.result(timeout)
                except concurrent.futures.TimeoutError:
                    log.error("closing the %s did not finish within %.1fs", self.owner, timeout)
                except concurrent.futures.CancelledError:
                    pass  # the loop stopped meanwhile
                else:
                    if not ok:
                        log.error("closing the %s failed: %r", self.owner, error)
            self._end()
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # the loop closed meanwhile
                return
            self.thread.join(timeout)
            if self.thread.is_alive():
                log.warning("event-loop thread of the %s did not stop within %.1fs", self.owner, timeout)

    async def _close_and_stop(self, close: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        try:
            if close is not None:
                await close()
        finally:
            self._end()
            self.loop.stop()

    def _end(self) -> None:
        """No caller drives the loop from now on; the daemon thread leaves once its run of
        the loop stops (and runs it at once if it was waiting for the callers)."""
        with self._lease:
            self._ended = True
            self._lease.notify_all()


class Facade:
    """What both seed facades share: a :class:`Portal`, a finalizer that stops it, ``with`` support.

    A subclass sets ``_portal``, calls :meth:`_arm` with its engine's shutdown (which stops
    the portal; also run by a finalizer, so an unreferenced facade is stopped too), sets
    :attr:`peer_id` and :attr:`control_address`, and describes itself in ``_describe``.
    """

    _portal: Portal
    _shutdown: Callable[[], None]
    _finalizer: weakref.finalize[Any, Any]
    peer_id: str
    """This side's agent-level id (what a peer's metadata, ``destination`` or ``source`` names)."""
    control_address: str
    """``tcp://host:port`` (``?key=`` and this side's public key under CURVE) peers dial."""

    def __repr__(self) -> str:
        state = "closed" if self._portal.closed else f"at {self.control_address}"
        return f"<{type(self).__name__} {self._describe()} {state}>"

    def _describe(self) -> str:
        return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the facade's core runs on: in its daemon thread, or (the block facade)
        in a caller's thread during its calls and for :data:`LEASE_S` after them.  Hand it
        work only thread-safely (``call_soon_threadsafe``, ``run_coroutine_threadsafe``)."""
        return self._portal.loop

    def _arm(self, shutdown: Callable[[], None]) -> None:
        """``shutdown()`` (idempotent, holding no reference to this facade) stops it: on
        :meth:`_stop`, or once the facade is collected."""
        self._shutdown = shutdown
        self._finalizer = weakref.finalize(self, shutdown)

    def _stop(self) -> None:
        """Stop the portal (idempotent, and whole when it returns: see :meth:`Portal.stop`);
        refused on the loop's own thread.  Not through the finalizer, which runs once: a stop
        cut short, or racing another, would return before the end."""
        self._portal.check_caller()
        self._finalizer.detach()
        self._shutdown()


@contextmanager
def sigint_held() -> Iterator[None]:
    """In the main thread: hold a SIGINT that arrives during the block, then hand it to the
    handler installed before (a Python-level one; an ignored, default or C-level SIGINT
    handler is left alone).  A look and a handler swap each way, through ``_signal`` (the C
    functions ``signal`` wraps: its wrappers map every handler through an enum, and a
    callable one by a caught ``ValueError``, 11-22 µs a turn against ~1 µs, measured)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _raw_signal.getsignal(_SIGINT)
    if not callable(previous):
        yield
        return
    held: list[FrameType | None] = []
    _raw_signal.signal(_SIGINT, lambda _signum, frame: held.append(frame))
    try:
        yield
    finally:
        _raw_signal.signal(_SIGINT, previous)
        if held:
            previous(signal.SIGINT, held[0])


def _run_to_end(loop: asyncio.AbstractEventLoop, awaitable: Awaitable[Any]) -> None:
    """``loop.run_until_complete(awaitable)``, run again if a stop request a caller left
    queued ends a run before it completed (:meth:`Portal.stop` posts one after ending the
    portal, which may land in the daemon thread's last pass)."""
    future = asyncio.ensure_future(awaitable, loop=loop)
    while True:
        try:
            loop.run_until_complete(future)
            return
        except RuntimeError:
            if future.done():
                raise  # (its own error, not a stopped run)


async def _boxed(coro: Coroutine[Any, Any, T]) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, exception)``; cancellation still propagates."""
    try:
        return True, await coro
    except Exception as exc:  # re-raised in the caller's thread
        return False, exc
