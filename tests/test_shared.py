"""The same-host lane: one copy straight into the peer's rows (memfd mapping, else
process_vm_writev), its checks, and kill -9 of either side in real separate processes."""

import asyncio
import fcntl
import os
import signal
import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest

from omni_async import Agent, BlockRegion, InvalidBlocks, PeerLost, ProtocolError, UnknownPeer
from omni_async.handshake import PeerInfo
from omni_async.memfd import NAME_PREFIX, SharedSegment
from omni_async.transport.shared import MappedRegion, Refused, advertise, open_writer
from omni_async.transport.turns import TurnBudget
from omni_async.transport.vmwrite import VmWriter
from omni_async.wire import (
    HEADER_TAG,
    Ack,
    RegionShare,
    RingOffer,
    RkeyOffer,
    WriteRequest,
    decode_control,
    encode_control,
    encode_header,
)

from .conftest import FAST, fast_config
from .helpers.kill import assert_lost_in_time, writer_killed_then_serve_another, writes_through_a_kill
from .helpers.procfs import fd_targets

pytestmark = pytest.mark.timeout(90)

NUM_BLOCKS, BLOCK_LEN = 64, 64 * 1024
KINDS = {"memfd": ".memfd", "process_vm_writev": ""}
"""Direct-writer kind -> the peer helper's region file suffix that makes the peer offer it."""


def dev_shm() -> set[str]:
    """Entries of /dev/shm, less the bench's region files (``make bench`` may run alongside)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("omni-bench-")}


def mapped(token: str) -> list[str]:
    """Lines of this process's memory map naming the memfd of ``token``."""
    with open("/proc/self/maps") as f:
        return [line for line in f if NAME_PREFIX + token in line]


def open_fds_to(token: str) -> list[str]:
    """What this process's descriptors naming the memfd of ``token`` point to."""
    return [target for target in fd_targets() if NAME_PREFIX + token in target]


def share_of(segment: SharedSegment, **changes):
    return RegionShare(pid=changes.get("pid", os.getpid()), fd=changes.get("fd", segment.fd),
                       token=changes.get("token", segment.token))


def peer_info(share, host_id="h", num_blocks=4, block_len=4096, base_addr=0):
    return PeerInfo(peer_id="p", nonce=1, base_addr=base_addr, num_blocks=num_blocks, block_len=block_len,
                    fingerprint="", host_id=host_id, region_share=share)


