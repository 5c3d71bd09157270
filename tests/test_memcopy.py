"""The same-host lane's copies (:mod:`omni_async.transport.memcopy`): byte-exact, nothing outside the
target, runs outside either array refused before any byte moves; through the C helper and numpy."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from omni_async.region import BlockRegion
from omni_async.transport import memcopy, native
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


def guarded_rows(rows: int, row: int, seed: int) -> np.ndarray:
    return pattern(rows * row, seed).reshape(rows, row)


def expected_copy(dst: np.ndarray, dst_col: int, src: np.ndarray, src_col: int, runs) -> np.ndarray:
    want = dst.copy()
    for run in runs:
        to, of, count = run[dst_col], run[src_col], run[2]
        want[to : to + count] = src[of : of + count]
    return want


@pytest.mark.parametrize("native", [True, False], ids=["C", "numpy"])
@pytest.mark.parametrize(("row", "runs"), [
    (1000, [(0, 7, 1), (3, 2, 2), (9, 0, 1)]),  # odd row length: unaligned rows, short copies
    (96, [(5, 1, 4)]),  # one short run
    (64 * 1024, [(2 * i, 31 - i, 1) for i in range(16)]),  # 1 MiB in all: streaming stores
    (300 * 1024 + 3, [(0, 1, 3), (5, 6, 1)]),  # rows longer than a piece, streaming, unaligned
])
def test_copy_runs_copies_each_run_and_nothing_else(monkeypatch, native, row, runs):
    """Runs of rows land byte-exact in both directions (local → remote and back), whether the C
    helper copies (streaming stores from STREAM_MIN bytes on) or numpy does; no other row changes."""
    if not native:
        monkeypatch.setattr(memcopy, "_helper", lambda: None)
    rows = 32 if row < 256 * 1024 else 8
    src = guarded_rows(rows, row, 1)
    for dst_col, src_col in ((memcopy.REMOTE, memcopy.LOCAL), (memcopy.LOCAL, memcopy.REMOTE)):
        dst = guarded_rows(rows, row, 2)
        want = expected_copy(dst, dst_col, src, src_col, runs)
        memcopy.copy_runs(dst, dst_col, src, src_col, runs)
        assert np.array_equal(dst, want)


@pytest.mark.parametrize("native", [True, False], ids=["C", "numpy"])
@pytest.mark.parametrize("bad", [(0, 7, 2), (8, 0, 1), (-1, 0, 1), (0, -1, 1), (0, 0, -1), (0, 0, 1 << 62)])
def test_copy_runs_refuses_a_run_outside_either_array_before_copying_anything(monkeypatch, native, bad):
    """A run past the end of either array, or negative, is refused with ValueError, and no row of
    the target changed, not even those of the good runs before it."""
    if not native:
        monkeypatch.setattr(memcopy, "_helper", lambda: None)
    src, dst = guarded_rows(8, 4096, 3), guarded_rows(8, 4096, 4)
    before = dst.copy()
    runs = [(1, 1, 1), (2, 3, 1), (4, 5, 1), bad]  # several runs: the C helper's path
    with pytest.raises(ValueError):
        memcopy.copy_runs(dst, memcopy.REMOTE, src, memcopy.LOCAL, runs)
    assert np.array_equal(dst, before)
    with pytest.raises(ValueError):
        memcopy.copy_runs(dst, memcopy.REMOTE, src, memcopy.LOCAL, [bad])  # alone: the one-run path
    assert np.array_equal(dst, before)


def test_copy_runs_refuses_rows_of_different_lengths():
    with pytest.raises(ValueError, match="rows of"):
        memcopy.copy_runs(np.zeros((4, 64), np.uint8), 1, np.zeros((4, 32), np.uint8), 0, [(0, 0, 1)])


def test_the_c_row_copier_is_built_here():
    """``make test`` installs the package with its C helper (a C compiler is there): the fast
    path is the one the suite and the bench run, and the helper has streaming stores on x86-64."""
    assert native.built()
    helper = memcopy._helper()
    assert helper is not None
    if platform.machine() in ("x86_64", "AMD64"):
        assert helper.stream_min == memcopy.STREAM_MIN


def test_a_mapped_peer_region_refuses_a_write_outside_it_with_an_os_error():
    """A run outside the peer's mapping (the planning bounds them: this is the last guard) fails
    the write as any failed same-host copy does (OSError), and nothing is written."""
    region = BlockRegion.allocate(4, 4096)
    writer = MappedRegion(share_of(region.segment), 4, 4096)
    try:
        src = pattern(8 * 4096, 5).reshape(8, 4096)
        with pytest.raises(OSError, match="outside the peer's mapped region"):
            writer.place(src, [(0, 0, 1), (1, 3, 2)])
        with pytest.raises(OSError, match="outside the peer's mapped region"):
            writer.fetch(src, [(7, 3, 2)])
        assert not region.array.any()
    finally:
        writer.close()


def test_the_c_row_copier_refuses_a_column_that_is_neither_local_nor_remote():
    """The helper reads a run's index at the column it is given: anything but 0 or 1 is refused
    before any byte moves (never an index read past the run)."""
    helper = memcopy._helper()
    assert helper is not None
    src, dst = guarded_rows(4, 256, 6), guarded_rows(4, 256, 7)
    before = dst.copy()
    table = np.array([[0, 1, 1], [2, 3, 1]], np.uint64)
    for dst_col, src_col in ((2, 0), (1, 3), (-1, 0)):
        status = helper.copy_runs(dst.ctypes.data, 4, dst_col, src.ctypes.data, 4, src_col, 256, table.ctypes.data, 2, 0)
        assert status == -1
    assert np.array_equal(dst, before)
