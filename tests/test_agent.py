"""Two agents in one process, over real ZeroMQ sockets and real UCX lanes."""

import asyncio

import numpy as np
import pytest
import zmq
import zmq.asyncio

from omni_async import (
    Agent,
    BlockRegion,
    ClosedError,
    DeadlineExceeded,
    FingerprintMismatch,
    HandshakeRejected,
    HandshakeTimeout,
    InvalidBlocks,
    LayoutMismatch,
    PeerLost,
    TransferCancelled,
    UnknownPeer,
    VersionMismatch,
)
from omni_async.control import end_monitor
from omni_async.wire import Hello, Reject, decode_control, encode_control

from .conftest import fast_config, leftover_tasks

pytestmark = pytest.mark.timeout(60)


def fill(agent, seed=1):
    rng = np.random.default_rng(seed)
    agent.region.array[:] = rng.integers(0, 256, agent.region.array.shape, dtype=np.uint8)


async def pair(make_agent, **config):
    a = await make_agent(peer_id="a", **config)
    b = await make_agent(peer_id="b", **config)
    assert await asyncio.wait_for(a.connect(b.control_address), 5) == "b"
    await asyncio.wait_for(b.wait_for_peer("a"), 5)
    return a, b


async def test_handshake_both_sides_know_each_other(make_agent):
    a, b = await pair(make_agent)
    assert set(a.peers) == {"b"} and set(b.peers) == {"a"}
    assert a.peers["b"].num_blocks == b.region.num_blocks
    assert b.peers["a"].base_addr == a.region.base_addr


async def test_scattered_and_contiguous_writes_byte_for_byte(make_agent):
    a, b = await pair(make_agent)
    fill(a)
    local = [5, 6, 7, 8, 30, 2, 63, 0]
    remote = [10, 11, 12, 13, 1, 40, 0, 63]
    await asyncio.wait_for(a.write_blocks("b", local, remote), 5)
    for li, ri in zip(local, remote):
        assert np.array_equal(b.region.array[ri], a.region.array[li])
    untouched = sorted(set(range(64)) - set(remote))
    assert not b.region.array[untouched].any()
    # contiguous, the other way round
    fill(b, seed=2)
    await asyncio.wait_for(b.write_blocks("a", list(range(16, 48)), list(range(32))), 5)
    assert np.array_equal(a.region.array[:32], b.region.array[16:48])


async def test_a_plan_made_elsewhere_is_written_only_to_the_layout_it_was_made_for(make_agent):
    """``write_runs`` (the sync facade plans in its caller's thread) writes a plan as
    ``write_blocks`` would, and refuses one made for another peer layout before any byte moves."""
    from omni_async.region import plan_runs

    a, b = await pair(make_agent)
    fill(a)
    local, remote = [3, 4, 5, 9], [20, 21, 22, 0]
    runs = plan_runs(local, remote, a.region.num_blocks, b.region.num_blocks)
    with pytest.raises(InvalidBlocks, match="planned for a peer of 32 blocks"):
        a.transport.write_runs("b", runs, len(local), remote_blocks=32)
    assert not b.region.array.any()
    await asyncio.wait_for(a.transport.write_runs("b", runs, len(local), remote_blocks=b.region.num_blocks), 5)
    for li, ri in zip(local, remote):
        assert np.array_equal(b.region.array[ri], a.region.array[li])
    with pytest.raises(UnknownPeer):
        a.transport.write_runs("nobody", runs, len(local), remote_blocks=b.region.num_blocks)


async def test_many_concurrent_transfers(make_agent):
    a, b = await pair(make_agent, )
    fill(a)
    transfers = [a.write_blocks("b", [i], [63 - i]) for i in range(64) for _ in range(4)]
    assert len({t.id for t in transfers}) == len(transfers)
    await asyncio.wait_for(asyncio.gather(*transfers), 20)
    assert np.array_equal(b.region.array[::-1], a.region.array)


async def test_a_write_on_an_agent_not_started_or_closed_raises_closed_error(make_agent):
    agent = Agent(BlockRegion.allocate(4, 4096), fast_config(peer_id="idle"))
    with pytest.raises(ClosedError, match="not started"):
        agent.write_blocks("b", [0], [0])
    a, _ = await pair(make_agent)
    await a.close()
    with pytest.raises(ClosedError):
        a.write_blocks("b", [0], [0])


