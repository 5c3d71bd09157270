"""Same-host message rings: the sans-I/O ring codec (Hypothesis, no processes), the rings
between two agents, a hostile peer writing garbage into them, and kill -9 of either side in
real separate processes."""

import asyncio
import gc
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_async.errors import DeadlineExceeded, PeerLost, ProtocolError, TransferCancelled, TransferFailed
from omni_async.transport import samehost
from omni_async.transport.ring import HEADER_BYTES, WRAP, Consumer, Producer, RingError, max_payload, ring_size
from omni_async.transport.turns import SpinGate
from omni_async.wire import HEADER_TAG, Ack, Goodbye, MessageHeader, encode_header, encode_record

from .conftest import FAST
from .helpers.procfs import fd_targets
from .test_shared import dev_shm, mapped, open_fds_to

pytestmark = pytest.mark.timeout(90)

CAPACITY = 256
SMALL_RING = 1 << 18
"""The smallest ring a peer may offer (``wire.MIN_RING_CAPACITY``)."""


def ring(capacity=CAPACITY):
    buffer = memoryview(bytearray(ring_size(capacity)))
    return buffer, Producer(buffer), Consumer(buffer)


# -- the codec, without processes ---------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, max_payload(CAPACITY)), st.just(-1)), max_size=80))
def test_records_come_out_in_order_whole_across_wraparound(steps):
    """Puts (sizes) and takes (-1) in any order: every record put comes out once, in order,
    with its bytes; a put is refused only while unconsumed records fill the ring."""
    _, producer, consumer = ring()
    queue, counter = [], 0
    for step in steps:
        if step < 0:
            record = consumer.take()
            if not queue:
                assert record is None
                continue
            kind, view = record
            expected_kind, expected = queue.pop(0)
            assert (kind, bytes(view)) == (expected_kind, expected)
            consumer.commit()
        else:
            counter += 1
            payload = bytes([counter % 251]) * step
            if producer.put(counter % 7, [payload[: step // 2], payload[step // 2 :]]):
                queue.append((counter % 7, payload))
            else:
                assert queue, "an empty ring refused a record"
    while queue:
        kind, view = consumer.take()
        assert (kind, bytes(view)) == queue.pop(0)
    assert consumer.take() is None


def test_a_record_over_the_limit_is_refused_by_the_producer():
    _, producer, _ = ring()
    with pytest.raises(ValueError):
        producer.put(1, [b"x" * (max_payload(CAPACITY) + 1)])


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=ring_size(CAPACITY), max_size=ring_size(CAPACITY)),
       st.one_of(st.integers(0, CAPACITY // 8).map(lambda n: 8 * n), st.integers(0, 2**64 - 1)),
       st.lists(st.sampled_from([0, 4, 8, 100, WRAP, max_payload(CAPACITY)]), max_size=4))
def test_garbage_from_the_producer_is_a_ring_error_never_a_read_outside(garbage, head, lengths):
    """Whatever a hostile producer writes (counters, framing), the consumer hands out only
    whole records inside the ring's data, or raises RingError."""
    buffer = memoryview(bytearray(garbage))
    buffer[:8] = head.to_bytes(8, "little")
    buffer[64:72] = bytes(8)  # the consumer starts at 0 (it made the ring)
    at = 0
    for length in lengths:  # plausible-looking framing at the first records
        struct.pack_into("<I", buffer, HEADER_BYTES + at, length)
        at = (at + 8 + (length + 7 & ~7)) % CAPACITY if length != WRAP else 0
    consumer = Consumer(buffer)
    data = buffer[HEADER_BYTES:]
    for _ in range(20):
        try:
            record = consumer.take()
        except RingError:
            return
        if record is None:
            return
        _kind, view = record
        offset = address(view) - address(data)  # where the payload starts in the ring's data
        (declared,) = struct.unpack_from("<I", data, offset - 8)
        assert len(view) == declared <= max_payload(CAPACITY)  # whole, not cut at the ring's end
        assert offset >= 8 and offset + len(view) <= CAPACITY
        consumer.commit()


def address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else address_of_empty(view)


def address_of_empty(view: memoryview) -> int:
    """Where an empty view points (numpy refuses zero-length buffers' addresses otherwise)."""
    return np.asarray(view).__array_interface__["data"][0]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_a_consumers_garbage_tail_never_makes_the_producer_overwrite_blindly(tail):
    buffer, producer, _ = ring()
    struct.pack_into("<Q", buffer, 64, tail)
    try:
        accepted = producer.put(1, [b"x" * 10])
    except RingError:
        return
    assert tail == 0 or not accepted or 0 <= producer.head - tail <= CAPACITY


@given(st.integers(0, 2**64 - 1))
def test_a_consumers_tail_is_checked_before_its_consumption_answers_anything(tail):
    """The producer reads the consumer's tail as an answer (``consumed``, ``passed``): a tail
    outside ``[head - capacity, head]`` is a RingError, never a count of records taken."""
    buffer, producer, _ = ring()
    assert producer.put(1, [b"x" * 10])
    head = producer.head
    struct.pack_into("<Q", buffer, 64, tail)
    assert producer.passed(head) == (tail >= head)
    if 0 <= head - tail <= CAPACITY:
        assert producer.consumed() == tail
    else:
        with pytest.raises(RingError, match="tail"):
            producer.consumed()


def test_wrap_marker_and_framing_errors_are_typed():
    buffer, producer, consumer = ring()
    struct.pack_into("<II", buffer, HEADER_BYTES, WRAP, 0)
    struct.pack_into("<Q", buffer, 0, 8)  # a wrap marker claiming the rest of the ring: only 8 bytes produced
    with pytest.raises(RingError, match="wrap marker"):
        consumer.take()
    buffer, _, consumer = ring()
    struct.pack_into("<II", buffer, HEADER_BYTES, 100, 1)
    struct.pack_into("<Q", buffer, 0, 16)  # a 100-byte record of which 8 bytes are produced
    with pytest.raises(RingError, match="leaves the ring"):
        consumer.take()


def test_a_consumer_bounded_by_a_published_head_takes_nothing_published_after_it():
    """``take(until)`` with a head read by ``published()`` stops at the records published by
    then (a drain's bound); a head no producer could have published is a RingError there."""
    buffer, producer, consumer = ring()
    assert producer.put(1, [b"a"]) and producer.put(1, [b"b"])
    until = consumer.published()
    assert producer.put(1, [b"c"])
    assert [bytes(consumer.take(until)[1]) for _ in range(2)] == [b"a", b"b"] and consumer.take(until) is None
    assert bytes(consumer.take()[1]) == b"c"
    for head in (CAPACITY + 8, 8):  # more than the ring holds; behind what was taken
        struct.pack_into("<Q", buffer, 0, head)
        with pytest.raises(RingError, match="head"):
            consumer.published()


def test_the_producer_wakes_a_sleeping_consumer_once_per_sleep():
    _, producer, consumer = ring()
    assert consumer.sleep() is False
    assert producer.put(1, [b"a"]) and producer.wants_wake()
    assert producer.put(1, [b"b"]) and not producer.wants_wake()  # woken already
    consumer.awake()
    assert consumer.take()[1] == b"a" and consumer.take()[1] == b"b"
    consumer.commit()
    assert producer.put(1, [b"c"]) and not producer.wants_wake()  # awake: no wake-up needed
    assert consumer.sleep() is True  # a record came before it slept: it must not sleep
    consumer.awake()
    consumer.take()
    consumer.commit()
    assert consumer.sleep() is False
    assert producer.put(1, [b"d"]) and producer.wants_wake()


# -- two agents in this process --------------------------------------------------------------------
async def pair(make_agent, num_blocks=16, block_len=4096, **config):
    a = await make_agent(num_blocks, block_len, peer_id="a", **config)
    b = await make_agent(num_blocks, block_len, peer_id="b", **config)
    await asyncio.wait_for(a.connect(b.control_address), 10)
    await asyncio.wait_for(b.wait_for_peer("a"), 10)
    links = a.transport.links["b"], b.transport.links["a"]
    async with asyncio.timeout(5):
        while config.get("same_host_lane", True) and not all(link.ring_out for link in links):
            await asyncio.sleep(0.01)
    return a, b


def count_header_sends(lane):
    """Fault-injection wrapper around a real lane: records the tags of its sends."""
    tags, send = [], lane.send
    lane.send = lambda buffer, tag, done: (tags.append(tag), send(buffer, tag, done))[1]
    return tags


async def test_headers_acks_and_messages_go_through_the_rings(make_agent):
    a, b = await pair(make_agent)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append((key, meta, [bytes(f) for f in frames])))
    tags_a = count_header_sends(a.transport.links["b"].lane)
    tags_b = count_header_sends(b.transport.links["a"].lane)
    a.region.array[3] = 7
    await asyncio.wait_for(a.write_blocks("b", [3], [4]), 5)
    frames = [np.arange(1000, dtype=np.uint8), np.zeros(0, np.uint8), np.full(5, 9, np.uint8)]
    await asyncio.wait_for(a.send_message("b", "k", b"meta", frames), 5)
    assert (b.region.array[4] == 7).all()
    assert got == [("k", b"meta", [bytes(f) for f in frames])]
    assert tags_a == [] and tags_b == []  # neither the header, nor the acks went over UCX
    assert b.transport.links["a"].ring_in.wakeups > 0
    assert b.transport.links["a"].ring_in.linger == 0  # a peer in this process cannot write while we poll


async def test_a_one_block_write_is_answered_by_the_receivers_consumption_not_by_an_ack(make_agent):
    """A one-block same-host write goes as a ``tail`` write request: the receiver answers it
    by consuming its ring record (and waking the sender, asleep here: a peer in this process
    is never spun for), with no Ack record; the write settles only then."""
    a, b = await pair(make_agent)
    answers = b.transport.links["a"].ring_out.producer  # where b's acknowledgements would go
    await asyncio.wait_for(a.write_blocks("b", [1], [1]), 5)
    before, wakeups = answers.head, a.transport.links["b"].ring_in.wakeups
    a.region.array[3] = 7
    write = a.write_blocks("b", [3], [4])
    assert a.transport.links["b"].ring_out.awaiting  # awaiting b's consumption
    await asyncio.wait_for(write, 5)
    assert (b.region.array[4] == 7).all() and b.stats()["received.blocks.ok"] == 2
    assert answers.head == before  # no acknowledgement record
    assert a.transport.links["b"].ring_in.wakeups > wakeups  # b woke a through a's ring
    assert not a.transport.links["b"].ring_out.awaiting


async def test_a_write_alone_in_its_transfer_is_answered_by_consumption_a_split_one_by_acks(make_agent):
    """A small same-host write of several runs is one placed request, answered by the
    receiver's consumption of its record; one the receiver's ``max_write_blocks`` splits is
    several requests under one transfer, each answered by an Ack (an answer per request, so
    the transfer settles once all are in)."""
    from omni_async.wire import WriteRequest, decode_record

    a = await make_agent(64, 4096, peer_id="a")
    b = await make_agent(64, 4096, peer_id="b", max_write_blocks=16)
    await asyncio.wait_for(a.connect(b.control_address), 10)
    async with asyncio.timeout(5):
        while not (a.transport.links["b"].ring_out and b.transport.links["a"].ring_out):
            await asyncio.sleep(0.01)
    fill = np.random.default_rng(9).integers(0, 256, a.region.array.shape, dtype=np.uint8)
    a.region.array[:] = fill
    answers = b.transport.links["a"].ring_out.producer  # where b's acknowledgements go
    ring = a.transport.links["b"].ring_out
    records: list[WriteRequest] = []
    put = ring.send
    ring.send = lambda kind, parts, answered=None: (  # type: ignore[method-assign]  # a spy around the real ring
        records.append(decode_record(parts[0])), put(kind, parts, answered))[1]
    await asyncio.wait_for(a.write_blocks("b", [0], [0]), 5)
    before = answers.head
    await asyncio.wait_for(a.write_blocks("b", [1, 5, 9, 2], [3, 7, 11, 1]), 5)
    assert answers.head == before and records[-1].tail and len(records[-1].runs) == 4
    records.clear()
    local, remote = list(range(20, 40)), list(range(40, 60))
    await asyncio.wait_for(a.write_blocks("b", local, remote), 5)
    assert len(records) == 2 and not any(r.tail for r in records) and answers.head > before
    assert np.array_equal(b.region.array[[3, 7, 11, 1, *remote]], fill[[1, 5, 9, 2, *local]])
    assert a.stats()["blocks.ok"] == 3 and not ring.awaiting


async def test_a_receiver_that_cannot_wake_the_sender_through_a_ring_acknowledges_as_before(make_agent):
    """b lost its ring to a (it broke): a's one-block write, answered by consumption, is
    acknowledged over the lane instead, and settles (once: the consumption comes too)."""
    a, b = await pair(make_agent)
    link = b.transport.links["a"]
    b.transport._drop_ring_out(link)  # as when its wake-up of a failed
    tags = count_header_sends(link.lane)
    for i in range(3):
        a.region.array[i] = i + 1
        await asyncio.wait_for(a.write_blocks("b", [i], [i + 8]), 5)
        assert (b.region.array[i + 8] == i + 1).all()
    assert len(tags) == 3 and a.stats()["blocks.ok"] == 3 and "b" in a.peers


async def test_an_invalid_write_answered_by_consumption_drops_its_sender(make_agent):
    """A ``tail`` write request whose runs leave the receiver's region breaks the protocol
    (its sender checked it against our layout): the receiver drops the peer, writes nothing,
    and keeps serving others."""
    from omni_async.wire import WriteRequest

    a, b = await pair(make_agent)
    ring = a.transport.links["b"].ring_out
    assert ring.send(samehost.KIND_HEADER, [encode_record(WriteRequest(999, 0, [(15, 2)], placed=True, tail=True))])
    async with asyncio.timeout(5):
        while "a" in b.peers:
            await asyncio.sleep(0.01)
    assert not b.region.array.any()
    c = await make_agent(16, 4096, peer_id="c")
    await asyncio.wait_for(c.connect(b.control_address), 10)
    c.region.array[2] = 5
    await asyncio.wait_for(c.write_blocks("b", [2], [3]), 5)
    assert (b.region.array[3] == 5).all()


async def test_drain_takes_every_record_even_when_a_batch_also_took_answers():
    """A batch that delivers a whole batch of records and then answers without records (the
    peer consumed a write of ours) still lets drain() go on: every record published before
    the call is delivered (a review found drain() stop after the first batch: a commit that
    came over the lane then found no intent, and a good peer was dropped)."""
    loop = asyncio.get_running_loop()
    got, answered = [], []
    ours = samehost.RingReceiver(loop, lambda kind, payload: got.append(bytes(payload)), lambda exc: None,
                                 lambda: False, capacity=SMALL_RING)
    theirs = samehost.RingReceiver(loop, lambda kind, payload: None, lambda exc: None, lambda: False,
                                   capacity=SMALL_RING)
    to_them, to_us = samehost.RingSender(theirs.offer()), samehost.RingSender(ours.offer())
    ours.answers_from(to_them, answered.append)
    try:
        for i in range(600):
            assert to_us.send(samehost.KIND_HEADER, [b"%d" % i])
        assert to_them.send(samehost.KIND_HEADER, [b"tail"], answered=7)
        theirs.drain()  # the peer consumes our record: its tail passes it
        ours.drain()
        assert answered == [7] and len(got) == 600
    finally:
        for ring in (to_them, to_us, ours, theirs):
            ring.close()


async def test_writes_consumed_before_the_peers_ring_broke_settle_as_done(make_agent):
    """The peer took a write (its tail passed the record), then closed its ring before we
    looked: dropping its ring settles that write as done (its answer came; a review found it
    failed with PeerLost).  The one it never took is failed by the peer's removal, not by the
    closed pipe (the peer may be leaving in order: it is still listed)."""
    a, b = await pair(make_agent)
    la, lb = a.transport.links["b"], b.transport.links["a"]
    first = a.write_blocks("b", [3], [4])
    lb.ring_in.drain()  # b takes and counts it
    lb.ring_in.run()  # b's turn: it sleeps again (a new epoch, so our next put wakes it)
    lb.ring_in.close()  # b closes its ring
    second = a.write_blocks("b", [5], [6])  # our wake-up fails: the ring is dropped
    assert la.ring_out is None and b.stats()["received.blocks.ok"] == 1
    await asyncio.wait_for(first, 5)
    assert not second.done() and "b" in a.peers
    assert await a.remove_peer("b")
    with pytest.raises(PeerLost, match="removed"):
        await asyncio.wait_for(second, 5)


async def test_a_write_cancelled_before_its_consumption_settles_once(make_agent):
    """Cancelled before the receiver consumed its record: cancelled, and the consumption
    that comes after answers nothing; the next write settles as usual."""
    a, b = await pair(make_agent)
    write = a.write_blocks("b", [3], [4])
    write.cancel()
    with pytest.raises(TransferCancelled):
        await asyncio.wait_for(write, 5)
    await asyncio.wait_for(a.write_blocks("b", [5], [6]), 5)
    assert not a.transport.links["b"].ring_out.awaiting and a.transport.in_flight() == []
    assert a.stats()["blocks.ok"] == 1 and "b" in a.peers


async def test_acks_of_one_ring_batch_travel_together(make_agent):
    """Chunk messages taken in one ring batch are acknowledged with one record per
    ``ACK_BATCH`` of them (an ``Acks``), not one ``Ack`` record each; every transfer settles."""
    from omni_async.transport.core import ACK_BATCH

    a, b = await pair(make_agent)
    b.set_message_sink(lambda *_message: None)
    answers = b.transport.links["a"].ring_out.producer  # where b's acknowledgements go
    await asyncio.wait_for(a.send_message("b", "warm", b"", [np.ones(8, np.uint8)]), 5)
    one_ack = answers.head
    await asyncio.wait_for(a.send_message("b", "single", b"", [np.ones(8, np.uint8)]), 5)
    one_ack = answers.head - one_ack  # bytes of the record that acknowledges one message
    count = 4 * ACK_BATCH
    before = answers.head
    transfers = [a.send_message("b", f"k{i}", b"", [np.ones(8, np.uint8)]) for i in range(count)]  # one batch
    await asyncio.wait_for(asyncio.gather(*transfers), 5)
    assert all(t.done() and t.error() is None for t in transfers)
    assert answers.head - before <= count // ACK_BATCH * 4 * one_ack < count * one_ack


async def test_ring_message_frames_are_one_aligned_copy(make_agent):
    """A chunk message out of the ring: the frames the sink gets are copied once into one
    allocation (not one array per frame), each frame 64-byte aligned within it whatever the
    sizes before it, writable, and not the ring's memory."""
    a, b = await pair(make_agent)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(list(frames)))
    sent = [np.full(3, 1, np.uint8), np.arange(40, dtype=np.int64).view(np.uint8), np.zeros(0, np.uint8),
            np.full(77, 5, np.uint8)]
    await asyncio.wait_for(a.send_message("b", "k", b"", sent), 5)
    frames = got[0]
    assert [bytes(f) for f in frames] == [bytes(f) for f in sent]
    base = frames[0].__array_interface__["data"][0]
    assert all((f.__array_interface__["data"][0] - base) % 64 == 0 for f in frames)
    assert all(f.flags.writeable for f in frames)
    assert len({id(f.base) for f in frames}) == 1 and frames[0].base is not None
    await asyncio.wait_for(a.send_message("b", "k2", b"", [np.full(8, 2, np.uint8)]), 5)
    assert bytes(frames[3]) == bytes(sent[3])  # the ring's later records did not change them
    # Every frame but the last a whole number of slots (no gap between them: copied in one go).
    gapless = [np.arange(128, dtype=np.uint8), np.zeros(0, np.uint8), np.full(64, 3, np.uint8),
               np.arange(7, dtype=np.uint8) + 100]
    await asyncio.wait_for(a.send_message("b", "k3", b"", gapless), 5)
    frames = got[2]
    assert [bytes(f) for f in frames] == [bytes(f) for f in gapless]
    base = frames[0].__array_interface__["data"][0]
    assert [f.__array_interface__["data"][0] - base for f in frames if f.nbytes] == [0, 128, 192]


async def test_large_ring_messages_land_in_the_shared_pool_and_a_hoarder_gets_copies(make_agent):
    """Frames of large ring messages are views of the receiver's shared pool, where the sender
    copied them (the ring carries only the header), reused once the sink's arrays are dropped;
    a sink that keeps every frame forever fills the shared pool, then the receive pool (frames
    copied out of the ring), and then gets fresh copies: nothing waits for it, every message
    arrives intact and is acknowledged."""
    from omni_async.transport.messages import POOL_MIN, RECEIVE_POOL_BYTES

    a, b = await pair(make_agent, max_message_bytes=1 << 30, shared_pool_mib=8)  # (a smaller one fills sooner)
    kept = []
    b.set_message_sink(lambda peer, key, meta, frames: kept.append(frames))
    size = max(POOL_MIN, 1 << 20)
    shared = b.transport.links["a"].ring_in.pool
    await asyncio.wait_for(a.send_message("b", "k", b"", [np.full(size, 1, np.uint8)]), 5)
    assert shared.taken == 1 and shared.in_use >= size and b.transport.receive_pool is None  # no copy
    kept.clear()
    assert shared.in_use == 0  # dropped: back in the pool
    count = (shared.capacity + RECEIVE_POOL_BYTES) // size + 8  # more than both pools hold, all kept
    transfers = [a.send_message("b", f"k{i}", b"", [np.full(size, i % 251, np.uint8)]) for i in range(count)]
    await asyncio.wait_for(asyncio.gather(*transfers), 30)
    assert len(kept) == count and all((frames[0] == i % 251).all() for i, frames in enumerate(kept))
    copied = b.transport.receive_pool
    assert shared.in_use <= shared.capacity and shared.taken > 1
    assert copied is not None and copied.taken > 1 and copied.fallbacks >= 1  # then fresh arrays
    kept.clear()  # the room is published on the receiver's next turn (the next message's)
    taken = shared.taken
    for i in range(2):
        await asyncio.wait_for(a.send_message("b", "again", b"", [np.full(size, i, np.uint8)]), 5)
        assert (kept[i][0] == i).all()
    assert shared.taken > taken  # the shared pool serves again


async def test_without_a_shared_pool_large_messages_are_copied_through_the_ring(make_agent):
    """``shared_pool_mib = 0`` on the receiver: no pool is offered, a large message's frames
    travel in its ring record and are copied out into the receive pool."""
    a, b = await pair(make_agent, max_message_bytes=1 << 30, shared_pool_mib=0)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(frames[0]))
    assert b.transport.links["a"].ring_in.pool is None and a.transport.links["b"].ring_out.pool is None
    await asyncio.wait_for(a.send_message("b", "k", b"", [np.full(1 << 20, 5, np.uint8)]), 5)
    assert (got[0] == 5).all() and b.transport.receive_pool is not None and b.transport.receive_pool.taken == 1


