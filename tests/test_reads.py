"""Pull reads (``read_blocks``): both lanes, refusal before any I/O, splitting, cancel modes,
and kill -9 of the source process mid-read."""

import asyncio
import time

import numpy as np
import pytest

from omni_async import DeadlineExceeded, InvalidBlocks, PeerLost, ReadsNotAllowed, TransferCancelled, TransferRefused
from omni_async.transport import block_writes
from omni_async.wire import HEADER_TAG, MAX_HEADER_BYTES, READ_RUNS_PER_REQUEST, ReadRequest, encode_header

from .conftest import FAST
from .helpers.rogue import Rogue

pytestmark = pytest.mark.timeout(60)
LANES = [pytest.param(True, id="same-host"), pytest.param(False, id="ucx")]


def fill(agent, seed=1):
    agent.region.array[:] = np.random.default_rng(seed).integers(0, 256, agent.region.array.shape, dtype=np.uint8)


async def pair(make_agent, same_host, num_blocks=64, block_len=4096, rx=None, src=None):
    a = await make_agent(num_blocks, block_len, peer_id="a", same_host_lane=same_host, **(rx or {}))
    b = await make_agent(num_blocks, block_len, peer_id="b", same_host_lane=same_host,
                         **{"allow_reads": True, **(src or {})})
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await asyncio.wait_for(b.wait_for_peer("a"), 5)
    return a, b


def test_worst_case_read_request_fits_a_header():
    big = (1 << 63) - 1
    assert len(encode_header(ReadRequest(big, [(big, big, big)] * READ_RUNS_PER_REQUEST))) <= MAX_HEADER_BYTES


@pytest.mark.parametrize("same_host", LANES)
async def test_read_copies_the_peers_rows_into_ours_and_nothing_else(make_agent, same_host):
    a, b = await pair(make_agent, same_host)
    fill(b, 3)
    remote, local = [5, 6, 7, 30, 2, 63], [10, 11, 12, 1, 40, 0]
    read = a.read_blocks("b", remote, local)
    assert read.done() == same_host  # same host: copied from the mapped region at once
    await asyncio.wait_for(read, 5)
    assert np.array_equal(a.region.array[local], b.region.array[remote])
    assert not a.region.array[sorted(set(range(64)) - set(local))].any()
    assert a.peers["b"].allow_reads and not b.peers["a"].allow_reads  # announced at the handshake


async def test_read_of_a_peer_that_does_not_allow_it_fails_before_any_io(make_agent):
    a, b = await pair(make_agent, False, src={"allow_reads": False})
    fill(b)
    with pytest.raises(ReadsNotAllowed):
        a.read_blocks("b", [0], [0])
    assert a.transport.in_flight() == [] and a.stats()["in_flight"] == 0
    # A peer that asks anyway (bypassing its own check) is refused, and nothing is written.
    link = a.transport.links["b"]
    link.lane.send(encode_header(ReadRequest(1 << 40, [(0, 0, 64)])), HEADER_TAG, lambda _e: None)
    async with asyncio.timeout(5):
        while not b.stats().get("received.blocks.reads_not_allowed"):
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert not a.region.array.any() and "b" in a.peers


async def test_invalid_indices_raise_before_any_io(make_agent):
    a, _ = await pair(make_agent, False)
    with pytest.raises(InvalidBlocks):
        a.read_blocks("b", [64], [0])
    with pytest.raises(InvalidBlocks):
        a.read_blocks("b", [0, 1], [0])
    assert a.transport.in_flight() == []


async def test_large_scattered_read_is_split_both_ways(make_agent):
    """More runs than one ReadRequest carries, answered by a write split to the reader's
    max_write_blocks: one transfer, every row."""
    a, b = await pair(make_agent, False, num_blocks=8192, block_len=64, rx={"max_write_blocks": 500})
    fill(b, 5)
    remote = list(range(0, 8192, 2))  # 4096 runs
    local = list(range(1, 8192, 2))
    await asyncio.wait_for(a.read_blocks("b", remote, local), 20)
    assert np.array_equal(a.region.array[local], b.region.array[remote])
    assert not a.region.array[0::2].any()


async def test_read_cancel_modes(make_agent):
    a, b = await pair(make_agent, False)
    fill(b, 9)
    rows = list(range(64))
    now = a.read_blocks("b", rows, rows)
    assert a.cancel([now.id], "immediate") == []
    with pytest.raises(TransferCancelled):
        await now
    later = a.read_blocks("b", rows, rows)
    assert a.cancel([later.id], "wait") == [later.id]
    with pytest.raises(TransferCancelled):
        await asyncio.wait_for(later, 5)
    assert np.array_equal(a.region.array, b.region.array)  # "wait": the peer's write landed


async def test_read_deadline(make_agent):
    """A source that never answers: the read fails with DeadlineExceeded, as a write would."""
    a = await make_agent(peer_id="a", transfer_timeout=0.3)
    async with Rogue.join(a.control_address, allow_reads=True):
        await asyncio.wait_for(a.wait_for_peer("rogue"), 5)
        read = a.read_blocks("rogue", [0, 1], [0, 1])
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(read, 5)
    assert not a.region.array.any()


