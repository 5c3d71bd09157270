"""The lane protocol's state without UCX: a fake lane reports events, the protocol answers."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async import ProtocolError
from omni_async.transport.protocol import Inbox


class FakeLane:
    """Stands in for a UCX lane: payload messages are ("msg", seq) handles; receiving one
    records which target it went to."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self.received: dict[int, str] = {}

    def take(self, result) -> None:
        if result is not None:
            (_, seq), target = result
            assert seq not in self.received, "a message received twice"
            self.received[seq] = target

    def header(self, seq: int, length: int) -> None:
        self.take(self.inbox.expect(seq, length, f"target{seq}"))

    def payload(self, seq: int, length: int) -> None:
        self.take(self.inbox.arrived(seq, length, ("msg", seq)))


@given(st.data(), st.integers(1, 60))
def test_every_payload_meets_its_header_in_any_order(data, count):
    lengths = data.draw(st.lists(st.integers(0, 1 << 20), min_size=count, max_size=count))
    events = [("header", seq) for seq in range(count)] + [("payload", seq) for seq in range(count)]
    order = data.draw(st.permutations(events))
    lane = FakeLane(Inbox(max_bytes=1 << 30, max_pending=2 * count))
    for kind, seq in order:
        getattr(lane, kind)(seq, lengths[seq])
    assert lane.received == {seq: f"target{seq}" for seq in range(count)}
    assert lane.inbox.pending == 0 and not lane.inbox.expecting
    assert lane.inbox.release() == []


@given(st.integers(0, 100), st.booleans())
def test_a_payload_of_the_wrong_length_is_a_violation_and_is_handed_back(length, early):
    lane = FakeLane(Inbox(max_bytes=1 << 30))
    with pytest.raises(ProtocolError, match="announced"):
        if early:
            lane.payload(7, length + 1)
            lane.header(7, length)
        else:
            lane.header(7, length)
            lane.payload(7, length + 1)
    assert lane.received == {}
    assert lane.inbox.release() == [("msg", 7)]  # the driver takes it: nothing left in UCX


@given(st.integers(1, 50), st.integers(0, 20))
def test_payloads_without_headers_are_bounded_and_all_handed_back(bound, announced):
    inbox = Inbox(max_bytes=1 << 30, max_pending=bound)
    lane = FakeLane(inbox)
    for seq in range(min(announced, bound)):
        inbox.admit(1000 + seq, 1, 0)
        lane.header(1000 + seq, 1)
    with pytest.raises(ProtocolError, match="pending"):
        for seq in range(bound + 1):
            lane.payload(seq, 1)
    returned = inbox.release()
    assert sorted(returned) == sorted(("msg", seq) for seq in range(len(returned)))
    assert len(returned) == bound - min(announced, bound) + 1
    assert inbox.pending == 0 and inbox.pending_bytes == 0 and not inbox.expecting


def test_admit_bounds_messages_and_bytes_and_counts_early_payloads_once():
    inbox = Inbox(max_bytes=100, max_pending=4)
    lane = FakeLane(inbox)
    lane.payload(0, 10)  # early
    inbox.admit(0, 4, 60)  # seqs 0..3: 0 is already pending, so 4 in all
    for seq in range(4):
        lane.header(seq, 10)
    assert lane.received == {0: "target0"}
    assert inbox.expecting and inbox.pending == 3
    with pytest.raises(ProtocolError, match="pending"):
        inbox.admit(4, 2, 0)
    with pytest.raises(ProtocolError, match="bytes"):
        inbox.admit(4, 1, 41)
    inbox.received(60)
    assert inbox.pending_bytes == 0
    inbox.admit(4, 1, 100)
    for seq in range(1, 4):
        lane.payload(seq, 10)
    assert sorted(lane.received) == [0, 1, 2, 3] and inbox.pending == 0


def outbox(max_messages):
    from omni_async.transport.limits import Window
    from omni_async.transport.protocol import Outbox

    return Outbox(Window(1 << 20, max_messages=max_messages))


def test_outbox_posts_within_the_window_in_order_and_settles_on_the_last_answer():
    box = outbox(max_messages=10)
    assert box.submit(1, [(6, 0, "1a"), (6, 0, "1b")]) == ["1a"]  # 1b waits for room
    assert box.submit(2, [(1, 0, "2a")]) == []  # in order: behind 1b
    assert box.posted(1) and not box.posted(2)
    assert box.answered(1, "", "") == (False, None, ["1b", "2a"])
    assert box.answered(1, "invalid_blocks", "no") == (True, ("invalid_blocks", "no"), [])
    assert box.answered(2, "", "") == (True, None, [])
    assert box.answered(99, "", "") == (False, None, [])  # unknown ids are ignored
    assert (box.window.messages, box.window.nbytes) == (0, 0)
    assert [box.take_seq(3), box.take_seq(1), box.take_seq(2)] == [0, 3, 4]


def test_outbox_cancel_in_both_modes():
    box = outbox(max_messages=4)
    assert box.submit(1, [(4, 0, "1")]) == ["1"]
    assert box.submit(2, [(4, 0, "2")]) == []
    # "wait" drains a transfer that left this side; one still waiting settles at once
    assert box.posted(1) and not box.posted(2)
    assert box.forget(2) == []  # cancelled (either mode): its request is dropped
    assert box.forget(1) == []  # cancelled "immediate": what it posted keeps its window share
    assert box.submit(3, [(4, 0, "3")]) == []
    assert box.answered(1, "", "") == (False, None, ["3"])  # the late answer frees the window
    assert box.forget(7) == []


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)), min_size=1, max_size=30), st.randoms())
def test_outbox_never_exceeds_the_window_and_every_request_goes_out_once(transfers, rnd):
    box = outbox(max_messages=8)
    posted, settled, in_flight = [], set(), []
    for transfer_id, (parts, messages) in enumerate(transfers):
        for post in box.submit(transfer_id, [(messages, 0, (transfer_id, i)) for i in range(parts)]):
            posted.append(post)
            in_flight.append(post[0])
        assert box.window.messages <= 8
    while in_flight:
        transfer_id = in_flight.pop(rnd.randrange(len(in_flight)))
        done, _, posts = box.answered(transfer_id, "", "")
        if done:
            settled.add(transfer_id)
        for post in posts:
            posted.append(post)
            in_flight.append(post[0])
        assert box.window.messages <= 8
    assert sorted(posted) == sorted((t, i) for t, (parts, _) in enumerate(transfers) for i in range(parts))
    assert settled == set(range(len(transfers)))
    assert box.window.messages == 0
