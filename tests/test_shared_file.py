"""The same-host lane into a wrapped region that is a shared mapping of a tmpfs file (a
``/dev/shm`` file, a memfd the caller made): offered like an allocated region's memfd, so a
peer maps it and copies once (no ``process_vm_writev``); its checks, a file that shrinks under
the mapping, and kill -9 of either side in real separate processes."""

import asyncio
import mmap
import os
import threading
import time
import uuid

import msgspec
import numpy as np
import pytest

from omni_async import Agent, BlockRegion
from omni_async.region import Run
from omni_async.transport.shared import MappedFile, Refused, advertise, open_writer

from .conftest import FAST, fast_config
from .helpers.kill import assert_lost_in_time
from .helpers.procfs import fd_targets
from .test_shared import BLOCK_LEN, NUM_BLOCKS, dev_shm, peer_info

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def shm_path():
    """``/dev/shm`` paths for the test's own region files, removed afterwards."""
    paths: list[str] = []

    def new(size: int = 0) -> str:
        path = f"/dev/shm/omni-test-{uuid.uuid4().hex}"
        paths.append(path)
        with open(path, "wb") as f:
            f.truncate(size)
        return path

    yield new
    for path in paths:
        for name in (path, path + ".messages"):  # the peer helper's log of chunk messages, too
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass


def memmap(path: str, num_blocks: int = 4, block_len: int = 4096, offset: int = 0, mode: str = "r+"):
    return np.memmap(path, dtype=np.uint8, mode=mode, shape=(num_blocks, block_len), offset=offset).view(np.ndarray)


def held(path: str) -> list[str]:
    """This process's descriptors and mappings of ``path``."""
    with open("/proc/self/maps") as f:
        maps = [line for line in f if path in line]
    return [t for t in fd_targets() if t.startswith(path)] + maps


# -- the offer and the mapping checks (no peer process) -------------------------------------------
def test_a_wrapped_shared_tmpfs_mapping_is_offered_and_mapped_by_inode(shm_path, tmp_path):
    path = shm_path(8 * 4096)
    rows = memmap(path, offset=3 * 4096)  # the region starts 3 pages into the file
    region = BlockRegion.wrap(rows)  # its descriptor of the file lives as long as it does
    offer = advertise(region)
    assert offer is not None and offer.fd >= 0 and offer.proof_fd >= 0
    assert offer.inode == os.stat(path).st_ino and offer.offset == 3 * 4096
    assert os.readlink(f"/proc/self/fd/{offer.proof_fd}") == f"/memfd:omni-{offer.token} (deleted)"
    writer = open_writer(peer_info(offer), "h")
    assert writer is not None and writer.kind == "file"
    src = np.arange(4 * 4096, dtype=np.uint64).astype(np.uint8).reshape(4, 4096)
    writer.place(src, [Run(0, 2, 2)])
    assert np.array_equal(rows[2:4], src[0:2]) and not rows[:2].any()
    assert not memmap(path, 3, 4096).any()  # nothing before the region
    writer.close()
    writer.close()

    # a region that starts inside a page of the file
    odd = memmap(path, offset=100)
    odd_region = BlockRegion.wrap(odd)
    odd_offer = advertise(odd_region)
    assert odd_offer is not None and odd_offer.offset == 100
    writer = open_writer(peer_info(odd_offer), "h")
    assert writer is not None and writer.kind == "file"
    writer.place(src, [Run(1, 0, 1)])
    assert np.array_equal(odd[0], src[1])
    writer.close()

    # a memfd the caller made and mapped itself
    fd = os.memfd_create("caller", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4 * 4096)
    caller = np.frombuffer(mmap.mmap(fd, 4 * 4096), np.uint8).reshape(4, 4096)
    os.close(fd)  # only the mapping's own descriptor keeps it
    region = BlockRegion.wrap(caller)
    offer = advertise(region)
    assert offer is not None and offer.inode > 0
    writer = open_writer(peer_info(offer), "h")
    assert writer is not None and writer.kind == "file"
    writer.place(src, [Run(3, 0, 1)])
    assert np.array_equal(caller[0], src[3])
    writer.close()

    # anything else keeps process_vm_writev: private memory, a disk file, a private mapping
    disk = tmp_path / "region"
    disk.write_bytes(bytes(4 * 4096))
    for other in (np.zeros((4, 4096), np.uint8), memmap(str(disk)), memmap(shm_path(4 * 4096), mode="c")):
        offer = advertise(BlockRegion.wrap(other))
        assert offer is not None and offer.fd == -1 and offer.inode == 0


