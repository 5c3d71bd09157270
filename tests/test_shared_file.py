"""The same-host lane into a wrapped region that is a shared mapping of a tmpfs file sealed
against shrinking (a memfd the caller made and sealed): offered like an allocated region's
memfd, so a peer maps it and copies once (no ``process_vm_writev``); a file that could shrink
(a plain ``/dev/shm`` file) is neither offered nor mapped; the checks, and kill -9 of either
side in real separate processes."""

import asyncio
import fcntl
import mmap
import os
import uuid

import msgspec
import numpy as np
import pytest

from omni_async import Agent, BlockRegion
from omni_async.memfd import SIZE_SEALS
from omni_async.transport.shared import MappedFile, Refused, advertise, open_writer

from .conftest import fast_config
from .helpers.kill import assert_lost_in_time, writer_killed_then_serve_another, writes_through_a_kill
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


def sealed_memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK) -> tuple[int, str]:
    """A memfd of ``size`` bytes (sealed with ``seals``) and its path through /proc, which other
    processes open too (as the bench's region files)."""
    fd = os.memfd_create(f"omni-test-{uuid.uuid4().hex}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, f"/proc/{os.getpid()}/fd/{fd}"


@pytest.fixture
def memfd_path():
    """Sealed memfds for the test's region files, by path (closed afterwards)."""
    fds: list[int] = []

    def new(size: int, seals: int = fcntl.F_SEAL_SHRINK) -> str:
        fd, path = sealed_memfd(size, seals)
        fds.append(fd)
        return path

    yield new
    for fd in fds:
        os.close(fd)


def name_of(path: str) -> str:
    """The name of the file at ``path`` as /proc shows it in descriptors and mappings."""
    return os.readlink(path).removesuffix(" (deleted)")


def held(path: str) -> list[str]:
    """This process's descriptors and mappings of ``path``."""
    with open("/proc/self/maps") as f:
        maps = [line for line in f if path in line]
    return [t for t in fd_targets() if t.startswith(path)] + maps


# -- the offer and the mapping checks (no peer process) -------------------------------------------
def test_a_wrapped_sealed_tmpfs_mapping_is_offered_and_mapped_by_inode(memfd_path, shm_path, tmp_path):
    path = memfd_path(8 * 4096)
    rows = memmap(path, offset=3 * 4096)  # the region starts 3 pages into the file
    region = BlockRegion.wrap(rows)  # its descriptor of the file lives as long as it does
    offer = advertise(region)
    assert offer is not None and offer.fd >= 0 and offer.proof_fd >= 0
    assert offer.inode == os.stat(path).st_ino and offer.offset == 3 * 4096
    assert os.readlink(f"/proc/self/fd/{offer.proof_fd}") == f"/memfd:omni-{offer.token} (deleted)"
    writer = open_writer(peer_info(offer), "h")
    assert writer is not None and writer.kind == "file"
    src = np.arange(4 * 4096, dtype=np.uint64).astype(np.uint8).reshape(4, 4096)
    writer.place(src, [(0, 2, 2)])
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
    writer.place(src, [(1, 0, 1)])
    assert np.array_equal(odd[0], src[1])
    writer.close()

    # a memfd the caller made, sealed and mapped itself; an allocated region's array, wrapped
    fd, _ = sealed_memfd(4 * 4096, SIZE_SEALS)
    caller = np.frombuffer(mmap.mmap(fd, 4 * 4096), np.uint8).reshape(4, 4096)
    os.close(fd)  # only the mapping's own descriptor keeps it
    for view in (caller, BlockRegion.allocate(4, 4096).array):
        region = BlockRegion.wrap(view)
        offer = advertise(region)
        assert offer is not None and offer.inode > 0
        writer = open_writer(peer_info(offer), "h")
        assert writer is not None and writer.kind == "file"
        writer.place(src, [(3, 0, 1)])
        assert np.array_equal(view[0], src[3])
        writer.close()

    # anything else keeps process_vm_writev: private memory, a disk file, a private mapping, and
    # a file that could shrink under a peer's mapping (a /dev/shm file, an unsealed memfd)
    disk = tmp_path / "region"
    disk.write_bytes(bytes(4 * 4096))
    others = (np.zeros((4, 4096), np.uint8), memmap(str(disk)), memmap(memfd_path(4 * 4096), mode="c"),
              memmap(shm_path(4 * 4096)), memmap(memfd_path(4 * 4096, seals=fcntl.F_SEAL_GROW)))
    for other in others:
        offer = advertise(BlockRegion.wrap(other))
        assert offer is not None and offer.fd == -1 and offer.inode == 0


def test_an_offered_file_is_allocated_and_its_descriptor_lives_with_the_region(memfd_path):
    path = memfd_path(4 * 4096)  # sparse: a page never written could meet a full tmpfs (SIGBUS)
    assert os.stat(path).st_blocks == 0
    region = BlockRegion.wrap(memmap(path))
    file = region.shared_file()
    assert file is not None and region.shared_file() is file  # looked up once
    assert os.stat(path).st_blocks * 512 >= 4 * 4096
    assert os.readlink(f"/proc/self/fd/{file.fd}") == os.readlink(path)
    file.close()
    file.close()
    assert not file.shareable and advertise(region).inode == 0  # closed: no longer offered
    assert BlockRegion.allocate(4, 4096).shared_file() is None  # an allocated one offers its memfd


@pytest.mark.parametrize(
    "case", ["inode", "size", "pid", "fd", "disk", "token", "proof_fd", "no_proof", "unsealed", "read_only"]
)
def test_mapping_a_file_refuses_anything_but_the_advertised_tmpfs_file(case, memfd_path, shm_path, tmp_path):
    path = memfd_path(4 * 4096)
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
    elif case in ("disk", "unsealed"):  # a regular file on a disk, or in /dev/shm: named by its own inode
        fd = os.open(tmp_path / "f" if case == "disk" else shm_path(), os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 4 * 4096)
        extra.append(fd)
        offer = msgspec.structs.replace(offer, fd=fd, inode=os.fstat(fd).st_ino)
    elif case == "read_only":  # the peer may only read the file: we would write it with our rights
        fd = os.open(path, os.O_RDONLY)
        extra.append(fd)
        offer = msgspec.structs.replace(offer, fd=fd)
    elif case == "token":
        offer = msgspec.structs.replace(offer, token="0" * 32)
    elif case == "proof_fd":  # a descriptor that is not the proof memfd (the file itself)
        offer = msgspec.structs.replace(offer, proof_fd=offer.fd)
    elif case == "no_proof":
        offer = msgspec.structs.replace(offer, token="", proof_fd=-1)
    name = name_of(path)
    mappings = len(held(name))
    try:
        with pytest.raises(Refused):
            MappedFile(offer, num_blocks, 4096)
        assert open_writer(peer_info(offer, num_blocks=num_blocks), "h") is None
        assert len(held(name)) == mappings  # nothing left open or mapped
    finally:
        for fd in extra:
            os.close(fd)


def test_a_peer_cannot_point_our_writes_at_another_processs_file():
    """Another process maps a sealed memfd; a peer names that process's pid and descriptor
    (with the right inode, and its own valid proof): refused, since the proof memfd is not in
    that process, and nothing is written into the file."""
    import subprocess
    import sys

    code = ("import fcntl, mmap, os, sys; fd = os.memfd_create('theirs', os.MFD_ALLOW_SEALING); "
            "os.ftruncate(fd, 4 * 4096); fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK); "
            "m = mmap.mmap(fd, 4 * 4096); print(fd, flush=True); sys.stdin.read()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        their_fd = int(other.stdout.readline())
        theirs = f"/proc/{other.pid}/fd/{their_fd}"
        region = BlockRegion.allocate(4, 4096)
        ours = advertise(BlockRegion.wrap(region.array))  # a valid proof, of this process
        assert ours is not None and ours.inode > 0
        forged = msgspec.structs.replace(ours, pid=other.pid, fd=their_fd, inode=os.stat(theirs).st_ino, offset=0)
        with pytest.raises(Refused):
            MappedFile(forged, 4, 4096)
        assert open_writer(peer_info(forged), "h") is None
        assert not memmap(theirs, mode="r").any()
    finally:
        other.kill()
        other.wait()


def test_a_file_that_could_shrink_is_neither_offered_nor_mapped(memfd_path, shm_path):
    """A copy into a page past the end of a tmpfs file raises SIGBUS, which no check before the
    copy can rule out (the owner may shrink the file between the two): so a /dev/shm file is
    not offered, and one a peer offers anyway is refused; a sealed file cannot shrink at all."""
    path = shm_path(4 * 4096)
    region = BlockRegion.wrap(memmap(path))
    offer = advertise(region)
    assert offer is not None and offer.inode == 0  # process_vm_writev
    fd = os.open(path, os.O_RDWR)
    try:
        proven = BlockRegion.wrap(BlockRegion.allocate(4, 4096).array)  # a valid proof, of this process
        forged = msgspec.structs.replace(advertise(proven), fd=fd, inode=os.fstat(fd).st_ino, offset=0)
        with pytest.raises(Refused, match="not sealed against shrinking"):
            MappedFile(forged, 4, 4096)
    finally:
        os.close(fd)
    sealed = memfd_path(4 * 4096)
    sealed_region = BlockRegion.wrap(memmap(sealed))
    writer = open_writer(peer_info(advertise(sealed_region)), "h")
    assert writer is not None and writer.kind == "file"
    with pytest.raises(PermissionError):
        os.truncate(sealed, 4096)  # its owner cannot shrink it under our mapping
    writer.place(np.ones((4, 4096), np.uint8), [(0, 3, 1)])
    assert memmap(sealed, mode="r")[3].all()
    writer.close()


# -- two processes, kill -9 of either side ----------------------------------------------------------
@pytest.mark.alone  # compares /dev/shm before and after: runs after the parallel part (make test)
async def test_writes_land_in_a_peers_file_and_a_killed_receiver_leaks_nothing(make_agent, spawn_peer, memfd_path):
    """The receiver process serves a region mapped from a sealed memfd (which it opened through
    our /proc path of it): we map the file (one copy, no process_vm_writev) and the rows land in
    it; then it is SIGKILLed while we copy: this process lives, every awaiter settles (failures
    are PeerLost) in time, we hold no descriptor or mapping of its file once it is dropped
    (but our own), and /dev/shm holds nothing new."""
    path = memfd_path(NUM_BLOCKS * BLOCK_LEN)
    name = name_of(path)
    before = dev_shm()
    peer = await spawn_peer("serve", path, NUM_BLOCKS, BLOCK_LEN, {"peer_id": "rx"})
    ours = held(name)  # the test's own descriptor of the file
    agent = await make_agent(NUM_BLOCKS, BLOCK_LEN, peer_id="tx")
    agent.region.array[:] = np.random.default_rng(7).integers(0, 256, agent.region.array.shape, dtype=np.uint8)
    await asyncio.wait_for(agent.connect(peer.info["address"]), 10)
    assert agent.transport.direct_kind("rx") == "file"
    local, remote = [3, 9, 10, 11, 40, 2], [50, 0, 1, 2, 33, 20]
    await asyncio.wait_for(agent.write_blocks("rx", local, remote), 10)
    expected = np.zeros_like(agent.region.array)
    expected[remote] = agent.region.array[local]
    assert np.array_equal(memmap(path, NUM_BLOCKS, BLOCK_LEN, mode="r"), expected)
    assert len(held(name)) > len(ours)  # our agent's mapping of the peer's file

    transfers, killed_at = await writes_through_a_kill(agent, "rx", peer.proc.kill, NUM_BLOCKS)
    await assert_lost_in_time(agent, transfers, killed_at)
    await asyncio.wait_for(peer.proc.wait(), 10)
    assert held(name) == ours
    assert dev_shm() <= before


@pytest.mark.alone  # compares /dev/shm before and after: runs after the parallel part (make test)
async def test_sender_killed_while_it_writes_our_file_receiver_keeps_serving(owned, spawn_peer, tmp_path):
    """Our region is a sealed memfd the caller mapped (an allocated region's array, wrapped);
    the writer maps it and is SIGKILLed while writing: we drop it in time, keep serving, and
    /dev/shm holds nothing new."""
    before = dev_shm()
    memory = BlockRegion.allocate(NUM_BLOCKS, BLOCK_LEN).array
    agent = Agent(BlockRegion.wrap(memory), fast_config(peer_id="rx"))
    owned.append(agent)
    await agent.start()
    share = agent.identity.region_share
    assert share is not None and share.inode == os.fstat(share.fd).st_ino
    await writer_killed_then_serve_another(agent, spawn_peer, tmp_path, NUM_BLOCKS, BLOCK_LEN, ".memfd")
    assert dev_shm() <= before
