"""The portal between synchronous callers and its event loop (``omni_async.seed.portal``):
who runs the loop, and what a caller's turn of it holds back."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from omni_async.seed.portal import Portal

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def portal():
    made = Portal("omni-test-portal", "test portal", use_uvloop=False)
    yield made
    made.stop(None, 5.0)
    assert not made.thread.is_alive()


def test_a_caller_takes_the_loop_and_its_thread_takes_it_back_after_the_lease(portal):
    ran_in: list[str] = []
    with portal.driving(1.0) as driving:
        assert driving and portal._driver is threading.current_thread()
        portal.loop.call_soon(lambda: ran_in.append(threading.current_thread().name))
        portal.turn(0.01)
    assert ran_in == [threading.current_thread().name]
    loop_thread_runs_it(portal)  # within the lease and a wake-up
    portal.loop.call_soon_threadsafe(lambda: ran_in.append(threading.current_thread().name))
    end = time.monotonic() + 5
    while len(ran_in) < 2:
        assert time.monotonic() < end
        time.sleep(0.001)
    assert ran_in[1] == portal.thread.name


def loop_thread_runs_it(portal: Portal) -> None:
    end = time.monotonic() + 5
    while portal._driver is not portal.thread:
        assert time.monotonic() < end, "the loop's thread never ran the loop"
        time.sleep(0.001)


def test_without_waiting_a_caller_does_not_take_a_loop_another_thread_runs(portal):
    loop_thread_runs_it(portal)
    with portal.driving(0.0) as driving:
        assert not driving
    with portal.driving(1.0) as driving:  # asked, it lets go
        assert driving


def test_a_sigint_during_a_callers_turn_waits_for_the_callback_it_lands_in(portal):
    """A KeyboardInterrupt raised inside a loop callback would leave the transport's state half
    changed: during a turn in the main thread the signal is held, and raised once it ends."""
    finished: list[bool] = []

    def interrupted_callback() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        total = 0
        for i in range(10_000):  # bytecode a KeyboardInterrupt would land in
            total += i
        finished.append(total > 0)

    with portal.driving(1.0) as driving:
        assert driving
        portal.loop.call_soon(interrupted_callback)
        with pytest.raises(KeyboardInterrupt):
            portal.turn(0.05)
    assert finished == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_calls_that_wait_for_the_loop_are_refused_in_a_thread_that_runs_it(portal):
    with portal.driving(1.0) as driving:
        assert driving
        with pytest.raises(RuntimeError, match="event-loop thread"):
            portal.check_caller()


def test_a_call_that_holds_the_loop_longer_than_the_lease_keeps_it_for_the_next_poll(portal, monkeypatch):
    """A caller that polls, then holds the loop through a call longer than the lease (a large
    write's copy), still has the loop when it polls next: the lease runs from the end of that
    call, so the next poll costs no hand-over from the daemon thread.  (The daemon thread
    looks every lease while the caller holds the loop: with the lease counted from the turn
    before, it took the loop within a lease of the call's end.)"""
    import omni_async.seed.portal as portal_module

    monkeypatch.setattr(portal_module, "LEASE_S", 0.5)
    for _ in range(4):
        with portal.driving(5.0) as driving:  # a poll: a turn of the loop
            assert driving
            portal.turn(0.001)
        with portal.driving(0.0) as driving:  # the next call, held longer than the lease
            assert driving
            time.sleep(0.6)
        time.sleep(0.3)  # the caller's own work, within the lease
        with portal.driving(0.0) as driving:  # the next poll finds the loop free, at once
            assert driving
    loop_thread_runs_it(portal)  # a lease after the last call, the loop's thread has it again
