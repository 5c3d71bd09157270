"""Receiver notices of block writes: the book's rules (no I/O), then real agents on both lanes
(same-host copy and UCX), a raw peer that gives up or vanishes, and kill -9 of either process."""

import asyncio
import json
import signal
import time

import numpy as np
import pytest

from omni_async import (
    DeadlineExceeded,
    InvalidBlocks,
    InvalidNotice,
    Notice,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferCancelled,
)
from omni_async.transport.lane import RNDV_THRESH_SHM
from omni_async.transport.notices import NoticeBook, NoticeQueue
from omni_async.transport.sink_tasks import SinkTasks
from omni_async.wire import (
    HEADER_TAG,
    MAX_HEADER_BYTES,
    MAX_NOTICE_RUNS,
    MAX_PENDING_PAYLOADS,
    RUNS_PER_REQUEST,
    Abort,
    Commit,
    WriteRequest,
    encode_header,
)

from .conftest import FAST
from .helpers.peer import random_rows
from .helpers.rogue import Rogue

pytestmark = pytest.mark.timeout(60)
LANES = [pytest.param(True, id="same-host"), pytest.param(False, id="ucx")]


# -- the book, no I/O ---------------------------------------------------------------------
def test_book_notifies_in_write_order_and_holds_only_the_completing_ack():
    book: NoticeBook[str] = NoticeBook("p", 8)
    book.seen(1, 0, 1, [(0, 2)], b"one")
    book.seen(2, 0, 2, [(5, 1)], b"two")
    book.seen(2, 1, 2, [(9, 2)], b"two")
    assert book.done(2, None, "ack2a") == (False, [])  # part 0 of 2: its ack goes out now
    held, ready = book.done(2, None, "ack2b")
    assert held and ready == []  # complete, but write 1 comes first
    held, ready = book.done(1, None, "ack1")
    assert held
    assert ready == [(Notice("p", (0, 1), b"one"), ["ack1"]), (Notice("p", (5, 9, 10), b"two"), ["ack2b"])]
    assert len(book) == 0


def test_book_abort_fails_with_the_rows_seen_once_they_are_in():
    book: NoticeBook[str] = NoticeBook("p", 8)
    book.seen(1, 0, 3, [(4, 2)], b"x")
    assert book.aborted(1, TransferCancelled("gone")) == []  # part 0 still landing
    held, ready = book.done(1, None, "ack")
    assert held and len(ready) == 1
    notice, acks = ready[0]
    assert notice.remote_idxs == (4, 5) and isinstance(notice.failed, TransferCancelled) and acks == ["ack"]
    assert book.aborted(1, TransferCancelled("again")) == []  # unknown now: nothing twice


def test_book_lost_fails_everything_pending_in_order_and_bounds_hold():
    book: NoticeBook[str] = NoticeBook("p", 2)
    book.seen(7, 0, 1, [(1, 1)], b"a")
    book.seen(8, 0, 2, [(2, 1)], b"b")
    with pytest.raises(ProtocolError):
        book.seen(9, 0, 1, [(3, 1)], b"c")  # over the bound
    with pytest.raises(ProtocolError):
        book.seen(8, 1, 2, [(3, 1)], b"other data")  # contradicts part 0
    with pytest.raises(ProtocolError):
        book.seen(10, 2, 2, [(3, 1)], b"c")
    lost = book.lost(PeerLost("bye"))
    assert [(n.remote_idxs, n.data, type(n.failed)) for n in lost] == [((1,), b"a", PeerLost), ((2,), b"b", PeerLost)]
    assert len(book) == 0