async def test_a_pooled_message_is_placed_whole_and_aligned_and_is_not_copied_by_the_receiver(make_agent):
    """Several frames of a pooled message: each lands at a 64-byte aligned offset of one piece
    of the shared pool, with its exact bytes; empty frames stay empty; the receiver makes no
    copy of its own."""
    from omni_async.transport.messages import POOL_MIN

    a, b = await pair(make_agent, max_message_bytes=1 << 30)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append((meta, frames)))
    frames = [np.arange(POOL_MIN + 3, dtype=np.uint8), np.zeros(0, np.uint8), np.full(1000, 7, np.uint8)]
    await asyncio.wait_for(a.send_message("b", "k", b"meta", frames), 5)
    meta, received = got[0]
    shared = b.transport.links["a"].ring_in.pool
    assert meta == b"meta" and [f.nbytes for f in received] == [f.nbytes for f in frames]
    assert all((r == f).all() for r, f in zip(received, frames, strict=True))
    starts = [r.__array_interface__["data"][0] for r in received if r.nbytes]
    assert all(start % 64 == 0 for start in starts) and starts[1] - starts[0] == -(-(POOL_MIN + 3) // 64) * 64
    assert shared.taken == 1 and b.transport.receive_pool is None


async def test_a_garbage_pool_tail_drops_the_peer_before_any_copy(make_agent):
    """A receiver that writes a tail into its shared pool that it could not have published:
    the sender raises no further, drops the peer first (its message fails with the removal's
    reason, the broken tail, as every transfer to that peer does), and never copies into the
    pool."""
    from omni_async.transport.messages import POOL_MIN

    a, b = await pair(make_agent, max_message_bytes=1 << 30)
    b.set_message_sink(lambda *_: None)
    ctl = b.transport.links["a"].ring_in.pool._ctl
    ctl[0] = 1 << 40  # far ahead of anything the sender placed
    message = a.send_message("b", "k", b"", [np.ones(POOL_MIN, np.uint8)])
    assert "b" not in a.peers and message.done()
    with pytest.raises(ProtocolError, match="the pool's tail is"):
        await asyncio.wait_for(message, 5)


async def test_an_idle_pair_runs_no_ring_turns(make_agent):
    """After traffic, each ring spins at most once more, then sleeps until a record comes."""
    a, b = await pair(make_agent)
    rings = [a.transport.links["b"].ring_in, b.transport.links["a"].ring_in]
    b.set_message_sink(lambda *_message: None)
    for _ in range(20):
        await asyncio.wait_for(a.send_message("b", "k", b"", [np.ones(10, np.uint8)]), 5)
    await asyncio.sleep(0.05)
    turns = [ring.turns for ring in rings]
    cpu = time.process_time()
    await asyncio.sleep(0.5)
    assert [ring.turns for ring in rings] == turns
    assert time.process_time() - cpu < 0.05


WRITE_CALL_BUDGET = 118
"""Python calls of omni_async per same-host 64 KiB write and its acknowledgement, both sides
(issue 9, row a: 143 before the ring and transport hot paths were trimmed, 115 after; 124
before one block took a short path, ``BlockWrites._place_row``, 117 after, 119 once its
acknowledgement was the receiver's consumption of the record: in one process the sender never
spins, so it is woken either way; 122 since session 17: ``_tell_placed``, and the consumed
answers handed out one by one, a generator's two resumptions, so that a removal a
done-callback starts still settles the others done; 123 since session 18: in one process
the awaiter is woken by a ring turn, a hand-off (``Handoffs.handed``); 115 since session 19:
no deadline book entry, no ``Metrics.started``, attributes for ``num_blocks``; a few calls of
headroom for a heartbeat or timer that lands among the 100 writes of a loaded run)."""


async def test_a_small_same_host_write_and_its_ack_stay_within_a_call_budget(make_agent):
    """Row a's latency is Python on both sides: a 64 KiB write, its header and its ack through
    the rings cost at most WRITE_CALL_BUDGET calls of this package (counted, not timed: the
    count does not depend on the machine's load)."""
    import sys

    import omni_async

    package = os.path.dirname(omni_async.__file__)
    a, b = await pair(make_agent, block_len=64 << 10)
    for _ in range(50):  # warm: both rings in their steady rhythm
        await asyncio.wait_for(a.write_blocks("b", [3], [5]), 5)
    calls = 0

    def count(frame, event, _arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls += 1

    writes = 100
    sys.setprofile(count)
    try:
        async with asyncio.timeout(10):
            for _ in range(writes):
                await a.write_blocks("b", [3], [5])
    finally:
        sys.setprofile(None)
    assert np.array_equal(b.region.array[5], a.region.array[3])
    assert calls / writes <= WRITE_CALL_BUDGET, calls / writes


def intent(transfer_id: int) -> bytes:
    """An encoded intent (a large write announced before its copy) of one row."""
    from omni_async.wire import WriteRequest, encode_record

    return encode_record(WriteRequest(transfer_id, 0, [(0, 1)], placed=True, intent=True))


async def turns_while_announcing(a, b, intents: int, gap: float) -> int:
    """Put ``intents`` intents that are never committed into b's ring, one per ``gap``
    seconds; b's ring turns from the second intent on."""
    ring, ours = a.transport.links["b"].ring_out, b.transport.links["a"].ring_in
    ours.lost_core = 1.0  # a loaded machine must not end b's polling early
    turns = 0
    for i in range(intents):
        if i == 1:
            turns = ours.turns
        assert ring.send(samehost.KIND_HEADER, [intent(1000 + i)])
        await asyncio.sleep(gap)
    assert len(b.transport.links["a"].intents) == intents
    return ours.turns - turns


async def test_intents_never_committed_keep_a_receiver_awake_only_once(make_agent):
    """A peer that keeps announcing intents it never commits, each within INTENT_WAIT of the
    last: the receiver stays awake (polls its ring) for the first one only, then sleeps between
    records, so the peer cannot keep its loop spinning."""
    from omni_async.transport.incoming_writes import INTENT_WAIT

    a, b = await pair(make_agent)
    b.transport.links["a"].ring_out.in_this_process = False  # as if a ran in another process
    intents = 20
    turns = await turns_while_announcing(a, b, intents, INTENT_WAIT * 2 / 3)
    assert turns < 6 * intents  # a wake-up and a spin or two per record; polling all along: ~30 each


async def test_a_receiver_does_not_poll_for_the_commit_of_a_peer_in_this_process(make_agent):
    """The peer runs in this process: it cannot copy while we poll, so an intent does not keep
    the receiver awake."""
    from omni_async.transport.incoming_writes import INTENT_WAIT

    a, b = await pair(make_agent)
    intents = 10
    turns = await turns_while_announcing(a, b, intents, INTENT_WAIT * 4)
    assert turns < 6 * intents  # a wake-up and a spin or two per record; polling: ~60 each


async def test_a_removed_peers_draining_lane_does_not_stay_hot(make_agent):
    """A removed peer's lane drains its goodbye for a while: it polls only as any lane
    without a peer's requests does, not as a hot lane (its rings are gone, not its ring traffic
    moved onto it)."""
    a, b = await pair(make_agent)
    lane = a.transport.links["b"].lane
    assert lane.stay_hot is not None and not lane.stay_hot()  # the rings carry the traffic
    await asyncio.wait_for(a.remove_peer("b"), 5)
    assert not lane.stay_hot()


async def test_a_large_write_is_announced_before_its_copy_and_a_small_one_after(make_agent):
    """A same-host write of at least ANNOUNCE_BYTES goes into the receiver's ring as an intent
    before its copy, and a commit after it (the receiver checks it meanwhile and is awake for
    the commit); a small one is copied first and then told with one placed header."""
    from omni_async.transport.block_writes import ANNOUNCE_BYTES
    from omni_async.wire import Commit, WriteRequest, decode_record

    a, b = await pair(make_agent, num_blocks=64, block_len=64 << 10)
    a.region.array[:] = np.random.default_rng(3).integers(0, 256, a.region.array.shape, dtype=np.uint8)
    ring = a.transport.links["b"].ring_out
    records: list[object] = []
    put = ring.send
    rows = b.region.array
    ring.send = lambda kind, parts, answered=None: (  # type: ignore[method-assign]  # a spy around the real ring
        records.append((decode_record(parts[0]), rows[40:44].copy())), put(kind, parts, answered))[1]
    large = ANNOUNCE_BYTES // a.region.block_len
    local, remote = list(range(large)), [40 + i for i in range(large)]
    await asyncio.wait_for(a.write_blocks("b", local, remote), 5)
    (intent, before), (commit, after) = records
    assert isinstance(intent, WriteRequest) and intent.placed and intent.intent and intent.announced
    assert intent.notice is None and intent.runs == [(40, large)]
    assert not before.any() and np.array_equal(after, a.region.array[:4])  # announced before the copy
    assert commit == Commit(intent.transfer_id, 0)
    assert np.array_equal(rows[remote], a.region.array[local])
    records.clear()
    await asyncio.wait_for(a.write_blocks("b", [1], [2]), 5)
    (small, _rows), = records
    assert isinstance(small, WriteRequest) and small.placed and not small.announced and small.tail
    assert b.transport.links["a"].intents == {}


async def split_pair(make_agent):
    """Agents a → b (64 × 64 KiB) whose writes b splits into requests of 16 blocks, both rings up."""
    a = await make_agent(64, 64 << 10, peer_id="a")
    b = await make_agent(64, 64 << 10, peer_id="b", max_write_blocks=16)
    await asyncio.wait_for(a.connect(b.control_address), 10)
    async with asyncio.timeout(5):
        while not (a.transport.links["b"].ring_out and b.transport.links["a"].ring_out):
            await asyncio.sleep(0.01)
    return a, b


async def test_a_split_announced_write_numbers_its_intents_and_commits_by_part(make_agent):
    """A large write split into several requests (the receiver's max_write_blocks): each
    request is its own intent and commit, numbered ``part`` of ``parts``, so no two are ever
    confused (a commit may travel over the lane while the next intent is in the ring)."""
    from omni_async.wire import Commit, WriteRequest, decode_record

    a, b = await split_pair(make_agent)
    link = a.transport.links["b"]
    a.region.array[:] = np.random.default_rng(4).integers(0, 256, a.region.array.shape, dtype=np.uint8)
    records: list[object] = []
    put = link.ring_out.send
    link.ring_out.send = lambda kind, parts, answered=None: (  # type: ignore[method-assign]  # a spy around the real ring
        records.append(decode_record(parts[0])), put(kind, parts, answered))[1]
    rows = list(range(48))  # three requests of 16 blocks (1 MiB each)
    await asyncio.wait_for(a.write_blocks("b", rows, rows[::-1]), 5)
    intents = [r for r in records if isinstance(r, WriteRequest)]
    commits = [r for r in records if isinstance(r, Commit)]
    assert [(r.part, r.parts, r.announced) for r in intents] == [(0, 3, True), (1, 3, True), (2, 3, True)]
    assert [c.part for c in commits] == [0, 1, 2]
    assert np.array_equal(b.region.array[47::-1], a.region.array[:48])
    assert b.transport.links["a"].intents == {}


def refuse_copies(link) -> None:
    """Fault injection around ``link``'s real direct writer: every copy fails with EPERM."""
    direct = link.direct

    class Refusing:
        kind, num_blocks, mapped = direct.kind, direct.num_blocks, direct.mapped

        def place(self, srcs, runs):
            raise PermissionError(1, "not permitted")

        def close(self):
            direct.close()

    link.direct = Refusing()


async def test_an_announced_write_whose_copy_fails_leaves_no_intent(make_agent):
    """The copy of an announced write fails (no permission, say): the write fails, an abort
    clears the receiver's intent (it never waits for a commit that will not come), and later
    writes go through UCX."""
    a, b = await pair(make_agent, num_blocks=64, block_len=64 << 10)
    link = a.transport.links["b"]
    refuse_copies(link)
    rows = list(range(32))  # 2 MiB: announced
    with pytest.raises(TransferFailed, match="not permitted"):
        await asyncio.wait_for(a.write_blocks("b", rows, rows), 5)
    intents = b.transport.links["a"].intents
    async with asyncio.timeout(5):
        while intents:
            await asyncio.sleep(0.01)
    a.region.array[:32] = 5
    await asyncio.wait_for(a.write_blocks("b", rows, rows), 5)  # over UCX now
    assert (b.region.array[:32] == 5).all() and link.direct is None and "a" in b.peers


async def test_a_split_announced_write_whose_copy_fails_frees_every_window_share(make_agent):
    """The first part's copy fails (no permission): the write fails and the lane is closed;
    the parts after it, posted but never sent, give their window shares back at once (an
    unanswered share would stall later writes until their deadline)."""
    a, b = await split_pair(make_agent)
    link = a.transport.links["b"]
    refuse_copies(link)
    rows = list(range(48))  # three announced requests of 16 blocks
    with pytest.raises(TransferFailed, match="not permitted"):
        await asyncio.wait_for(a.write_blocks("b", rows, rows), 5)
    window = link.outbox.window
    async with asyncio.timeout(5):  # the first part's share comes back with the peer's answer
        while window.messages or window.nbytes:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(a.write_blocks("b", [1], [1]), 5)
    assert (window.messages, window.nbytes) == (0, 0)


async def test_a_split_write_with_a_notice_whose_copy_fails_sends_no_later_part(make_agent):
    """The first part's copy of a split write with a notice fails (no permission): the write
    fails with one failed notice, and no later part of it is sent (one sent over UCX after the
    write's Abort started a notice that could never end at the receiver: every later write
    with a notice waited behind it, unacknowledged).  A later write with a notice completes."""
    a, b = await split_pair(make_agent)
    link = a.transport.links["b"]
    direct, failed = link.direct, []

    class FailOnce:  # fault injection around the real writer: its first copy fails
        kind, num_blocks, mapped = direct.kind, direct.num_blocks, direct.mapped

        def place(self, srcs, runs):
            if not failed:
                failed.append(1)
                raise PermissionError(1, "not permitted")
            return direct.place(srcs, runs)

        def close(self):
            direct.close()

    link.direct = FailOnce()
    rows = list(range(48))  # three requests of 16 blocks
    with pytest.raises(TransferFailed, match="not permitted"):
        await asyncio.wait_for(a.write_blocks("b", rows, rows, notice=b"split"), 5)
    a.region.array[50] = 7
    await asyncio.wait_for(a.write_blocks("b", [50], [50], notice=b"later"), 5)
    got = []
    async with asyncio.timeout(5):
        async for notice in b.notices():
            got.append((notice.data, notice.failed is not None))
            if notice.data == b"later":
                break
    assert got == [(b"split", True), (b"later", False)] and (b.region.array[50] == 7).all()
    async with asyncio.timeout(5):  # nothing left at the receiver that could hold a later notice
        while len(b.transport.links["a"].notices):
            await asyncio.sleep(0.01)


async def test_switch_off_leaves_everything_on_ucx(make_agent):
    a, b = await pair(make_agent, same_host_lane=False)
    assert a.transport.links["b"].ring_in is None and a.transport.links["b"].ring_out is None
    await asyncio.wait_for(a.write_blocks("b", [1], [2]), 5)


async def test_a_message_larger_than_the_ring_goes_through_the_pool_and_one_larger_than_that_over_ucx(make_agent):
    a, b = await pair(make_agent, max_message_bytes=80 << 20)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(frames[0].nbytes))
    tags = count_header_sends(a.transport.links["b"].lane)
    big = samehost.RING_CAPACITY // 2 + 1
    await asyncio.wait_for(a.send_message("b", "big", b"", [np.ones(big, np.uint8)]), 10)
    assert got == [big] and tags == []  # its frames in the shared pool, its header in the ring
    huge = b.transport.links["a"].ring_in.pool.capacity + 1
    await asyncio.wait_for(a.send_message("b", "huge", b"", [np.ones(huge, np.uint8)]), 20)
    assert got == [big, huge] and HEADER_TAG in tags


async def test_messages_wait_in_order_for_room_in_a_full_ring(make_agent):
    """More chunk bytes at once than the ring and the shared pool hold: the excess waits for
    the answers that free room, in order, instead of taking the lane; every message arrives
    intact."""
    a, b = await pair(make_agent, shared_pool_mib=8)  # (a smaller pool: fewer messages fill it)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append((key, int(frames[0][0]))))
    tags = count_header_sends(a.transport.links["b"].lane)
    size = samehost.RING_CAPACITY // 8
    count = 3 * (samehost.RING_CAPACITY + b.transport.links["a"].ring_in.pool.capacity) // size  # 3x both
    frames = [np.full(size, i, np.uint8) for i in range(7)]
    transfers = [a.send_message("b", f"k{i}", b"", [frames[i % 7]]) for i in range(count)]
    assert a.transport.links["b"].parked
    await asyncio.wait_for(asyncio.gather(*transfers), 30)
    assert got == [(f"k{i}", i % 7) for i in range(count)]
    assert tags == [] and not a.transport.links["b"].parked


async def test_parked_messages_meeting_a_closed_ring_settle_every_transfer_and_go_out_once(make_agent):
    """Messages parked behind a full ring and pool, a write the peer answered by consuming its
    record, then the peer closes its ring (as an orderly leave does first): the put that finds
    the pipe closed drops the ring, which settles the consumed write, whose settling unparks
    again inside the unparking under way.  Every transfer still settles (done, or failed at
    its deadline) and no message is delivered twice (the nested call sent every parked message
    over the lane, the one just put into the ring too; the outer one then failed on the
    emptied queue: the consumed write never settled, not even at its deadline)."""
    a, b = await pair(make_agent, shared_pool_mib=8, transfer_timeout=1.0)
    got: list[str] = []
    b.set_message_sink(lambda _peer, key, _meta, _frames: got.append(key))
    la, lb = a.transport.links["b"], b.transport.links["a"]
    write = a.write_blocks("b", [3], [4])
    size = samehost.RING_CAPACITY // 8
    count = 3 * (samehost.RING_CAPACITY + lb.ring_in.pool.capacity) // size
    frame = np.ones(size, np.uint8)
    transfers = [write] + [a.send_message("b", f"k{i}", b"", [frame]) for i in range(count)]
    assert la.parked  # some wait for room
    lb.ring_in.drain()
    lb.ring_in.run()
    lb.ring_in.close()
    async with asyncio.timeout(10):  # (the deadlines are 1 s)
        while not all(t.done() for t in transfers):
            await asyncio.sleep(0.01)
    assert write.error() is None  # its record was consumed: done
    assert len(got) == len(set(got)), "a message was delivered twice"
    assert a.transport.in_flight() == []


async def test_a_message_sent_while_parked_ones_are_posted_goes_after_them(make_agent):
    """The ring holds a write's record and k0; k1 and k2 wait (parked, no shared pool).  The
    peer consumes both records and closes its ring; k0's answer posts the parked ones: k1's
    put finds the ring closed, dropping it settles the consumed write, whose done-callback
    sends "late" (inside that posting).  "late" goes after k2, in call order (it went straight
    over the lane, ahead of k2, when only parked messages were left in flight: a review)."""
    from omni_async.wire import MessageHeader, encode_header

    a, b = await pair(make_agent, shared_pool_mib=0, transfer_timeout=1.0)
    got: list[str] = []
    b.set_message_sink(lambda _peer, key, _meta, _frames: got.append(key))
    la, lb = a.transport.links["b"], b.transport.links["a"]
    assert la.ring_out.pool is None
    write = a.write_blocks("b", [3], [4])
    header = len(encode_header(MessageHeader(2, 1, "k0", b"", [1 << 22])))
    frame = np.ones(la.ring_out.max_payload - header, np.uint8)  # one message fills half the ring
    transfers = [write] + [a.send_message("b", f"k{i}", b"", [frame]) for i in range(3)]
    assert [m[1] for m in la.parked] == ["k1", "k2"]
    late = []
    write.add_done_callback(lambda _t: late.append(a.send_message("b", "late", b"", [frame])))
    lb.ring_in.drain()
    lb.ring_in.run()
    lb.ring_in.close()
    async with asyncio.timeout(10):  # (the deadlines are 1 s)
        while not all(t.done() for t in transfers) or not late or not late[0].done():
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert write.error() is None and late[0].error() is None
    assert got[-1] == "late" and "k2" in got, got  # (k1 went into the closed ring: it fails at its deadline)


async def test_a_ring_found_broken_while_parked_messages_go_out_drops_the_peer_and_fails_them_all(make_agent):
    """Messages wait for room in a full ring; when the first of them is put, the peer's tail
    is found broken: the peer is dropped (which fails every message, those waiting included),
    and the posting of the parked ones stops there, with nothing left behind."""
    a, b = await pair(make_agent, shared_pool_mib=8)
    size = samehost.RING_CAPACITY // 8
    count = 3 * (samehost.RING_CAPACITY + b.transport.links["a"].ring_in.pool.capacity) // size
    frame = np.ones(size, np.uint8)
    transfers = [a.send_message("b", f"k{i}", b"", [frame]) for i in range(count)]
    link = a.transport.links["b"]
    assert link.parked
    producer = link.ring_out.producer
    producer._ctl[8] = producer.head + 8  # b's tail (ring.py's layout) past what was produced
    a.transport._unpark(link)  # as an answer that freed room would
    assert "b" not in a.peers and not link.parked
    results = await asyncio.wait_for(asyncio.gather(*transfers, return_exceptions=True), 10)
    assert all(isinstance(result, PeerLost | ProtocolError) for result in results), results


def sleeps_unwoken(producer) -> bool:
    """Whether the consumer of ``producer``'s ring sleeps (its epoch is odd: ring.py's layout)
    and this producer has not woken it for that sleep yet (so its next put wakes it)."""
    epoch = int(producer._ctl[16])
    return bool(epoch & 1) and epoch != producer._woken


async def until_ring_sleeps(producer) -> None:
    async with asyncio.timeout(5):
        while not sleeps_unwoken(producer):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("what", ["write", "message"])
async def test_a_put_into_the_ring_of_a_peer_leaving_in_order_does_not_cut_its_leave_short(make_agent, what):
    """b removes a in order: it closes its ring (its pipe too) at once and says goodbye over the
    lane.  A write (or message) a puts into that ring meanwhile finds the wake-up pipe closed:
    a stops using the ring but does not drop b for it, so b's leave drains in order (well
    under its drain timeout), a hears b is closing, and the transfer fails with b's removal."""
    a, b = await pair(make_agent)
    b.set_message_sink(lambda *_: None)
    await asyncio.wait_for(a.write_blocks("b", [1], [1]), 5)
    await until_ring_sleeps(a.transport.links["b"].ring_out.producer)
    events = []
    a.add_peer_listener(lambda event: events.append((event.kind, str(event.error))))
    assert await b.remove_peer("a")
    (drain,) = b.transport._drains
    transfer = a.write_blocks("b", [2], [2]) if what == "write" else a.send_message("b", "k", b"", [np.ones(9, np.uint8)])
    started = time.monotonic()
    await asyncio.wait_for(asyncio.shield(drain), 5)
    assert time.monotonic() - started < 0.5, "b's leave waited out its drain timeout"
    with pytest.raises(PeerLost):
        await asyncio.wait_for(transfer, 5)
    assert "b" not in a.peers and events and "closing" in events[-1][1], events


async def test_every_message_the_peer_put_before_it_left_in_order_is_delivered(make_agent):
    """b sends 40 messages, then removes a in order (closing its ring, where a's
    acknowledgements go): a's acknowledgements then find b's ring closed mid-batch, and a
    still takes every record b put before it left."""
    a, b = await pair(make_agent)
    got = []
    a.set_message_sink(lambda peer, key, meta, frames: got.append(key))
    await asyncio.wait_for(a.write_blocks("b", [1], [1]), 5)
    await until_ring_sleeps(a.transport.links["b"].ring_out.producer)
    for i in range(40):
        b.send_message("a", f"k{i}", b"", [np.ones(64, np.uint8)])
    assert await b.remove_peer("a")
    async with asyncio.timeout(5):
        while "b" in a.peers or len(got) < 40:
            await asyncio.sleep(0.01)
    assert got == [f"k{i}" for i in range(40)]


async def test_a_write_the_peer_consumed_settles_done_even_if_an_earlier_ones_callback_removes_the_peer(make_agent):
    """Two writes consumed in one go: the first's done-callback removes the peer (as a write
    that finds the ring broken would).  The second was consumed too: its removal settles it
    done, not lost."""
    a, b = await pair(make_agent)
    first, second = a.write_blocks("b", [3], [4]), a.write_blocks("b", [5], [6])
    first.add_done_callback(lambda _transfer: a.transport.remove_peer("b", PeerLost("removed by a callback"), orderly=True))
    b.transport.links["a"].ring_in.drain()  # b takes and counts both
    a.transport.links["b"].ring_in.run()  # a's turn takes both answers
    await asyncio.wait_for(first, 5)
    await asyncio.wait_for(second, 5)
    assert b.stats()["received.blocks.ok"] == 2


@pytest.mark.parametrize("how", ["closed pipe", "orderly removal"])
async def test_an_awaiter_taking_answers_stops_when_a_callback_drops_the_ring(make_agent, how):
    """The task awaiting ``second`` takes answers itself; the answer to ``first`` runs a
    done-callback that drops the ring (a write whose wake-up finds the peer's pipe closed, or
    an orderly removal): the awaiter stops polling that ring (its mapping is released) and
    waits as any other: pending until the peer's removal, or failed by it."""
    a, b = await pair(make_agent)
    la, lb = a.transport.links["b"], b.transport.links["a"]
    la.ring_out.in_this_process = False  # as for a peer in another process: the awaiter takes answers
    first = a.write_blocks("b", [3], [4])
    lb.ring_in.drain()  # b consumes first
    second = a.write_blocks("b", [5], [6])  # put; b never takes it
    if how == "closed pipe":
        lb.ring_in._consumer.awake()
        lb.ring_in._consumer.sleep()  # b sleeps in a new epoch (our next put wakes it) ...
        lb.ring_in.close()  # ... and closes its ring
        first.add_done_callback(lambda _transfer: a.write_blocks("b", [7], [8]))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await second
        assert first.done() and la.ring_out is None and not second.done()
    else:
        first.add_done_callback(lambda _transfer: a.transport.remove_peer("b", orderly=True))
        with pytest.raises(PeerLost):
            async with asyncio.timeout(10):
                await second


@pytest.mark.parametrize("garbage", ["head", "kind", "frames", "undecodable", "goodbye", "pooled", "pool overrun"])
async def test_garbage_in_the_ring_drops_the_peer_and_nothing_else(make_agent, garbage):
    """A peer that writes garbage into our ring: a typed error, the peer dropped, this
    process keeps serving others."""
    a, b = await pair(make_agent)
    ring = a.transport.links["b"].ring_out
    producer = ring.producer
    if garbage == "head":
        struct.pack_into("<Q", producer.buffer, 0, producer.head + 3 * samehost.RING_CAPACITY + 3)
    elif garbage == "kind":
        producer.put(9, [encode_header(Ack(1))])
    elif garbage == "goodbye":  # only ever sent over the lane
        producer.put(samehost.KIND_HEADER, [encode_record(Goodbye())])
    elif garbage == "frames":
        producer.put(samehost.KIND_MESSAGE, [encode_header(MessageHeader(1, 0, "k", b"", [1 << 20]))])
    elif garbage == "pooled":  # frames in the record of a pooled message
        producer.put(samehost.KIND_POOLED, [encode_header(MessageHeader(1, 0, "k", b"", [8])), b"x" * 8])
    elif garbage == "pool overrun":  # more than the room the receiver gave back (all of the pool)
        too_big = b.transport.links["a"].ring_in.pool.capacity + 64
        producer.put(samehost.KIND_POOLED, [encode_header(MessageHeader(1, 0, "k", b"", [too_big]))])
    else:
        producer.put(samehost.KIND_HEADER, [b"\xff" * 16])
    ring.wake()
    async with asyncio.timeout(5):
        while "a" in b.peers:
            await asyncio.sleep(0.01)
    c = await make_agent(16, 4096, peer_id="c")
    await asyncio.wait_for(c.connect(b.control_address), 10)
    await asyncio.wait_for(c.write_blocks("b", [1], [1]), 5)


@pytest.mark.parametrize("fault", ["garbage tail", "closed pipe"])
async def test_a_one_block_write_whose_ring_put_breaks_settles_and_the_writer_keeps_serving(make_agent, fault):
    """The short path of a one-block write puts its header into the peer's ring before it
    registers the transfer: a put that finds the peer's tail corrupted fails the write with
    that RingError (the peer is dropped); one whose wake-up finds the peer's pipe closed (the
    ring is dropped, the peer still joined) fails it at its deadline: registered after the
    put, it is still failed, never left pending; the writer keeps serving other peers."""
    a, b = await pair(make_agent, transfer_timeout=1.0)
    general = spy_general_writes(a)
    link = a.transport.links["b"]
    ring = link.ring_out
    if fault == "garbage tail":  # the consumer's tail (u64 at byte 64) far ahead of our head
        struct.pack_into("<Q", ring.producer.buffer, 64, ring.producer.head + (1 << 40))
    else:  # the peer asleep, its wake-up pipe gone: the put succeeds, its wake-up fails
        struct.pack_into("<Q", ring.producer.buffer, 128, 2 * 1000 + 1)  # an odd epoch: asleep
        b.transport.links["a"].ring_in.close()
    write = a.write_blocks("b", [3], [4])
    if fault == "closed pipe":
        assert a.transport.links["b"].ring_out is None and "b" in a.peers  # the ring dropped, the peer not
    with pytest.raises(ProtocolError if fault == "garbage tail" else DeadlineExceeded):
        await asyncio.wait_for(write, 10)
    assert write.done() and not a.transport.in_flight() and general == []  # (the short path took it)
    c = await make_agent(16, 4096, peer_id="c")
    await asyncio.wait_for(c.connect(a.control_address), 10)
    await asyncio.wait_for(a.write_blocks("c", [1], [1]), 5)


async def test_a_one_block_write_that_finds_the_ring_full_goes_over_the_lane_and_completes(make_agent):
    """The short path of a one-block write with no room in the peer's ring: its header goes
    over the lane (answered by an Ack), the rows land, the write completes."""
    a, b = await pair(make_agent)
    general = spy_general_writes(a)
    ring = a.transport.links["b"].ring_out
    a.region.array[3] = 77
    ring.send = lambda *_args: False  # (fault injection on the real ring: no room in it)
    write = a.write_blocks("b", [3], [4])
    del ring.send
    assert not ring.awaiting  # not into the ring (it would await the record's consumption)
    await asyncio.wait_for(write, 5)
    assert (b.region.array[4] == 77).all() and general == []  # (the short path took it)


def spy_general_writes(agent) -> list[int]:
    """The block counts of the writes ``agent`` sends by the general path (a wrapper around the
    real ``_write_runs``), so a test of the one-block short path sees it was taken."""
    calls: list[int] = []
    transport = agent.transport
    real = transport._write_runs

    def spy(link, runs, blocks, notice):
        calls.append(blocks)
        return real(link, runs, blocks, notice)

    transport._write_runs = spy
    return calls


async def test_a_rogue_record_after_good_ones_in_a_batch_still_acknowledges_them(make_agent):
    """Chunk messages and then a record that breaks the protocol, taken in one ring batch: the
    peer is dropped, but the messages delivered before the bad record are acknowledged first
    (their sender must not hear PeerLost for data that arrived)."""
    a, b = await pair(make_agent)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(key))
    producer = a.transport.links["b"].ring_out.producer
    transfers = [a.send_message("b", f"k{i}", b"", [np.ones(8, np.uint8)]) for i in range(3)]
    producer.put(9, [encode_header(Ack(1))])  # same turn of the loop: b takes all four at once
    async with asyncio.timeout(5):
        while "a" in b.peers:
            await asyncio.sleep(0.01)
    assert got == ["k0", "k1", "k2"]
    await asyncio.wait_for(asyncio.gather(*transfers, return_exceptions=True), 5)
    assert [t.error() for t in transfers] == [None, None, None]


