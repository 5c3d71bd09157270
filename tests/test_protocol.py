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


@pytest.mark.parametrize("rendezvous", [None, 8])
def test_payloads_before_their_header_are_bounded_in_bytes(rendezvous):
    """Early payloads count their bytes (those under ``rendezvous_bytes``: the rest hold no
    bytes in UCX) until matched; over ``max_early_bytes`` is a violation, handed back whole."""
    inbox = Inbox(max_bytes=1 << 30, max_early_bytes=20, rendezvous_bytes=rendezvous)
    lane = FakeLane(inbox)
    lane.payload(0, 7)
    if rendezvous is None:
        with pytest.raises(ProtocolError, match="bytes of payload messages before their header"):
            lane.payload(1, 1000)
        assert sorted(inbox.release()) == [("msg", 0), ("msg", 1)] and inbox.early_bytes == 0
        return
    lane.payload(1, 1000)  # by rendezvous: not counted
    assert inbox.early_bytes == 7
    lane.header(0, 7)  # matched: no longer early
    assert inbox.early_bytes == 0 and lane.received == {0: "target0"}
    lane.payload(2, 7)
    lane.payload(3, 7)
    with pytest.raises(ProtocolError, match="bytes of payload messages before their header"):
        lane.payload(4, 7)
    assert sorted(inbox.release()) == [("msg", seq) for seq in range(1, 5)] and inbox.early_bytes == 0


@pytest.mark.parametrize("twice", ["header", "early payload"])
def test_a_sequence_number_announced_or_arriving_twice_is_a_violation_and_nothing_is_lost(twice):
    """A second header of one sequence number overwrote the first's target (its write then
    waited for good); a second early payload overwrote the first (a message UCX holds that
    release() never handed back).  Both are violations; every arrived message is handed back."""
    inbox = Inbox(max_bytes=1 << 30)
    lane = FakeLane(inbox)
    if twice == "header":
        lane.header(3, 10)
        with pytest.raises(ProtocolError, match="announced twice"):
            lane.header(3, 10)
        assert inbox.release() == []
    else:
        inbox.arrived(3, 10, ("msg", 3, "first"))
        with pytest.raises(ProtocolError, match="arrived twice"):
            inbox.arrived(3, 10, ("msg", 3, "second"))
        assert sorted(inbox.release()) == [("msg", 3, "first"), ("msg", 3, "second")]
    assert inbox.pending == 0 and inbox.release() == []


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


def test_outbox_starts_a_placed_request_at_once_only_while_idle_and_settles_it_as_submitted():
    """``start``: a transfer of one request that needs no window room (a same-host placed
    write), posted at once, as ``submit`` would post it on an idle outbox: the same answers,
    cancel modes and window accounting."""
    from omni_async.transport.protocol import GiveUp

    box = outbox(max_messages=4)
    assert box.idle
    box.start(1)
    assert box.posted(1) and (box.window.messages, box.window.nbytes) == (0, 0)
    assert box.answered(1, "", "") == (True, None, [])
    assert box.answered(1, "", "") == (False, None, [])  # a second answer (tail and Ack) is ignored
    assert box.submit(2, [(4, 0, "2a"), (1, 0, "2b")]) == ["2a"]  # 2b waits for room
    assert not box.idle  # the short path is not taken now: a write goes behind 2b
    assert box.answered(2, "", "") == (False, None, ["2b"])
    assert box.idle
    box.start(3)
    assert box.give_up(3, "wait") is GiveUp.KEEP and box.give_up(3) is GiveUp.SETTLE  # posted, not abortable
    assert box.forget(3) == [] and not box.posted(3)


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


@given(
    st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6), st.booleans()), min_size=1, max_size=12),
    st.lists(st.tuples(st.integers(0, 11), st.sampled_from(["immediate", "wait"])), max_size=12),
    st.randoms(),
)
def test_give_up_in_both_modes_with_and_without_posted_parts(transfers, cancels, rnd):
    """A cancel in "wait" mode keeps a transfer some request of which was posted (until it is
    answered); otherwise it settles now, with an Abort for a write with a notice some of which
    was posted.  Forgotten transfers keep their window share until answered; answers for ids
    the outbox does not know (forgotten, never sent) are ignored."""
    from omni_async.transport.protocol import GiveUp

    box = outbox(max_messages=8)
    in_flight, posted = [], {}  # posts not answered yet; how many requests of each left

    def carry_out(posts):
        for transfer_id in posts:
            in_flight.append(transfer_id)
            posted[transfer_id] += 1

    for transfer_id, (parts, messages, noticed) in enumerate(transfers):
        posted[transfer_id] = 0
        carry_out(box.submit(transfer_id, [(messages, 0, transfer_id)] * parts, abortable=noticed))
    kept, settled = set(), set()
    for index, mode in cancels:
        transfer_id = index % len(transfers)
        if transfer_id in settled:
            assert box.give_up(transfer_id, mode) is GiveUp.SETTLE  # unknown now: nothing to wait for
            continue
        if not posted[transfer_id]:
            expected = GiveUp.SETTLE
        elif mode == "wait":
            expected = GiveUp.KEEP
        else:
            expected = GiveUp.ABORT if transfers[transfer_id][2] else GiveUp.SETTLE
        assert box.give_up(transfer_id, mode) is expected
        assert box.posted(transfer_id) == bool(posted[transfer_id])
        if expected is GiveUp.KEEP:
            kept.add(transfer_id)
        else:
            kept.discard(transfer_id)  # "immediate" after "wait": settled now after all
            settled.add(transfer_id)
            carry_out(box.forget(transfer_id))
    window = (box.window.messages, box.window.nbytes)
    assert box.answered(len(transfers) + 7, "", "") == (False, None, [])  # never sent: ignored
    assert (box.window.messages, box.window.nbytes) == window
    answered = set()
    while in_flight:
        transfer_id = in_flight.pop(rnd.randrange(len(in_flight)))
        done, error, posts = box.answered(transfer_id, "", "")
        assert not (done and transfer_id in settled), "a forgotten transfer settled again"
        if done:
            answered.add(transfer_id)
        carry_out(posts)
        assert box.window.messages <= 8
    assert kept <= answered  # a kept transfer settles on its last answer
    assert answered == set(range(len(transfers))) - settled
    assert (box.window.messages, box.window.nbytes) == (0, 0)  # every share came back