def test_book_bounds_the_runs_and_parts_it_keeps():
    """A write has at most MAX_NOTICE_RUNS parts and runs, a peer's book at most ``max_runs``
    runs (a part counts at least one); the runs of notified or lost writes are given back."""
    book: NoticeBook[str] = NoticeBook("p", 8, max_runs=4)
    with pytest.raises(ProtocolError):
        book.seen(1, 0, MAX_NOTICE_RUNS + 1, [(0, 1)], b"a")
    book.seen(1, 0, 2, [(0, 1), (2, 1)], b"a")
    book.seen(2, 0, 1, [], b"b")  # a refused part counts one
    with pytest.raises(ProtocolError):
        book.seen(1, 1, 2, [(4, 1), (6, 1)], b"a")  # 5 runs > 4
    assert book.runs == 3
    book.seen(1, 1, 2, [(4, 1)], b"a")
    book.done(1, None, "a0")
    book.done(1, None, "a1")
    assert book.runs == 1  # write 1 notified
    book.lost(PeerLost("bye"))
    assert book.runs == 0
    big = NoticeBook[str]("p", 8)
    big.seen(3, 0, 2, [(0, 1)] * (MAX_NOTICE_RUNS - 1), b"c")
    with pytest.raises(ProtocolError):
        big.seen(3, 1, 2, [(0, 1)] * 2, b"c")  # the write over MAX_NOTICE_RUNS


async def test_a_write_with_a_notice_of_too_many_runs_fails_locally(make_agent):
    a, b = await pair(make_agent, False)
    many = [0] * (MAX_NOTICE_RUNS + 1)  # one row, again and again: a run each
    with pytest.raises(InvalidBlocks, match="runs exceeds"):
        a.write_blocks("b", many, many, notice=b"n")
    assert a.transport.in_flight() == [] and "a" in b.peers


async def test_queue_full_holds_releases_in_order_and_drops_nothing():
    handed = []
    queue = NoticeQueue(2, SinkTasks(), lambda: handed.append(len(queue)))
    released = []
    for i in range(5):
        queue.offer(Notice("p", (i,), b"%d" % i), lambda i=i: released.append(i))
    assert released == [0, 1] and len(queue) == 2 and queue.waiting == 3
    assert handed == [1, 2]  # each notice queued woke the readers (a hand-off); those waiting did not
    got = []
    async for notice in queue:
        got.append(notice.remote_idxs[0])
        if len(got) == 5:
            break
    assert got == [0, 1, 2, 3, 4] and released == [0, 1, 2, 3, 4]


def test_worst_case_write_request_with_a_notice_fits_a_header():
    big = (1 << 63) - 1
    req = WriteRequest(big, big, [(big, big)] * RUNS_PER_REQUEST, False, True, b"\xff" * 4096, big, big)
    assert len(encode_header(req)) <= MAX_HEADER_BYTES


# -- two agents, both lanes -----------------------------------------------------------------
def fill(agent, seed=1):
    agent.region.array[:] = np.random.default_rng(seed).integers(0, 256, agent.region.array.shape, dtype=np.uint8)


async def take_notices(agent, count, timeout=5.0):
    """The next ``count`` notices the agent's application gets, within ``timeout`` seconds."""
    got = []
    async with asyncio.timeout(timeout):
        async for notice in agent.notices():
            got.append(notice)
            if len(got) == count:
                return got
    raise AssertionError(f"the notice stream ended after {len(got)} of {count}")


async def pair(make_agent, same_host, rx=None, tx=None):
    a = await make_agent(peer_id="a", same_host_lane=same_host, **(tx or {}))
    b = await make_agent(peer_id="b", same_host_lane=same_host, **(rx or {}))
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await asyncio.wait_for(b.wait_for_peer("a"), 5)
    assert a.transport.peer("b").max_notice_bytes == b.config.max_notice_bytes  # announced
    return a, b


@pytest.mark.parametrize("same_host", LANES)
async def test_notice_is_queued_with_the_rows_in_place_before_the_sender_returns(make_agent, same_host):
    a, b = await pair(make_agent, same_host)
    fill(a)
    local, remote = [5, 6, 7, 30, 2], [10, 11, 12, 1, 40]
    seen = []
    b.set_notice_sink(lambda n: seen.append((n, b.region.array[list(n.remote_idxs)].copy())))
    await asyncio.wait_for(a.write_blocks("b", local, remote, notice=b"req-1"), 5)
    assert len(seen) == 1  # before the await returned, with every row in place
    notice, rows = seen[0]
    assert notice == Notice("a", tuple(remote), b"req-1")
    assert np.array_equal(rows, a.region.array[local])
    await asyncio.wait_for(a.write_blocks("b", [0], [0]), 5)  # no notice asked: none given
    assert len(seen) == 1