async def test_removing_a_peer_releases_both_rings(make_agent):
    a, b = await pair(make_agent)
    ours = a.transport.links["b"].ring_in
    theirs = a.transport.links["b"].ring_out.token
    mine = ours.offer().token
    pipe = os.readlink(f"/proc/self/fd/{ours.fds[1]}")
    assert pipe.startswith("pipe:") and len(mapped(theirs)) == 2  # b's mapping of its ring, and ours
    await a.remove_peer("b")
    async with asyncio.timeout(5):
        while "a" in b.peers:
            await asyncio.sleep(0.01)
    del ours
    gc.collect()
    assert open_fds_to(mine) == []  # a's ring: its memfd, and both mappings (each holds a descriptor)
    assert pipe not in fd_targets()  # a's wake-up pipe: both ends closed (b's write end too, by b)
    assert mapped(theirs) == []  # b's ring: a's mapping, and b's own (b dropped a too)


async def test_drain_delivers_every_published_record_now_but_never_inside_a_turn():
    """What the receiver does before acting on news from elsewhere (a goodbye, a commit over
    the lane, the peer's loss): every record published so far, beyond one turn's batch."""
    got: list[bytes] = []
    nested: list[int] = []

    def deliver(kind: int, payload: memoryview) -> None:
        got.append(bytes(payload))
        if len(got) == 1:
            receiver.drain()  # inside a turn: nothing (the turn delivers the rest, in order)
            nested.append(len(got))

    receiver = samehost.RingReceiver(asyncio.get_running_loop(), deliver, lambda exc: None, lambda: False,
                                     capacity=SMALL_RING)
    sender = samehost.RingSender(receiver.offer())
    try:
        for i in range(600):  # more than one turn takes
            assert sender.send(samehost.KIND_HEADER, [b"%d" % i])
        receiver.drain()
        assert got == [b"%d" % i for i in range(600)] and nested == [1]
        receiver.drain()  # nothing new: nothing twice
        assert len(got) == 600
    finally:
        sender.close()
        receiver.close()