def seal_free_memfd(token: str, size: int) -> int:
    fd = os.memfd_create(NAME_PREFIX + token, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


# -- the region and the mapping checks (no peer process) -----------------------------------------
@pytest.mark.alone  # compares /dev/shm before and after: runs after the parallel part (make test)
def test_allocated_region_lives_in_a_sealed_memfd_not_in_dev_shm():
    before = dev_shm()
    region = BlockRegion.allocate(4, 4096)
    segment = region.segment
    assert segment is not None and dev_shm() == before
    assert os.readlink(f"/proc/self/fd/{segment.fd}") == f"/memfd:{NAME_PREFIX}{segment.token} (deleted)"
    seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(PermissionError):
        os.ftruncate(segment.fd, 4096)  # a peer's mapping can never lose its pages
    assert not region.array.any()
    fds = len(open_fds_to(segment.token))
    segment.close()
    segment.close()
    assert not segment.shareable and len(open_fds_to(segment.token)) == fds - 1
    assert BlockRegion.wrap(np.zeros((2, 8), np.uint8)).segment is None


def test_mapping_our_own_segment_writes_the_same_memory():
    region = BlockRegion.allocate(4, 4096)
    fds = len(open_fds_to(region.segment.token))
    writer = MappedRegion(share_of(region.segment), 4, 4096)
    src = np.arange(4 * 4096, dtype=np.uint64).astype(np.uint8).reshape(4, 4096)
    writer.place(src, [(0, 2, 2)])
    assert np.array_equal(region.array[2:4], src[0:2]) and not region.array[:2].any()
    assert len(mapped(region.segment.token)) == 2  # ours and the writer's
    writer.close()
    writer.close()
    assert len(mapped(region.segment.token)) == 1  # the writer's mapping is gone
    assert len(open_fds_to(region.segment.token)) == fds  # and so is its descriptor


@pytest.mark.parametrize("case", ["token", "size", "pid", "fd", "not_memfd", "unsealed", "no_fd"])
def test_mapping_refuses_anything_but_the_advertised_sealed_memfd(case, tmp_path):
    region = BlockRegion.allocate(4, 4096)
    segment = region.segment
    share, num_blocks = share_of(segment), 4
    extra_fds = []
    if case == "token":
        share = share_of(segment, token="0" * 32)
    elif case == "size":
        num_blocks = 8
    elif case == "pid":
        share = share_of(segment, pid=(1 << 22) + 1)
    elif case == "fd":
        share = share_of(segment, fd=segment.fd + 1000)
    elif case == "not_memfd":  # a regular file at the advertised fd number
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 4 * 4096)
        extra_fds.append(fd)
        share = share_of(segment, fd=fd)
    elif case == "unsealed":  # the right name, but it could shrink under our mapping
        fd = seal_free_memfd("1" * 32, 4 * 4096)
        extra_fds.append(fd)
        share = share_of(segment, fd=fd, token="1" * 32)
    elif case == "no_fd":
        share = RegionShare(pid=os.getpid(), fd=-1, token=segment.token)
    try:
        with pytest.raises(Refused):
            MappedRegion(share, num_blocks, 4096)
        # open_writer falls back (UCX) instead of raising, and leaves nothing mapped
        if case != "no_fd":
            assert open_writer(peer_info(share, num_blocks=num_blocks), "h") is None
        assert len(mapped(segment.token)) == 1
    finally:
        for fd in extra_fds:
            os.close(fd)


def test_open_writer_only_for_peers_on_this_host_that_offer_it():
    region = BlockRegion.allocate(4, 4096)
    share = share_of(region.segment)
    assert open_writer(peer_info(share, host_id="other"), "h") is None
    assert open_writer(peer_info(None), "h") is None
    assert open_writer(peer_info(share, host_id=""), "") is None
    writer = open_writer(peer_info(share), "h")
    assert writer is not None and writer.kind == "memfd"
    writer.close()
    wrapped = BlockRegion.wrap(np.zeros((4, 4096), np.uint8))
    offer = advertise(wrapped)
    assert offer.fd == -1 and offer.proof_addr
    vm = open_writer(peer_info(offer, base_addr=wrapped.base_addr), "h")
    assert vm is not None and vm.kind == "process_vm_writev"
    vm.place(np.full((4, 4096), 3, np.uint8), [(1, 2, 1)])
    assert (wrapped.array[2] == 3).all() and not wrapped.array[[0, 1, 3]].any()
    vm.close()
    vm.close()
    assert open_writer(peer_info(msgspec.structs.replace(offer, pid=(1 << 22) + 1)), "h") is None  # no such process


def test_both_writers_place_many_scattered_runs_exactly():
    """Scattered one-block runs and longer ones, more than a handful (the vectorised iovec path
    of process_vm_writev), land in exactly the named rows."""
    from omni_async.region import plan_runs

    rng = np.random.default_rng(7)
    local = [int(i) for i in rng.choice(64, 40, replace=False)] + [60, 61, 62]
    remote = [int(i) for i in rng.choice(60, 40, replace=False)] + [60, 61, 62]
    runs = plan_runs(local, remote, 64, 64)
    src = rng.integers(0, 255, (64, 256), dtype=np.uint8)
    allocated = BlockRegion.allocate(64, 256)
    wrapped = BlockRegion.wrap(np.zeros((64, 256), np.uint8))
    mapped = open_writer(peer_info(share_of(allocated.segment), num_blocks=64, block_len=256), "h")
    vm = open_writer(peer_info(advertise(wrapped), num_blocks=64, block_len=256, base_addr=wrapped.base_addr), "h")
    assert mapped is not None and vm is not None and vm.kind == "process_vm_writev"
    try:
        for writer, region in ((mapped, allocated), (vm, wrapped)):
            writer.place(src, runs)
            assert np.array_equal(region.array[remote], src[local])
            untouched = np.setdiff1d(np.arange(64), remote)
            assert not region.array[untouched].any()
    finally:
        mapped.close()
        vm.close()


