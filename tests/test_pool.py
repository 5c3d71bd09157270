"""The receive pool (sans-I/O): memory handed out first in, first out, reused only once every
array viewing it is gone, never blocking (a full pool says so and the caller allocates)."""

import gc
import threading

import numpy as np
import pytest

from omni_async.transport.pool import ReceivePool

pytestmark = pytest.mark.timeout(30)


def address(array):
    return array.__array_interface__["data"][0]


def test_dropped_memory_is_handed_out_again_warm():
    pool = ReceivePool(1 << 16)
    first = pool.take(4096)
    where = address(first)
    assert first.dtype == np.uint8 and first.shape == (4096,) and first.flags.writeable
    del first
    again = pool.take(4096)
    assert address(again) == where and pool.taken == 2 and pool.fallbacks == 0


def test_memory_still_viewed_is_never_handed_out_again():
    """A frame's decoded array or a memoryview of it holds the memory like the frame itself;
    whatever is taken and written meanwhile, the held bytes do not change."""
    pool = ReceivePool(1 << 16)
    frame = pool.take(1000)
    frame[:] = 7
    decoded = np.ndarray((10, 10), np.uint8, frame[100:200])  # as serde decodes a frame
    view = memoryview(frame[500:600])
    del frame
    gc.collect()
    for round_ in range(50):
        other = pool.take(3000)
        if other is not None:
            other[:] = round_
        del other
    assert (decoded == 7).all() and bytes(view) == b"\x07" * 100
    assert pool.in_use >= 1000
    del decoded
    assert pool.in_use >= 1000  # the memoryview still holds it
    del view
    gc.collect()
    assert pool.in_use == 0


def test_a_full_pool_refuses_and_recovers_never_blocks():
    pool = ReceivePool(10_000)
    held = [pool.take(3000) for _ in range(3)]
    assert all(a is not None for a in held)
    assert pool.take(3000) is None and pool.fallbacks == 1  # no room: the caller allocates
    del held[0]  # the oldest is back: room again
    assert pool.take(3000) is not None


def test_a_piece_never_wraps_and_a_held_old_piece_keeps_what_follows():
    pool = ReceivePool(10_000)
    old = pool.take(4000)
    newer = pool.take(4000)
    del newer  # released, but behind the held old one: reclaimed in order only
    assert pool.take(4000) is None  # 8000 in use; 4000 more would wrap past the end
    del old
    piece = pool.take(9000)  # everything back: starts over at 0, so a large piece fits
    assert piece is not None and piece.nbytes == 9000


def test_release_from_another_thread():
    pool = ReceivePool(1 << 16)
    frames = [pool.take(1024) for _ in range(8)]
    dropper = threading.Thread(target=frames.clear)
    dropper.start()
    dropper.join(5)
    assert pool.in_use == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        ReceivePool(0)