async def test_empty_write_completes(make_agent):
    a, _ = await pair(make_agent)
    transfer = a.write_blocks("b", [], [])
    assert transfer.done()
    await transfer


async def test_fingerprint_mismatch_rejected_with_reason_on_both_sides(make_agent):
    a = await make_agent(peer_id="a", config_fields={"model": "x"})
    b = await make_agent(peer_id="b", config_fields={"model": "y"})
    with pytest.raises(FingerprintMismatch, match="fingerprint"):
        await a.connect(b.control_address)
    assert b.control.stats.rejected == 1
    assert a.peers == {} and b.peers == {}


async def test_empty_fingerprint_is_compatible(make_agent):
    a = await make_agent(peer_id="a", config_fields={"model": "x"})
    b = await make_agent(peer_id="b")
    assert await a.connect(b.control_address) == "b"


async def test_layout_mismatch_rejected(make_agent):
    a = await make_agent(peer_id="a", block_len=4096)
    b = await make_agent(peer_id="b", block_len=8192)
    with pytest.raises(LayoutMismatch, match="block_len"):
        await a.connect(b.control_address)
    assert b.peers == {} and a.peers == {}


async def test_version_mismatch_from_raw_socket(make_agent):
    b = await make_agent(peer_id="b")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(b.control_address)
        hello = Hello(version=99, peer_id="x", nonce=1, agent_metadata=b"", base_addr=0,
                      num_blocks=64, block_len=4096, fingerprint="")
        await sock.send(encode_control(hello))
        reply = decode_control(await asyncio.wait_for(sock.recv(), 5))
        assert isinstance(reply, Reject) and reply.code == VersionMismatch.code
    finally:
        sock.close(0)
        ctx.term()
    assert b.peers == {}


async def test_handshake_timeout(make_agent):
    a = await make_agent(peer_id="a", handshake_timeout=0.3)
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(HandshakeTimeout):
            await a.connect(f"tcp://127.0.0.1:{port}")
    finally:
        silent.close(0)
        ctx.term()
    assert a.peers == {}


async def test_a_monitor_that_ends_keeps_the_context_working():
    """``end_monitor`` stops a socket reporting before it closes the monitor's reading end:
    the socket's connection dropping afterwards must not block libzmq's I/O thread (closing
    the reading end first blocked it for good, measured: every later connection of the
    context stalled, which timed handshakes out after a peer's kill -9)."""
    ctx = zmq.asyncio.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        await dealer.send(b"up")
        await asyncio.wait_for(router.recv_multipart(), 5)
        end_monitor(dealer, monitor)
        router.close(linger=0)  # the dealer's connection drops now: an event it must not report
        await asyncio.sleep(0.3)
        again = ctx.socket(zmq.ROUTER)
        port = again.bind_to_random_port("tcp://127.0.0.1")
        other = ctx.socket(zmq.DEALER)
        other.connect(f"tcp://127.0.0.1:{port}")
        await other.send(b"still working")
        assert (await asyncio.wait_for(again.recv_multipart(), 5))[1] == b"still working"
        for sock in (dealer, again, other):
            sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)


async def test_duplicate_connect_rejected(make_agent):
    a, b = await pair(make_agent)
    with pytest.raises(HandshakeRejected, match="already connected"):
        await b.connect(a.control_address)
    assert set(a.peers) == {"b"}


async def test_bad_indices_raise_before_any_byte_moves(make_agent):
    a, b = await pair(make_agent)
    fill(a)
    with pytest.raises(InvalidBlocks):
        a.write_blocks("b", [0, 1], [0])
    with pytest.raises(InvalidBlocks):
        a.write_blocks("b", [64], [0])
    with pytest.raises(InvalidBlocks):
        a.write_blocks("b", [0], [64])
    with pytest.raises(InvalidBlocks):
        a.write_blocks("b", [0], [-1])
    with pytest.raises(UnknownPeer):
        a.write_blocks("nobody", [0], [0])
    await asyncio.sleep(0.05)
    assert not b.region.array.any()


