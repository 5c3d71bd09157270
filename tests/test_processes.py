"""Two real processes on loopback: writes verified in the peer's memory, and kill -9 of either side.

The peer process maps its region from a file, so this process can check every byte it holds.
"""

import asyncio
import json
import os
import signal
import time

import numpy as np
import pytest

from omni_async import PeerEvent, PeerLost

from .conftest import FAST
from .helpers.kill import assert_lost_in_time

pytestmark = pytest.mark.timeout(90)

NUM_BLOCKS, BLOCK_LEN = 64, 64 * 1024
SHIPPED_TLS = ["^cma", "tcp", "tcp-tags"]
"""Every UCX_TLS setting we ship or document; each is proven by the kill -9 tests below.  Over
tcp block writes go as one-sided puts (``ucx_puts``, the default); ``tcp-tags`` is tcp with
puts off (tag messages)."""


def ucx(tls: str) -> dict[str, object]:
    """The agent config of a ``SHIPPED_TLS`` entry."""
    return {"ucx_tls": "tcp", "ucx_puts": False} if tls == "tcp-tags" else {"ucx_tls": tls}


async def until_puts(agent, peer_id, tls):
    """Over tcp with puts on, wait until writes to the peer go as puts (its keys were vetted)."""
    if tls != "tcp":
        return
    async with asyncio.timeout(10):
        while agent.transport.links[peer_id].remote_keys is None:
            await asyncio.sleep(0.005)


def peer_region(path):
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(NUM_BLOCKS, BLOCK_LEN))