async def test_drain_takes_only_what_was_published_before_it_and_turns_take_the_rest():
    """A peer that refills its ring as fast as records are taken cannot hold the loop in
    drain(): it delivers the records published before it was called (all that the header
    which made it drain can refer to), and leaves those published meanwhile to the turns,
    which yield between batches; nothing is lost, in order.  Before, drain() went on as
    long as whole batches came (a peer that kept its ring full held the loop for seconds)."""
    got: list[bytes] = []
    refills = 20_000  # each record delivered makes the peer publish another, this many times

    def deliver(kind: int, payload: memoryview) -> None:
        got.append(bytes(payload))
        if len(got) <= refills:
            assert sender.send(samehost.KIND_HEADER, [b"%d" % (600 + len(got) - 1)])

    receiver = samehost.RingReceiver(asyncio.get_running_loop(), deliver, lambda exc: None, lambda: False,
                                     capacity=SMALL_RING)
    sender = samehost.RingSender(receiver.offer())
    try:
        for i in range(600):  # more than one batch
            assert sender.send(samehost.KIND_HEADER, [b"%d" % i])
        receiver.drain()
        assert got == [b"%d" % i for i in range(600)]  # (before: 600 + refills)
        async with asyncio.timeout(5):
            while len(got) < 600 + refills:
                await asyncio.sleep(0)
        assert got == [b"%d" % i for i in range(600 + refills)]
    finally:
        sender.close()
        receiver.close()