async def test_receiver_refuses_out_of_range_write_and_keeps_serving(make_agent):
    """Fault injection: the sender believes the receiver has more blocks than it has."""
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b", claimed_blocks=128)
    assert await asyncio.wait_for(a.connect(b.control_address), 5) == "b"
    assert a.peers["b"].num_blocks == 128 and b.region.num_blocks == 64
    fill(a)
    with pytest.raises(InvalidBlocks, match="exceeds the region"):
        await asyncio.wait_for(a.write_blocks("b", [0, 1], [100, 101]), 5)
    assert not b.region.array.any()
    await asyncio.wait_for(a.write_blocks("b", [3], [4]), 5)
    assert np.array_equal(b.region.array[4], a.region.array[3])
    assert set(b.peers) == {"a"}


async def test_cancel_immediate(make_agent):
    a, _ = await pair(make_agent)
    transfer = a.write_blocks("b", list(range(64)), list(range(64)))
    assert a.cancel([transfer.id, 12345], "immediate") == []
    with pytest.raises(TransferCancelled):
        await transfer
    assert a.transport.in_flight() == []


async def test_cancel_wait_drains_then_settles(make_agent):
    a, b = await pair(make_agent)
    fill(a)
    transfer = a.write_blocks("b", list(range(64)), list(range(64)))
    assert a.cancel([transfer.id], "wait") == [transfer.id]
    with pytest.raises(TransferCancelled):
        await asyncio.wait_for(transfer, 5)
    assert a.transport.in_flight() == []
    assert a.cancel([transfer.id], "wait") == []


async def test_transfer_deadline(make_agent):
    a, b = await pair(make_agent, transfer_timeout=0.3)
    never = asyncio.get_running_loop().create_future()
    b.set_message_sink(lambda *args: never)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(a.send_message("b", "k", b"", [b"x"]), 5)
    never.cancel()


async def test_remove_peer_fails_in_flight_and_tells_the_peer(make_agent):
    a, b = await pair(make_agent)
    never = asyncio.get_running_loop().create_future()
    b.set_message_sink(lambda *args: never)
    transfer = a.send_message("b", "k", b"", [b"x"])
    assert await a.remove_peer("b")
    with pytest.raises(PeerLost):
        await transfer
    await asyncio.wait_for(_until(lambda: not b.peers), 5)
    assert not await a.remove_peer("b")
    never.cancel()


async def test_messages_round_trip(make_agent):
    a, b = await pair(make_agent)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append((peer, key, meta, [bytes(f) for f in frames])))
    payload = np.arange(1000, dtype=np.float32)
    await asyncio.wait_for(a.send_message("b", "r1:0:0", b"hdr", [payload, b"", b"tail"]), 5)
    assert got == [("a", "r1:0:0", b"hdr", [payload.tobytes(), b"", b"tail"])]


def record_sends(lane):
    """Fault-injection wrapper around a real lane: records the tag of every message it sends."""
    tags, send, send_iov = [], lane.send, lane.send_iov
    lane.send = lambda buffer, tag, done: (tags.append(tag), send(buffer, tag, done))[1]
    lane.send_iov = lambda vector, keep, tag, done: (tags.append(tag), send_iov(vector, keep, tag, done))[1]
    return tags


async def test_a_small_message_over_ucx_is_one_ucx_message_and_a_large_one_two(make_agent):
    """Over the UCX lane (no same-host lane), a chunk message whose header and frames fit
    ``WHOLE_MAX`` travels whole on the header tag (one send, no payload message: one hand-off
    less); a larger one as a header and one payload message.  Both arrive intact; the small
    one's frames are copied once into one writable allocation, each 64-byte aligned in it."""
    from omni_async.transport.messages import WHOLE_MAX
    from omni_async.wire import HEADER_TAG

    a, b = await pair(make_agent, same_host_lane=False, max_message_bytes=1 << 20)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(frames))
    tags = record_sends(a.transport.links["b"].lane)
    small = [np.arange(1000, dtype=np.float32), np.zeros(0, np.uint8), np.frombuffer(b"tail", np.uint8)]
    await asyncio.wait_for(a.send_message("b", "small", b"m", small), 5)
    assert tags == [HEADER_TAG]
    assert [bytes(f) for f in got[0]] == [bytes(f) for f in small]
    base = got[0][0].__array_interface__["data"][0]
    assert all((f.__array_interface__["data"][0] - base) % 64 == 0 for f in got[0])
    assert len({id(f.base) for f in got[0]}) == 1 and all(f.flags.writeable for f in got[0])
    large = [np.full(WHOLE_MAX, 3, np.uint8)]
    await asyncio.wait_for(a.send_message("b", "large", b"m", large), 5)
    assert tags[1] == HEADER_TAG and len(tags) == 3 and tags[2] != HEADER_TAG
    assert (got[1][0] == 3).all() and got[1][0].nbytes == WHOLE_MAX