def test_an_offered_file_is_allocated_and_its_descriptor_lives_with_the_region(shm_path):
    path = shm_path(4 * 4096)  # sparse: a page never written could meet a full tmpfs (SIGBUS)
    assert os.stat(path).st_blocks == 0
    region = BlockRegion.wrap(memmap(path))
    file = region.shared_file()
    assert file is not None and region.shared_file() is file  # looked up once
    assert os.stat(path).st_blocks * 512 >= 4 * 4096
    assert os.readlink(f"/proc/self/fd/{file.fd}") == path
    file.close()
    file.close()
    assert not file.shareable and advertise(region).inode == 0  # closed: no longer offered
    assert BlockRegion.allocate(4, 4096).shared_file() is None  # an allocated one offers its memfd


@pytest.mark.parametrize("case", ["inode", "size", "pid", "fd", "disk", "token", "proof_fd", "no_proof"])
def test_mapping_a_file_refuses_anything_but_the_advertised_tmpfs_file(case, shm_path, tmp_path):
    path = shm_path(4 * 4096)
    region = BlockRegion.wrap(memmap(path))
    offer = advertise(region)
    num_blocks, extra = 4, []
    if case == "inode":
        offer = msgspec.structs.replace(offer, inode=offer.inode + 1)
    elif case == "size":
        num_blocks = 5
    elif case == "pid":
        offer = msgspec.structs.replace(offer, pid=(1 << 22) + 1)
    elif case == "fd":
        offer = msgspec.structs.replace(offer, fd=offer.fd + 1000)
    elif case == "disk":  # a regular file on a disk, named by its own inode
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 4 * 4096)
        extra.append(fd)
        offer = msgspec.structs.replace(offer, fd=fd, inode=os.fstat(fd).st_ino)
    elif case == "token":
        offer = msgspec.structs.replace(offer, token="0" * 32)
    elif case == "proof_fd":  # a descriptor that is not the proof memfd (the file itself)
        offer = msgspec.structs.replace(offer, proof_fd=offer.fd)
    elif case == "no_proof":
        offer = msgspec.structs.replace(offer, token="", proof_fd=-1)
    mappings = len(held(path))
    try:
        with pytest.raises(Refused):
            MappedFile(offer, num_blocks, 4096)
        assert open_writer(peer_info(offer, num_blocks=num_blocks), "h") is None
        assert len(held(path)) == mappings  # nothing left open or mapped
    finally:
        for fd in extra:
            os.close(fd)


def test_a_peer_cannot_point_our_writes_at_another_processs_file(shm_path):
    """Another process maps a /dev/shm file; a peer names that process's pid and descriptor
    (with the right inode, and its own valid proof): refused, since the proof memfd is not in
    that process, and nothing is written into the file."""
    import subprocess
    import sys

    path = shm_path(4 * 4096)
    code = ("import mmap, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); m = mmap.mmap(fd, 4 * 4096); "
            "print(fd, flush=True); sys.stdin.read()")
    other = subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        their_fd = int(other.stdout.readline())
        region = BlockRegion.wrap(memmap(shm_path(4 * 4096)))
        ours = advertise(region)  # a valid proof, of this process
        forged = msgspec.structs.replace(ours, pid=other.pid, fd=their_fd, inode=os.stat(path).st_ino, offset=0)
        with pytest.raises(Refused):
            MappedFile(forged, 4, 4096)
        assert open_writer(peer_info(forged), "h") is None
        assert not memmap(path, mode="r").any()
    finally:
        other.kill()
        other.wait()