async def test_a_peer_that_keeps_its_ring_full_cannot_hold_the_loop_in_drain(make_agent):
    """A same-host peer in another process writes records into our ring as fast as it can,
    then a header comes over UCX that makes us drain the ring first (its Goodbye): drain()
    takes what was published before it and returns; the loop is held for well under the
    flood.  Before, it went on while the peer refilled the ring: held for the whole flood
    (heartbeats stopped: other peers dropped us)."""
    import json
    import subprocess
    import sys

    import msgspec

    a, b = await pair(make_agent)
    flood = 3.0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    offer = msgspec.json.encode(b.transport.links["a"].ring_in.offer()).decode()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.helpers.rogue", "ring-flood", offer, str(flood), cwd=root,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert json.loads(await asyncio.wait_for(child.stdout.readline(), 30)) == {"mapped": True}
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        await asyncio.sleep(0.3)  # the flood is on: turns take it a batch at a time, and yield
        assert "a" in b.peers
        a.transport.links["b"].lane.send(encode_header(Goodbye()), HEADER_TAG, lambda _error: None)
        started = time.monotonic()
        await asyncio.sleep(0.01)  # the Goodbye arrives: b drains, then removes a
        await asyncio.sleep(0.01)
        held = time.monotonic() - started
        assert held < flood / 3, f"the loop was held {held:.2f}s (a flood of {flood}s)"
        assert child.returncode is None  # still flooding
        async with asyncio.timeout(5):
            while "a" in b.peers:
                await asyncio.sleep(0.01)
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


