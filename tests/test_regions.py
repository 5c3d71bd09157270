"""Region sets (one region per layer, sharing num_blocks): a block index moves that block in
every region, on both lanes, through every path (gathered, one message per run and region,
same-host copy, split requests, notices, reads); layouts are checked at the handshake."""

import asyncio

import numpy as np
import pytest

from omni_async import BlockRegion, ConfigError, LayoutMismatch, PeerLost, ProtocolError
from omni_async.region import RegionSet
from omni_async.wire import PROTOCOL_VERSION, Hello, Layer, decode_control, encode_control

from .conftest import fast_config

pytestmark = pytest.mark.timeout(60)
LANES = [pytest.param({"same_host_lane": True}, id="same-host"),
         pytest.param({"same_host_lane": False}, id="ucx-gathered"),
         pytest.param({"same_host_lane": False, "ucx_tls": "tcp", "ucx_puts": False}, id="ucx-per-run"),
         pytest.param({"same_host_lane": False, "ucx_tls": "tcp"}, id="ucx-puts")]


async def until_keyed(a, b, lane):
    """On the puts lane, wait until each side writes to the other with puts (keys vetted)."""
    if lane.get("ucx_tls") != "tcp" or lane.get("ucx_puts") is False:
        return
    async with asyncio.timeout(10):
        while not all(getattr(x.transport.links.get(y.peer_id), "remote_keys", None) is not None
                      for x, y in ((a, b), (b, a))):
            await asyncio.sleep(0.005)


@pytest.fixture
def make_set_agent(owned):
    from omni_async import Agent

    async def factory(regions, **config):
        agent = Agent(regions, fast_config(**config))
        owned.append(agent)
        return await agent.start()

    return factory


def fill(regions, seed):
    rng = np.random.default_rng(seed)
    for array in regions.arrays:
        array[:] = rng.integers(0, 256, array.shape, dtype=np.uint8)


def test_a_set_shares_num_blocks():
    with pytest.raises(ConfigError, match="share num_blocks"):
        RegionSet([BlockRegion.allocate(8, 64), BlockRegion.allocate(9, 64)])
    with pytest.raises(ConfigError):
        RegionSet([])
    regions = RegionSet.allocate(8, [64, 128])
    assert regions.block_lens == (64, 128) and regions.block_bytes == 192 and regions.num_blocks == 8


def test_hello_carries_every_layout_and_each_is_checked():
    hello = Hello(version=PROTOCOL_VERSION, peer_id="p", nonce=1, agent_metadata=b"x", base_addr=4096, num_blocks=8,
                  block_len=64, fingerprint="", layers=[Layer(8192, 128), Layer(1 << 20, 32)])
    assert decode_control(encode_control(hello)) == hello
    bad = Hello(version=PROTOCOL_VERSION, peer_id="p", nonce=1, agent_metadata=b"x", base_addr=4096, num_blocks=8,
                block_len=64, fingerprint="", layers=[Layer((1 << 63) - 64, 128)])
    with pytest.raises(ProtocolError, match="overflows"):
        decode_control(encode_control(bad))


@pytest.mark.parametrize("lane", LANES)
async def test_a_block_index_moves_the_block_in_every_region(make_set_agent, lane):
    lens = [4096, 1024, 512, 64]
    a = await make_set_agent(RegionSet.allocate(64, lens), peer_id="a", **lane)
    b = await make_set_agent(RegionSet.allocate(64, lens), peer_id="b", allow_reads=True, **lane)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await asyncio.wait_for(b.wait_for_peer("a"), 5)
    await until_keyed(a, b, lane)
    assert (a.transport.links["b"].direct is not None) == lane["same_host_lane"]
    fill(a.regions, 1)
    local, remote = [5, 6, 7, 30, 2, 63, 0], [10, 11, 12, 1, 40, 0, 63]
    write = a.write_blocks("b", local, remote, notice=b"layers")
    assert write.nbytes == len(local) * sum(lens)
    await asyncio.wait_for(write, 5)
    one = a.write_blocks("b", [9], [20])  # one block (same host: its short path) moves every region's row too
    assert one.nbytes == sum(lens)
    await asyncio.wait_for(one, 5)
    written, read = [*remote, 20], [*local, 9]
    untouched = sorted(set(range(64)) - set(written))
    for src, dst in zip(a.regions.arrays, b.regions.arrays, strict=True):
        assert np.array_equal(dst[written], src[read])
        assert not dst[untouched].any()
    notice = await asyncio.wait_for(anext(b.notices()), 5)
    assert notice.remote_idxs == tuple(remote) and notice.failed is None
    # and back: a read moves every region's rows too
    fill(b.regions, 2)
    await asyncio.wait_for(a.read_blocks("b", [3, 4, 50], [20, 21, 22]), 5)
    for mine, theirs in zip(a.regions.arrays, b.regions.arrays, strict=True):
        assert np.array_equal(mine[[20, 21, 22]], theirs[[3, 4, 50]])


