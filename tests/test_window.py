"""SaveWindow: the adapter's bound on unacknowledged saves (a semaphore with a take that never waits)."""

import asyncio

import pytest

from omni_async.window import SaveWindow

pytestmark = pytest.mark.timeout(30)


def test_shares_are_taken_without_waiting_until_the_window_is_full():
    window = SaveWindow(2)
    assert not window.locked()
    assert window.take_nowait() and window.take_nowait()
    assert window.locked() and not window.take_nowait()
    window.release()
    assert not window.locked() and window.take_nowait()
    with pytest.raises(ValueError):
        SaveWindow(0)


async def test_waiters_are_served_in_order_and_a_caller_that_did_not_wait_never_barges_in():
    window = SaveWindow(1)
    assert await window.acquire()  # free: no wait
    order: list[int] = []

    async def wait(i: int) -> None:
        await window.acquire()
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)  # all three queued
    assert window.locked()
    window.release()
    assert not window.take_nowait()  # the share went to the oldest waiter, not to us
    await asyncio.sleep(0)
    assert order == [0]
    window.release()
    window.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2]
    assert window.locked()  # the last waiter holds the one share
    window.release()
    assert not window.locked()


@pytest.mark.parametrize("release", ["after the cancel ended", "while the cancel is pending"])
async def test_a_waiter_cancelled_before_its_share_leaves_the_queue(release):
    """A waiter cancelled before it got a share holds nothing back: released after it ended
    (it left the queue) or while its cancel is still pending (it is skipped), the share goes
    back to the window, and the window has one share in all."""
    window = SaveWindow(1)
    assert window.take_nowait()
    waiter = asyncio.create_task(window.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    if release == "while the cancel is pending":
        window.release()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    if release == "after the cancel ended":
        window.release()
    assert not window.locked() and window.take_nowait() and not window.take_nowait()


async def test_a_waiter_cancelled_just_after_it_got_a_share_passes_the_share_on():
    window = SaveWindow(1)
    assert window.take_nowait()
    first = asyncio.create_task(window.acquire())
    second = asyncio.create_task(window.acquire())
    await asyncio.sleep(0)
    window.release()  # handed to `first`, which has not run yet
    first.cancel()  # ... and is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 5)  # the share went on to the next waiter
    window.release()
    assert window.take_nowait() and not window.take_nowait()  # still one share in all