async def test_process_vm_writev_needs_the_peers_proof():
    """A peer cannot point our writes at another process: the advertised pid must hold the
    advertised token at the advertised address."""
    import sys

    offer = advertise(BlockRegion.wrap(np.zeros((4, 4096), np.uint8)))
    for forged in (msgspec.structs.replace(offer, token="0" * 32), msgspec.structs.replace(offer, proof_addr=offer.proof_addr + 32),
                   msgspec.structs.replace(offer, token="")):
        assert open_writer(peer_info(forged), "h") is None
    other = await asyncio.create_subprocess_exec(sys.executable, "-c", "import sys; sys.stdin.read()",
                                                 stdin=asyncio.subprocess.PIPE)
    try:  # another process of ours, named with our own (valid) proof
        assert open_writer(peer_info(msgspec.structs.replace(offer, pid=other.pid)), "h") is None
    finally:
        other.kill()
        await other.wait()


def test_vm_writer_to_an_exited_process_raises_esrch_and_this_process_lives():
    import subprocess
    import sys

    code = "import sys; from omni_async.transport.vmwrite import proof; print(*proof(), flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    token, address = child.stdout.readline().split()
    writer = VmWriter(child.pid, 0x10000, 1, token.decode(), int(address))
    child.kill()
    child.wait()
    with pytest.raises(ProcessLookupError):
        writer.place(np.zeros((1, 8), np.uint8), [(0, 0, 1)])
    writer.close()
    writer.close()


def test_region_share_is_validated_on_the_wire():
    good = RegionShare(pid=5, fd=3, token="a" * 32)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(good), type=RegionShare) == good
    for bad in ([5, 3, "../../x"], [0, 3, ""], [5, -2, ""], [5, 3, "A" * 32, 1], [5, -1, "", -1], [5, 3, "", 0, -1],
                [5, 3, "", 0, 1, -1], [5, 3, "", 0, 1, 0, -2], [5, 3, "", 0, 1, 0, 4, 1]):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=RegionShare)
    from omni_async.handshake import LocalIdentity

    hello = LocalIdentity("x", 0, 1, 8, "", region_share=good).hello(b"a" * 20)
    raw = msgspec.msgpack.decode(encode_control(hello))
    raw[-1] = [5, 3, "zz"]
    with pytest.raises(ProtocolError):
        decode_control(msgspec.msgpack.encode(raw))


# -- two agents in this process --------------------------------------------------------------------
async def pair(make_agent, **config):
    a = await make_agent(NUM_BLOCKS, 4096, peer_id="a", **config)
    b = await make_agent(NUM_BLOCKS, 4096, peer_id="b", **config)
    await asyncio.wait_for(a.connect(b.control_address), 10)
    await asyncio.wait_for(b.wait_for_peer("a"), 10)
    return a, b


async def test_blocks_are_placed_in_one_copy_and_acknowledged(make_agent):
    a, b = await pair(make_agent)
    assert a.transport.direct_kind("b") == "memfd"
    a.region.array[:] = np.random.default_rng(3).integers(0, 256, a.region.array.shape, dtype=np.uint8)
    await asyncio.wait_for(a.write_blocks("b", [5, 6, 7, 1], [10, 11, 12, 0]), 5)
    assert np.array_equal(b.region.array[[10, 11, 12, 0]], a.region.array[[5, 6, 7, 1]])
    assert not b.region.array[1:10].any()
    assert b.stats()["received.blocks.ok"] == 1 and a.stats()["blocks.ok"] == 1