@pytest.mark.parametrize("garbage", ["not a message", "frames short", "frames long"])
async def test_a_header_followed_by_garbage_over_ucx_drops_the_peer(make_agent, garbage):
    """A lane message on the header tag with bytes after its header: only a chunk message may
    carry them, and exactly its frames' bytes; anything else drops the peer (typed), and this
    side keeps serving."""
    from omni_async.transport.core import ignore
    from omni_async.wire import HEADER_TAG, Ack, MessageHeader, encode_header

    a, b = await pair(make_agent, same_host_lane=False)
    b.set_message_sink(lambda *_: None)
    if garbage == "not a message":
        data = encode_header(Ack(1)) + b"xx"
    else:
        data = encode_header(MessageHeader(1, 0, "k", b"", [10])) + b"x" * (9 if garbage == "frames short" else 11)
    a.transport.links["b"].lane.send(np.frombuffer(data, np.uint8), HEADER_TAG, ignore)
    await asyncio.wait_for(_until(lambda: "a" not in b.peers), 5)
    c = await make_agent(peer_id="c", same_host_lane=False)
    await asyncio.wait_for(c.connect(b.control_address), 5)
    await asyncio.wait_for(c.send_message("b", "ok", b"", [b"fine"]), 5)


async def test_a_sink_that_returns_a_plain_value_acknowledges_at_once(make_agent):
    """A sink's result that is neither None nor awaitable (here: True) counts as handled: the
    message is acknowledged, not left for the sender's deadline."""
    a, b = await pair(make_agent, transfer_timeout=30.0)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(key) or True)
    await asyncio.wait_for(a.send_message("b", "plain", b"", [b"x"]), 5)
    assert got == ["plain"]


async def test_close_is_idempotent_and_fails_in_flight(make_agent):
    a, b = await pair(make_agent)
    never = asyncio.get_running_loop().create_future()
    b.set_message_sink(lambda *args: never)
    transfer = a.send_message("b", "k", b"", [b"x"])
    await a.close()
    await a.close()
    with pytest.raises(ClosedError):
        await transfer
    with pytest.raises(ClosedError):
        a.write_blocks("b", [0], [0])
    await asyncio.wait_for(_until(lambda: not b.peers), 5)
    never.cancel()
    await b.close()
    await asyncio.sleep(0)
    assert leftover_tasks() == []


async def test_idle_pair_does_not_spin(make_agent):
    """Event-driven progress: an idle connected pair wakes only for heartbeats."""
    a, b = await pair(make_agent, heartbeat_interval=0.5, heartbeat_timeout=3.0)
    await a.write_blocks("b", [0], [0])
    await asyncio.sleep(0.2)  # completions of that write may still arrive: let them, then watch
    lanes = [a.transport.lane("b"), b.transport.lane("a")]
    before = [lane.wakeups for lane in lanes]
    import time
    cpu0 = time.process_time()
    await asyncio.sleep(1.0)
    cpu = time.process_time() - cpu0
    assert [lane.wakeups - w for lane, w in zip(lanes, before)] == [0, 0]
    assert cpu < 0.1, f"idle pair used {cpu:.3f}s of CPU in 1s"


async def _until(predicate, interval=0.01):
    while not predicate():
        await asyncio.sleep(interval)


async def test_write_of_10000_scattered_blocks_just_works(make_agent):
    """More non-adjacent runs than one request carries: split, settled as one transfer."""
    a = await make_agent(num_blocks=20_000, block_len=64, peer_id="a")
    b = await make_agent(num_blocks=20_000, block_len=64, peer_id="b")
    await asyncio.wait_for(a.connect(b.control_address), 5)
    fill(a)
    local = list(range(0, 20_000, 2))
    remote = list(range(19_999, 0, -2))
    await asyncio.wait_for(a.write_blocks("b", local, remote), 20)
    assert np.array_equal(b.region.array[remote], a.region.array[local])
    assert not b.region.array[0:20_000:2].any()
    assert set(a.peers) == {"b"} and set(b.peers) == {"a"}


