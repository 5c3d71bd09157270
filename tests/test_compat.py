"""Contract tests of ``SyncDataTransport`` against the seed ``DataTransport`` text.

Written from the seed's docstrings, not from the implementation: plain synchronous test
functions, two transports in one process (each runs its own background loop) and a transport in
a spawned child process, driven over a pipe.  A child stopped with SIGSTOP is a receiver that
cannot acknowledge, which makes "still in flight" deterministic without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from omni_async import (
    AgentConfig,
    BlockRegion,
    ClosedError,
    FingerprintMismatch,
    HandshakeRejected,
    HandshakeTimeout,
    InvalidBlocks,
    LayoutMismatch,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferFailed,
    UnknownPeer,
)
from omni_async.auth import generate_keypair
from omni_async.compat import PollResult, SyncDataTransport, decode_agent_metadata
from omni_async.seed import portal as portal_module
from omni_async.transport.vetting import shared_vetter_fds

from .helpers.ctrl_c import ctrl_c_storm

pytestmark = pytest.mark.timeout(60)

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only, here and in spawned children

TIMINGS = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "handshake_timeout": 2.0, "ucx_net_devices": "lo"}
NUM_BLOCKS, BLOCK_LEN = 32, 16 * 1024
DEADLINE_S = 10.0


def config(peer_id: str, **overrides: Any) -> AgentConfig:
    return AgentConfig(peer_id=peer_id, **{**TIMINGS, **overrides})


def block_memory(num_blocks: int = NUM_BLOCKS, block_len: int = BLOCK_LEN, seed: int | None = None) -> np.ndarray:
    if seed is None:
        return np.zeros((num_blocks, block_len), dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, (num_blocks, block_len), dtype=np.uint8)


def seed_fingerprint(fields: dict[str, Any] | None) -> str:
    """The seed's formula, restated from its text."""
    if not fields:
        return ""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def peer_args(t: SyncDataTransport) -> tuple[bytes, int, int, int]:
    """What the seed's callers exchange out of band."""
    return t.get_agent_metadata(), t.base_addr, t.num_blocks, t.block_len


def poll_until(t: SyncDataTransport, ids: set[int], seen: PollResult | None = None,
               deadline_s: float = DEADLINE_S) -> PollResult:
    """Poll until every id in ``ids`` was reported; return everything reported meanwhile."""
    done: list[int] = list(seen.done) if seen else []
    failed: list[int] = list(seen.failed) if seen else []
    end = time.monotonic() + deadline_s
    while not ids <= set(done) | set(failed):
        assert time.monotonic() < end, f"ids {ids - set(done) - set(failed)} never surfaced"
        result = t.poll()
        done += result.done
        failed += result.failed
        time.sleep(0.002)
    return PollResult(done, failed)


def loop_runner(t: SyncDataTransport) -> threading.Thread | None:
    """The thread that runs the transport's loop now (None: nobody, between runs)."""
    return t._portal._driver


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


@pytest.fixture
def make_transport() -> Iterator[Callable[..., SyncDataTransport]]:
    """``make_transport(memory, peer_id, config_fields=None, **config)``; all closed at teardown."""
    made: list[SyncDataTransport] = []

    def factory(memory: np.ndarray, peer_id: str, config_fields: dict[str, Any] | None = None,
                **overrides: Any) -> SyncDataTransport:
        t = SyncDataTransport(memoryview(memory), config_fields, config=config(peer_id, **overrides))
        made.append(t)
        return t

    yield factory
    for t in made:
        t.close()


def connect_both_ways(a: SyncDataTransport, a_name: str, b: SyncDataTransport, b_name: str) -> None:
    a.add_remote_peer(b_name, *peer_args(b))
    b.add_remote_peer(a_name, *peer_args(a))


# -- construction and properties ------------------------------------------------------------------
def test_properties_match_the_view(make_transport):
    memory = block_memory(8, 4096)
    t = make_transport(memory, "props")
    assert t.base_addr == ctypes.addressof(ctypes.c_char.from_buffer(memoryview(memory)))
    assert (t.num_blocks, t.block_len) == (8, 4096)
    assert t.config_fingerprint == ""
    assert isinstance(t.get_agent_metadata(), bytes)

    raw = bytearray(3 * 512)
    view = memoryview(raw).cast("B", (3, 512))
    u = SyncDataTransport(view, {"model": "m", "layers": 2}, config=config("props-2"))
    try:
        assert u.base_addr == ctypes.addressof(ctypes.c_char.from_buffer(view))
        assert (u.num_blocks, u.block_len) == (3, 512)
        assert u.config_fingerprint == seed_fingerprint({"layers": 2, "model": "m"})
    finally:
        u.close()


def test_each_transport_runs_its_own_loop_thread_gone_after_idempotent_close():
    before = set(threading.enumerate())
    a = SyncDataTransport(memoryview(block_memory()), config=config("own-a"))
    mid = set(threading.enumerate())
    b = SyncDataTransport(memoryview(block_memory()), config=config("own-b"))
    started_a = mid - before
    started_b = set(threading.enumerate()) - mid
    assert started_a and started_b and not started_a & started_b
    assert all(th.daemon for th in started_a | started_b)
    a.close()
    a.close()
    assert not any(th.is_alive() for th in started_a)
    assert all(th.is_alive() for th in started_b)
    with pytest.raises(ClosedError):
        a.write_blocks("x", [0], [0])
    with pytest.raises(ClosedError):
        a.poll()
    b.close()
    b.close()
    assert set(threading.enumerate()) <= before


# -- peers ---------------------------------------------------------------------------------------------
def test_two_in_one_process_write_both_ways_and_bytes_arrive(make_transport):
    mem_a, mem_b = block_memory(seed=1), block_memory(seed=2)
    orig_a = mem_a.copy()
    a = make_transport(mem_a, "one-a")
    b = make_transport(mem_b, "one-b")
    connect_both_ways(a, "A", b, "B")

    local, remote = [0, 1, 2, 9, 31, 4], [10, 11, 12, 0, 1, 30]
    tid, elapsed = timed(a.write_blocks, "B", local, remote)
    assert isinstance(tid, int) and elapsed < 0.2
    result = poll_until(a, {tid})
    assert result == PollResult([tid], [])
    for li, ri in zip(local, remote, strict=True):
        assert np.array_equal(mem_b[ri], orig_a[li])

    tids = [b.write_blocks("A", [i], [31 - i]) for i in range(8)]
    assert all(isinstance(i, int) for i in tids) and len(set(tids)) == 8
    result = poll_until(b, set(tids))
    assert sorted(result.done) == sorted(tids) and result.failed == []
    assert np.array_equal(mem_a[24:32], mem_b[7::-1])  # b sent its current blocks 0..7
    assert b.poll() == PollResult([], [])  # reported once, then gone from the inflight set


def test_add_remote_peer_in_either_order_and_again(make_transport):
    a = make_transport(block_memory(), "order-a")
    b = make_transport(block_memory(), "order-b")
    # The side that registers first is the one whose peer id sorts last.
    b.add_remote_peer("A", *peer_args(a))
    a.add_remote_peer("B", *peer_args(b))
    a.add_remote_peer("B", *peer_args(b))  # once more: nothing changes
    tid = a.write_blocks("B", [3], [4])
    assert isinstance(tid, int)
    assert poll_until(a, {tid}).done == [tid]


