"""The portal between synchronous callers and an event loop that runs in a thread of its own.

Like anyio's ``BlockingPortal``: a :class:`Portal` owns one event loop (uvloop where installed)
running forever in a daemon thread, runs coroutines and plain calls on it for callers in other
threads, and hands completions back to them through books guarded by :attr:`Portal.lock`.

The hand-back is cheap and never starves the loop.  The loop thread releases the GIL on every
epoll and ctypes call and then has to win it back; from a caller thread that never blocks (a
tight ``poll()`` loop, or pure-Python work between polls) that takes up to
``sys.getswitchinterval()`` (5 ms) each time, which made one 64 KiB write take ~80 ms.  So a
caller that finds nothing new while work is outstanding waits on :meth:`Portal.wait_for_news`:
a condition wait, which releases the GIL and ends as soon as the loop calls
:meth:`Portal.notify` (something settled), or after :data:`NEWS_WAIT_S` at most.  Nothing sleeps
for a fixed time, and a caller that polls an idle portal never waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Self, TypeVar, cast

from ..errors import ClosedError, DeadlineExceeded
from ..eventloop import new_event_loop

__all__ = ["NEWS_WAIT_S", "Facade", "Portal"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NEWS_WAIT_S = 0.002
"""The longest a drain (``poll()``, ``get_finished_requests()``) waits for news while work is
outstanding and nothing settled since the previous drain.  It ends at once when something
settles; the bound only keeps a caller that polls between other work from stalling long."""


class Portal:
    """An event loop in a daemon thread, bounded hand-offs to it, and completions handed back.

    ``owner`` names the facade in errors.  Fields of the owner's books are guarded by
    :attr:`lock` (the loop thread writes them, callers drain them); :attr:`closed` too.
    Every method may be called from any thread except the loop's own, where a call that waits
    for the loop would deadlock and raises :class:`RuntimeError` instead.
    """

    def __init__(self, name: str, owner: str, *, use_uvloop: bool) -> None:
        self.owner = owner
        self.lock = threading.Lock()
        self.closed = False  # locked
        self._news = threading.Condition(self.lock)
        self.loop = new_event_loop(use_uvloop=use_uvloop)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for task in tasks:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())  # its threads too
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    # -- checks --------------------------------------------------------------------------------
    def check_caller(self) -> None:
        """Raise :class:`RuntimeError` on the loop's own thread (waiting there would deadlock)."""
        if threading.current_thread() is self.thread:
            raise RuntimeError(f"{self.owner} must not be called from its own event-loop thread")

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
        future = asyncio.run_coroutine_threadsafe(_boxed(coro), self.loop)
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
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.cancel():
                raise DeadlineExceeded(f"{what} did not finish within {timeout:.1f}s") from None
            return future.result()  # it started meanwhile: it is a plain call, it ends soon

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand ``fn(*args)`` to the loop without waiting (call order is kept).

        Raises :class:`ClosedError` if the loop is closed."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed concurrently
            raise ClosedError(f"{self.owner} is closed") from None

    # -- completions handed back -----------------------------------------------------------------
    def notify(self) -> None:
        """Wake callers waiting in :meth:`wait_for_news`.  Loop thread, with :attr:`lock` held."""
        self._news.notify_all()

    def wait_for_news(self) -> None:
        """Release the GIL (and :attr:`lock`) until :meth:`notify` or :data:`NEWS_WAIT_S` passed.

        Caller's thread, with :attr:`lock` held; the caller re-reads its books afterwards.
        Call it only when work is outstanding and nothing new was found.  On the loop's own
        thread it returns at once (nothing could settle while it waited).
        """
        if threading.current_thread() is not self.thread:
            self._news.wait(NEWS_WAIT_S)

    # -- stopping --------------------------------------------------------------------------------
    def stop(self, close: Callable[[], Coroutine[Any, Any, None]] | None, timeout: float) -> None:
        """Mark closed, run ``close()`` on the loop to its end, stop the loop and join its thread.

        ``close()`` is never cancelled by this wait (a cut-short close leaves sockets bound and
        UCX workers alive): ``timeout`` is a safety bound far above the bounded close it waits
        for, logged if passed.  Idempotent.  On the loop thread itself (a finalizer run there)
        nothing may wait, so the close then finishes on the loop.
        """
        with self.lock:
            self.closed = True
            self._news.notify_all()
        if threading.current_thread() is self.thread:
            self.loop.create_task(self._close_and_stop(close), name=f"{self.owner}-close")
            return
        if not self.thread.is_alive() or self.loop.is_closed():
            return
        if close is not None:
            future = asyncio.run_coroutine_threadsafe(_boxed(close()), self.loop)
            try:
                ok, error = future.result(timeout)
            except concurrent.futures.TimeoutError:
                log.error("closing the %s did not finish within %.1fs", self.owner, timeout)
            except concurrent.futures.CancelledError:
                pass  # the loop stopped meanwhile
            else:
                if not ok:
                    log.error("closing the %s failed: %r", self.owner, error)
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
            self.loop.stop()


class Facade:
    """What both seed facades share: a :class:`Portal`, a finalizer that stops it, ``with`` support.

    A subclass sets ``_portal``, ``_finalizer`` (a :func:`weakref.finalize` of its engine's
    shutdown, so an unreferenced facade is stopped too), :attr:`peer_id` and
    :attr:`control_address`, and describes itself in ``_describe``.
    """

    _portal: Portal
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
        """The event loop the facade's core runs on, in its daemon thread."""
        return self._portal.loop

    def _stop(self) -> None:
        """Stop the portal (idempotent); refused on the loop's own thread."""
        self._portal.check_caller()
        self._finalizer()


async def _boxed(coro: Coroutine[Any, Any, T]) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, exception)``; cancellation still propagates."""
    try:
        return True, await coro
    except Exception as exc:  # re-raised in the caller's thread
        return False, exc