@given(
    st.floats(0.5, 30),
    st.lists(st.tuples(st.sampled_from(["start", "settle", "time", "early"]), st.integers(0, 1000)), max_size=80),
)
def test_deadlines_expire_in_start_order_never_for_settled_ids_with_one_timer(timeout, events):
    """A fake driver keeps its transfers in flight in start order and one timer, armed when
    the book says so: every transfer not settled expires once, in start order, no sooner than
    its deadline (a timer that goes off a little early expires what was due by its time), and
    the timer is never later than the oldest deadline plus the book's slack (2 % of the
    timeout, at most 50 ms)."""
    from omni_async.transport.protocol import Deadlines

    book = Deadlines(timeout)
    now, timer, next_id = 0.0, None, 0
    live: dict[int, float] = {}  # the driver's book: started, neither settled nor expired: id -> start
    settled, expired = set(), []

    def fire(at):
        nonlocal timer
        ids, due = book.fired(at, iter(list(live.items())))
        cutoff = max(at, timer)
        assert ids == [i for i, started in live.items() if started + timeout <= cutoff]
        for i in ids:
            del live[i]
        expired.extend(ids)
        timer = due

    for kind, value in events:
        if kind == "start":
            due = book.start(now)
            assert (due is None) == (timer is not None)  # one timer: armed only when none is
            timer = due if due is not None else timer
            live[next_id] = now
            next_id += 1
        elif kind == "settle":
            if live:
                transfer_id = sorted(live)[value % len(live)]
                del live[transfer_id]
                settled.add(transfer_id)
        else:
            now += value / 300 * timeout
            while timer is not None and timer <= now:
                fire(timer - 1e-3 if kind == "early" else now)
        assert book.slack == min(timeout * 0.02, 0.05)
        if live:
            assert timer is not None and timer <= min(live.values()) + timeout + book.slack
    while timer is not None:  # time runs on: everything left expires
        now = max(now, timer)
        fire(now)
    assert expired == [i for i in range(next_id) if i not in settled]
    assert not live and book.fired(now + 2 * timeout, iter([])) == ([], None)


@given(st.lists(st.sampled_from(["leave", "goodbye", "busy", "idle", "announce", "arrive", "expire"]), max_size=40))
def test_drain_releases_the_lane_exactly_when_its_conditions_hold(events):
    """The lane may be released once this side left, the peer's Goodbye came, nothing is in
    flight and no announced payload is still to come; or when its time is up.  Exactly once."""
    from omni_async.transport.protocol import Drain

    inbox = Inbox(max_bytes=1 << 20)
    drain = Drain(inbox)
    leaving = peer_left = released = False
    in_flight, seq, expected, releases = 0, 0, [], 0
    for event in events:
        if event == "leave" and not leaving:  # the driver leaves once (remove_peer)
            drain.leave()
            leaving = True
        elif event == "goodbye":
            first = drain.goodbye()
            assert first == (not leaving)
            peer_left = True
            if first:  # the peer left first: the driver leaves too
                drain.leave()
                leaving = True
        elif event == "busy":
            in_flight += 1
        elif event == "idle":
            in_flight = 0
        elif event == "announce":
            assert inbox.expect(seq, 1, seq) is None
            expected.append(seq)
            seq += 1
        elif event == "arrive" and expected:
            arrived = expected.pop(0)
            assert inbox.arrived(arrived, 1, ("msg", arrived)) == (("msg", arrived), arrived)
        elif event == "expire":
            assert drain.expire() == (not released)
            releases += not released
            released = True
            continue
        may = leaving and peer_left and in_flight == 0 and not expected and not released
        assert drain.progress(in_flight) == may
        releases += may
        released = released or may
        assert drain.released == released and drain.leaving == leaving and drain.peer_left == peer_left
    assert releases == int(released)
    drain.expire()  # its time is up, if it had not drained
    assert drain.released and not drain.progress(0) and not drain.expire()  # released once only
