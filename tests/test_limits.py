"""The sender's side of the receiver's limits, without I/O."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async import InvalidMessage
from omni_async.transport.limits import check_message, split_runs
from omni_async.wire import MAX_FRAMES, MAX_KEY, MAX_META_BYTES, RUNS_PER_REQUEST, WriteRequest, validate_write

runs_st = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 50)),
    max_size=60,
)


def blocks_of(runs):
    return [(local + i, remote + i) for local, remote, length in runs for i in range(length)]


@given(runs_st, st.integers(1, 40), st.integers(1, 8))
def test_split_keeps_every_block_in_order_within_limits(runs, max_blocks, max_runs):
    requests = split_runs(runs, max_blocks, max_runs)
    assert blocks_of([run for request in requests for run in request]) == blocks_of(runs)
    # check_notice_runs' bound on the runs a split makes
    assert sum(map(len, requests)) <= len(runs) + sum(length for _l, _r, length in runs) // max_blocks
    for request in requests:
        assert 1 <= len(request) <= max_runs
        assert sum(length for _local, _remote, length in request) <= max_blocks
        # the receiver's own check accepts every request
        header = WriteRequest(1, 0, [(remote, length) for _local, remote, length in request])
        assert validate_write(header, 20_000, max_blocks) == sum(length for _local, _remote, length in request)


def test_split_defaults_to_the_wire_limit():
    runs = [(2 * i, 2 * i, 1) for i in range(10_000)]
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


def test_window_admits_within_the_receivers_bounds_and_releases_on_answers():
    from omni_async.transport.limits import Window, receive_budget
    from omni_async.wire import MAX_PENDING_PAYLOADS

    window = Window(1 << 20)
    assert window.max_bytes == receive_budget(1 << 20) >= 1 << 20
    assert window.fits(MAX_PENDING_PAYLOADS, window.max_bytes)
    window.take(1, RUNS_PER_REQUEST, 0)
    window.take(1, 10, 0)  # a split write: two requests under one id
    window.take(2, 1, window.max_bytes - 5)
    assert not window.fits(1, 6)
    assert not window.fits(MAX_PENDING_PAYLOADS - RUNS_PER_REQUEST - 10, 0)
    window.release(99)  # an id never sent: ignored
    window.release(1)  # the smaller request of id 1 goes first
    assert (window.messages, window.nbytes) == (RUNS_PER_REQUEST + 1, window.max_bytes - 5)
    window.release(2)
    window.release(1)
    window.release(1)  # more answers than requests: ignored
    assert (window.messages, window.nbytes) == (0, 0)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 100), st.integers(0, 1000)), max_size=50),
       st.randoms())
def test_window_never_goes_negative_and_empties(requests, rnd):
    from omni_async.transport.limits import Window

    window = Window(1000, max_messages=10_000)
    for transfer_id, messages, nbytes in requests:
        window.take(transfer_id, messages, nbytes)
    answers = [transfer_id for transfer_id, _, _ in requests]
    rnd.shuffle(answers)
    for transfer_id in answers:
        window.release(transfer_id)
        assert window.messages >= 0 and window.nbytes >= 0
    assert (window.messages, window.nbytes) == (0, 0)