@pytest.mark.parametrize(
    ("local", "remote", "error"),
    [
        (2, 3, None),
        (np.int64(2), np.int64(3), None),  # not a Python int: the general path takes it
        (True, 3, "not an int"),
        (2, 3.0, "not an int"),
        (-1, 3, "out of range"),
        (NUM_BLOCKS, 3, "out of range"),
        (2, NUM_BLOCKS, "out of range"),
    ],
)
async def test_a_one_block_write_is_checked_and_placed_as_any_other(make_agent, local, remote, error):
    """One block to a peer on this host takes a short path (``_place_row``): what it accepts
    lands in one copy and is acknowledged; what it declines goes the general way, which
    places numpy indices and refuses bad ones before anything moves."""
    a, b = await pair(make_agent)
    a.region.array[:] = np.random.default_rng(5).integers(0, 256, a.region.array.shape, dtype=np.uint8)
    if error is not None:
        with pytest.raises(InvalidBlocks, match=error):
            a.write_blocks("b", [local], [remote])
        assert not a.transport.in_flight() and not b.region.array.any()
        return
    write = a.write_blocks("b", [local], [remote])
    assert write.nbytes == 4096
    await asyncio.wait_for(write, 5)
    assert np.array_equal(b.region.array[3], a.region.array[2]) and not b.region.array[:3].any()
    assert b.stats()["received.blocks.ok"] == 1 and a.stats()["blocks.ok"] == 1


async def test_a_one_block_write_while_requests_wait_for_the_window_lands(make_agent):
    """While chunk messages wait for room in the receiver's budget (the sender's window), a
    one-block write queues behind them as every write does (it takes no short path), and lands."""
    from omni_async.transport.limits import receive_budget

    a = await make_agent(NUM_BLOCKS, 4096, peer_id="a")
    b = await make_agent(NUM_BLOCKS, 4096, peer_id="b", max_message_bytes=1 << 20)
    await asyncio.wait_for(a.connect(b.control_address), 10)
    order: list[str] = []
    b.set_message_sink(lambda peer, key, meta, frames: order.append(key))
    count = 2 * receive_budget(1 << 20) // (1 << 20)
    frame = np.ones(1 << 20, np.uint8)
    messages = [a.send_message("b", f"k{i}", b"", [frame]) for i in range(count)]
    assert not a.transport.links["b"].outbox.idle  # some wait for room
    a.region.array[7] = 9
    write = a.write_blocks("b", [7], [8])
    await asyncio.wait_for(asyncio.gather(write, *messages), 30)
    assert (b.region.array[8] == 9).all() and len(order) == count


async def test_a_peer_that_cannot_make_its_proof_answers_at_once_and_stays_on_ucx(make_agent, monkeypatch):
    """A peer that cannot make its proof memfd (EMFILE, a seccomp filter) still answers: the
    asker finds no proof and keeps to UCX at once (connect waited the whole handshake timeout
    for an answer that never came)."""
    from omni_async.transport import peers

    def no_memfd(_nonce: str, _asker: str) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(peers, "make_proof", no_memfd)
    a = await make_agent(NUM_BLOCKS, 4096, peer_id="a", handshake_timeout=5.0)
    b = await make_agent(NUM_BLOCKS, 4096, peer_id="b", handshake_timeout=5.0)
    started = time.monotonic()
    await asyncio.wait_for(a.connect(b.control_address), 10)
    assert time.monotonic() - started < 2
    assert a.transport.links["b"].proven and a.transport.direct_kind("b") is None
    a.region.array[4] = 9
    await asyncio.wait_for(a.write_blocks("b", [4], [5]), 5)  # over UCX
    assert (b.region.array[5] == 9).all()


def test_a_proof_is_named_for_its_nonce_and_asker_and_found_only_where_it_is_held():
    from omni_async.transport.pid_proof import holds_proof, make_proof, new_nonce, proof_name

    nonce = new_nonce()
    assert len(nonce) == 32 and nonce != new_nonce()
    ours, relayed = proof_name(nonce, "a"), proof_name(nonce, "p")
    assert ours != relayed and ours == proof_name(nonce, "a") and len(ours) <= 249  # a memfd name's limit
    fd = make_proof(nonce, "a")
    try:
        assert holds_proof(os.getpid(), fd, ours)
        assert not holds_proof(os.getpid(), fd, relayed)
        assert not holds_proof(os.getpid(), 0, ours) and not holds_proof(os.getpid(), -1, ours)  # another fd, none
        assert not holds_proof(os.getppid(), fd, ours)  # another process (the test runner's parent)
        assert not holds_proof(2**22 + 1, fd, ours)  # no such process
    finally:
        os.close(fd)
    assert not holds_proof(os.getpid(), fd, ours)  # closed: no longer held


