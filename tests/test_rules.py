"""The sans-I/O core without sockets: the handshake and pair rules, a control plane's triage of
arriving hellos, the peer-session state machine, and the :class:`Transfer` handle."""

import asyncio
import itertools

import pytest

from omni_async.errors import (
    AlreadyConnected,
    FingerprintMismatch,
    HandshakeRejected,
    LayoutMismatch,
    PeerLost,
    TransferCancelled,
    VersionMismatch,
)
from omni_async.handshake import (
    Connection,
    LocalIdentity,
    PeerInfo,
    admit,
    check_peer,
    hello_refusal,
    keeps_dial_of,
    reject_for,
    rejection_error,
)
from omni_async.session import NEXT, PeerSession
from omni_async.transport.transfer import State, Transfer
from omni_async.wire import PROTOCOL_VERSION, Hello, Reject

LOCAL = LocalIdentity(peer_id="m", base_addr=4096, num_blocks=8, block_len=4096, fingerprint="f1", nonce=7)


def hello(peer_id="p", **overrides):
    return Hello(**{"version": PROTOCOL_VERSION, "peer_id": peer_id, "nonce": 5, "agent_metadata": b"lane",
                    "base_addr": 0, "num_blocks": 4, "block_len": 4096, "fingerprint": "f1", **overrides})


# -- handshake rules --------------------------------------------------------------------------
def test_identity_describes_itself_in_hello_and_welcome():
    sent = LOCAL.hello(b"addr")
    assert (sent.peer_id, sent.nonce, sent.agent_metadata, sent.block_len) == ("m", 7, b"addr", 4096)
    assert PeerInfo.from_hello(LOCAL.welcome(b"addr")).nonce == 7
    assert LocalIdentity("x", 0, 1, 1, "").nonce > 0  # a fresh incarnation draws its nonce


@pytest.mark.parametrize(("overrides", "error", "words"), [
    ({"version": PROTOCOL_VERSION + 1}, VersionMismatch, "protocol version"),
    ({"peer_id": "m"}, HandshakeRejected, "own id"),
    ({"block_len": 8192}, LayoutMismatch, "block_len 8192"),
    ({"fingerprint": "f2"}, FingerprintMismatch, "fingerprint f2"),
])
def test_check_peer_names_the_rule_a_hello_breaks(overrides, error, words):
    with pytest.raises(error, match=words):
        check_peer(LOCAL, hello(**overrides))


def test_check_peer_accepts_a_compatible_hello():
    check_peer(LOCAL, hello())  # other region size, same block_len and fingerprint
    check_peer(LOCAL, hello(fingerprint=""))  # an empty fingerprint is compatible with any


def test_a_rejection_round_trips_to_the_same_error_type():
    for error in (FingerprintMismatch("x"), AlreadyConnected("y"), HandshakeRejected("z")):
        back = rejection_error(reject_for(error))
        assert type(back) is type(error) and str(back) == str(error)
    assert type(rejection_error(Reject(code="not_a_code", reason="r"))) is HandshakeRejected
    assert type(rejection_error(Reject(code="peer_lost", reason="r"))) is HandshakeRejected  # not a refusal


# -- the pair rules ---------------------------------------------------------------------------
def test_the_tie_break_keeps_the_smaller_ids_dial_on_both_sides():
    assert keeps_dial_of("a", "b") == keeps_dial_of("b", "a") == "a"


def test_first_handshake_joins_and_a_new_incarnation_restarts():
    assert admit("m", None, Connection(5, "p"), "p") == "join"
    assert admit("m", Connection(5, "p"), Connection(6, "p"), "p") == "restart"
    assert admit("m", Connection(5, "m"), Connection(6, "p"), "p") == "restart"


def test_a_repeated_connect_from_the_same_side_is_refused():
    for dialler in ("m", "p"):
        with pytest.raises(AlreadyConnected, match="already connected"):
            admit("m", Connection(5, dialler), Connection(5, dialler), "p")


@pytest.mark.parametrize(("local", "remote"), [("a", "b"), ("b", "a")])
def test_crossing_handshakes_resolve_the_same_way_on_both_sides(local, remote):
    """Each side sees the two connections in either order; both keep the one dialled by the
    smaller id, whichever joined first."""
    nonce = {local: 1, remote: 2}  # the nonce of the far side's incarnation, as each side sees it
    small = min(local, remote)
    for side, other in ((local, remote), (remote, local)):
        mine, theirs = Connection(nonce[other], side), Connection(nonce[other], other)
        winner, loser = (mine, theirs) if side == small else (theirs, mine)
        assert admit(side, loser, winner, other) == "replace"  # the winner takes over
        with pytest.raises(AlreadyConnected, match=f"dialled by '{small}' joins"):
            admit(side, winner, loser, other)