async def test_a_reader_cannot_make_the_source_hold_unbounded_reads(make_agent, monkeypatch):
    """Each read request is a write the source serves, waiting behind the reader's window: a
    reader that never answers and keeps asking (a few bytes a request) made the source hold
    every one of them.  Past ``MAX_SERVED_READS`` at once they are refused, the reader told
    why; the source serves again once reads end."""
    monkeypatch.setattr(block_writes, "MAX_SERVED_READS", 8)
    b = await make_agent(peer_id="b", allow_reads=True)
    async with Rogue.join(b.control_address) as rogue:  # it never answers b's writes
        await asyncio.wait_for(b.wait_for_peer("rogue"), 5)
        for i in range(40):
            rogue.send(encode_header(ReadRequest(i, [(0, 0, 64)])), HEADER_TAG)
        link = b.transport.links["rogue"]
        async with asyncio.timeout(5):
            while link.reads_served + link.reads_refused < 40:
                await asyncio.sleep(0.005)
        assert (link.reads_served, link.reads_refused) == (8, 32)
        assert len(link.sent) == 8  # the writes serving them, no more
    # A well-behaved reader is served, and told when it asks for too much at once.
    a = await make_agent(peer_id="a")
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await asyncio.wait_for(b.wait_for_peer("a"), 5)
    fill(b, 4)
    reads = [a.read_blocks("b", [i], [i]) for i in range(12)]
    outcomes = await asyncio.wait_for(asyncio.gather(*reads, return_exceptions=True), 10)
    assert all(o is None or isinstance(o, TransferRefused) for o in outcomes), outcomes
    served = [i for i, o in enumerate(outcomes) if o is None]
    assert len(served) >= 8 and np.array_equal(a.region.array[served], b.region.array[served])
    await asyncio.wait_for(a.read_blocks("b", [20], [20]), 5)  # and again once they ended


async def test_a_read_request_cannot_ask_for_more_than_the_readers_region(make_agent):
    """A request of a few bytes may name 2,048 runs, each as long as the reader's region: the
    source wrote 2,048 regions' worth of rows into it (each row many times) for one request.
    A request for more blocks than the reader's region has rows is refused (`InvalidBlocks`,
    logged once), nothing written for it; a read of the whole region is served.  The reader's
    own ``read_blocks`` refuses such a read before any I/O."""
    b = await make_agent(peer_id="b", allow_reads=True)
    async with Rogue.join(b.control_address) as rogue:  # its region: 64 blocks
        await asyncio.wait_for(b.wait_for_peer("rogue"), 5)
        rogue.send(encode_header(ReadRequest(1, [(0, 0, 64)] * READ_RUNS_PER_REQUEST)), HEADER_TAG)
        rogue.send(encode_header(ReadRequest(2, [(0, 0, 32), (32, 0, 32), (0, 32, 1)])), HEADER_TAG)
        rogue.send(encode_header(ReadRequest(3, [(0, 0, 32), (32, 32, 32)])), HEADER_TAG)
        link = b.transport.links["rogue"]
        async with asyncio.timeout(5):
            while link.reads_served + link.reads_refused < 3:
                await asyncio.sleep(0.005)
        assert (link.reads_served, link.reads_refused) == (1, 2)
        assert len(link.sent) == 1  # the write serving the whole region, no more
    a = await make_agent(peer_id="a")
    await asyncio.wait_for(a.connect(b.control_address), 5)
    with pytest.raises(InvalidBlocks):
        a.read_blocks("b", [0] * 65, [0] * 65)
    assert a.transport.in_flight() == []


NUM_BLOCKS, BLOCK_LEN = 64, 64 * 1024


@pytest.mark.timeout(90)
async def test_source_killed_mid_read_fails_awaiters_in_time_and_spares_other_rows(make_agent, spawn_peer, tmp_path):
    src = await spawn_peer("serve", str(tmp_path / "region"), NUM_BLOCKS, BLOCK_LEN,
                           {"peer_id": "src", "allow_reads": True, "ucx_tls": "tcp"})
    a = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="rx", same_host_lane=False, ucx_tls="tcp")
    a.region.array[32:] = 7  # not read into: must stay as it is
    await asyncio.wait_for(a.connect(src.info["address"]), 10)
    half = list(range(32))
    await asyncio.wait_for(a.read_blocks("src", half, half), 10)
    reads = [a.read_blocks("src", half, half) for _ in range(128)]  # 256 MiB asked for
    src.kill()
    killed = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*reads, return_exceptions=True), 15)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures, "the kill came too late to catch a read in flight"
    assert all(isinstance(r, PeerLost) for r in failures), {type(r) for r in failures}
    assert time.monotonic() - killed < FAST["heartbeat_timeout"] + 2.0
    assert (a.region.array[32:] == 7).all()


async def test_a_caller_awaiting_reads_that_settle_at_once_does_not_starve_the_loop(make_agent):
    """Reads from a mapped peer settle before ``read_blocks`` returns; awaiting them in a loop
    for longer than the heartbeat timeout still lets the loop run: timers fire, heartbeats
    flow, both sides keep the pair."""
    a, b = await pair(make_agent, True)
    read = a.read_blocks("b", [1], [2])
    assert read.done()  # the case at hand: settled on return
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0.01)
            turns += 1

    ticking = asyncio.create_task(ticker())
    try:
        until = time.monotonic() + FAST["heartbeat_timeout"] * 1.5
        reads = 0
        while time.monotonic() < until:
            await a.read_blocks("b", [1], [2])
            reads += 1
    finally:
        ticking.cancel()
    assert reads > 100 and turns >= 30  # 10 ms timers kept firing (~150 if never delayed; 0 starved)
    assert "b" in a.peers and "a" in b.peers  # neither side went silent