@pytest.mark.parametrize("same_host", LANES)
async def test_notices_come_in_write_order_and_split_writes_yield_one(make_agent, same_host):
    a, b = await pair(make_agent, same_host, rx={"max_write_blocks": 4})
    fill(a)
    writes = [a.write_blocks("b", list(range(20)), list(range(63, 43, -1)), notice=b"split")]
    writes += [a.write_blocks("b", [i], [i], notice=b"%d" % i) for i in range(40)]
    await asyncio.wait_for(asyncio.gather(*writes), 10)
    got = await take_notices(b, 41)
    assert got[0] == Notice("a", tuple(range(63, 43, -1)), b"split")  # one notice, every row, in order
    assert [n.data for n in got[1:]] == [b"%d" % i for i in range(40)]
    assert b.transport.notices.get_nowait() is None  # nothing more, nothing twice


async def test_notices_come_in_write_order_when_a_header_goes_by_rendezvous(make_agent):
    """Over UCX shared memory a header of 8 KiB or more (a write of 2,000 scattered runs) goes
    by rendezvous: its receive completes after those of the small headers that arrived behind
    it.  Headers are handled in arrival order all the same: notices come in write order."""
    blocks = {"num_blocks": 8192, "block_len": 64}
    a, b = await pair(make_agent, False, rx=blocks, tx=blocks)
    fill(a)
    scattered = list(range(0, 4000, 2))
    header = encode_header(WriteRequest(1, 0, [(row, 1) for row in scattered], notice=b"big0"))
    assert len(header) >= RNDV_THRESH_SHM  # by rendezvous: both agents are on this host, over shared memory
    writes = []
    for i in range(4):
        writes.append(a.write_blocks("b", scattered, scattered, notice=b"big%d" % i))
        writes.append(a.write_blocks("b", [4001 + i], [4001 + i], notice=b"small%d" % i))
    await asyncio.wait_for(asyncio.gather(*writes), 10)
    got = await take_notices(b, 8)
    assert [n.data for n in got] == [b"%s%d" % (kind, i) for i in range(4) for kind in (b"big", b"small")]
    assert not any(n.failed for n in got)
    assert np.array_equal(b.region.array[scattered], a.region.array[scattered])


async def test_intents_wait_behind_noticed_headers_sent_over_ucx(make_agent):
    """With no room in the ring, a same-host write with a notice travels over UCX; the
    intents of the writes after it wait until it is answered (a ring record would overtake
    it): the notices still come in write order."""
    a, b = await pair(make_agent, True)
    fill(a)
    link = a.transport.links["b"]
    ring = link.ring_out
    assert ring is not None and link.direct is not None
    put = ring.send
    ring.send = lambda kind, parts, answered=None: False  # type: ignore[method-assign]  # fault injection: "full"
    writes = [a.write_blocks("b", [i], [63 - i], notice=b"%d" % i) for i in range(20)]
    ring.send = put  # type: ignore[method-assign]
    writes += [a.write_blocks("b", [i], [63 - i], notice=b"%d" % i) for i in range(20, 40)]
    assert link.lane_noticed == {writes[0].id}  # the first went over UCX; it is not answered yet
    assert len(link.held) == 39  # every later one waits (behind it, and in order)
    await asyncio.wait_for(asyncio.gather(*writes), 10)
    assert not link.held and not link.lane_noticed
    got = await take_notices(b, 40)
    assert [n.data for n in got] == [b"%d" % i for i in range(40)] and not any(n.failed for n in got)
    assert np.array_equal(b.region.array[63:23:-1], a.region.array[:40])


async def test_removing_a_peer_first_takes_the_intents_in_its_ring(make_agent):
    """A peer removed before this side read its ring (as when it is lost right after it
    wrote there) still counts what it put there: its intent yields a failed notice."""
    a, b = await pair(make_agent, True)
    write = a.write_blocks("b", [1, 2], [3, 4], notice=b"last")  # intent, copy, commit: all in b's ring
    assert await b.remove_peer("a")  # (nothing yields to the loop in between: b has not read its ring)
    notice = b.transport.notices.get_nowait()
    assert notice is not None and (notice.remote_idxs, notice.data) == ((3, 4), b"last")
    assert isinstance(notice.failed, PeerLost)  # not acknowledged: the sender does not count it done either
    assert b.transport.notices.get_nowait() is None
    with pytest.raises(PeerLost):
        await asyncio.wait_for(write, 5)