def test_every_outcome_of_two_crossing_handshakes_leaves_one_connection():
    """Replay every interleaving of two crossing handshakes' commits on both sides: whatever
    order, both sides end on the same connection, the smaller id's dial."""
    for local, remote in (("a", "b"), ("b", "a")):
        dials = {local: Connection(2, local), remote: Connection(1, remote)}  # each side's own dial
        ends = set()
        for side, other in ((local, remote), (remote, local)):
            seen = {Connection(1 if side == local else 2, d.dialled_by) for d in dials.values()}
            for order in itertools.permutations(seen):
                current = None
                for conn in order:
                    try:
                        verdict = admit(side, current, conn, other)
                    except AlreadyConnected:
                        continue
                    assert verdict in ("join", "replace")
                    current = conn
                assert current is not None
                ends.add(current.dialled_by)
        assert ends == {min(local, remote)}


# -- hellos refused on arrival ----------------------------------------------------------------
def test_hello_triage():
    free = {"admitting": False, "queued": False, "joined": False, "in_use": 0, "max_peers": 2}
    assert hello_refusal("p", **free) is None
    assert isinstance(hello_refusal("p", **{**free, "queued": True, "admitting": True}), AlreadyConnected)
    full = {**free, "in_use": 2}
    assert "peer limit of 2" in str(hello_refusal("p", **full))
    # A known id is never refused for the limit: it restarts, or waits for its admission.
    assert hello_refusal("p", **{**full, "joined": True}) is None
    assert hello_refusal("p", **{**full, "admitting": True}) is None


# -- the peer session -------------------------------------------------------------------------
def test_a_session_moves_only_forward_and_reports_each_move():
    session = PeerSession("p")
    assert session.phase == "admitting" and session.current() is None
    joined = session.move("joined")
    assert (joined.peer_id, joined.old, joined.new, joined.error) == ("p", "admitting", "joined", None)
    with pytest.raises(ValueError, match="cannot go from joined to admitting"):
        session.move("admitting")
    error = PeerLost("bye")
    assert session.move("leaving", error).error is error
    assert session.move("gone").old == "leaving"
    assert session.connection is None
    assert session.move("admitting").new == "admitting"  # starts over for a new handshake


def test_every_phase_can_reach_gone():
    def reachable(phase, seen):
        for nxt in NEXT[phase] - seen:
            seen.add(nxt)
            reachable(nxt, seen)
        return seen
    assert all("gone" in reachable(phase, set()) for phase in NEXT if phase != "gone")


# -- the Transfer handle ----------------------------------------------------------------------
async def test_a_transfer_settles_once_and_awaiters_see_the_outcome():
    done, failed = Transfer(1, "p", 10), Transfer(2, "p", 10)
    called = []
    done.add_done_callback(called.append)
    waiter = asyncio.ensure_future(asyncio.wait_for(_await(done), 5))
    await asyncio.sleep(0)
    assert not waiter.done() and done.state is State.PENDING
    done.set_done()
    done.set_failed(PeerLost("late"))  # settled already: ignored
    await waiter
    assert done.done() and done.error() is None and called == [done]
    failed.set_failed(PeerLost("gone"))
    failed.set_done()
    with pytest.raises(PeerLost, match="gone"):
        await failed
    late = []
    failed.add_done_callback(late.append)  # settled: called at once
    assert late == [failed] and "failed" in repr(failed)


async def _await(transfer):
    await transfer


async def test_cancelling_one_awaiter_leaves_the_transfer_and_its_other_awaiters():
    """Each ``await`` has its own future: a cancelled (or timed-out) awaiter neither settles
    the transfer nor disturbs another awaiter, which still gets the outcome; the transfer
    keeps no future of a cancelled awaiter."""
    transfer = Transfer(1, "p", 10)
    first = asyncio.ensure_future(_await(transfer))
    second = asyncio.ensure_future(_await(transfer))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_await(transfer), 0.01)
    assert transfer.state is State.PENDING and not second.done() and transfer.waiters == 1
    transfer.set_failed(PeerLost("gone"))
    with pytest.raises(PeerLost, match="gone"):
        await asyncio.wait_for(second, 5)
    assert transfer.waiters == 0