@pytest.mark.parametrize("answer", ["no proof", "relayed"])
async def test_a_peer_cannot_point_our_writes_at_another_agents_region(make_agent, answer):
    """A peer ``p`` that joined another agent ``q`` on this host offers ``q``'s region share
    (and base address) as its own.  Every check of a share passes (its proofs really are in
    ``q``), and our writes to ``p`` were copied into ``q``'s region.  Now ``p`` must first hold,
    in the process the share names, a memfd named for our nonce *and our id*: it cannot make
    one there ("no proof": it points at ``q``'s region memfd), and relaying our nonce to ``q``
    gets one named for ``p`` ("relayed": it points at that one).  Our writes to it stay on UCX;
    ``q``'s rows are never touched."""
    from omni_async.wire import HEADER_TAG, ProofReady, ProofRequest, encode_header
    from tests.helpers.rogue import Rogue

    q = await make_agent(peer_id="q", heartbeat_timeout=30.0)
    a = await make_agent(peer_id="a", heartbeat_timeout=30.0)
    a.region.array[:] = 7
    share = q.identity.region_share
    assert share is not None
    async with (
        Rogue.join(q.control_address, peer_id="p") as to_q,  # p as q's peer: its relay
        Rogue.join(a.control_address, peer_id="p", prove=False, host_id=a.transport.host_id, region_share=share,
                   base_addr=q.identity.base_addr) as p,
    ):
        async with asyncio.timeout(5):
            while not p.requests:
                await asyncio.sleep(0.01)
        nonce = p.requests[0].nonce
        fd = share.fd  # a descriptor of q's: its region memfd
        if answer == "relayed":
            to_q.send(encode_header(ProofRequest(nonce)), HEADER_TAG)
            q_link = q.transport.links["p"]
            async with asyncio.timeout(5):
                while q_link.proof_fd < 0:  # q made it, named for p
                    await asyncio.sleep(0.01)
            fd = q_link.proof_fd
        p.send(encode_header(ProofReady(nonce, fd)), HEADER_TAG)
        link = a.transport.links["p"]
        async with asyncio.timeout(5):
            while not link.proven:
                await asyncio.sleep(0.01)
        assert a.transport.direct_kind("p") is None
        write = a.write_blocks("p", [0, 1, 2], [0, 1, 2])  # over UCX: p never answers
        await asyncio.sleep(0.3)
        assert not q.region.array.any()
        write.cancel()


async def test_a_placed_write_settles_only_on_the_receivers_ack(make_agent, spawn_peer, tmp_path):
    """The rows are in place at once, yet the transfer waits for the receiver's answer: the
    receiver is a process stopped (SIGSTOP) before the write, so it cannot answer until resumed."""
    calm = {"heartbeat_interval": 0.5, "heartbeat_timeout": 10.0}
    peer = await spawn_peer("serve", str(tmp_path / "region.memfd"), NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx", **calm})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx", **calm)
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    assert agent.transport.direct_kind("rx") == "memfd"
    view = MappedRegion(RegionShare(pid=peer.info["pid"], fd=peer.info["fd"], token=peer.info["token"]),
                        NUM_BLOCKS, BLOCK_LEN)
    agent.region.array[1] = 5
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        transfer = agent.write_blocks("rx", [1], [2])
        assert (view.rows[2] == 5).all()
        await asyncio.sleep(0.2)
        assert not transfer.done()
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    await asyncio.wait_for(transfer, 10)  # resumed, the receiver answers
    view.close()