@pytest.mark.parametrize("same_host", LANES)
async def test_full_queue_holds_the_senders_writes_until_read(make_agent, same_host):
    a, b = await pair(make_agent, same_host, rx={"notice_queue": 2})
    writes = [a.write_blocks("b", [i], [i], notice=b"%d" % i) for i in range(6)]
    await asyncio.wait_for(asyncio.gather(*writes[:2]), 5)
    await asyncio.sleep(0.3)
    assert not any(w.done() for w in writes[2:])  # back-pressure: unacknowledged
    assert len(b.transport.notices) == 2 and b.transport.notices.waiting == 4
    got = await take_notices(b, 6)
    await asyncio.wait_for(asyncio.gather(*writes), 5)
    assert [n.data for n in got] == [b"%d" % i for i in range(6)]


async def test_notice_over_the_receivers_limit_fails_locally_and_keeps_the_peer(make_agent):
    a, b = await pair(make_agent, False, rx={"max_notice_bytes": 16})
    with pytest.raises(InvalidNotice):
        a.write_blocks("b", [0], [0], notice=b"x" * 17)
    with pytest.raises(TypeError):
        a.write_blocks("b", [0], [0], notice="text")  # type: ignore[arg-type]
    assert a.transport.in_flight() == []
    await asyncio.wait_for(a.write_blocks("b", [0], [0], notice=b"x" * 16), 5)
    c = await make_agent(peer_id="c", max_notice_bytes=0)
    await asyncio.wait_for(a.connect(c.control_address), 5)
    with pytest.raises(InvalidNotice, match="takes no notices"):
        a.write_blocks("c", [0], [0], notice=b"")


@pytest.mark.parametrize("same_host", LANES)
async def test_cancelled_or_expired_write_yields_exactly_one_notice(make_agent, same_host):
    """Given up right after it was posted, a write may still land: the receiver gets exactly
    one notice for it, a success or a failure naming the reason, never none or two."""
    a, b = await pair(make_agent, same_host, rx={"notice_queue": 1})
    rows = list(range(64))
    cancelled = a.write_blocks("b", rows, rows, notice=b"cancel")
    a.cancel([cancelled.id])
    with pytest.raises(TransferCancelled):
        await cancelled
    got = await take_notices(b, 1)
    assert got[0].data == b"cancel" and (got[0].failed is None or isinstance(got[0].failed, TransferCancelled))
    await asyncio.sleep(0.2)
    assert b.transport.notices.get_nowait() is None


async def test_abort_after_part_of_a_write_yields_a_failed_notice_with_its_rows(make_agent):
    b = await make_agent(peer_id="b")
    async with Rogue.join(b.control_address) as rogue:
        await asyncio.wait_for(b.wait_for_peer("rogue"), 5)
        rogue.send(encode_header(WriteRequest(9, 0, [(3, 2)], placed=True, notice=b"n", part=0, parts=2)), HEADER_TAG)
        rogue.send(encode_header(Abort(9, DeadlineExceeded.code, "too slow")), HEADER_TAG)
        async with asyncio.timeout(5):
            notice = await anext(b.notices())
        assert notice.remote_idxs == (3, 4) and notice.data == b"n"
        assert isinstance(notice.failed, DeadlineExceeded) and "too slow" in str(notice.failed)
        # a write the rogue leaves unfinished fails with PeerLost once it is gone
        rogue.send(encode_header(WriteRequest(10, 0, [(7, 1)], placed=True, notice=b"m", part=0, parts=2)), HEADER_TAG)
        await asyncio.sleep(0.2)
    started = time.monotonic()
    async with asyncio.timeout(5):
        notice = await anext(b.notices())
    assert notice.remote_idxs == (7,) and isinstance(notice.failed, PeerLost)
    assert time.monotonic() - started < FAST["heartbeat_timeout"] + 1.0


