import hashlib
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async import BlockRegion, ConfigError, InvalidBlocks, config_fingerprint
from omni_async.region import fingerprints_compatible, plan_runs


def seed_fingerprint(fields):
    """The seed transport's fingerprint, written out independently."""
    if not fields:
        return ""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def test_fingerprint_empty_is_compatible_with_all():
    assert config_fingerprint(None) == ""
    assert config_fingerprint({}) == ""
    assert fingerprints_compatible("", "abc")
    assert fingerprints_compatible("abc", "")
    assert fingerprints_compatible("abc", "abc")
    assert not fingerprints_compatible("abc", "abd")


def test_fingerprint_known_value():
    # sha256('{"a":1,"b":"x"}') computed outside this code base.
    assert config_fingerprint({"b": "x", "a": 1}) == hashlib.sha256(b'{"a":1,"b":"x"}').hexdigest()[:16]
    assert config_fingerprint({"model": "m", "dtype": "bf16"}) == config_fingerprint({"dtype": "bf16", "model": "m"})


@given(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8), st.booleans()), max_size=6))
def test_fingerprint_matches_seed(fields):
    assert config_fingerprint(fields) == seed_fingerprint(fields)


def test_allocate_and_views():
    region = BlockRegion.allocate(8, 16)
    assert (region.num_blocks, region.block_len, region.nbytes) == (8, 16, 128)
    region.block(3)[:] = 7
    assert region.array[3].sum() == 7 * 16
    assert region.blocks(2, 3).shape == (48,)
    assert region.base_addr == region.array.ctypes.data


def test_wrap_is_zero_copy():
    backing = np.zeros((4, 32), np.uint8)
    region = BlockRegion.wrap(backing)
    region.block(1)[:] = 5
    assert backing[1, 0] == 5
    mv = memoryview(bytearray(64)).cast("B", (2, 32))
    assert BlockRegion.wrap(mv).num_blocks == 2
    wide = np.zeros((4, 8), np.float32)
    assert BlockRegion.wrap(wide).block_len == 32


@pytest.mark.parametrize(
    "bad",
    [np.zeros(8, np.uint8), np.zeros((4, 8), np.uint8)[:, ::2], np.zeros((0, 8), np.uint8), "nope"],
)
def test_wrap_rejects(bad):
    with pytest.raises(ConfigError):
        BlockRegion.wrap(bad)


def test_wrap_rejects_readonly():
    arr = np.zeros((2, 2), np.uint8)
    arr.flags.writeable = False
    with pytest.raises(ConfigError):
        BlockRegion.wrap(arr)
    with pytest.raises(ConfigError):
        BlockRegion.wrap(memoryview(bytes(4)).cast("B", (2, 2)))


@pytest.mark.parametrize("num_blocks,block_len", [(0, 4), (4, 0), (True, 4), (2.0, 4)])
def test_allocate_rejects(num_blocks, block_len):
    with pytest.raises(ConfigError):
        BlockRegion.allocate(num_blocks, block_len)


def test_plan_runs_coalesces_both_sides():
    assert plan_runs([0, 1, 2, 7, 8], [10, 11, 12, 3, 4], 16, 16) == [(0, 10, 3), (7, 3, 2)]
    assert plan_runs([0, 1], [5, 7], 16, 16) == [(0, 5, 1), (1, 7, 1)]
    assert plan_runs([], [], 1, 1) == []
    assert plan_runs(np.array([3, 4]), np.array([0, 1]), 5, 5) == [(3, 0, 2)]


@pytest.mark.parametrize(
    "local,remote",
    [([0, 1], [0]), ([16], [0]), ([0], [16]), ([-1], [0]), ([0.0], [0]), ([True], [0]), (["1"], [0])],
)
def test_plan_runs_rejects(local, remote):
    with pytest.raises(InvalidBlocks):
        plan_runs(local, remote, 16, 16)


def test_a_contiguous_write_is_one_run_and_is_checked_like_any_other():
    """Counting-up lists take the one-run shortcut; its checks are the loop's."""
    assert plan_runs(list(range(3, 259)), list(range(256)), 300, 256) == [(3, 0, 256)]
    assert plan_runs((0, 1, 2), (5, 6, 7), 16, 16) == [(0, 5, 3)]  # tuples: the loop, same plan
    assert plan_runs([0, 1, 2], [5, 6, 9], 16, 16) == [(0, 5, 2), (2, 9, 1)]
    assert plan_runs([0, 5, 2], [0, 5, 2], 16, 16) == [(0, 0, 1), (5, 5, 1), (2, 2, 1)]  # ends fit, middle not
    for local, remote in [
        ([0, 1.0, 2], [0, 1, 2]),  # equal to the range, not all ints
        ([0, 1, 2], [0, True, 2]),
        ([14, 15, 16], [0, 1, 2]),  # one past the end
        ([0, 1, 2], [-1, 0, 1]),
    ]:
        with pytest.raises(InvalidBlocks):
            plan_runs(local, remote, 16, 16)


@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 31)), max_size=80))
def test_plan_runs_covers_exactly(pairs):
    local = [p[0] for p in pairs]
    remote = [p[1] for p in pairs]
    runs = plan_runs(local, remote, 64, 32)
    expanded = [(local + i, remote + i) for local, remote, length in runs for i in range(length)]
    assert expanded == pairs


def _runs_by_loop(local, remote):
    """The plan as the definition says it: pairs that continue the run before join it."""
    runs = []
    for li, ri in zip(local, remote, strict=True):
        if runs and li == runs[-1][0] + runs[-1][2] and ri == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((li, ri, 1))
    return runs


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500), st.integers(1, 9)), min_size=1, max_size=60))
def test_long_plans_coalesce_as_short_ones(segments):
    """Long lists coalesce into the same runs, in order, as the definition says."""
    local = [start + i for start, _, length in segments for i in range(length)]
    remote = [start + i for _, start, length in segments for i in range(length)]
    assert plan_runs(local, remote, 512, 512) == _runs_by_loop(local, remote)


def test_long_scattered_plan_is_one_run_per_pair():
    rng = np.random.default_rng(7)
    local = rng.choice(1024, 256, replace=False).tolist()
    remote = rng.choice(1024, 256, replace=False).tolist()
    assert plan_runs(local, remote, 1024, 1024) == _runs_by_loop(local, remote)
    assert plan_runs(list(range(100)), list(range(5, 105)), 128, 128) == [(0, 5, 100)]


@pytest.mark.parametrize(
    "bad",
    [True, 1.0, "1", np.int64(3), -1, 200, 2**70],
    ids=["bool", "float", "str", "numpy-int", "negative", "out-of-range", "over-int64"],
)
@pytest.mark.parametrize("side", ["local", "remote"])
def test_long_plans_check_every_index(bad, side):
    """One bad index anywhere in a long list is refused (a numpy integer in range is accepted)."""
    local, remote = list(range(128)), list(range(128))
    (local if side == "local" else remote)[67] = bad
    if isinstance(bad, np.integer):
        assert plan_runs(local, remote, 200, 200)[0] == (0, 0, 67)
        return
    with pytest.raises(InvalidBlocks):
        plan_runs(local, remote, 200, 200)
