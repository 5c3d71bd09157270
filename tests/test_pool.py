"""The receive pool (sans-I/O): memory handed out first in, first out, reused only once every
array viewing it is gone, never blocking (a full pool says so and the caller allocates)."""

import gc
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_async.transport.pool import CONTROL_BYTES, PoolWriter, ReceivePool, SharedPool, fit, frame_slots
from omni_async.transport.ring import RingError

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


# -- the shared pool: the sender places pieces, the receiver hands them out -------------------------
def shared_pair(arena: int) -> tuple[SharedPool, PoolWriter]:
    buffer = memoryview(bytearray(CONTROL_BYTES + arena))
    return SharedPool(buffer), PoolWriter(buffer)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.booleans(), st.booleans()), max_size=60))
def test_writer_and_receiver_agree_on_every_piece_and_held_bytes_never_change(steps):
    """Whatever the sizes and the order consumers drop pieces in: the receiver finds each
    message's frames where the writer put them, a piece the writer reserves never overlaps one
    a consumer holds (every held frame keeps its bytes), and the writer refuses only when the
    room the receiver published cannot take the piece."""
    pool, writer = shared_pair(8192)
    base = np.frombuffer(pool._arena, np.uint8).__array_interface__["data"][0]
    held: list[tuple[np.ndarray, int, int]] = []  # (piece, value, first frame's size)
    placed = 0
    for number, (size, drop_oldest, publish) in enumerate(steps):
        value = number % 251
        sizes = [size, 0, size // 3]
        starts, total = frame_slots(sizes)
        published = int(pool._ctl[0])
        start = writer.reserve(total)
        if start is None:
            assert fit(placed, published, writer.capacity, total) is None
        else:
            writer.write(start, [np.full(s, value, np.uint8) for s in sizes if s], sizes, starts)
            writer.commit()
            piece = pool.place(total)
            assert piece.__array_interface__["data"][0] - base == start and piece.nbytes == total
            assert (piece[starts[2] : starts[2] + sizes[2]] == value).all()
            placed = writer._head
            held.append((piece, value, size))
        if drop_oldest and held:
            held.pop(0)
        if publish:
            pool.publish()
        assert all((piece[:first] == v).all() for piece, v, first in held)


def test_a_writer_that_overruns_the_room_given_back_is_refused_by_the_receiver():
    pool, writer = shared_pair(4096)
    assert writer.reserve(4096) == 0
    writer.commit()
    first = pool.place(4096)
    with pytest.raises(RingError, match="overruns"):
        pool.place(64)  # the writer did not wait for room: a protocol error, not a read
    del first
    pool.publish()
    assert writer.reserve(4096) == 0  # given back: all of it again


@pytest.mark.parametrize("tail", [1 << 40, -1 & 0xFFFFFFFFFFFFFFFF, 4097])
def test_a_garbage_tail_is_a_ring_error_for_the_writer(tail):
    pool, writer = shared_pair(4096)
    pool._ctl[0] = tail
    with pytest.raises(RingError):
        writer.reserve(64)


def test_frame_slots_align_every_frame():
    assert frame_slots([1, 0, 64, 65]) == ([0, 64, 64, 128], 256)