@pytest.mark.parametrize("pool", [1, 64, 64 + 65])
async def test_an_offer_of_a_pool_that_is_not_one_is_refused_before_any_mapping(pool):
    """A ring offer whose pool is not a control line and whole frame slots is refused (headers
    then go over UCX) before anything is mapped, even when the memfd holds exactly that many
    bytes after the ring; a receiver is never made with such a pool."""
    import msgspec

    from omni_async.memfd import SharedSegment
    from omni_async.transport.ring import ring_size
    from omni_async.transport.shared import Refused

    with pytest.raises(ValueError, match="shared pool"):
        samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: None, lambda exc: None,
                              lambda: False, capacity=SMALL_RING, pool_bytes=pool)
    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: None,
                                     lambda exc: None, lambda: False, capacity=SMALL_RING)
    forged = SharedSegment(ring_size(SMALL_RING) + pool)  # a ring memfd of exactly that layout
    try:
        offer = msgspec.structs.replace(receiver.offer(), fd=forged.fd, token=forged.token, pool=pool)
        before = mapped(forged.token)  # the segment's own mapping
        with pytest.raises(Refused, match="shared pool"):
            samehost.RingSender(offer)
        assert mapped(forged.token) == before
    finally:
        forged.close()
        receiver.close()


@pytest.mark.parametrize("head", [8 * 31 + 4, (1 << 64) - 8, 1 << 62])
def test_a_producer_refuses_a_ring_whose_head_no_new_ring_has(head):
    """The consumer makes the ring (head 0); a head that is no record boundary, or so high
    the u64 counters would wrap, is refused with RingError, not met later as a struct or
    memoryview error inside a send.  Its views are let go (the buffer can be resized)."""
    buffer = bytearray(ring_size(256))
    struct.pack_into("<QQ", buffer, 0, head, 0)
    struct.pack_into("<Q", buffer, 64, head)  # tail == head: "empty"
    with pytest.raises(RingError, match="head"):
        Producer(memoryview(buffer))
    buffer.extend(b"x")  # BufferError if a view of it were still held