async def test_an_awaiter_that_took_the_answer_itself_goes_on_without_a_loop_turn_only_when_told():
    """``answer_in_awaiter``: the first await calls the hook once while pending; a hook that
    settled the transfer and returns True lets the await return without suspending (a
    callback queued before it has not run), False makes it wait as any other (a loop turn),
    a failure is raised either way, and a transfer settled before its await never calls it."""
    loop = asyncio.get_running_loop()
    ran: list[str] = []
    calls: list[int] = []

    def settle_and(go_on: bool, error: PeerLost | None = None):
        def hook(transfer: Transfer) -> bool:
            calls.append(transfer.id)
            transfer.set_failed(error) if error else transfer.set_done()
            return go_on
        return hook

    quick = Transfer(1, "p", 1)
    quick.answer_in_awaiter(settle_and(True))
    loop.call_soon(ran.append, "turn")
    await quick
    assert ran == [] and calls == [1] and quick.state is State.DONE
    await quick  # the hook was used up: a settled transfer's await gives the loop its turn
    assert ran == ["turn"] and calls == [1]

    slow = Transfer(2, "p", 1)
    slow.answer_in_awaiter(settle_and(False))
    loop.call_soon(ran.append, "turn 2")
    await slow
    assert ran == ["turn", "turn 2"] and calls == [1, 2]

    lost = Transfer(3, "p", 1)
    lost.answer_in_awaiter(settle_and(True, PeerLost("gone")))
    with pytest.raises(PeerLost, match="gone"):
        await lost

    unanswered = Transfer(4, "p", 1)  # the hook found no answer: the await waits for it
    unanswered.answer_in_awaiter(lambda transfer: calls.append(transfer.id) or False)
    waiter = asyncio.ensure_future(_await(unanswered))
    await asyncio.sleep(0)
    assert not waiter.done() and unanswered.waiters == 1
    unanswered.set_done()
    await asyncio.wait_for(waiter, 5)

    early = Transfer(5, "p", 1)
    early.answer_in_awaiter(settle_and(True))
    early.set_done()  # settled by the loop first: the hook is dropped (it holds the transport)
    await early
    assert calls == [1, 2, 3, 4]
    late = Transfer(6, "p", 1)
    late.set_done()
    late.answer_in_awaiter(settle_and(True))  # settled already: not kept
    await late
    assert calls == [1, 2, 3, 4]


def test_a_poller_takes_the_answer_through_the_same_hook_once():
    """``take_answer`` (a caller that polls): calls the hook once, returns whether settled;
    without a hook it only says whether settled."""
    calls: list[int] = []

    def hook(transfer: Transfer) -> bool:
        calls.append(transfer.id)
        if len(calls) == 1:
            transfer.set_done()
        return False  # (a poller ignores whether it may skip a loop turn)

    answered, unanswered = Transfer(1, "p", 1), Transfer(2, "p", 1)
    answered.answer_in_awaiter(hook)
    assert answered.take_answer() is True and answered.take_answer() is True and calls == [1]
    unanswered.answer_in_awaiter(hook)
    assert unanswered.take_answer() is False and unanswered.take_answer() is False and calls == [1, 2]
    assert Transfer(3, "p", 1).take_answer() is False


async def test_cancelling_a_transfer_immediately_or_after_the_data_plane_lets_go():
    asked = []

    def on_cancel(transfer, mode):
        asked.append(mode)
        return True  # the data plane still holds it

    now = Transfer(1, "p", 1, on_cancel)
    assert now.cancel("immediate") is False
    with pytest.raises(TransferCancelled):
        await now
    later = Transfer(2, "p", 1, on_cancel)
    assert later.cancel("wait") is True and later.state is State.DRAINING and not later.done()
    later.set_done()  # the receiver answered: still a cancelled transfer
    assert isinstance(later.error(), TransferCancelled) and asked == ["immediate", "wait"]
    lost = Transfer(3, "p", 1, on_cancel)
    lost.cancel("wait")
    lost.set_failed(PeerLost("x"))
    assert isinstance(lost.error(), TransferCancelled)
    assert lost.cancel() is False  # settled: left alone
    with pytest.raises(ValueError, match="cancel mode"):
        Transfer(4, "p", 1).cancel("soon")  # type: ignore[arg-type]
    assert Transfer(5, "p", 1).cancel("wait") is False  # no data plane to wait for
