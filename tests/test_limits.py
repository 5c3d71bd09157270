"""The sender's side of the receiver's limits, without I/O."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async import InvalidMessage
from omni_async.region import Run
from omni_async.transport.limits import check_message, split_runs
from omni_async.wire import MAX_FRAMES, MAX_KEY, MAX_META_BYTES, RUNS_PER_REQUEST, WriteRequest, validate_write

runs_st = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 50)).map(lambda t: Run(*t)),
    max_size=60,
)


def blocks_of(runs):
    return [(run.local + i, run.remote + i) for run in runs for i in range(run.length)]


@given(runs_st, st.integers(1, 40), st.integers(1, 8))
def test_split_keeps_every_block_in_order_within_limits(runs, max_blocks, max_runs):
    requests = split_runs(runs, max_blocks, max_runs)
    assert blocks_of([run for request in requests for run in request]) == blocks_of(runs)
    for request in requests:
        assert 1 <= len(request) <= max_runs
        assert sum(run.length for run in request) <= max_blocks
        # the receiver's own check accepts every request
        header = WriteRequest(1, 0, [(run.remote, run.length) for run in request])
        assert validate_write(header, 20_000, max_blocks) == sum(run.length for run in request)


def test_split_defaults_to_the_wire_limit():
    runs = [Run(2 * i, 2 * i, 1) for i in range(10_000)]
    requests = split_runs(runs, 1 << 20)
    assert [len(r) for r in requests] == [RUNS_PER_REQUEST] * 3 + [10_000 - 3 * RUNS_PER_REQUEST]
    with pytest.raises(ValueError):
        split_runs(runs, 0)


def test_check_message_limits():
    check_message("k" * MAX_KEY, b"m" * MAX_META_BYTES, [1] * MAX_FRAMES, MAX_FRAMES)
    check_message("k", memoryview(b"m"), [], 0)
    for key, meta, sizes, limit in [
        ("k" * (MAX_KEY + 1), b"", [], 10),
        ("k", b"m" * (MAX_META_BYTES + 1), [], 10),
        ("k", b"", [0] * (MAX_FRAMES + 1), 10),
        ("k", b"", [6, 5], 10),
    ]:
        with pytest.raises(InvalidMessage):
            check_message(key, meta, sizes, limit)
    with pytest.raises(TypeError):
        check_message(b"k", b"", [], 10)
    with pytest.raises(TypeError):
        check_message("k", "meta", [], 10)