async def test_a_put_write_ends_only_once_its_flush_completed_even_if_the_answer_came_first(make_set_agent):
    """A put write's ``placed`` header goes before its puts (the receiver checks the runs while
    the bytes travel), so the receiver's answer may come before every byte is in its memory:
    the write ends only once its flush completed too, and a flush that fails after the answer
    fails the write with ``PeerLost``.  (The flush's completion is held by a wrapper around
    the real lane.)"""
    lane = {"same_host_lane": False, "ucx_tls": "tcp"}
    a = await make_set_agent(RegionSet.allocate(16, [65536]), peer_id="a", **lane)
    b = await make_set_agent(RegionSet.allocate(16, [65536]), peer_id="b", **lane)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await asyncio.wait_for(b.wait_for_peer("a"), 5)
    await until_keyed(a, b, lane)
    link = a.transport.links["b"]
    held = []
    real_put = link.lane.put

    def put(puts, keepalive, done):
        real_put(puts, keepalive, lambda error: held.append((done, error)))

    link.lane.put = put
    fill(a.regions, 3)

    async def flushed_and_answered(transfer_id):
        async with asyncio.timeout(5):
            while not (held and transfer_id in link.early_answers):
                await asyncio.sleep(0.001)

    write = a.write_blocks("b", [0, 1], [2, 3])  # two blocks: puts
    await flushed_and_answered(write.id)
    await asyncio.sleep(0.05)
    assert not write.done()  # answered, but its flush has not completed (here: not reported)
    done, error = held.pop()
    assert error is None
    done(None)
    await asyncio.wait_for(write, 5)
    assert np.array_equal(b.regions.arrays[0][[2, 3]], a.regions.arrays[0][[0, 1]])

    failing = a.write_blocks("b", [4, 5], [6, 7])
    await flushed_and_answered(failing.id)
    done, _ = held.pop()
    done(OSError("injected: the flush failed"))
    with pytest.raises(PeerLost):
        await asyncio.wait_for(failing, 5)


@pytest.mark.parametrize("lane", LANES)
async def test_64_scattered_blocks_by_32_layers_split_within_the_receivers_bounds(make_set_agent, lane):
    """32 regions and 1,024 scattered runs: more payload messages than the receiver holds for
    one peer unless the sender splits (a run is one message per region when not gathered)."""
    await write_1024_runs_by_32_layers(make_set_agent, lane)


async def test_puts_posted_one_ctypes_call_each_land_as_those_posted_in_one_c_call(make_set_agent, monkeypatch):
    """Where the C loops are built (as here), a request's puts go out in one call of them; the
    Python loop that stands in where they are not posts each put itself, to the same rows."""
    from omni_async.transport import rma

    assert rma._rma().put_all is not None  # the other runs of this write use the C loop
    monkeypatch.setattr(rma._rma(), "put_all", None)
    await write_1024_runs_by_32_layers(make_set_agent, {"same_host_lane": False, "ucx_tls": "tcp"})


async def write_1024_runs_by_32_layers(make_set_agent, lane):
    lens = [64] * 32
    a = await make_set_agent(RegionSet.allocate(2048, lens), peer_id="a", **lane)
    b = await make_set_agent(RegionSet.allocate(2048, lens), peer_id="b", **lane)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await until_keyed(a, b, lane)
    fill(a.regions, 3)
    local = list(range(0, 2048, 2))
    remote = list(range(1, 2048, 2))
    await asyncio.wait_for(a.write_blocks("b", local, remote), 20)
    for src, dst in zip(a.regions.arrays, b.regions.arrays, strict=True):
        assert np.array_equal(dst[remote], src[local]) and not dst[0::2].any()
    assert "a" in b.peers  # nothing over a bound: the peer was not dropped


@pytest.mark.parametrize("lane", LANES)
async def test_concurrent_writes_of_a_set_keep_their_payloads_apart(make_set_agent, lane):
    """Each write request takes one sequence number per payload message: one per run and
    region when not gathered, so concurrent writes never share a tag."""
    lens = [8192, 1024, 2048]
    a = await make_set_agent(RegionSet.allocate(64, lens), peer_id="a", **lane)
    b = await make_set_agent(RegionSet.allocate(64, lens), peer_id="b", **lane)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    await until_keyed(a, b, lane)
    fill(a.regions, 4)
    writes = [a.write_blocks("b", [i, i + 1, i + 5], [63 - i, 62 - i, 40 - i]) for i in range(0, 16, 2)]
    await asyncio.wait_for(asyncio.gather(*writes), 10)
    for i in range(0, 16, 2):
        for src, dst in zip(a.regions.arrays, b.regions.arrays, strict=True):
            assert np.array_equal(dst[[63 - i, 62 - i, 40 - i]], src[[i, i + 1, i + 5]])
    assert "a" in b.peers


