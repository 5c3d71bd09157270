"""Copies in pieces (:mod:`omni_async.transport.memcopy`): byte-exact, nothing outside the target."""

from __future__ import annotations

import numpy as np
import pytest

from omni_async.region import BlockRegion
from omni_async.transport.memcopy import COPY_PIECE, copy_into
from omni_async.transport.pool import CONTROL_BYTES, PoolWriter, SharedPool, frame_slots
from omni_async.transport.shared import MappedRegion

from .test_shared import share_of


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [0, 1, COPY_PIECE - 1, COPY_PIECE, COPY_PIECE + 1, 3 * COPY_PIECE + 17])
def test_copy_into_copies_every_byte_and_nothing_around_it(nbytes):
    guarded = np.full(nbytes + 128, 0xAB, np.uint8)
    src = pattern(nbytes, nbytes)
    copy_into(guarded[64 : 64 + nbytes], src)
    assert np.array_equal(guarded[64 : 64 + nbytes], src)
    assert (guarded[:64] == 0xAB).all() and (guarded[64 + nbytes :] == 0xAB).all()


def test_copy_into_takes_rows_of_several_pieces_each():
    block_len = COPY_PIECE + 4096  # each row is more than one piece, the run more still
    src = pattern(3 * block_len, 7).reshape(3, block_len)
    dst = np.zeros((5, block_len), np.uint8)
    copy_into(dst[1:4], src)
    assert np.array_equal(dst[1:4], src) and not dst[0].any() and not dst[4].any()


def test_a_mapped_peer_region_gets_runs_larger_than_a_piece_byte_exact():
    block_len = 3 * COPY_PIECE // 2  # single rows and runs both cross piece boundaries
    region = BlockRegion.allocate(6, block_len)
    writer = MappedRegion(share_of(region.segment), 6, block_len)
    try:
        src = pattern(6 * block_len, 3).reshape(6, block_len)
        writer.place(src, [(0, 4, 1), (1, 1, 2)])  # one row, then a run of two
        assert np.array_equal(region.array[4], src[0]) and np.array_equal(region.array[1:3], src[1:3])
        assert not region.array[0].any() and not region.array[3].any() and not region.array[5].any()
        back = np.zeros_like(src)
        writer.fetch(back, [(2, 1, 2)])
        assert np.array_equal(back[2:4], src[1:3]) and not back[:2].any() and not back[4:].any()
    finally:
        writer.close()


def test_a_frame_larger_than_a_piece_lands_whole_in_the_shared_pool():
    buffer = memoryview(bytearray(CONTROL_BYTES + 4 * COPY_PIECE))
    pool, writer = SharedPool(buffer), PoolWriter(buffer)
    sizes = [2 * COPY_PIECE + 5, 100]
    frames = [pattern(size, size) for size in sizes]
    starts, total = frame_slots(sizes)
    start = writer.reserve(total)
    assert start is not None
    writer.write(start, frames, sizes, starts)
    writer.commit()
    piece = pool.place(total)
    for at, frame in zip(starts, frames, strict=True):
        assert np.array_equal(piece[at : at + frame.nbytes], frame)