async def test_switch_off_keeps_blocks_on_ucx(make_agent):
    a, b = await pair(make_agent, same_host_lane=False)
    assert a.transport.direct_kind("b") is None and a.identity.region_share is None
    a.region.array[3] = 9
    await asyncio.wait_for(a.write_blocks("b", [3], [4]), 5)
    assert (b.region.array[4] == 9).all()


async def test_placed_header_out_of_range_is_refused_and_writes_nothing(make_agent):
    """A rogue peer's placed-write header naming rows beyond the receiver's region: refused
    with InvalidBlocks, nothing written, and the receiver keeps serving its peers."""
    from tests.helpers.rogue import Rogue

    a, b = await pair(make_agent, heartbeat_timeout=30.0)
    async with Rogue.join(b.control_address) as rogue:
        answered: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()

        def received(header: object) -> None:
            # b offers its keys for puts, or its ring, first
            if not isinstance(header, RkeyOffer | RingOffer) and not answered.done():
                answered.set_result(header)

        rogue.on_header = received
        rogue.send(encode_header(WriteRequest(1, 0, [(NUM_BLOCKS - 1, 2)], placed=True)), HEADER_TAG)
        ack = await asyncio.wait_for(answered, 5)
        assert isinstance(ack, Ack) and ack.transfer_id == 1
        assert ack.code == InvalidBlocks.code and "exceeds the region" in ack.reason
        assert not b.region.array.any() and "rogue" in b.peers
    a.region.array[2] = 7
    await asyncio.wait_for(a.write_blocks("b", [2], [3]), 5)  # the pair keeps working
    assert (b.region.array[3] == 7).all() and "a" in b.peers


async def test_removing_a_peer_unmaps_its_region(make_agent):
    a, b = await pair(make_agent)
    token = b.region.segment.token
    fds = len(open_fds_to(token))
    assert len(mapped(token)) == 2  # b's own mapping and a's mapping of it
    await a.remove_peer("b")
    assert len(mapped(token)) == 1
    assert len(open_fds_to(token)) < fds  # a's descriptor (held by its mapping) is closed too