def register_at(barrier: threading.Barrier, errors: list[Exception], me: SyncDataTransport, name: str,
                other: SyncDataTransport) -> None:
    """``me.add_remote_peer(name, other)`` once every party reached ``barrier``; errors collected."""
    args = peer_args(other)
    barrier.wait()
    try:
        me.add_remote_peer(name, *args)
    except Exception as exc:
        errors.append(exc)


def test_both_sides_register_at_the_same_moment(make_transport):
    """The seed's flow from two threads at once: both calls succeed and the pair works both ways."""
    for round_ in range(3):
        a = make_transport(block_memory(seed=round_), f"same-{round_}-a")
        b = make_transport(block_memory(), f"same-{round_}-b")
        barrier = threading.Barrier(2)
        errors: list[Exception] = []
        threads = [threading.Thread(target=register_at, args=(barrier, errors, a, "B", b)),
                   threading.Thread(target=register_at, args=(barrier, errors, b, "A", a))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(DEADLINE_S)
        assert errors == []
        ta, tb = a.write_blocks("B", [1], [2]), b.write_blocks("A", [3], [4])
        assert ta is not None and tb is not None
        assert poll_until(a, {ta}).done == [ta] and poll_until(b, {tb}).done == [tb]


def test_one_sided_registration_is_enough_to_write(make_transport):
    mem_a = block_memory(seed=5)
    mem_b = block_memory()
    a = make_transport(mem_a, "solo-z")  # sorts last: waits for a dial that never comes, then dials
    b = make_transport(mem_b, "solo-a")
    a.add_remote_peer("B", *peer_args(b))
    tid = a.write_blocks("B", [1], [2])
    assert poll_until(a, {tid}).done == [tid]
    assert np.array_equal(mem_b[2], mem_a[1])


def test_write_to_unregistered_peer_or_bad_indices_returns_none(make_transport):
    a = make_transport(block_memory(), "none-a")
    b = make_transport(block_memory(), "none-b")
    assert a.write_blocks("nobody", [0], [0]) is None
    connect_both_ways(a, "A", b, "B")
    assert a.write_blocks("b", [0], [0]) is None  # the caller's name is "B"
    assert a.write_blocks("B", [0, 1], [0]) is None
    assert a.write_blocks("B", [NUM_BLOCKS], [0]) is None
    assert a.write_blocks("B", [0], [NUM_BLOCKS]) is None
    assert a.poll() == PollResult([], [])


def test_fingerprint_mismatch_raises(make_transport):
    a = make_transport(block_memory(), "fp-a", {"model": "x"})
    b = make_transport(block_memory(), "fp-b", {"model": "y"})
    with pytest.raises(FingerprintMismatch):
        a.add_remote_peer("B", *peer_args(b))
    with pytest.raises(FingerprintMismatch):
        b.add_remote_peer("A", *peer_args(a))
    assert a.write_blocks("B", [0], [0]) is None
    c = make_transport(block_memory(), "fp-c")  # no fingerprint: compatible with anyone
    a.add_remote_peer("C", *peer_args(c))
    assert isinstance(a.write_blocks("C", [0], [0]), int)


def test_malformed_metadata_raises_protocol_error(make_transport):
    a = make_transport(block_memory(), "meta-a")
    for blob in (b"", b"\x00garbage", json.dumps({"address": "tcp://127.0.0.1:1"}).encode()):
        with pytest.raises(ProtocolError):
            a.add_remote_peer("X", blob, 0, NUM_BLOCKS, BLOCK_LEN)


def test_layout_mismatch_raises_and_leaves_peer_unregistered(make_transport):
    a = make_transport(block_memory(), "lay-a")
    b = make_transport(block_memory(), "lay-b")
    meta, base, num, blen = peer_args(b)
    with pytest.raises(LayoutMismatch):
        a.add_remote_peer("B", meta, base, num, blen * 2)  # block_len must match the local one
    with pytest.raises(LayoutMismatch):
        a.add_remote_peer("B", meta, base, num + 1, blen)
    with pytest.raises(LayoutMismatch):
        a.add_remote_peer("B", meta, base + 4096, num, blen)
    assert a.write_blocks("B", [0], [0]) is None
    a.add_remote_peer("B", meta, base, num, blen)
    assert isinstance(a.write_blocks("B", [0], [0]), int)


def test_cancel_immediate_in_process_never_reports_the_id(make_transport):
    a = make_transport(block_memory(seed=3), "ci-a")
    b = make_transport(block_memory(), "ci-b")
    connect_both_ways(a, "A", b, "B")
    tid = a.write_blocks("B", list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)))
    assert a.cancel([tid, 987654], "immediate") == []
    marker = a.write_blocks("B", [0], [0])
    seen = poll_until(a, {marker})
    seen = poll_until(a, set(), seen, deadline_s=0.2)
    assert tid not in seen.done and tid not in seen.failed
    assert a.cancel([tid], "wait") == []  # no longer tracked


def test_unknown_cancel_mode_is_refused(make_transport):
    a = make_transport(block_memory(), "mode-a")
    with pytest.raises(ValueError):
        a.cancel([1], "later")  # type: ignore[arg-type]


# -- a peer in another process -------------------------------------------------------------------------
def _child_main(conn: Any, peer_id: str, num_blocks: int, block_len: int, path: str | None = None) -> None:
    """A SyncDataTransport in a spawned process, answering commands sent over ``conn``; its
    memory is a shared mapping of the file ``path`` if given (e.g. in ``/dev/shm``), or with
    ``path="sealed"`` an allocated region's array (a sealed memfd, as docs/migration.md says)."""
    if path is None:
        memory = np.zeros((num_blocks, block_len), dtype=np.uint8)
    elif path == "sealed":
        memory = BlockRegion.allocate(num_blocks, block_len).array
    else:
        memory = np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_blocks, block_len)).view(np.ndarray)
    baseline = set(threading.enumerate())
    t = SyncDataTransport(memoryview(memory), config=config(peer_id))
    started = sorted(th.name for th in set(threading.enumerate()) - baseline)
    conn.send((os.getpid(), started, *peer_args(t)))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "add":
                reply: Any = t.add_remote_peer(*args)
            elif cmd == "fill":
                memory[:] = block_memory(num_blocks, block_len, seed=args[0])
                reply = None
            elif cmd == "write":
                tid = t.write_blocks(*args)
                result = poll_until(t, {tid})
                reply = ("done" if tid in result.done else "failed", tid)
            elif cmd == "read":
                reply = memory[list(args[0])].tobytes()
            elif cmd == "close":
                t.close()
                t.close()
                reply = sorted(th.name for th in set(threading.enumerate()) - baseline)
            else:
                raise ValueError(cmd)
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))
        else:
            conn.send(("ok", reply))
        if cmd == "close":
            return


