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