async def test_an_abort_behind_its_writes_rendezvous_header_fails_that_write_only(make_agent):
    """A write with a notice split in two requests (the receiver's ``max_write_blocks``), whose
    first header goes by rendezvous (~10 KiB), is cancelled while its second waits for the
    sender's window (held by the receiver's slow message sink): its ``Abort``, small and eager,
    arrives right behind the first header and is handled after it.  The write yields one
    failed notice with the rows of its first part, and the peer's later writes with notices
    are notified and acknowledged (an ``Abort`` handled first was ignored as unknown, and every
    later notice of the peer waited behind the write for good)."""
    tx = {"num_blocks": 8192, "block_len": 64, "heartbeat_timeout": 30.0}
    a, b = await pair(make_agent, False, rx={**tx, "max_write_blocks": 2000}, tx=tx)
    loop = asyncio.get_running_loop()
    held: list[asyncio.Future[None]] = []

    def slow_sink(_peer, _key, _meta, _frames):
        held.append(loop.create_future())
        return held[-1]  # acknowledged when it completes: the sender's window stays taken

    b.set_message_sink(slow_sink)
    frame = np.zeros(1, np.uint8)
    messages = [a.send_message("b", f"k{i}", b"", [frame]) for i in range(MAX_PENDING_PAYLOADS - 1)]
    async with asyncio.timeout(30):
        while len(held) < len(messages):
            await asyncio.sleep(0.05)
    rows = list(range(0, 8000, 2))  # 4,000 scattered blocks: two requests of 2,000 runs
    split = a.write_blocks("b", rows, rows, notice=b"split")
    split.cancel("immediate")  # part 0 is on the wire, part 1 waits for the window
    with pytest.raises(TransferCancelled):
        await split
    for future in held:
        future.set_result(None)  # the reader catches up: the window frees
    await asyncio.wait_for(asyncio.gather(*messages), 10)
    await asyncio.wait_for(a.write_blocks("b", [8001], [8001], notice=b"later"), 5)
    failed, later = await take_notices(b, 2)
    assert failed.data == b"split" and isinstance(failed.failed, TransferCancelled)
    assert failed.remote_idxs == tuple(rows[:2000])
    assert later == Notice("a", (8001,), b"later")


async def test_intent_is_answered_on_its_commit_and_stray_commits_drop_the_peer(make_agent):
    """A placed request with a notice is an intent: nothing is notified (or acknowledged)
    before its Commit; a commit that follows no intent, or commits one twice, is a
    protocol violation (the peer is dropped, nothing is notified for it)."""
    b = await make_agent(peer_id="b")
    async with Rogue.join(b.control_address) as rogue:
        await asyncio.wait_for(b.wait_for_peer("rogue"), 5)
        rogue.send(encode_header(WriteRequest(4, 0, [(5, 3)], placed=True, notice=b"i")), HEADER_TAG)
        await asyncio.sleep(0.2)
        assert b.transport.notices.get_nowait() is None  # announced, not copied yet
        rogue.send(encode_header(Commit(4)), HEADER_TAG)
        async with asyncio.timeout(5):
            notice = await anext(b.notices())
        assert notice == Notice("rogue", (5, 6, 7), b"i")
        rogue.send(encode_header(Commit(4)), HEADER_TAG)  # once more: no intent left
        async with asyncio.timeout(5):
            while "rogue" in b.peers:
                await asyncio.sleep(0.02)
    for stray in (Commit(77), Commit(8, part=1)):  # an unknown write; a part never announced
        async with Rogue.join(b.control_address) as rogue:
            await asyncio.wait_for(b.wait_for_peer("rogue"), 5)
            rogue.send(encode_header(WriteRequest(8, 0, [(1, 1)], placed=True, notice=b"j", parts=2)), HEADER_TAG)
            rogue.send(encode_header(stray), HEADER_TAG)
            async with asyncio.timeout(5):
                while "rogue" in b.peers:
                    await asyncio.sleep(0.02)
        async with asyncio.timeout(5):
            notice = await anext(b.notices())  # the announced rows fail with the peer, saying why
        assert notice.remote_idxs == (1,) and isinstance(notice.failed, ProtocolError)
    assert b.transport.notices.get_nowait() is None