class Child:
    """Handle on a ``_child_main`` process."""

    def __init__(self, peer_id: str, path: str | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child_conn, peer_id, NUM_BLOCKS, BLOCK_LEN, path),
                                daemon=True)
        self.proc.start()
        child_conn.close()
        assert self.conn.poll(30), "child did not start"
        self.pid, self.threads, *self.args = self.conn.recv()

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, *args))

    def reply(self, timeout: float = DEADLINE_S) -> Any:
        assert self.conn.poll(timeout), "child did not answer"
        status, *rest = self.conn.recv()
        assert status == "ok", rest
        return rest[0]

    def call(self, cmd: str, *args: Any) -> Any:
        self.send(cmd, *args)
        return self.reply()

    def signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP, return only once every thread of the child has stopped.

        (The kernel stops a process's threads one by one, after the signal is sent: on a busy
        machine a thread kept running, and answering, for milliseconds after ``kill``.)"""
        os.kill(self.pid, sig)
        deadline = time.monotonic() + 5.0
        while sig == signal.SIGSTOP and not self._stopped():
            assert time.monotonic() < deadline, "child did not stop"
            time.sleep(0.001)

    def _stopped(self) -> bool:
        states = []
        for task in os.listdir(f"/proc/{self.pid}/task"):
            with open(f"/proc/{self.pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        return all(state in ("T", "t") for state in states)

    def finish(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # SIGKILL also ends a stopped process
        self.proc.join(10)


@pytest.fixture
def child() -> Iterator[Callable[..., Child]]:
    children: list[Child] = []

    def factory(peer_id: str, path: str | None = None) -> Child:
        c = Child(peer_id, path)
        children.append(c)
        return c

    yield factory
    for c in children:
        c.finish()


def pair_with_child(t: SyncDataTransport, c: Child) -> None:
    """Both sides register each other at the same time, as two real processes would."""
    c.send("add", "parent", *peer_args(t))
    t.add_remote_peer("child", *c.args)
    assert c.reply() is None


def test_two_processes_write_both_ways_and_bytes_arrive(make_transport, child):
    mem = block_memory(seed=11)
    original = mem.copy()
    t = make_transport(mem, "proc-p")
    c = child("proc-c")
    pair_with_child(t, c)

    local, remote = [5, 6, 7, 8, 30, 2], [10, 11, 12, 13, 1, 31]
    tid = t.write_blocks("child", local, remote)
    assert isinstance(tid, int)
    assert poll_until(t, {tid}) == PollResult([tid], [])
    got = np.frombuffer(c.call("read", remote), dtype=np.uint8).reshape(len(remote), BLOCK_LEN)
    assert np.array_equal(got, original[local])

    c.call("fill", 12)
    status, _ = c.call("write", "parent", list(range(16)), list(range(16, 32)))
    assert status == "done"
    assert np.array_equal(mem[16:32], block_memory(seed=12)[:16])
    assert np.array_equal(mem[:16], original[:16])  # untouched blocks unchanged

    assert c.threads  # the transport runs its own loop thread ...
    assert c.call("close") == []  # ... and no thread it started is left after close
    c.proc.join(10)
    assert c.proc.exitcode == 0


def test_remove_remote_peer_fails_inflight(make_transport, child):
    t = make_transport(block_memory(seed=13), "rm-a")  # sorts first: dials at once
    c = child("rm-z")
    pair_with_child(t, c)
    c.signal(signal.SIGSTOP)  # the receiver cannot acknowledge: the write stays in flight
    try:
        tid, elapsed = timed(t.write_blocks, "child", list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)))
        assert isinstance(tid, int) and elapsed < 0.2
        assert poll_until(t, set(), deadline_s=0.1) == PollResult([], [])
        t.remove_remote_peer("child")
        assert poll_until(t, {tid}) == PollResult([], [tid])
        assert isinstance(t.failure_reason(tid), PeerLost)
        assert t.write_blocks("child", [0], [0]) is None
        t.remove_remote_peer("child")  # unknown now: ignored
    finally:
        c.signal(signal.SIGCONT)


def test_cancel_wait_and_immediate_then_peer_death(make_transport, child):
    t = make_transport(block_memory(seed=14), "cx-p")
    c = child("cx-c")
    pair_with_child(t, c)
    everything = list(range(NUM_BLOCKS))

    # "wait": the transfer is still moving, so its id is returned and surfaces later.
    c.signal(signal.SIGSTOP)
    tid = t.write_blocks("child", everything, everything)
    assert t.cancel([tid, 424242], "wait") == [tid]
    assert poll_until(t, set(), deadline_s=0.1) == PollResult([], [])
    c.signal(signal.SIGCONT)
    seen = poll_until(t, {tid})
    assert tid in seen.done or tid in seen.failed

    # "immediate": returns [] at once and the id is never reported.
    c.signal(signal.SIGSTOP)
    gone = t.write_blocks("child", everything, everything)
    assert t.cancel([gone], "immediate") == []
    c.signal(signal.SIGCONT)
    marker = t.write_blocks("child", [0], [0])
    seen = poll_until(t, {marker})
    seen = poll_until(t, set(), seen, deadline_s=0.2)
    assert marker in seen.done and gone not in seen.done and gone not in seen.failed

    # A peer that dies mid-transfer: the write fails (after the heartbeat timeout) and is reported.
    c.signal(signal.SIGSTOP)
    doomed = t.write_blocks("child", everything, everything)
    c.signal(signal.SIGKILL)
    assert poll_until(t, {doomed}) == PollResult([], [doomed])
    assert isinstance(t.failure_reason(doomed), OmniAsyncError)
    assert t.write_blocks("child", [0], [0]) is None


def test_a_write_failed_by_its_peers_loss_is_reported_only_once_the_peer_is_gone(make_transport, child):
    """The agent fails a lost peer's transfers before it tells its listeners that the peer
    left; a caller woken by the failure must already find the peer gone (``write_blocks``
    returns None): the race the peer-death test above lost under a CPU hog.  Checked where
    it happens: at the moment the facade records the failure (on its loop), the peer is no
    longer among the live ones.  The peer is only stopped: its rows are copied, and its loss is
    found by the control plane (its connection dropped or silent), not by a failed copy
    (which drops it first)."""
    t = make_transport(block_memory(seed=15), "cx-q")
    c = child("cx-r")
    pair_with_child(t, c)
    engine = t._engine
    core_id = engine.peers["child"]
    seen: list[bool] = []
    settle = engine.settle

    def recording(transfer_id: int, error: OmniAsyncError | None) -> None:
        if error is not None:
            seen.append(core_id in engine.live)  # (on the loop thread, which updates it)
        settle(transfer_id, error)

    engine.settle = recording
    c.signal(signal.SIGSTOP)  # copied into, but silent: lost after the heartbeat timeout
    doomed = t.write_blocks("child", [1, 2], [3, 4])
    assert poll_until(t, {doomed}) == PollResult([], [doomed])
    assert isinstance(t.failure_reason(doomed), PeerLost)  # found by the control plane
    assert seen == [False]
    assert t.write_blocks("child", [0], [0]) is None
    c.signal(signal.SIGKILL)


def direct_kind(t: SyncDataTransport, core_id: str) -> str | None:
    """How ``t``'s agent writes blocks into the peer ``core_id`` (asked on the facade's loop)."""

    async def ask() -> str | None:
        return t.agent.transport.direct_kind(core_id)

    return asyncio.run_coroutine_threadsafe(ask(), t.loop).result(DEADLINE_S)


@pytest.mark.parametrize(("memory", "kind"), [("dev_shm", "process_vm_writev"), ("sealed", "file")])
def test_a_peer_whose_view_maps_a_tmpfs_file_is_written_through_a_mapping_only_if_sealed(
    make_transport, child, memory, kind
):
    """The peer's memory is a shared mapping of a tmpfs file (as a NIXL-style caller may
    register).  A sealed memfd (an allocated region's array): its facade offers the file, ours
    maps it and copies each block once (no process_vm_writev).  A /dev/shm file, which could
    shrink under our mapping (SIGBUS): not offered, so process_vm_writev.  Either way the bytes
    arrive, and a peer killed mid-write is reported failed."""
    path = f"/dev/shm/omni-test-compat-{os.getpid()}-{time.monotonic_ns()}" if memory == "dev_shm" else "sealed"
    if memory == "dev_shm":
        with open(path, "wb") as f:
            f.truncate(NUM_BLOCKS * BLOCK_LEN)
    try:
        mem = block_memory(seed=15)
        t = make_transport(mem, "shm-p")
        c = child("shm-c", path)
        pair_with_child(t, c)
        assert direct_kind(t, "shm-c") == kind
        local, remote = [1, 2, 3, 20], [4, 5, 6, 0]
        tid = t.write_blocks("child", local, remote)
        assert poll_until(t, {tid}) == PollResult([tid], [])
        got = np.frombuffer(c.call("read", remote), dtype=np.uint8).reshape(len(remote), BLOCK_LEN)
        assert np.array_equal(got, mem[local])
        if memory == "dev_shm":
            theirs = np.memmap(path, dtype=np.uint8, mode="r", shape=(NUM_BLOCKS, BLOCK_LEN))
            assert np.array_equal(theirs[remote], mem[local])

        everything = list(range(NUM_BLOCKS))
        c.signal(signal.SIGSTOP)  # it cannot acknowledge: the write stays in flight
        doomed = t.write_blocks("child", everything, everything)
        c.signal(signal.SIGKILL)
        assert poll_until(t, {doomed}) == PollResult([], [doomed])
        assert isinstance(t.failure_reason(doomed), PeerLost)
        late = t.write_blocks("child", [0], [0])  # refused, or failed if the loss is still being processed
        assert late is None or poll_until(t, {late}) == PollResult([], [late])
    finally:
        if memory == "dev_shm":
            os.unlink(path)


def test_a_transport_over_a_sealed_memfd_offers_it_and_lets_go_of_it_on_close():
    """Our view is an allocated region's array (a sealed memfd): the transport holds a
    descriptor of it (peers map it through that) and of the memfd that proves the offer while
    open, and neither once closed, even while the object is still referenced."""
    region = BlockRegion.allocate(NUM_BLOCKS, BLOCK_LEN)
    view = region.array
    name = f"/memfd:omni-{region.segment.token} (deleted)"
    mapping_fds = fds_to(name)  # what the region and its mapping hold
    t = SyncDataTransport(memoryview(view), config=config("shm-own"))
    try:
        assert len(fds_to(name)) == len(mapping_fds) + 1
        share = t.agent.identity.region_share
        assert share is not None and share.inode == os.fstat(region.segment.fd).st_ino
        proof = f"/memfd:omni-{share.token} (deleted)"  # the memfd that proves the offer is ours
        assert len(fds_to(proof)) == 1
    finally:
        t.close()
    assert fds_to(name) == mapping_fds and fds_to(proof) == []
    t.close()
    del t, view, region
    gc.collect()  # the memfd and its mapping go now, not amid a later test's count of descriptors
    assert fds_to(name) == []


def test_a_transport_over_a_dev_shm_file_does_not_offer_it():
    """Our view maps a /dev/shm file, which could shrink under a peer's mapping (SIGBUS in the
    peer): the transport offers process_vm_writev and holds no descriptor of the file."""
    path = f"/dev/shm/omni-test-compat-{os.getpid()}-{time.monotonic_ns()}"
    with open(path, "wb") as f:
        f.truncate(NUM_BLOCKS * BLOCK_LEN)
    try:
        view = np.memmap(path, dtype=np.uint8, mode="r+", shape=(NUM_BLOCKS, BLOCK_LEN)).view(np.ndarray)
        mapping_fds = fds_to(path)  # what the memmap itself holds
        t = SyncDataTransport(memoryview(view), config=config("shm-own"))
        try:
            share = t.agent.identity.region_share
            assert share is not None and share.inode == 0 and share.fd == -1 and share.proof_addr
            assert fds_to(path) == mapping_fds
        finally:
            t.close()
        del t, view
        gc.collect()  # the mapping goes now, not amid a later test's count of descriptors
        assert fds_to(path) == []
    finally:
        os.unlink(path)


def test_a_close_that_raises_still_lets_go_of_the_region_file():
    """Stopping the facade raises (here: its agent's close, injected; in life an interrupt):
    the descriptor of the caller's region file that the transport opened is closed anyway."""
    region = BlockRegion.allocate(NUM_BLOCKS, BLOCK_LEN)
    name = f"/memfd:omni-{region.segment.token} (deleted)"
    t = SyncDataTransport(memoryview(region.array), config=config("raising-close"))
    agent = t.agent
    real_close = agent.close
    held_open = len(fds_to(name))  # the region's, its mapping's and the transport's

    def refuse() -> None:
        raise RuntimeError("injected")

    agent.close = refuse  # fault injection around the real agent
    try:
        with pytest.raises(RuntimeError, match="injected"):
            t.close()
        assert len(fds_to(name)) == held_open - 1
    finally:  # what the failed close left running
        asyncio.run_coroutine_threadsafe(real_close(), t.loop).result(DEADLINE_S)
        t.loop.call_soon_threadsafe(t.loop.stop)


def fds_to(path: str) -> list[int]:
    """This process's descriptors that point to ``path``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == path:
                found.append(int(name))
        except OSError:
            pass
    return found


# -- a caller that never sleeps -----------------------------------------------------------------------
def busy(seconds: float) -> None:
    """Pure-Python work that holds the GIL for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("step_s", [0.0, 0.0002], ids=["tight", "per-step"])
def test_a_caller_that_polls_without_sleeping_does_not_starve_the_loop(make_transport, step_s):
    """The seed's poll loop with no sleep (or 200 µs of pure-Python work per poll) in the caller.

    The loop thread releases the GIL on every epoll and ctypes call; from a caller that never
    blocks it gets it back only after the switch interval.  Raised to 100 ms here, 20 writes
    with a starved loop take well over a second; ``poll()`` waiting for news keeps them fast.
    """
    mem_a = block_memory(seed=21)
    a = make_transport(mem_a, "tight-a")
    b_mem = block_memory()
    b = make_transport(b_mem, "tight-b")
    a.add_remote_peer("B", *peer_args(b))
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    try:
        start = time.perf_counter()
        for i in range(20):
            tid = a.write_blocks("B", [i], [NUM_BLOCKS - 1 - i])
            assert tid is not None
            while True:
                busy(step_s)
                result = a.poll()
                if tid in result.done:
                    break
                assert tid not in result.failed, a.failure_reason(tid)
                assert time.perf_counter() - start < DEADLINE_S, "the write never completed"
        elapsed = time.perf_counter() - start
    finally:
        sys.setswitchinterval(previous)
    assert elapsed < 1.0, f"20 writes took {elapsed:.2f}s"
    assert np.array_equal(b_mem[NUM_BLOCKS - 20:][::-1], mem_a[:20])



def test_write_blocks_does_not_wait_for_the_loop(make_transport):
    """``write_blocks`` checks and numbers the write in the caller's thread and hands it to the
    loop without a round trip: with the loop thread held up, it still returns an id at once
    (and refuses bad indices at once); the write completes once the loop runs again."""
    mem_a, mem_b = block_memory(seed=23), block_memory()
    a = make_transport(mem_a, "nowait-a")
    b = make_transport(mem_b, "nowait-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done  # the lane is up
    end = time.monotonic() + DEADLINE_S
    while loop_runner(a) is not a._portal.thread:  # (this thread ran the loop last: the lease)
        assert time.monotonic() < end, "the loop's thread never took the loop back"
        time.sleep(0.001)
    release = threading.Event()
    a.loop.call_soon_threadsafe(release.wait, DEADLINE_S)  # the loop thread is busy until released
    try:
        tid, elapsed = timed(a.write_blocks, "B", [5, 6], [9, 10])
        refused, refused_in = timed(a.write_blocks, "B", [0], [NUM_BLOCKS])
        assert isinstance(tid, int) and elapsed < 0.5, f"write_blocks waited {elapsed:.2f}s for the loop"
        assert refused is None and isinstance(a.last_error, InvalidBlocks) and refused_in < 0.5
        assert a.poll() == PollResult([], [])  # nothing settles while the loop is held up
    finally:
        release.set()
    assert poll_until(a, {tid}).done == [tid]
    assert np.array_equal(mem_b[9:11], mem_a[5:7])


# -- the caller runs the loop -------------------------------------------------------------------------
def submitted_in(t: SyncDataTransport) -> list[str]:
    """Fault-free wrapper around the real engine: records the thread each write starts in."""
    threads: list[str] = []
    submit = t._engine.submit

    def recording(*args: Any) -> None:
        threads.append(threading.current_thread().name)
        submit(*args)

    t._engine.submit = recording  # type: ignore[method-assign]
    return threads


def test_the_caller_runs_the_loop_and_its_thread_takes_it_back_once_the_caller_is_away(make_transport, monkeypatch):
    """A write starts and its acknowledgement is taken in the caller's thread; once the caller
    stops calling, the loop's own thread runs the loop again within the lease, so heartbeats
    keep the pair joined while the caller does other work for longer than their timeout.  (The
    lease is stretched to 0.25 s here, so that a loaded machine that takes this thread's core
    for a few milliseconds between two calls does not hand the loop back meanwhile.)"""
    monkeypatch.setattr(portal_module, "LEASE_S", 0.25)
    mem_a, mem_b = block_memory(seed=31), block_memory()
    a = make_transport(mem_a, "drive-a")
    b = make_transport(mem_b, "drive-b")
    a.add_remote_peer("B", *peer_args(b))
    threads = submitted_in(a)
    me = threading.current_thread().name
    row = 0
    while me not in threads:  # the loop's thread had the loop (add_remote_peer ran there)
        assert row < NUM_BLOCKS - 12, f"no write started in the caller's thread: {threads}"
        tid = a.write_blocks("B", [row], [row])
        assert poll_until(a, {tid}).done == [tid]  # a poll that waits takes the loop
        row += 1
    taken = len(threads)
    for i in range(row, row + 9):  # polled without a pause: the caller keeps the loop
        tid = a.write_blocks("B", [i], [i])
        end = time.monotonic() + DEADLINE_S
        while tid not in a.poll().done:
            assert time.monotonic() < end, f"write {tid} never reported"
    assert threads[taken:] == [me] * 9, threads
    row += 9
    end = time.monotonic() + DEADLINE_S
    while loop_runner(a) is not a._portal.thread:  # the lease ran out: the loop thread has it
        assert time.monotonic() < end, "the loop thread never took the loop back"
        time.sleep(0.001)
    time.sleep(2 * TIMINGS["heartbeat_timeout"])  # away for longer than the heartbeat timeout
    tid = a.write_blocks("B", [row], [row])
    assert tid is not None and poll_until(a, {tid}).done == [tid]
    assert np.array_equal(mem_b[: row + 1], mem_a[: row + 1])


def test_writes_with_no_poll_after_them_complete_on_the_loops_thread(make_transport):
    """A caller that writes and then does other work (no poll) leaves the loop to its thread:
    the writes are acknowledged and settled before the caller polls again."""
    mem_a, mem_b = block_memory(seed=35), block_memory()
    a = make_transport(mem_a, "nopoll-a")
    b = make_transport(mem_b, "nopoll-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done
    tids = [a.write_blocks("B", [i], [i]) for i in range(1, 9)]
    end = time.monotonic() + DEADLINE_S
    while True:
        with a._portal.lock:
            if len(a._engine.settled) == len(tids):
                break
        assert time.monotonic() < end, "writes with no poll after them never settled"
        time.sleep(0.005)
    assert sorted(a.poll().done) == tids
    assert np.array_equal(mem_b[:9], mem_a[:9])


def test_a_caller_inside_an_event_loop_hands_writes_to_the_loop_thread(make_transport):
    """A thread that runs an event loop of its own cannot run the transport's: its writes go to
    the loop's thread and its polls wait on the condition, as before."""
    mem_a, mem_b = block_memory(seed=32), block_memory()
    a = make_transport(mem_a, "inloop-a")
    b = make_transport(mem_b, "inloop-b")
    a.add_remote_peer("B", *peer_args(b))
    threads = submitted_in(a)

    async def from_a_coroutine() -> PollResult:
        return poll_until(a, {a.write_blocks("B", [3], [4])})  # (blocking calls, on purpose)

    assert len(asyncio.run(from_a_coroutine()).done) == 1
    assert threads == [a._portal.thread.name]
    assert np.array_equal(mem_b[4], mem_a[3])


def test_two_caller_threads_write_and_poll_at_once(make_transport):
    """Callers in two threads take turns running the loop; every write of each is reported
    (to whichever thread polled it) and lands."""
    mem_a, mem_b = block_memory(seed=33), block_memory()
    a = make_transport(mem_a, "threads-a")
    b = make_transport(mem_b, "threads-b")
    a.add_remote_peer("B", *peer_args(b))
    reported: set[int] = set()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def writer(rows: range) -> None:
        try:
            for row in rows:
                tid = a.write_blocks("B", [row], [row])
                assert tid is not None
                end = time.monotonic() + DEADLINE_S
                while True:
                    result = a.poll()
                    assert not result.failed, [a.failure_reason(i) for i in result.failed]
                    with lock:
                        reported.update(result.done)
                        if tid in reported:
                            break
                    assert time.monotonic() < end, f"write {tid} never reported"
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=writer, args=(rows,)) for rows in (range(0, 16), range(16, 32))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(2 * DEADLINE_S)
    assert not errors and not any(worker.is_alive() for worker in workers)
    assert len(reported) == NUM_BLOCKS and np.array_equal(mem_b, mem_a)


def test_closing_while_another_thread_polls_ends_both(make_transport):
    """``close()`` while another thread polls a write the peer never answers (the peer is held
    up): the close ends, bounded, and the poller's next call raises ClosedError."""
    mem_a, mem_b = block_memory(seed=34), block_memory()
    a = make_transport(mem_a, "closing-a")
    b = make_transport(mem_b, "closing-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done
    release = threading.Event()
    b.loop.call_soon_threadsafe(release.wait, DEADLINE_S)  # b cannot acknowledge until released
    outcome: list[BaseException] = []

    def poller() -> None:
        try:
            a.write_blocks("B", [1], [1])
            while True:
                a.poll()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=poller)
    try:
        thread.start()
        time.sleep(0.05)
        _, elapsed = timed(a.close)
        thread.join(DEADLINE_S)
    finally:
        release.set()
    assert not thread.is_alive() and elapsed < DEADLINE_S
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError)


def test_a_burst_of_writes_without_polls_does_not_stop_the_loop(make_transport, monkeypatch):
    """A caller that polled once, then only writes (one write every ~0.5 ms, never a poll):
    each write holds the loop for a moment but never runs it, so the callers' lease must not
    be renewed write after write; the loop's thread runs the loop again within about a
    lease (it did not for as long as the burst lasted: heartbeats stopped, the peer dropped us)."""
    monkeypatch.setattr(portal_module, "LEASE_S", 0.25)  # so the first write surely follows a turn
    a = make_transport(block_memory(seed=35), "burst-a")
    b = make_transport(block_memory(), "burst-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done  # a poll: the caller turned the loop
    ran = threading.Event()
    a.loop.call_soon_threadsafe(ran.set)
    start, ids = time.monotonic(), set()
    while not ran.is_set() and time.monotonic() - start < 3.0:
        ids.add(a.write_blocks("B", [1], [1]))
        busy(0.0005)
    assert ran.is_set(), f"the loop did not run for 3 s while the caller wrote ({len(ids)} writes)"
    assert time.monotonic() - start < 1.5
    assert None not in ids and poll_until(a, ids).done == sorted(ids)


@contextlib.contextmanager
def loop_held_elsewhere(t: SyncDataTransport) -> Iterator[None]:
    """For the ``with`` block, another caller's thread holds ``t``'s loop without running it (as
    a caller between its calls, or the loop's thread between its runs): a write made meanwhile
    is handed over and waits."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with t._portal.driving(5.0) as driving:
            assert driving
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        yield
    finally:
        release.set()
        holder.join(5)


def ordered_pair(make_transport: Callable[..., SyncDataTransport], monkeypatch: pytest.MonkeyPatch,
                 tag: str) -> tuple[SyncDataTransport, np.ndarray, np.ndarray]:
    """A facade writing to another, after one write and its poll (the lease is the caller's;
    ``LEASE_S`` 1 s, so the loop's thread keeps away meanwhile)."""
    monkeypatch.setattr(portal_module, "LEASE_S", 1.0)
    mem_a, mem_b = block_memory(seed=38), block_memory()
    a = make_transport(mem_a, f"{tag}-a")
    b = make_transport(mem_b, f"{tag}-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done
    return a, mem_a, mem_b


def test_a_write_handed_to_the_loop_is_posted_before_a_later_one_made_in_the_callers_thread(make_transport, monkeypatch):
    """A write handed to the loop (another thread held it) and the next one, made in the
    caller's thread once it got the loop: the first reaches the transport first, so two writes
    to one row land in call order and are reported in it (the second was posted first: the row
    kept the first write's bytes, reported second; a burst of writes to one row read [..., 327,
    326, ...] once in a fresh clone's suite)."""
    a, mem_a, mem_b = ordered_pair(make_transport, monkeypatch, "order-w")
    with loop_held_elsewhere(a):
        first = a.write_blocks("B", [2], [5])  # handed over, not run
    second = a.write_blocks("B", [3], [5])  # within the switch interval: takes the loop, writes here
    result = poll_until(a, {first, second})
    assert result.done == [first, second] and result.failed == []
    assert np.array_equal(mem_b[5], mem_a[3])  # the later write's bytes: written last


def test_a_write_handed_over_and_cancelled_or_closed_before_it_was_posted_leaves_nothing(make_transport, monkeypatch):
    """A write still waiting to be posted: ``cancel(immediate)`` forgets it (never reported),
    ``cancel(wait)`` and ``close()`` from another thread end once the loop is free, and nothing
    stays queued."""
    a, _mem_a, _mem_b = ordered_pair(make_transport, monkeypatch, "unposted")
    with loop_held_elsewhere(a):
        first = a.write_blocks("B", [2], [5])
        assert a.cancel([first], "immediate") == []
    later = a.write_blocks("B", [3], [6])
    reported = poll_until(a, {later})
    time.sleep(0.2)
    afterwards = a.poll()
    assert first not in reported.done + reported.failed + afterwards.done + afterwards.failed
    assert first not in a._engine.inflight
    waited: list[list[int]] = []
    with loop_held_elsewhere(a):
        second = a.write_blocks("B", [2], [5])
        canceller = threading.Thread(target=lambda: waited.append(a.cancel([second], "wait")))
        canceller.start()
        time.sleep(0.05)
    canceller.join(10)
    assert waited, "cancel(wait) of a write not posted yet did not return"
    if waited[0]:
        poll_until(a, set(waited[0]))
    closed = threading.Event()
    with loop_held_elsewhere(a):
        a.write_blocks("B", [2], [5])
        threading.Thread(target=lambda: (a.close(), closed.set()), daemon=True).start()
        time.sleep(0.05)
    assert closed.wait(15), "close() with a write not posted yet did not return"
    assert not a._engine.unposted


def test_writes_from_a_thread_that_hands_them_over_and_one_that_drives_keep_call_order(make_transport):
    """Two threads write one row, 300 times each, in an order a lock fixes: one runs its own
    event loop (its writes are always handed to the loop's thread), the other holds the loop
    when it can (its writes start in its thread).  The row ends with the last write's bytes and
    ``poll()`` reports every id in call order (failed every run before the writes queued)."""
    mem_a, mem_b = block_memory(seed=1), block_memory()
    a = make_transport(mem_a, "two-order-a")
    b = make_transport(mem_b, "two-order-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done
    order: list[int | None] = []
    lock = threading.Lock()

    def from_a_loop() -> None:
        async def write_all() -> None:
            for _ in range(300):
                with lock:
                    order.append(a.write_blocks("B", [1], [7]))
                await asyncio.sleep(0)

        asyncio.run(write_all())

    other = threading.Thread(target=from_a_loop)
    other.start()
    for _ in range(300):
        with lock:
            order.append(a.write_blocks("B", [2], [7]))
    other.join(30)
    order.append(a.write_blocks("B", [3], [7]))
    assert None not in order
    result = poll_until(a, {i for i in order if i is not None})
    assert result.failed == [] and result.done == order
    assert np.array_equal(mem_b[7], mem_a[3])


def test_a_ctrl_c_storm_on_a_writing_and_polling_caller_leaves_the_transport_whole(make_transport):
    """SIGINTs landing anywhere in a caller's writes and polls (caught: the program goes on):
    after each, the loop is free or its thread's and no write waits unposted; afterwards a
    write still completes.  (One landing right after the drive lock was taken left the loop
    held by nobody, writes never ran and close() could not finish; one between queueing a
    write and posting it left it unposted; found by a review.)"""
    a = make_transport(block_memory(seed=3), "ctrl-c-a")
    b = make_transport(block_memory(), "ctrl-c-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done
    portal, engine, main = a._portal, a._engine, threading.main_thread()

    def write_and_poll() -> None:
        a.write_blocks("B", [1], [1])
        a.poll()

    def leaked() -> object | None:
        deadline = time.monotonic() + 1.0
        while portal._driver is main or (portal._drive.locked() and portal._driver is not portal.thread):
            if time.monotonic() > deadline:
                return "the loop held by nobody", portal._driver
            time.sleep(0.01)
        time.sleep(0.05)  # nobody calls: the loop's thread posts what was handed over
        with portal.lock:
            return ("writes never posted", list(engine.unposted)) if engine.unposted else None

    interrupts, left = ctrl_c_storm(write_and_poll, 3.0, leaked)
    assert left is None, f"after {interrupts} interrupts: {left}"
    assert interrupts >= 10  # (the storm reached the calls)
    after = a.write_blocks("B", [2], [2])
    assert after in poll_until(a, {after}).done


def test_a_call_handed_to_the_loop_after_its_last_pass_raises_closed_error(make_transport, monkeypatch):
    """``cancel(ids, "wait")`` racing ``close()`` from another thread, its hand-off landing after
    the loop's last pass (before the loop closes): ClosedError at once (the callback was queued
    in a loop that never ran again, and the caller got DeadlineExceeded after 5 s; found by a
    review)."""
    a = make_transport(block_memory(seed=3), "late-call-a")
    b = make_transport(block_memory(), "late-call-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done
    write = a.write_blocks("B", [1], [1])  # in flight, or settled and not polled: known to cancel
    portal, loop = a._portal, a._portal.loop
    at_close = threading.Event()
    real_close, real_call = loop.close, portal.call

    def slow_close() -> None:  # the loop's thread, after its last pass of the loop
        at_close.set()
        time.sleep(0.3)
        real_close()

    def late_call(*args: Any, **kwargs: Any) -> Any:  # the canceller, preempted before its hand-off
        at_close.wait(10)
        return real_call(*args, **kwargs)

    monkeypatch.setattr(loop, "close", slow_close)
    monkeypatch.setattr(portal, "call", late_call)
    outcome: list[object] = []

    def cancel() -> None:
        started = time.monotonic()
        try:
            outcome.append(a.cancel([write], "wait"))
        except BaseException as exc:
            outcome.append(exc)
        outcome.append(time.monotonic() - started)

    canceller = threading.Thread(target=cancel)
    canceller.start()
    time.sleep(0.05)
    a.close()
    canceller.join(15)
    assert isinstance(outcome[0], ClosedError), outcome
    assert outcome[1] < 2.0, outcome


def test_a_pair_survives_a_caller_that_only_writes_for_twice_the_heartbeat_timeout(make_transport, child):
    """A caller that polls once, then writes without a poll for 2.5× the heartbeat timeout
    (one write per ~0.5 ms of Python): its writes keep the loop moving (a pass of it once per
    lease), so heartbeats flow both ways and no write fails (the loop went unrun for the whole
    burst: the child dropped us).  Two processes, as in production: in one process the caller
    can starve another facade's loop thread of the GIL (docs/migration.md)."""
    t = make_transport(block_memory(seed=37), "burst-p")
    c = child("burst-c")
    pair_with_child(t, c)
    assert poll_until(t, {t.write_blocks("child", [0], [0])}).done
    start, ids = time.monotonic(), []
    while time.monotonic() - start < 2.5 * TIMINGS["heartbeat_timeout"]:
        transfer_id = t.write_blocks("child", [1], [1])
        assert transfer_id is not None, t.last_error
        ids.append(transfer_id)
        busy(0.0005)
    result = poll_until(t, set(ids))
    assert not result.failed, f"{len(result.failed)} of {len(ids)} failed: {t.failure_reason(result.failed[0])}"
    assert result.done == sorted(ids)


def test_a_caller_polling_one_block_writes_takes_their_answers_itself_and_keeps_the_pair(make_transport, child):
    """One-block writes to a peer in another process, each polled for without sleeping, for
    1.5 times the heartbeat timeout: ``poll()`` takes the answer (the peer's consumption of the
    write's ring record) in the caller's thread instead of running the loop for it, and the
    loop still runs once a lease, so heartbeats flow, nothing fails and every block lands."""
    mem = block_memory(seed=41)
    t = make_transport(mem, "inplace-p")
    c = child("inplace-c")
    pair_with_child(t, c)
    start, writes = time.monotonic(), 0
    while time.monotonic() - start < 1.5 * TIMINGS["heartbeat_timeout"]:
        block = writes % NUM_BLOCKS
        transfer_id = t.write_blocks("child", [block], [NUM_BLOCKS - 1 - block])
        assert transfer_id is not None, t.last_error
        result = poll_until(t, {transfer_id})
        assert result.done == [transfer_id], t.failure_reason(transfer_id)
        writes += 1
    assert writes >= NUM_BLOCKS
    (link,) = t.agent.transport.links.values()
    assert link.ring_in.taken_in_place > 0
    got = np.frombuffer(c.call("read", list(range(NUM_BLOCKS))), dtype=np.uint8).reshape(NUM_BLOCKS, BLOCK_LEN)
    assert np.array_equal(got[::-1], mem)


@pytest.mark.usefixtures("sigint_raises")
def test_a_sigint_during_a_write_started_in_the_callers_thread_waits_for_the_write(make_transport, monkeypatch):
    """A write started in the caller's (main) thread runs the transport's code there: a SIGINT
    that comes meanwhile is held until the write was handed to the transport, then raised; the
    write still completes and is reported by a later poll (it was cut in half, and its id stayed
    in flight forever)."""
    monkeypatch.setattr(portal_module, "LEASE_S", 2.0)  # the write surely starts in this thread
    assert threading.current_thread() is threading.main_thread()
    a = make_transport(block_memory(seed=36), "sigint-a")
    b = make_transport(block_memory(), "sigint-b")
    a.add_remote_peer("B", *peer_args(b))
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done  # the caller holds the loop now
    transport = a.agent.transport
    real, finished, where = transport.write_runs, [], []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        where.append(threading.current_thread().name)
        os.kill(os.getpid(), signal.SIGINT)
        total = 0
        for i in range(10_000):  # bytecode a KeyboardInterrupt would land in
            total += i
        result = real(*args, **kwargs)
        finished.append(total > 0)
        return result

    transport.write_runs = interrupted
    a.poll()  # a turn just before the write: the caller holds the loop for the lease (0.25 s was once too short under load)
    try:
        with pytest.raises(KeyboardInterrupt):
            a.write_blocks("B", [1], [1])
    finally:
        transport.write_runs = real
    assert where == ["MainThread"] and finished == [True]
    result = poll_until(a, set(a._engine.inflight))  # the id it never returned is reported done
    assert len(result.done) == 1 and not result.failed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.parametrize("cut_short", [False, True], ids=["racing", "cut-short"])
def test_close_is_whole_when_it_returns_racing_another_close_or_after_one_cut_short(cut_short):
    """Two threads close at once: the second returns only once the first is done (the loop
    thread joined, the port free).  A close cut short by Ctrl-C while it waits for the agent's
    close is finished by the next ``close()`` (it was a no-op: the loop thread ran forever)."""
    t = SyncDataTransport(memoryview(block_memory()), config=config(f"whole-close-{cut_short}"))
    agent, thread = t.agent, t._portal.thread
    real_close, started = agent.close, threading.Event()

    async def slow_close() -> None:  # lanes draining take a moment
        started.set()
        await asyncio.sleep(0.4)
        await real_close()

    agent.close = slow_close  # type: ignore[method-assign]
    if cut_short:
        assert threading.current_thread() is threading.main_thread()
        ctrl_c = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            t.close()
        ctrl_c.join()
        assert thread.is_alive()
        t.close()
    else:
        first = threading.Thread(target=t.close)
        first.start()
        assert started.wait(DEADLINE_S)
        t.close()
        first.join(DEADLINE_S)
    assert not thread.is_alive(), "close() returned while the loop thread still runs"
    with pytest.raises(ClosedError):
        t.poll()


def test_a_write_the_agent_refuses_on_the_loop_is_reported_failed(make_transport):
    """The caller's checks passed but the agent refuses the write once the loop posts it (the
    peer left in between; a UCX error posting it): ``poll`` reports it failed, with the reason."""
    a = make_transport(block_memory(), "refuse-a")
    b = make_transport(block_memory(), "refuse-b")
    a.add_remote_peer("B", *peer_args(b))
    transport, post = a.agent.transport, a.agent.transport.write_runs  # what the loop posts the plan to
    errors = [UnknownPeer("peer 'refuse-b' left meanwhile"), OSError("UCX could not post")]

    def refusing(*args: Any, **kwargs: Any) -> Any:  # fault injection around the real agent
        if errors:
            raise errors.pop(0)
        return post(*args, **kwargs)

    transport.write_runs = refusing  # type: ignore[method-assign]
    left, broken, fine = (a.write_blocks("B", [i], [i]) for i in range(3))
    assert None not in (left, broken, fine)
    seen = poll_until(a, {left, broken, fine})
    assert set(seen.failed) == {left, broken} and seen.done == [fine]
    assert isinstance(a.failure_reason(left), UnknownPeer)
    assert isinstance(a.failure_reason(broken), TransferFailed)


def test_polling_with_nothing_in_flight_never_waits(make_transport):
    """``poll()`` waits for news only while transfers are in flight: an idle poll returns at once."""
    a = make_transport(block_memory(), "idle-a")
    b = make_transport(block_memory(), "idle-b")
    a.add_remote_peer("B", *peer_args(b))
    tid = a.write_blocks("B", [0], [0])
    assert poll_until(a, {tid}).done == [tid]
    start = time.perf_counter()
    for _ in range(500):
        assert a.poll() == PollResult([], []) and a.poll("B") == PollResult([], [])
    assert time.perf_counter() - start < 0.5  # waiting even 1 ms per poll would take 1 s

# -- close under a stopped peer ------------------------------------------------------------------------
def open_fds() -> int:
    """Descriptors this process holds, but for the shared address vetters' (process-wide: they
    may start or retire a vetting server while a transport lives, and outlive it)."""
    return len({int(fd) for fd in os.listdir("/proc/self/fd")} - shared_vetter_fds())


def control_port(t: SyncDataTransport) -> int:
    return int(t.control_address.rpartition(":")[2].partition("?")[0])


def test_close_under_a_stopped_peer_is_bounded_and_complete(child):
    """A peer that stops answering (SIGSTOP) with a write in flight: ``close()`` returns in bounded
    time, and only after the agent's own close (lane drain, endpoint-close grace) finished: its
    loop thread is gone, the port can be bound again, and the process holds no more file
    descriptors than before the transport existed."""
    c = child("stop-c")
    warm = SyncDataTransport(memoryview(block_memory()), config=config("stop-warm"))  # UCX's lazy globals
    try:
        pair_with_child(warm, c)
        assert poll_until(warm, {warm.write_blocks("child", [0], [0])}).done
    finally:
        warm.close()
    baseline_fds, baseline_threads = open_fds(), set(threading.enumerate())

    t = SyncDataTransport(memoryview(block_memory(seed=15)), config=config("stop-p"))
    port = control_port(t)
    pair_with_child(t, c)
    c.signal(signal.SIGSTOP)
    try:
        everything = list(range(NUM_BLOCKS))
        tid = t.write_blocks("child", everything, everything)
        assert tid is not None and t.poll() == PollResult([], [])
        _, elapsed = timed(t.close)
        assert elapsed < 30.0
        assert set(threading.enumerate()) <= baseline_threads
        again = SyncDataTransport(memoryview(block_memory()), config=config("stop-again", port=port))
        assert control_port(again) == port
        again.close()
        assert open_fds() == baseline_fds
    finally:
        c.signal(signal.SIGCONT)


# -- CURVE ----------------------------------------------------------------------------------------------
def test_the_pair_works_with_curve_and_refuses_a_stranger(make_transport):
    """With CURVE on, the metadata carries this side's public key (``?key=``); the pair joins both
    ways and writes; a transport whose key is not allow-listed cannot join."""
    a_pub, a_sec = generate_keypair()
    b_pub, b_sec = generate_keypair()
    mem_a, mem_b = block_memory(seed=16), block_memory()
    a = make_transport(mem_a, "curve-a", curve_secret_key=a_sec, curve_allowed_keys=[b_pub])
    b = make_transport(mem_b, "curve-b", curve_secret_key=b_sec, curve_allowed_keys=[a_pub])
    card = decode_agent_metadata(a.get_agent_metadata())
    assert card.address == a.control_address and card.address.endswith(f"?key={a_pub}")
    connect_both_ways(a, "A", b, "B")
    ta, tb = a.write_blocks("B", [1, 2], [3, 4]), b.write_blocks("A", [5], [6])
    assert ta is not None and tb is not None
    assert poll_until(a, {ta}).done == [ta] and poll_until(b, {tb}).done == [tb]
    assert np.array_equal(mem_b[3:5], mem_a[1:3]) and np.array_equal(mem_a[6], mem_b[5])

    s_pub, s_sec = generate_keypair()  # allows a, but a does not allow it
    stranger = make_transport(block_memory(), "curve-0", curve_secret_key=s_sec, curve_allowed_keys=[a_pub],
                              handshake_timeout=0.5)
    with pytest.raises((HandshakeTimeout, HandshakeRejected)):
        stranger.add_remote_peer("A", *peer_args(a))
    assert stranger.write_blocks("A", [0], [0]) is None


def test_a_removed_peers_write_is_reported_only_once_its_rows_are_no_longer_read():
    """``remove_remote_peer`` with a 64 MiB write in flight over tcp: the write was reported
    failed at once, while the orderly drain still sent its bytes, so rows the caller changed
    after the report reached the peer (34-60 of 64 here).  It is reported once the lane no
    longer reads them; what the caller writes afterwards stays here."""
    rows, row_bytes = 64, 1 << 20
    timings = dict(heartbeat_interval=0.1, heartbeat_timeout=2.0, handshake_timeout=3.0,
                   ucx_net_devices="lo", same_host_lane=False, ucx_tls="tcp")
    source, target = np.ones((rows, row_bytes), np.uint8), np.zeros((rows, row_bytes), np.uint8)
    with SyncDataTransport(memoryview(source), config=AgentConfig(peer_id="drain-a", **timings)) as a, \
            SyncDataTransport(memoryview(target), config=AgentConfig(peer_id="drain-b", **timings)) as b:
        a.add_remote_peer("B", *peer_args(b))
        write = a.write_blocks("B", list(range(rows)), list(range(rows)))
        a.remove_remote_peer("B")
        assert poll_until(a, {write}).failed == [write] and isinstance(a.failure_reason(write), PeerLost)
        source[:] = 7  # reported: the caller may reuse its rows
        time.sleep(1.0)
        assert not (target[:, 0] == 7).any(), "rows changed after the report reached the peer"


def test_a_refused_add_remote_peer_leaves_a_registration_of_that_peer_as_it_was(make_transport):
    """``add_remote_peer`` under a new name with a wrong ``num_blocks`` for a peer registered
    already raises ``LayoutMismatch``, and nothing else: it disconnected the peer first (the
    good registration's write in flight failed, both sides' registrations stayed dead)."""
    a = make_transport(block_memory(seed=1), "lm-a")
    b = make_transport(block_memory(), "lm-b")
    connect_both_ways(a, "A", b, "B")
    assert poll_until(a, {a.write_blocks("B", [0], [0])}).done
    release = threading.Event()
    b.loop.call_soon_threadsafe(release.wait, 10)  # b cannot acknowledge for now
    try:
        in_flight = a.write_blocks("B", [1], [1])
        metadata, base, num_blocks, block_len = peer_args(b)
        with pytest.raises(LayoutMismatch):
            a.add_remote_peer("B-typo", metadata, base, num_blocks + 1, block_len)
    finally:
        release.set()
    assert poll_until(a, {in_flight}).done == [in_flight]
    assert poll_until(a, {a.write_blocks("B", [2], [2])}).done
    assert poll_until(b, {b.write_blocks("A", [2], [2])}).done