async def test_layout_mismatch_is_refused_naming_the_region(make_set_agent):
    a = await make_set_agent(RegionSet.allocate(16, [4096, 1024]), peer_id="a")
    b = await make_set_agent(RegionSet.allocate(16, [4096, 2048]), peer_id="b")
    c = await make_set_agent(RegionSet.allocate(16, [4096]), peer_id="c")
    with pytest.raises(LayoutMismatch, match="region 1"):
        await asyncio.wait_for(a.connect(b.control_address), 5)
    with pytest.raises(LayoutMismatch, match="2 regions"):
        await asyncio.wait_for(a.connect(c.control_address), 5)
    assert a.peers == {} and b.peers == {} and c.peers == {}


async def test_a_single_region_is_the_one_region_case(make_set_agent):
    region = BlockRegion.allocate(16, 256)
    a = await make_set_agent(region, peer_id="a")
    b = await make_set_agent(RegionSet([BlockRegion.allocate(16, 256)]), peer_id="b")
    assert a.region is region and a.regions.regions == (region,)
    await asyncio.wait_for(a.connect(b.control_address), 5)
    region.array[3] = 9
    await asyncio.wait_for(a.write_blocks("b", [3], [4]), 5)
    assert (b.region.array[4] == 9).all()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "ucx"])
async def test_region_set_writes_to_another_process_and_its_kill(make_set_agent, spawn_peer, tmp_path, same_host):
    """Writes with notices through a region set land in a child process (it reports each
    notice after every region's rows are in place); kill -9 of it fails the writes in flight
    with PeerLost in time, and this process keeps serving."""
    import time

    from omni_async import PeerLost

    from .conftest import FAST

    lens = [16384, 4096, 4096]
    rx = await spawn_peer("notices", str(tmp_path / "rx.memfd"), 64, 4096,
                          {"peer_id": "rx", "same_host_lane": same_host}, ",".join(map(str, lens)))
    a = await make_set_agent(RegionSet.allocate(64, lens), peer_id="tx", same_host_lane=same_host)
    await asyncio.wait_for(a.connect(rx.info["address"]), 10)
    everything = list(range(64))
    await asyncio.wait_for(a.write_blocks("rx", everything, everything[::-1], notice=b"0"), 10)
    line = await asyncio.wait_for(rx.proc.stdout.readline(), 10)
    while b"notice" not in line:
        line = await asyncio.wait_for(rx.proc.stdout.readline(), 10)
    assert b'"rows": 64' in line and b'"failed": null' in line
    writes = [a.write_blocks("rx", everything, everything, notice=b"%d" % i) for i in range(64)]
    rx.kill()
    killed = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 15)
    assert all(r is None or isinstance(r, PeerLost) for r in results), results
    assert time.monotonic() - killed < FAST["heartbeat_timeout"] + 2.0
    other = await make_set_agent(RegionSet.allocate(64, lens), peer_id="other", same_host_lane=same_host)
    await asyncio.wait_for(a.connect(other.control_address), 5)
    await asyncio.wait_for(a.write_blocks("other", [1], [2]), 5)
    assert np.array_equal(other.regions.arrays[0][2], a.regions.arrays[0][1])



def test_a_registration_unmaps_every_region_even_if_one_unmap_fails(monkeypatch):
    """An unmap UCX refuses (fault injection around the real one, first call) is raised, but
    only after every other region of the set was unmapped (the later ones leaked)."""
    from omni_async.transport import rma
    from omni_async.transport.lane import new_context

    context = new_context("tcp", "lo")
    registration = rma.Registration(context, [np.zeros((4, 4096), np.uint8) for _ in range(3)])
    real, calls = rma._rma().mem_unmap, []

    def refuse_first(ctx, handle):
        calls.append(handle)
        return -1 if len(calls) == 1 else real(ctx, handle)  # UCS_ERR_NO_MESSAGE for the first

    monkeypatch.setattr(rma._rma(), "mem_unmap", refuse_first)
    with pytest.raises(OSError):
        registration.close()
    assert len(calls) == 3  # the two others were unmapped
    registration.close()  # idempotent: nothing left
    assert len(calls) == 3
    real(context.handle, calls[0])  # (the refused one, for real, so nothing leaks here)