def test_a_file_that_shrinks_under_the_mapping_fails_the_write_instead_of_killing_us(shm_path):
    """A copy into a page past the end of a tmpfs file raises SIGBUS: the writer checks the
    size first, so a shrunk file fails the write with an OSError and this process lives."""
    path = shm_path(4 * 4096)
    region = BlockRegion.wrap(memmap(path))
    writer = open_writer(peer_info(advertise(region)), "h")
    assert writer is not None and writer.kind == "file"
    os.truncate(path, 4096)
    with pytest.raises(OSError, match="shrank"):
        writer.place(np.ones((4, 4096), np.uint8), [Run(0, 3, 1)])
    writer.close()


# -- two processes, kill -9 of either side ----------------------------------------------------------
async def test_writes_land_in_a_peers_file_and_a_killed_receiver_leaks_nothing(make_agent, spawn_peer, shm_path):
    """The receiver process serves a region mapped from a /dev/shm file: we map the file (one
    copy, no process_vm_writev) and the rows land in it; then it is SIGKILLed while we copy:
    this process lives, every awaiter settles (failures are PeerLost) in time, we hold no
    descriptor or mapping of its file once it is dropped, and /dev/shm holds nothing new."""
    path = shm_path()
    before = dev_shm()
    peer = await spawn_peer("serve", path, NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    agent.region.array[:] = np.random.default_rng(7).integers(0, 256, agent.region.array.shape, dtype=np.uint8)
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    assert agent.transport.direct_kind("rx") == "file"
    local, remote = [3, 9, 10, 11, 40, 2], [50, 0, 1, 2, 33, 20]
    await asyncio.wait_for(agent.write_blocks("rx", local, remote), 10)
    expected = np.zeros_like(agent.region.array)
    expected[remote] = agent.region.array[local]
    assert np.array_equal(memmap(path, NUM_BLOCKS, BLOCK_LEN, mode="r"), expected)
    assert held(path)  # our mapping (and descriptor) of the peer's file

    everything = list(range(NUM_BLOCKS))
    killer = threading.Timer(0.1, peer.proc.kill)  # a thread: it lands while the loop copies
    killer.start()
    transfers = []
    started = time.monotonic()
    while time.monotonic() - started < 0.4 and "rx" in agent.transport.peer_ids:  # 4 MiB per write
        transfers.append(agent.write_blocks("rx", everything, everything))
        await asyncio.sleep(0)
    killer.join()
    await assert_lost_in_time(agent, transfers, started + 0.1)
    await asyncio.wait_for(peer.proc.wait(), 10)
    assert held(path) == []
    assert dev_shm() - {os.path.basename(path) + ".messages"} <= before  # the helper's own log aside


async def test_sender_killed_while_it_writes_our_file_receiver_keeps_serving(owned, spawn_peer, shm_path, tmp_path):
    """Our region is a /dev/shm file mapping; the writer maps it and is SIGKILLed while
    writing: we drop it in time, keep serving, and /dev/shm holds nothing new."""
    path = shm_path(NUM_BLOCKS * BLOCK_LEN)
    before = dev_shm()
    agent = Agent(BlockRegion.wrap(memmap(path, NUM_BLOCKS, BLOCK_LEN)), fast_config(peer_id="rx"))
    owned.append(agent)
    await agent.start()
    assert agent.identity.region_share is not None and agent.identity.region_share.inode == os.stat(path).st_ino
    writer = await spawn_peer("write", str(tmp_path / "w.memfd"), NUM_BLOCKS, BLOCK_LEN,
                              {"peer_id": "tx"}, agent.control_address)
    assert writer.info == {"connected": "rx"}
    await asyncio.sleep(0.2)  # let it write for a while
    assert agent.stats()["received.blocks.ok"] > 0
    writer.kill()
    killed_at = time.monotonic()
    while "tx" in agent.peers:
        assert time.monotonic() - killed_at < FAST["heartbeat_timeout"] + 2.0
        await asyncio.sleep(0.02)
    await asyncio.wait_for(writer.proc.wait(), 10)
    other = await spawn_peer("serve", str(tmp_path / "o.memfd"), NUM_BLOCKS, BLOCK_LEN, {"peer_id": "o"})
    await asyncio.wait_for(agent.connect(other.info["address"]), 10)
    agent.region.array[5] = 42
    await asyncio.wait_for(agent.write_blocks("o", [5], [6]), 10)
    assert dev_shm() <= before