async def test_a_second_intent_of_a_part_before_its_commit_drops_the_peer(make_agent):
    """An announced write without a notice (``intent``) is answered on its commit; a second
    intent for the same write and part while the first awaits its commit is a protocol
    violation (it would take the first one's answer)."""
    b = await make_agent(peer_id="b")
    async with Rogue.join(b.control_address) as rogue:
        await asyncio.wait_for(b.wait_for_peer("rogue"), 5)
        rogue.send(encode_header(WriteRequest(4, 0, [(5, 3)], placed=True, intent=True)), HEADER_TAG)
        async with asyncio.timeout(5):
            while not b.transport.links["rogue"].intents:
                await asyncio.sleep(0.01)
        rogue.send(encode_header(Commit(4)), HEADER_TAG)
        async with asyncio.timeout(5):
            while b.transport.links["rogue"].intents:
                await asyncio.sleep(0.01)
        rogue.send(encode_header(WriteRequest(5, 0, [(5, 3)], placed=True, intent=True)), HEADER_TAG)
        rogue.send(encode_header(WriteRequest(5, 0, [(9, 1)], placed=True, intent=True)), HEADER_TAG)
        async with asyncio.timeout(5):
            while "rogue" in b.peers:
                await asyncio.sleep(0.02)


async def test_notice_over_the_announced_limit_is_a_protocol_violation(make_agent):
    b = await make_agent(peer_id="b", max_notice_bytes=4)
    async with Rogue.join(b.control_address) as rogue:
        await asyncio.wait_for(b.wait_for_peer("rogue"), 5)
        rogue.send(encode_header(WriteRequest(1, 0, [(0, 1)], placed=True, notice=b"12345")), HEADER_TAG)
        async with asyncio.timeout(5):
            while "rogue" in b.peers:
                await asyncio.sleep(0.02)
    assert b.transport.notices.get_nowait() is None


# -- two processes, kill -9 ---------------------------------------------------------------
NUM_BLOCKS, BLOCK_LEN = 64, 64 * 1024


@pytest.mark.timeout(90)
@pytest.mark.parametrize("same_host", LANES)
async def test_sender_killed_every_seen_write_notified_exactly_once(make_agent, spawn_peer, tmp_path, same_host):
    b = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="rx", same_host_lane=same_host)
    got: list[Notice] = []
    b.set_notice_sink(got.append)
    sender = await spawn_peer("notify", str(tmp_path / "tx"), NUM_BLOCKS, BLOCK_LEN,
                              {"peer_id": "tx", "same_host_lane": same_host}, b.control_address)
    async with asyncio.timeout(20):
        while len(got) < 20:
            await asyncio.sleep(0.01)
    sender.kill()
    killed = time.monotonic()
    async with asyncio.timeout(10):
        while "tx" in b.peers:
            await asyncio.sleep(0.01)
    assert time.monotonic() - killed < FAST["heartbeat_timeout"] + 2.0
    await asyncio.sleep(0.1)
    numbers = [int(n.data) for n in got]
    assert numbers == list(range(len(numbers)))  # every write seen, once, in order: none lost
    # One that failed for another reason is shown.  Seen twice under load: UCX failing the
    # payload receive of the write the kill cut ("Connection reset by remote peer"), reported
    # as TransferFailed until such a receive failure counted as the peer's loss.
    assert [n for n in got if n.failed is not None and not isinstance(n.failed, PeerLost)] == []
    assert all(n.remote_idxs == tuple(range(NUM_BLOCKS)) for n in got if n.failed is None)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("same_host", LANES)
async def test_receiver_restart_no_notice_lost_or_duplicated(make_agent, spawn_peer, tmp_path, same_host):
    path = str(tmp_path / "region.memfd")
    a = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx", same_host_lane=same_host)
    config = {"peer_id": "rx", "same_host_lane": same_host}
    acked: list[list[int]] = [[], []]
    for life in range(2):
        rx = await spawn_peer("notices", path, NUM_BLOCKS, BLOCK_LEN, config)
        await asyncio.wait_for(a.connect(rx.info["address"]), 10)
        base = life * 1000

        async def writer(k, rx=rx, base=base, life=life):
            for i in range(base + k, base + 1000, 4):
                try:
                    await a.write_blocks("rx", [i % NUM_BLOCKS], [i % NUM_BLOCKS], notice=b"%d" % i)
                except PeerLost:
                    return
                acked[life].append(i)

        tasks = [asyncio.create_task(writer(k)) for k in range(4)]
        if life == 0:
            await asyncio.sleep(0.5)
            rx.kill()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            await asyncio.wait_for(rx.proc.wait(), 10)
        else:
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert await rx.stop() == 0
        assert rx.proc.stdout is not None
        lines = [json.loads(line) for line in (await rx.proc.stdout.read()).splitlines()]
        numbers = [int(line["notice"]) for line in lines if "notice" in line and line["failed"] is None]
        assert len(numbers) == len(set(numbers))  # none twice
        assert set(acked[life]) <= set(numbers)  # every acknowledged write was notified in this life
        assert all(base <= n < base + 1000 for n in numbers)  # nothing of the other life
    assert len(acked[1]) == 1000 and acked[0]