@pytest.mark.parametrize("tls", SHIPPED_TLS)
async def test_writes_land_in_the_other_process(make_agent, spawn_peer, tmp_path, tls):
    path = str(tmp_path / "region")
    peer = await spawn_peer("serve", path, NUM_BLOCKS, BLOCK_LEN, {**ucx(tls), "peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx", **ucx(tls))
    rng = np.random.default_rng(7)
    agent.region.array[:] = rng.integers(0, 256, agent.region.array.shape, dtype=np.uint8)
    assert await asyncio.wait_for(agent.connect(peer.info["address"]), 10) == "rx"
    await until_puts(agent, "rx", tls)

    scattered_local = [3, 9, 10, 11, 40, 2]
    scattered_remote = [50, 0, 1, 2, 33, 20]
    contiguous = list(range(8, 24))
    await asyncio.wait_for(agent.write_blocks("rx", scattered_local, scattered_remote), 10)
    await asyncio.wait_for(agent.write_blocks("rx", contiguous, [i - 4 for i in contiguous]), 10)

    remote = peer_region(path)
    expected = np.zeros_like(agent.region.array)
    expected[scattered_remote] = agent.region.array[scattered_local]
    expected[[i - 4 for i in contiguous]] = agent.region.array[contiguous]
    assert np.array_equal(remote, expected)  # written blocks exact, untouched blocks still zero

    await asyncio.wait_for(agent.send_message("rx", "req:0:0", b"m", [b"abc", np.arange(3, dtype=np.int16)]), 10)
    assert await peer.stop() == 0
    lines = [json.loads(line) for line in open(path + ".messages")]
    assert lines == [{"peer": "tx", "key": "req:0:0", "meta": b"m".hex(),
                      "frames": [b"abc".hex(), np.arange(3, dtype=np.int16).tobytes().hex()]}]


@pytest.mark.parametrize("tls", SHIPPED_TLS)
async def test_receiver_killed_mid_transfer_fails_awaiters_in_time(make_agent, spawn_peer, tmp_path, tls):
    """The sender (this process) survives, and every awaiter fails with PeerLost promptly.

    Blocks go through UCX here (the same-host lane copies each write before ``write_blocks``
    returns, so nothing would be queued at the kill): tests/test_shared.py proves the same
    rule for that lane."""
    path = str(tmp_path / "region")
    peer = await spawn_peer("serve", path, NUM_BLOCKS, BLOCK_LEN, {**ucx(tls), "peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx", **ucx(tls), same_host_lane=False)
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    await until_puts(agent, "rx", tls)
    everything = list(range(NUM_BLOCKS))
    await asyncio.wait_for(agent.write_blocks("rx", everything, everything), 10)

    # The receiver is stopped while 512 MiB of writes are posted (else, on a loaded host, it may
    # take all of them before the kill: a fresh clone's suite once saw every write done), then
    # runs for a moment, the bytes flowing, and is killed mid-transfer.
    os.kill(peer.proc.pid, signal.SIGSTOP)
    transfers = [agent.write_blocks("rx", everything, everything) for _ in range(128)]
    os.kill(peer.proc.pid, signal.SIGCONT)
    await asyncio.sleep(0.02)  # (512 MiB take far longer than this, at any speed loopback has)
    peer.kill()
    killed_at = time.monotonic()
    await assert_lost_in_time(agent, transfers, killed_at)
    # This process keeps working: a new peer can join and receive.
    peer2 = await spawn_peer("serve", str(tmp_path / "region2"), NUM_BLOCKS, BLOCK_LEN,
                             {**ucx(tls), "peer_id": "rx2"})
    await asyncio.wait_for(agent.connect(peer2.info["address"]), 10)
    await until_puts(agent, "rx2", tls)
    await asyncio.wait_for(agent.write_blocks("rx2", [1], [2]), 10)


@pytest.mark.parametrize("tls", SHIPPED_TLS)
async def test_sender_killed_mid_transfer_receiver_keeps_serving(make_agent, spawn_peer, tmp_path, tls):
    """kill -9 of a sender in the middle of its writes: the receiver (this process) drops it in
    time, no byte lands outside the rows the writes announced, and the next sender's write
    arrives intact."""
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="rx", **ucx(tls))
    agent.region.array[:] = 0xAB
    first, count = 16, 32  # the writer's blocks go to rows 16..47 only
    events: list[PeerEvent] = []
    agent.add_peer_listener(events.append)
    # blocks through UCX (tests/test_shared.py proves this rule for the same-host lane)
    writer = await spawn_peer("write", str(tmp_path / "w"), NUM_BLOCKS, BLOCK_LEN,
                              {**ucx(tls), "peer_id": "tx", "same_host_lane": False}, agent.control_address,
                              str(first), str(count))
    assert writer.info == {"connected": "rx", **({"puts": True} if tls == "tcp" else {})}
    sent = np.array(peer_region(str(tmp_path / "w"))[:count])
    while not (agent.region.array[first:first + count] == sent).all():  # at least one write landed
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # writes are continuously in flight
    writer.kill()
    killed_at = time.monotonic()
    while "tx" in agent.peers:
        assert time.monotonic() - killed_at < FAST["heartbeat_timeout"] + 2.0
        await asyncio.sleep(0.02)
    assert [e.kind for e in events] == ["joined", "left"] and isinstance(events[1].error, PeerLost)
    outside = np.r_[0:first, first + count:NUM_BLOCKS]
    assert (agent.region.array[outside] == 0xAB).all(), "a byte landed outside the announced rows"
    # Still serving: the next sender's write lands intact, and this side can send too.
    nxt = await spawn_peer("write", str(tmp_path / "n"), NUM_BLOCKS, BLOCK_LEN,
                           {**ucx(tls), "peer_id": "tx2"}, agent.control_address, "0", "8", "once")
    assert nxt.info == {"connected": "rx", **({"puts": True} if tls == "tcp" else {})}
    line = await asyncio.wait_for(nxt.proc.stdout.readline(), 10)
    assert json.loads(line) == {"written": 8}
    assert np.array_equal(agent.region.array[:8], peer_region(str(tmp_path / "n"))[:8])
    assert (agent.region.array[first + count:] == 0xAB).all()
    other = await spawn_peer("serve", str(tmp_path / "o"), NUM_BLOCKS, BLOCK_LEN, {**ucx(tls), "peer_id": "o"})
    await asyncio.wait_for(agent.connect(other.info["address"]), 10)
    await until_puts(agent, "o", tls)
    agent.region.array[5] = 42
    await asyncio.wait_for(agent.write_blocks("o", [5], [6]), 10)
    assert (peer_region(str(tmp_path / "o"))[6] == 42).all()


async def test_chunk_streams_across_processes_and_a_receiver_restart(make_service, spawn_peer, tmp_path):
    """Ordered streams into another process; the receiver is killed mid-stream and replaced:
    the sender's saves fail with PeerLost, and the same requests then stream to the new one."""
    from omni_async import workload

    tx = await make_service("tx")
    plan = workload.Plan(stage="s", requests=16, chunks=100, sizes=tuple(4 * (2048 + i) for i in range(100)))
    sender = tx.adapter(plan.stage, peer_id="rx")
    requests = [plan.request_id(r) for r in range(plan.requests)]

    async def stream_all(rx_peer):
        await asyncio.wait_for(tx.agent.connect(rx_peer.info["address"]), 10)
        await workload.announce(tx, "rx", plan, 0)
        return [sender.save_async(plan.request_id(r), workload.make_chunk(plan, r, i), final=i == 99)
                for i in range(100) for r in range(plan.requests)]

    first = await spawn_peer("streams", str(tmp_path / "a"), 1, 4096, {"peer_id": "rx"})
    saves = await stream_all(first)
    while sum(s.done() for s in saves) < 100:  # kill it mid-stream
        await asyncio.sleep(0.001)
    first.kill()
    results = await asyncio.wait_for(asyncio.gather(*saves, return_exceptions=True), 15)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all(isinstance(r, PeerLost) for r in failed), {type(r) for r in failed}
    await asyncio.wait_for(_until_gone(tx.agent, "rx"), 10)
    for request in requests:
        sender.cancel(request)  # the old streams are gone with the old receiver
    second = await spawn_peer("streams", str(tmp_path / "b"), 1, 4096, {"peer_id": "rx"})
    saves = await stream_all(second)
    await asyncio.wait_for(asyncio.gather(*saves), 30)
    line = await asyncio.wait_for(second.proc.stdout.readline(), 30)
    assert json.loads(line) == {"verified": 16 * 100, "bad": 0}


async def _until_gone(agent, peer_id):
    while peer_id in agent.peers:
        await asyncio.sleep(0.02)