async def test_an_offer_of_a_ring_with_a_forged_head_is_refused_and_leaves_nothing_open():
    """A ring offer whose memfd holds a head no new ring has is refused (headers then go over
    UCX): neither the mapping nor the peer's pipe stays open here."""
    import msgspec

    from omni_async.memfd import SharedSegment
    from omni_async.transport.shared import Refused

    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: None,
                                     lambda exc: None, lambda: False, capacity=SMALL_RING)
    forged = SharedSegment(ring_size(SMALL_RING))
    forged.array[:8] = np.frombuffer(struct.pack("<Q", 252), np.uint8)  # head: not a record boundary
    try:
        offer = msgspec.structs.replace(receiver.offer(), fd=forged.fd, token=forged.token)
        before, fds = mapped(forged.token), fd_targets()
        with pytest.raises(Refused, match="head"):
            samehost.RingSender(offer)
        assert mapped(forged.token) == before
        assert fd_targets() == fds  # the pipe opened through /proc was closed again
    finally:
        forged.close()
        receiver.close()


async def test_an_offer_of_a_ring_too_small_for_every_header_is_refused_before_any_mapping():
    """A ring whose records cannot carry every header (a 64-byte one carries 24 bytes: a write
    of a few runs does not fit) is refused before anything is mapped: its offer does not decode
    (a protocol violation), a sender is never made for one (a put of a header it cannot hold
    raised an untyped ValueError out of ``write_blocks``, after the rows were copied) and a
    receiver never offers one.  The smallest that may be offered carries the largest header."""
    import msgspec

    from omni_async.errors import ProtocolError
    from omni_async.memfd import SharedSegment
    from omni_async.transport.shared import Refused
    from omni_async.wire import MAX_HEADER_BYTES, decode_framed

    assert max_payload(SMALL_RING) >= MAX_HEADER_BYTES > max_payload(SMALL_RING // 2)
    with pytest.raises(ValueError, match="every header"):
        samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: None, lambda exc: None,
                              lambda: False, capacity=SMALL_RING // 2)
    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: None,
                                     lambda exc: None, lambda: False, capacity=SMALL_RING)
    try:
        assert decode_framed(encode_header(receiver.offer()))[0] == receiver.offer()
        for capacity in (64, SMALL_RING // 2):
            forged = SharedSegment(ring_size(capacity))  # a real ring of that size, mappable
            try:
                offer = msgspec.structs.replace(receiver.offer(), fd=forged.fd, token=forged.token, capacity=capacity)
                with pytest.raises(ProtocolError, match=f">= {SMALL_RING}"):
                    decode_framed(encode_header(offer))
                before, fds = mapped(forged.token), fd_targets()
                with pytest.raises(Refused, match="every header"):
                    samehost.RingSender(offer)
                assert mapped(forged.token) == before and fd_targets() == fds
            finally:
                forged.close()
    finally:
        receiver.close()


async def test_a_bug_in_batch_done_does_not_stop_the_ring():
    """A ``batch_done`` that raises (an owner's bug) is logged; the turn still ends as turns
    do, so the next record wakes the receiver and is delivered."""
    got: list[bytes] = []
    calls: list[int] = []

    def batch_done() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")

    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: got.append(bytes(payload)),
                                     lambda exc: None, lambda: False, capacity=SMALL_RING, batch_done=batch_done)
    sender = samehost.RingSender(receiver.offer())
    try:
        assert sender.send(samehost.KIND_HEADER, [b"one"])
        for _ in range(200):
            await asyncio.sleep(0.005)
            if calls:
                break
        assert got == [b"one"] and calls == [1]
        assert sender.send(samehost.KIND_HEADER, [b"two"])
        for _ in range(200):
            await asyncio.sleep(0.005)
            if len(got) == 2:
                break
        assert got == [b"one", b"two"] and len(calls) == 2
    finally:
        sender.close()
        receiver.close()


async def test_a_receiver_told_to_stay_awake_takes_a_record_without_a_wake_up_then_sleeps():
    """While told to stay awake (an intent's commit is due) the receiver polls its ring turn
    after turn: a record from another thread is taken with no pipe wake-up.  Told it is over,
    or once the time is up, it sleeps: no turns while idle."""
    got: list[bytes] = []
    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: got.append(bytes(payload)),
                                     lambda exc: None, lambda: False, capacity=SMALL_RING)
    receiver.lost_core = float("inf")  # a loaded host may take its core away mid-spin: not here
    sender = samehost.RingSender(receiver.offer())
    try:
        await asyncio.sleep(0.02)
        turns = receiver.turns
        receiver.stay_awake(5.0)
        await asyncio.sleep(0.05)
        assert receiver.turns > turns + 2  # polling, the loop's other callbacks in between
        wakeups = receiver.wakeups
        await asyncio.to_thread(sender.send, samehost.KIND_HEADER, [b"commit"])
        async with asyncio.timeout(5):
            while not got:
                await asyncio.sleep(0)
        assert got == [b"commit"] and receiver.wakeups == wakeups  # no wake-up was needed
        receiver.stay_awake(0)
        await asyncio.sleep(0.05)
        turns = receiver.turns
        await asyncio.sleep(0.1)
        assert receiver.turns == turns  # asleep
        receiver.stay_awake(0.03)  # nothing comes: bounded
        await asyncio.sleep(0.15)
        turns = receiver.turns
        await asyncio.sleep(0.1)
        assert receiver.turns == turns
        assert sender.send(samehost.KIND_HEADER, [b"later"])  # and a record still wakes it
        async with asyncio.timeout(5):
            while len(got) < 2:
                await asyncio.sleep(0.01)
        assert receiver.wakeups == wakeups + 1
    finally:
        sender.close()
        receiver.close()


async def test_a_ring_turn_does_not_spin_while_the_work_it_handed_on_runs(monkeypatch):
    """A record whose delivery hands work to the application (a sink that wakes a chain of
    tasks: ``asyncio.wait_for`` over a queue is three loop turns) is not followed by a spin
    that holds that chain back: the lingering ring polls on the next loop turns instead, and
    spins again only after its ``Handoffs.QUIET`` refusals (was: a 50 µs spin per hop)."""
    from omni_async.transport.turns import Handoffs

    loop = asyncio.get_running_loop()
    events: list[str] = []
    real_spin = samehost.spin

    def spin(poll, seconds):  # fault-injection wrapper around the real spin: records each one
        events.append("spin")
        return real_spin(poll, seconds)

    monkeypatch.setattr(samehost, "spin", spin)
    handoffs = Handoffs()

    def hop(n: int) -> None:
        events.append(f"hop {n}")
        if n < 3:
            loop.call_soon(hop, n + 1)

    def deliver(kind, payload) -> None:
        handoffs.handed()  # as the transport does before it calls a sink
        loop.call_soon(hop, 1)

    receiver = samehost.RingReceiver(loop, deliver, lambda exc: None, lambda: False, capacity=SMALL_RING,
                                     handoffs=handoffs)
    receiver.lost_core = float("inf")
    receiver.linger = 0.5  # it would poll (spin) after this record
    sender = samehost.RingSender(receiver.offer())
    try:
        await asyncio.sleep(0.02)
        events.clear()
        assert sender.send(samehost.KIND_HEADER, [b"notice"])
        await _until(lambda: "hop 3" in events and events.count("spin") >= 1)
        assert events.index("hop 3") < events.index("spin"), events  # the whole chain ran first
    finally:
        sender.close()
        receiver.close()


async def test_rings_sleep_after_traffic_that_handed_work_on(make_agent):
    """Hand-offs refuse spins only for a few turns: after messages to an async sink, transfers
    awaited and with done-callbacks (each a hand-off), both rings, polling as they would for a
    peer in another process, stop turning once the traffic ends; nothing runs while idle."""
    a, b = await pair(make_agent)
    for agent, peer in ((a, "b"), (b, "a")):
        link = agent.transport.links[peer]
        link.ring_out.in_this_process = False  # poll as for a peer in another process
        link.ring_in.linger = samehost.LINGER
    rings = [a.transport.links["b"].ring_in, b.transport.links["a"].ring_in]
    woken: asyncio.Queue[int] = asyncio.Queue()

    async def sink(*_message) -> None:
        await woken.put(1)

    b.set_message_sink(sink)
    called: list[object] = []
    for i in range(50):
        message = a.send_message("b", "k", b"", [np.ones(10 if i % 2 else 70000, np.uint8)])
        message.add_done_callback(called.append)
        await asyncio.wait_for(message, 5)
        await asyncio.wait_for(a.write_blocks("b", [1, 2], [3, 4]), 5)
    assert len(called) == 50 and woken.qsize() == 50
    await asyncio.sleep(0.1)
    turns = [ring.turns for ring in rings]
    cpu = time.process_time()
    await asyncio.sleep(0.5)
    assert [ring.turns for ring in rings] == turns  # asleep
    assert time.process_time() - cpu < 0.05