async def test_sender_splits_writes_to_the_receivers_max_write_blocks(make_agent):
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b", max_write_blocks=5)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    assert a.peers["b"].max_write_blocks == 5
    fill(a)
    await asyncio.wait_for(a.write_blocks("b", list(range(64)), list(range(64))), 5)
    assert np.array_equal(b.region.array, a.region.array)
    assert set(a.peers) == {"b"} and set(b.peers) == {"a"}


async def test_messages_over_a_limit_fail_locally_and_keep_the_peer(make_agent):
    from omni_async import InvalidMessage
    from omni_async.wire import MAX_FRAMES, MAX_KEY, MAX_META_BYTES

    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b", max_message_bytes=1000)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(key))
    for key, meta, frames in [
        ("k" * (MAX_KEY + 1), b"", [b"x"]),
        ("k", b"m" * (MAX_META_BYTES + 1), [b"x"]),
        ("k", b"", [b"x"] * (MAX_FRAMES + 1)),
        ("k", b"", [bytes(1001)]),
    ]:
        with pytest.raises(InvalidMessage):
            a.send_message("b", key, meta, frames)
    for key, meta in [(7, b""), ("k", "text")]:
        with pytest.raises(TypeError):
            a.send_message("b", key, meta, [b"x"])
    assert a.transport.in_flight() == []
    await asyncio.wait_for(a.send_message("b", "k" * MAX_KEY, b"m" * MAX_META_BYTES, [bytes(1000)]), 5)
    assert got == ["k" * MAX_KEY]
    assert set(a.peers) == {"b"} and set(b.peers) == {"a"}


async def test_many_concurrent_large_messages_stay_within_the_receivers_bounds(make_agent):
    """Unacknowledged chunk bytes beyond the receiver's budget wait at the sender (its
    window) instead of making the receiver drop the peer."""
    from omni_async.transport.limits import receive_budget

    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b", max_message_bytes=1 << 20)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    got = []
    b.set_message_sink(lambda peer, key, meta, frames: got.append(int(frames[0][0])))
    count = 2 * receive_budget(1 << 20) // (1 << 20)
    frames = [np.full(1 << 20, i % 256, np.uint8) for i in range(count)]
    transfers = [a.send_message("b", f"k{i}", b"", [frames[i]]) for i in range(count)]
    await asyncio.wait_for(asyncio.gather(*transfers), 30)
    assert sorted(got) == sorted(i % 256 for i in range(count))
    assert set(a.peers) == {"b"} and set(b.peers) == {"a"}



async def test_close_during_connect_fails_it_with_closed_error(make_agent):
    """``connect()`` waits for a Welcome (the far side, a bare ROUTER, never answers) while the
    agent closes: the caller, whom nobody cancelled, gets ClosedError (it ended as cancelled:
    the close destroyed the socket, which cancelled its pending receive)."""
    a = await make_agent(peer_id="a", handshake_timeout=10.0)
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        connecting = asyncio.ensure_future(a.connect(f"tcp://127.0.0.1:{port}"))
        await asyncio.wait_for(router.recv_multipart(), 5)  # the Hello came: connect() waits
        await asyncio.wait_for(a.close(), 10)
        with pytest.raises(ClosedError):
            await asyncio.wait_for(connecting, 5)
    finally:
        router.close(0)
        ctx.term()


async def test_close_during_start_fails_it_with_closed_error():
    """``close()`` while ``start()`` warms up (an application shut down during start-up):
    ``start()`` raises ClosedError and nothing is left running (it raised a raw ZMQError: the
    control plane was started on the context the close had destroyed)."""
    agent = Agent(BlockRegion.allocate(64, 4096), fast_config(peer_id="s"))
    starting = asyncio.ensure_future(agent.start())
    await asyncio.sleep(0)  # start() now awaits the transport's warm-up
    await asyncio.wait_for(agent.close(), 10)
    with pytest.raises(ClosedError):
        await asyncio.wait_for(starting, 10)
    await agent.close()
    assert not leftover_tasks()