@pytest.mark.timeout(60)
async def test_sender_killed_between_copy_and_commit_yields_one_failed_notice(make_agent, spawn_peer, tmp_path):
    """A same-host write with a notice announces itself in the receiver's ring before any byte
    is copied: a sender killed after the copy, before its commit, leaves changed rows that the
    receiver hears of, as one failed notice naming them, within the heartbeat timeout."""
    b = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="rx")
    got: list[Notice] = []
    b.set_notice_sink(got.append)
    sender = await spawn_peer("doomed", str(tmp_path / "tx.memfd"), NUM_BLOCKS, BLOCK_LEN, {"peer_id": "tx"},
                              b.control_address)
    assert sender.info["direct"] in ("memfd", "vm")  # the same-host copy is what this is about
    assert await asyncio.wait_for(sender.proc.wait(), 10) == -signal.SIGKILL
    died = time.monotonic()
    async with asyncio.timeout(FAST["heartbeat_timeout"] + 3.0):
        while not got:
            await asyncio.sleep(0.01)
    assert time.monotonic() - died < FAST["heartbeat_timeout"] + 1.0
    assert np.array_equal(b.region.array, random_rows(b.region.array.shape, 23))  # the copy did land
    notice = got[0]
    assert (notice.peer_id, notice.data, notice.remote_idxs) == ("tx", b"doomed", tuple(range(NUM_BLOCKS)))
    assert isinstance(notice.failed, PeerLost)
    await asyncio.sleep(0.3)
    assert len(got) == 1  # exactly once


async def test_a_payload_receive_ucx_fails_is_the_peers_loss(make_agent):
    """Fault injection on a real lane: UCX fails the receive of a write's payload (as when
    the sender dies mid-message: "Connection reset by remote peer").  The write's notice
    fails with PeerLost, as everything else the peer's death fails, not as a failure of this
    side (it read TransferFailed "receive failed: ..." before)."""
    a, b = await pair(make_agent, False)
    got: list[Notice] = []
    b.set_notice_sink(got.append)
    lane = b.transport.links["a"].lane
    receive = lane.recv_arrived_many

    def reset(buffers, message, done):
        receive(buffers, message, lambda _error: done(OSError("UCX: Connection reset by remote peer")))

    lane.recv_arrived_many = reset
    write = a.write_blocks("b", [1, 2], [3, 4], notice=b"cut")
    async with asyncio.timeout(5):
        while not got:
            await asyncio.sleep(0.01)
    assert isinstance(got[0].failed, PeerLost), got[0].failed
    with pytest.raises(PeerLost):
        await asyncio.wait_for(write, 5)


@pytest.mark.parametrize("sink", ["notice", "message"])
async def test_what_a_sink_still_awaits_is_cancelled_and_ended_when_the_agent_closes(make_agent, sink):
    """An async sink (notice or message) runs as a task of the agent's: ``close()`` cancels it
    and waits for its end.  It was a task nobody held: still pending after both agents closed
    (and destroyed pending, or cut off at the loop's end, whenever that came)."""
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b")
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await asyncio.wait_for(b.wait_for_peer("a"), 5)
    started, ended = asyncio.Event(), []

    async def forever(*_args: object) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(True)

    if sink == "notice":
        b.set_notice_sink(forever)
        transfer = a.write_blocks("b", [1], [1], notice=b"n")
    else:
        b.set_message_sink(forever)
        transfer = a.send_message("b", "key", b"", [np.zeros(8, np.uint8)])
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.wait_for(b.close(), 15)
    assert ended == [True]
    assert [t for t in asyncio.all_tasks() if "sink" in t.get_name() and not t.done()] == []
    await asyncio.wait_for(a.close(), 15)
    with pytest.raises(OmniAsyncError):
        await transfer