async def test_settling_an_awaited_transfer_or_delivering_a_message_is_a_hand_off(make_agent, monkeypatch):
    """The transport counts as hand-offs (see ``Handoffs``) what wakes the application: a
    transfer settled while awaited, a message given to the sink; not a transfer nobody awaits."""
    from omni_async.transport.turns import Handoffs

    a, b = await pair(make_agent)
    owner = {id(a.transport._handoffs): "a", id(b.transport._handoffs): "b"}
    handed = {"a": 0, "b": 0}
    real = Handoffs.handed

    def counted(self: Handoffs) -> None:  # a wrapper around the real method: counts per transport
        handed[owner[id(self)]] += 1
        real(self)

    monkeypatch.setattr(Handoffs, "handed", counted)
    b.set_message_sink(lambda *_message: None)
    unawaited = a.write_blocks("b", [1, 2], [3, 4])
    await _until(unawaited.done)
    assert unawaited.error() is None and handed["a"] == 0  # settled with nobody waiting: no hand-off
    await asyncio.wait_for(a.write_blocks("b", [1, 2], [3, 4]), 5)
    assert handed["a"] == 1  # the awaiter was woken
    await asyncio.wait_for(a.send_message("b", "k", b"", [np.ones(8, np.uint8)]), 5)
    assert handed["b"] == 1 and handed["a"] == 2  # b's sink got the message, a's awaiter its answer


async def test_a_receiver_that_loses_its_core_while_staying_awake_sleeps_and_is_woken():
    """A spin that took longer than ``lost_core`` (another process had the core) ends the
    wait for the commit: the receiver sleeps, and the record wakes it (a wake-up lets the
    scheduler run it at once; polling would only take the core from whoever needs it)."""
    got: list[bytes] = []
    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: got.append(bytes(payload)),
                                     lambda exc: None, lambda: False, capacity=SMALL_RING)
    receiver.lost_core = 0.0  # every spin counts as one that lost the core
    sender = samehost.RingSender(receiver.offer())
    try:
        await asyncio.sleep(0.02)
        receiver.stay_awake(5.0)
        await asyncio.sleep(0.05)
        turns, wakeups = receiver.turns, receiver.wakeups
        await asyncio.sleep(0.1)
        assert receiver.turns == turns  # asleep after one fruitless spin, though 5 s were granted
        assert sender.send(samehost.KIND_HEADER, [b"commit"])
        async with asyncio.timeout(5):
            while not got:
                await asyncio.sleep(0.01)
        assert receiver.wakeups == wakeups + 1
    finally:
        sender.close()
        receiver.close()


async def _until(predicate) -> None:
    async with asyncio.timeout(5):
        while not predicate():
            await asyncio.sleep(0)


async def test_a_lingering_receiver_takes_the_next_record_without_a_wake_up_then_sleeps():
    """After the peer's record the receiver polls for ``linger`` seconds (turn after turn): the
    next record of a stream, from another thread, is taken with no pipe wake-up.  Once a
    window passes with nothing, it sleeps: no turns while idle."""
    got: list[bytes] = []
    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: got.append(bytes(payload)),
                                     lambda exc: None, lambda: False, capacity=SMALL_RING)
    receiver.lost_core = float("inf")  # a loaded host may take its core away mid-spin: not here
    receiver.linger = 0.5
    sender = samehost.RingSender(receiver.offer())
    try:
        await asyncio.sleep(0.02)
        assert sender.send(samehost.KIND_HEADER, [b"first"])  # asleep: this one wakes it
        await _until(lambda: got)
        wakeups = receiver.wakeups
        def later() -> None:  # well after one turn's spin (SPIN), well within the window
            time.sleep(0.01)
            sender.send(samehost.KIND_HEADER, [b"next"])

        await asyncio.to_thread(later)
        await _until(lambda: len(got) == 2)
        assert receiver.wakeups == wakeups  # taken while lingering
        await asyncio.sleep(0.7)  # the window runs out
        turns = receiver.turns
        await asyncio.sleep(0.1)
        assert receiver.turns == turns  # asleep
    finally:
        sender.close()
        receiver.close()


async def test_lingering_stops_once_it_no_longer_pays_and_is_off_by_default():
    """After ``SpinGate.MISSES`` windows in which no record came, a record opens no window (the
    receiver sleeps right after it) but every ``LINGER_RETRY``-th; with ``linger`` 0 (the
    default: a peer in this process) it never polls after a record."""
    got: list[bytes] = []
    receiver = samehost.RingReceiver(asyncio.get_running_loop(), lambda kind, payload: got.append(bytes(payload)),
                                     lambda exc: None, lambda: False, capacity=SMALL_RING)
    receiver.lost_core = float("inf")
    sender = samehost.RingSender(receiver.offer())

    async def turns_after_a_record() -> int:
        await asyncio.sleep(0.01)
        turns = receiver.turns
        assert sender.send(samehost.KIND_HEADER, [b"r"])
        await _until(lambda: receiver.turns > turns)
        await asyncio.sleep(0.1)
        return receiver.turns - turns

    try:
        assert await turns_after_a_record() <= 3  # linger 0: take it, one look, sleep
        receiver.linger = 0.03
        polled = [await turns_after_a_record() for _ in range(SpinGate.MISSES + 1)]
        assert all(turns > 5 for turns in polled[: SpinGate.MISSES]), polled  # a window each
        assert polled[SpinGate.MISSES] <= 3, polled  # none pays: no window
        retried = [await turns_after_a_record() for _ in range(samehost.LINGER_RETRY)]
        assert sum(turns > 5 for turns in retried) == 1, retried  # tried again, once
    finally:
        sender.close()
        receiver.close()


# -- two processes, kill -9 of either side ----------------------------------------------------------
POOLED = 256 * 1024
"""A frame size that travels through the receiver's shared pool (``POOL_MIN`` or more)."""


@pytest.mark.alone  # compares /dev/shm before and after: runs after the parallel part (make test)
@pytest.mark.parametrize("size", [8192, POOLED], ids=["in-ring", "pooled"])
async def test_receiver_killed_mid_stream_fails_awaiters_and_leaks_nothing(make_agent, spawn_peer, tmp_path, size):
    before = dev_shm()
    peer = await spawn_peer("serve", str(tmp_path / "region.memfd"), 16, 4096, {"peer_id": "rx"})
    agent = await make_agent(16, 4096, peer_id="tx")
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    link = agent.transport.links["rx"]
    async with asyncio.timeout(5):
        while link.ring_out is None:
            await asyncio.sleep(0.01)
    token = link.ring_out.token
    assert link.ring_out.pool is not None  # frames of POOLED bytes go through it
    frame = np.ones(size, np.uint8)
    transfers = []
    started = time.monotonic()
    killed = False
    while time.monotonic() - started < 0.5 and "rx" in agent.transport.peer_ids:
        if len(transfers) > 64 and not killed:
            peer.proc.kill()
            killed, killed_at = True, time.monotonic()
        transfers.append(agent.send_message("rx", "k", b"", [frame]))
        await asyncio.sleep(0)
    assert killed
    results = await asyncio.wait_for(asyncio.gather(*transfers, return_exceptions=True), 15)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, PeerLost) for r in failures), {type(r) for r in failures}
    async with asyncio.timeout(FAST["heartbeat_timeout"] + 2.0):
        while agent.peers:
            await asyncio.sleep(0.02)
    assert time.monotonic() - killed_at < FAST["heartbeat_timeout"] + 2.0
    await asyncio.wait_for(peer.proc.wait(), 10)
    gc.collect()
    assert mapped(token) == [] and open_fds_to(token) == []
    assert dev_shm() <= before


@pytest.mark.alone  # compares /dev/shm before and after: runs after the parallel part (make test)
@pytest.mark.parametrize("size", [8192, POOLED], ids=["in-ring", "pooled"])
async def test_sender_killed_mid_stream_receiver_keeps_serving(make_agent, spawn_peer, tmp_path, size):
    """Also: frames the sender copied into our shared pool and we still hold stay intact and
    readable after its death (the pool is our memory)."""
    before = dev_shm()
    agent = await make_agent(16, 4096, peer_id="rx", max_message_bytes=1 << 20)
    received, held = [], []
    agent.set_message_sink(lambda peer, key, meta, frames: (received.append(key), held.append(frames[0])))
    sender = await spawn_peer("chat", str(tmp_path / "c.memfd"), 16, 4096, {"peer_id": "tx"}, agent.control_address,
                              str(size))
    assert sender.info == {"connected": "rx"}
    link = agent.transport.links["tx"]
    async with asyncio.timeout(5):
        while len(received) < 200:
            del held[:-8]  # keep the last few
            await asyncio.sleep(0.01)
    assert link.ring_in.pool is not None and (link.ring_in.pool.taken > 0) == (size == POOLED)
    assert link.ring_in is not None and link.ring_in.wakeups > 0
    assert link.ring_in.linger == samehost.LINGER  # a peer in another process: poll for its next record
    mine = link.ring_in.offer().token
    pipe = os.readlink(f"/proc/self/fd/{link.ring_in.fds[1]}")
    sender.kill()
    killed_at = time.monotonic()
    async with asyncio.timeout(FAST["heartbeat_timeout"] + 2.0):
        while "tx" in agent.peers:
            await asyncio.sleep(0.02)
    assert time.monotonic() - killed_at < FAST["heartbeat_timeout"] + 2.0
    await asyncio.wait_for(sender.proc.wait(), 10)
    pattern = np.arange(size, dtype=np.uint8)
    assert held and all((frame == pattern).all() for frame in held[-8:])
    held.clear()  # pooled frames keep our ring's mapping (and the descriptor mmap holds) until dropped
    gc.collect()
    assert open_fds_to(mine) == [] and pipe not in fd_targets()  # our ring's memfd and pipe: closed
    other = await spawn_peer("serve", str(tmp_path / "o.memfd"), 16, 4096, {"peer_id": "o"})
    await asyncio.wait_for(agent.connect(other.info["address"]), 10)
    await asyncio.wait_for(agent.send_message("o", "k", b"", [np.ones(10, np.uint8)]), 10)
    assert dev_shm() <= before