# -- two processes, kill -9 of either side ----------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
async def test_writes_land_in_the_other_process_with_one_copy(make_agent, spawn_peer, tmp_path, kind):
    path = str(tmp_path / "region") + KINDS[kind]
    peer = await spawn_peer("serve", path, NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    agent.region.array[:] = np.random.default_rng(7).integers(0, 256, agent.region.array.shape, dtype=np.uint8)
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    assert agent.transport.direct_kind("rx") == kind
    local, remote = [3, 9, 10, 11, 40, 2], [50, 0, 1, 2, 33, 20]
    await asyncio.wait_for(agent.write_blocks("rx", local, remote), 10)
    expected = np.zeros_like(agent.region.array)
    expected[remote] = agent.region.array[local]
    assert np.array_equal(peer_rows(peer, kind, path), expected)


def peer_rows(peer: Any, kind: str, path: str) -> np.ndarray:
    """A copy of a "serve" peer's region, read the way the lane reaches it."""
    if kind == "memfd":  # mapped as the lane maps it
        view = MappedRegion(RegionShare(pid=peer.info["pid"], fd=peer.info["fd"], token=peer.info["token"]),
                            NUM_BLOCKS, BLOCK_LEN)
        rows = view.rows.copy()
        view.close()
        return rows
    return np.array(np.memmap(path, dtype=np.uint8, mode="r", shape=(NUM_BLOCKS, BLOCK_LEN)))


@pytest.mark.parametrize("kind", list(KINDS))
async def test_awaited_one_block_writes_take_their_answers_in_the_awaiter_and_the_loop_still_turns(
    make_agent, spawn_peer, tmp_path, kind
):
    """A receiver in another process: one-block writes awaited back to back take the answer
    (the receiver's consumption of the record) in the awaiting task, and may go on without a
    loop turn; every block lands, and the loop still turns at least once per
    ``TurnBudget.LIMIT`` + 1 writes (a task that counts its turns keeps running)."""
    path = str(tmp_path / "region") + KINDS[kind]
    peer = await spawn_peer("serve", path, NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    agent.region.array[:] = np.arange(1, NUM_BLOCKS + 1, dtype=np.uint8)[:, None]
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    writes = 20 * (TurnBudget.LIMIT + 1)
    try:
        async with asyncio.timeout(30):
            for i in range(writes):
                await agent.write_blocks("rx", [i % NUM_BLOCKS], [(i * 7) % NUM_BLOCKS])
    finally:
        counter.cancel()
    assert turns >= writes // (TurnBudget.LIMIT + 1)
    assert agent.transport.links["rx"].ring_in.taken_in_place > 0
    assert np.array_equal(peer_rows(peer, kind, path)[(np.arange(NUM_BLOCKS) * 7) % NUM_BLOCKS], agent.region.array)


@pytest.mark.parametrize("what", ["write", "message"])
async def test_a_transfer_whose_wake_up_finds_the_receivers_ring_closed_fails_only_after_the_peer_left(
    make_agent, spawn_peer, tmp_path, what
):
    """A receiver killed while its ring sleeps: a write copied into its mapped rows (or a
    message) put into its ring finds the wake-up pipe closed (EPIPE).  It is not failed then,
    while the peer is still listed (the pipe alone does not say the peer is gone: an orderly
    leave closes it too), but with the peer's removal: PeerLost, with the peer gone by then,
    within the heartbeat timeout."""
    peer = await spawn_peer("serve", str(tmp_path / "region.memfd"), NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    await asyncio.wait_for(agent.write_blocks("rx", [1], [1]), 10)
    producer = agent.transport.links["rx"].ring_out.producer
    deadline = time.monotonic() + 10
    while not sleeps_unwoken(producer):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    peer.proc.kill()
    while not all_threads_exited(peer.proc.pid):  # (its pipe closed) without running the loop
        assert time.monotonic() < deadline
        time.sleep(0.001)
    if what == "write":
        write = agent.write_blocks("rx", [2], [2])
    else:
        write = agent.send_message("rx", "k", b"meta", [np.ones(100, np.uint8)])
    assert agent.transport.links["rx"].ring_out is None  # the wake-up failed: the ring is dropped
    assert not write.done() and "rx" in agent.peers
    killed = time.monotonic()
    with pytest.raises(PeerLost):
        try:
            await asyncio.wait_for(write, FAST["heartbeat_timeout"] + 5)
        finally:
            assert "rx" not in agent.peers  # whoever is told so finds the peer gone
    assert time.monotonic() - killed < FAST["heartbeat_timeout"] + 2


@pytest.mark.parametrize("kind", list(KINDS))
async def test_receiver_killed_while_one_block_writes_are_awaited_one_by_one(make_agent, spawn_peer, tmp_path, kind):
    """kill -9 of the receiver while this process awaits one-block writes back to back (each
    awaiter polls for its answer itself): the write in progress fails with PeerLost (or the
    next one finds the peer gone) within the heartbeat timeout, and this process lives on."""
    peer = await spawn_peer("serve", str(tmp_path / "region") + KINDS[kind], NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    written = 0
    killer = threading.Timer(0.1, peer.proc.kill)
    killer.start()
    try:
        with pytest.raises((PeerLost, UnknownPeer)) as failed:
            async with asyncio.timeout(FAST["heartbeat_timeout"] + 5):
                while True:
                    await agent.write_blocks("rx", [written % NUM_BLOCKS], [written % NUM_BLOCKS])
                    written += 1
    finally:
        killer.join()
    assert written > 0 and agent.peers == {}, repr(failed.value)
    await asyncio.wait_for(peer.proc.wait(), 10)


@pytest.mark.alone  # compares /dev/shm before and after: runs after the parallel part (make test)
@pytest.mark.parametrize("blocks", [NUM_BLOCKS, 1], ids=["all-blocks", "one-block"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_receiver_killed_mid_write_fails_awaiters_and_leaks_nothing(make_agent, spawn_peer, tmp_path, kind, blocks):
    """The kill lands while this process copies into the receiver's rows: this process lives,
    every awaiter settles (failures are PeerLost) in time, nothing is left in /dev/shm, and
    the receiver's memory is unmapped once the peer is dropped.  ``one-block``: writes of one
    block each (their short path, ``_place_row``), thousands in flight at the kill."""
    before = dev_shm()
    peer = await spawn_peer("serve", str(tmp_path / "region") + KINDS[kind], NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    assert agent.transport.direct_kind("rx") == kind
    everything = list(range(NUM_BLOCKS))
    await asyncio.wait_for(agent.write_blocks("rx", everything, everything), 10)

    transfers, killed_at = await writes_through_a_kill(agent, "rx", peer.proc.kill, blocks)
    await assert_lost_in_time(agent, transfers, killed_at)
    await asyncio.wait_for(peer.proc.wait(), 10)
    if kind == "memfd":
        assert mapped(peer.info["token"]) == [] and open_fds_to(peer.info["token"]) == []
    assert dev_shm() <= before
    peer2 = await spawn_peer("serve", str(tmp_path / "region2") + KINDS[kind], NUM_BLOCKS, BLOCK_LEN,
                             {"peer_id": "rx2"})
    await asyncio.wait_for(agent.connect(peer2.info["address"]), 10)
    await asyncio.wait_for(agent.write_blocks("rx2", [1], [2]), 10)


@pytest.mark.alone  # compares /dev/shm before and after: runs after the parallel part (make test)
@pytest.mark.parametrize("kind", list(KINDS))
async def test_sender_killed_mid_write_receiver_keeps_serving(owned, spawn_peer, tmp_path, kind):
    """The writer maps (or process_vm_writes into) this process's region and is killed while
    writing: this process notices in time, keeps serving, and nothing is left in /dev/shm."""
    before = dev_shm()
    region = BlockRegion.allocate(NUM_BLOCKS, BLOCK_LEN) if kind == "memfd" else \
        BlockRegion.wrap(np.zeros((NUM_BLOCKS, BLOCK_LEN), np.uint8))
    agent = Agent(region, fast_config(peer_id="rx"))
    owned.append(agent)
    await agent.start()
    await writer_killed_then_serve_another(agent, spawn_peer, tmp_path, NUM_BLOCKS, BLOCK_LEN, KINDS[kind])
    assert dev_shm() <= before



def sleeps_unwoken(producer: Any) -> bool:
    """Whether the consumer of ``producer``'s ring sleeps (its epoch is odd: ring.py's layout)
    and this producer has not woken it for that sleep yet (so its next put wakes it)."""
    epoch = int(producer._ctl[16])
    return bool(epoch & 1) and epoch != producer._woken


def all_threads_exited(pid: int) -> bool:
    """Whether every thread of ``pid`` exited (its descriptors are closed only then: a killed
    process's leader is a zombie while its other threads still exit)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return tasks in ([], [str(pid)]) and process_state(pid) in ("Z", None)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (``"Z"``: a zombie), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


async def test_a_write_that_finds_the_peer_gone_fails_only_after_the_peer_left(make_agent, spawn_peer, tmp_path):
    """A write into a SIGKILLed peer's memory (process_vm_writev: ESRCH) fails with PeerLost, and
    whoever is told so finds the peer already gone (its leave came first): a facade polling it
    must not still see the peer as connected."""
    kind = "process_vm_writev"
    peer = await spawn_peer("serve", str(tmp_path / "region") + KINDS[kind], NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    assert agent.transport.direct_kind("rx") == kind
    peer.proc.kill()
    deadline = time.monotonic() + 10
    while process_state(peer.proc.pid) not in ("Z", None):  # a zombie, or reaped already
        assert time.monotonic() < deadline
        time.sleep(0.001)  # no await: the loop must not notice the death before the write does
    seen: list[bool] = []
    transfer = agent.write_blocks("rx", [1], [2])
    transfer.add_done_callback(lambda _t: seen.append("rx" in agent.peers))
    with pytest.raises(PeerLost):
        await asyncio.wait_for(transfer, 10)
    assert seen == [False]
