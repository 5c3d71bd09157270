"""One lane, or two lanes in one process, over real UCX workers."""

import asyncio
import gc
import subprocess
import weakref

import numpy as np
import pytest

from omni_async import TransferFailed
from omni_async.transport import iov, rma
from omni_async.transport.lane import Lane, new_context
from omni_async.transport.samehost import RingReceiver
from omni_async.wire import FULL_MASK

pytestmark = pytest.mark.timeout(60)

TAG = 7
CLOSE_GRACE = 0.5
"""Seconds a closing lane of these tests waits for its endpoint's close: an endpoint to a
stopped peer never closes, so its lane is released when the grace runs out, however long that is."""


async def lanes():
    loop = asyncio.get_running_loop()
    context = new_context("^cma", "lo")
    sender, receiver = Lane(context, loop), Lane(context, loop)
    sender.connect(receiver.address)
    return sender, receiver


async def close(*lanes):
    for lane in lanes:
        lane.close()
    await asyncio.wait_for(asyncio.gather(*(lane.wait_closed() for lane in lanes)), 10)


async def test_a_raising_callback_never_unwinds_through_progress(owned):
    """An arrival callback and a completion that raise are logged; the lane keeps serving."""
    sender, receiver = await lanes()
    got: list[bytes] = []

    def completed(buffer, error):
        got.append(bytes(buffer))
        raise RuntimeError("completion bug")

    def arrived(_tag, length, message):
        buffer = np.empty(length, np.uint8)
        receiver.recv_arrived(buffer, message, lambda error: completed(buffer, error))
        raise ValueError("arrival bug")

    receiver.watch(TAG, FULL_MASK, arrived)
    try:
        for i in range(5):
            sender.send(np.full(8, i, np.uint8), TAG, lambda error: None)
            async with asyncio.timeout(5):
                while len(got) <= i:
                    await asyncio.sleep(0.001)
        assert got == [bytes([i] * 8) for i in range(5)]
    finally:
        await close(sender, receiver)


async def test_closed_lanes_and_ring_receivers_are_freed_when_dropped():
    """Nothing in how a lane or a ring receiver queues its next turn ties it to itself: closed
    and dropped, each is freed at once (with whatever its callbacks hold), not when the GC next
    runs, so the descriptor checks that follow a close see it gone."""
    loop = asyncio.get_running_loop()
    sender, receiver = await lanes()
    ring = RingReceiver(loop, lambda kind, payload: None, lambda error: None, lambda: False)
    sent = loop.create_future()
    sender.send(np.zeros(8, np.uint8), TAG, sent.set_result)  # queues a drive of each lane
    ring.kick()  # queues a turn
    await asyncio.wait_for(sent, 5)
    await close(sender, receiver)
    ring.close()
    refs = [weakref.ref(part) for part in (sender, receiver, ring)]
    gc.disable()
    try:
        del sender, receiver, ring
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("size", [64, 64 * 1024], ids=["eager", "rendezvous"])
async def test_an_error_a_completion_keeps_pins_neither_the_lane_nor_its_worker(size):
    """A request that fails (here a receive into a buffer shorter than its message) hands its
    completion an error that holds no frame of the lane: an owner that keeps the error (a
    failed transfer's reason) does not keep the lane, nor the UCX worker its progress had in
    hand, so the closed lane is freed at once when dropped.  (An error raised and caught inside
    the lane pinned them through its traceback: a lane whose peer was killed kept its worker's
    descriptors open for as long as the error lived.)"""
    sender, receiver = await lanes()
    taken: list[tuple[int, int]] = []
    receiver.watch(TAG, FULL_MASK, lambda _tag, length, message: taken.append((length, message)))
    sender.send(np.ones(size, np.uint8), TAG, lambda error: None)
    async with asyncio.timeout(5):
        while not taken:
            await asyncio.sleep(0.001)
    errors: list[BaseException | None] = []
    length, message = taken[0]
    receiver.recv_arrived(np.empty(length // 2, np.uint8), message, errors.append)
    async with asyncio.timeout(5):
        while not errors:
            await asyncio.sleep(0.001)
    assert isinstance(errors[0], OSError) and "truncated" in str(errors[0]), errors
    await close(sender, receiver)
    refs = [weakref.ref(lane) for lane in (sender, receiver)]
    gc.disable()
    try:
        del sender, receiver
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()
    assert errors[0] is not None  # still kept


async def test_a_sink_that_raises_fails_its_message_with_a_failed_ack(make_agent):
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b")
    await asyncio.wait_for(a.connect(b.control_address), 5)
    got = []

    def sink(peer, key, meta, frames):
        if key == "bad":
            raise ValueError("cannot reshape array of size 3 into shape (2,)")  # a decoder's error
        got.append(key)

    b.set_message_sink(sink)
    with pytest.raises(TransferFailed, match="reshape"):
        await asyncio.wait_for(a.send_message("b", "bad", b"", [b"xyz"]), 5)
    await asyncio.wait_for(a.send_message("b", "good", b"", [b"xyz"]), 5)
    assert got == ["good"]
    assert set(a.peers) == {"b"} and set(b.peers) == {"a"}


def test_lanes_on_two_threads_never_see_each_others_probes():
    """ctypes calls release the GIL: probe results live per lane, not in shared state."""
    import threading

    failures: list[str] = []
    counts: list[int] = []

    def hammer(kind: int, size: int) -> None:
        async def run() -> None:
            sender, receiver = await lanes()
            seen = 0

            def arrived(tag, length, message):
                nonlocal seen
                seen += 1
                if tag >> 60 != kind or length != size:
                    failures.append(f"lane {kind} probed tag {tag:#x} of {length} bytes")
                receiver.recv_arrived_many([np.empty(length, np.uint8)], message, lambda error: None)

            receiver.watch(0, 0, arrived)
            payload = np.ones(size, np.uint8)
            try:
                async with asyncio.timeout(30):
                    for batch in range(40):
                        for i in range(250):
                            sender.send(payload, (kind << 60) | (batch * 250 + i), lambda error: None)
                        while seen < (batch + 1) * 250:
                            await asyncio.sleep(0)
            finally:
                counts.append(seen)
                await close(sender, receiver)

        asyncio.run(run())

    threads = [threading.Thread(target=hammer, args=(kind, 64 * kind)) for kind in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == [], failures[:5]
    assert counts == [10_000] * 3


def test_importing_the_transport_has_no_side_effects():
    """No environment edit and no UCX library loaded at import; both happen on first use
    (ucxx's GPU UCX_* writes undone, UCX_LOG_FILE defaulted to stderr, UCX's mmap hooks off)."""
    import os
    import sys

    code = """
import os, sys
before = dict(os.environ)
import omni_async.transport.iov
import omni_async.transport.lane as lane
assert "ucxx" not in sys.modules, "ucxx imported"
assert dict(os.environ) == before, "environment edited at import"
assert "libucp" not in open("/proc/self/maps").read(), "libucp loaded at import"
lane.new_context("^cma", "lo")
assert "ucxx" in sys.modules
expected = {k: v for k, v in before.items() if k.startswith("UCX_")}
expected.setdefault("UCX_LOG_FILE", "stderr")
expected.setdefault("UCX_MEM_MMAP_HOOK_MODE", "none")
assert {k: v for k, v in os.environ.items() if k.startswith("UCX_")} == expected, os.environ
print("ok")
"""
    env = {key: value for key, value in os.environ.items() if key not in ("UCX_LOG_FILE", "UCX_MEM_MMAP_HOOK_MODE")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": root},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


_SILENT_PEER = """
import asyncio, sys
from omni_async.transport import iov
from omni_async.transport.lane import Lane, new_context

async def main():
    lane = Lane(new_context("^cma", "lo"), asyncio.get_running_loop())
    print(lane.address.hex(), flush=True)
    peer = await asyncio.to_thread(sys.stdin.readline)
    if peer.strip():  # send one message of the given size to the lane at this address
        address, size = peer.split()
        lane.connect(bytes.fromhex(address))
        lane.send(bytearray(int(size)), 7, lambda error: None)
    await asyncio.sleep(3600)  # never takes a message: every rendezvous send to it stays in flight

asyncio.run(main())
"""


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


async def _lane_to(child: subprocess.Popen[bytes], context: object) -> tuple[Lane, int]:
    """A lane of ``context`` (the caller keeps it alive, closing waits at most ``CLOSE_GRACE``)
    connected to the address ``child`` prints, and this process's descriptor count before it (a warm-up lane pays UCX's lazy
    per-process state, e.g. shm segments, first)."""
    assert child.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
    address = bytes.fromhex(line.decode())
    loop = asyncio.get_running_loop()
    warm = Lane(context, loop)
    warm.connect(address)
    await close(warm)
    del warm
    gc.collect()
    baseline = _open_fds()
    lane = Lane(context, loop, close_grace=CLOSE_GRACE)
    lane.connect(address)
    return lane, baseline


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
async def test_a_lane_whose_peer_died_or_stopped_with_sends_in_flight_frees_its_worker(signal_name):
    """Rendezvous sends (64 KiB-1 MiB, contiguous and gathered) to another process that is then
    killed or stopped can never finish, and UCX cannot cancel them: once the lane is released
    the process holds no more descriptors than before it existed (its UCX worker is gone), it
    lives, and another pair of lanes keeps transferring throughout."""
    import os
    import signal
    import sys

    from .conftest import ROOT

    child = subprocess.Popen([sys.executable, "-c", _SILENT_PEER], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    sender, receiver = await lanes()  # the other peer, which must stay unaffected
    got: list[int] = []

    def arrived(_tag, length, message):
        buffer = np.empty(length, np.uint8)
        receiver.recv_arrived_many([buffer], message, lambda error: got.append(int(buffer[0])) if error is None else None)

    async def healthy_pair_moves(value: int) -> None:
        sender.send(np.full(256 * 1024, value, np.uint8), TAG, lambda error: None)
        async with asyncio.timeout(10):
            while value not in got:
                await asyncio.sleep(0.001)

    receiver.watch(TAG, FULL_MASK, arrived)
    try:
        context = new_context("^cma", "lo")
        lane, baseline = await _lane_to(child, context)
        failed: list[BaseException | None] = []
        payloads = [np.ones(size, np.uint8) for size in (64 * 1024, 256 * 1024, 1024 * 1024)]
        for payload in payloads:
            lane.send(payload, TAG, failed.append)
            lane.send_many([payload[:4096], payload[4096:]], TAG, failed.append)
        await healthy_pair_moves(1)
        assert lane.in_flight == 2 * len(payloads) and failed == []
        assert _open_fds() > baseline
        child.send_signal(getattr(signal, signal_name))
        await healthy_pair_moves(2)
        lane.close()
        await asyncio.wait_for(lane.wait_closed(), 10)
        assert lane.released and len(failed) == 2 * len(payloads) and all(failed)
        del lane
        gc.collect()
        assert _open_fds() == baseline
        await healthy_pair_moves(3)
    finally:
        child.kill()  # a stopped process is killed too
        child.wait()
        await close(sender, receiver)


async def test_a_lane_whose_peer_stopped_while_we_receive_its_message_frees_its_worker():
    """A 1 MiB rendezvous message from another process is taken, then its sender is stopped
    (SIGSTOP) before our receive is posted: the receive can never finish, and UCX cannot cancel
    a receive of a taken message.  Once the lane is released the descriptors are back to
    baseline."""
    import os
    import signal
    import sys

    from .conftest import ROOT

    child = subprocess.Popen([sys.executable, "-c", _SILENT_PEER], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert child.stdin is not None
        context = new_context("^cma", "lo")
        lane, baseline = await _lane_to(child, context)
        taken: list[tuple[int, int]] = []
        lane.watch(TAG, FULL_MASK, lambda _tag, length, message: taken.append((length, message)))
        child.stdin.write(f"{lane.address.hex()} {1024 * 1024}\n".encode())
        child.stdin.flush()
        async with asyncio.timeout(10):
            while not taken:
                await asyncio.sleep(0.001)
        child.send_signal(signal.SIGSTOP)
        length, message = taken[0]
        buffer = np.empty(length, np.uint8)
        failed: list[BaseException | None] = []
        lane.recv_arrived(buffer, message, failed.append)
        await asyncio.sleep(0.1)
        assert lane.in_flight == 1 and failed == []
        lane.close()
        await asyncio.wait_for(lane.wait_closed(), 10)
        assert lane.released and len(failed) == 1 and failed[0] is not None
        del lane
        gc.collect()
        assert _open_fds() == baseline
    finally:
        child.kill()  # a stopped process is killed too
        child.wait()


async def test_a_one_block_write_over_tcp_is_one_hand_off_each_way(make_agent):
    """Over tcp a 64 KiB block goes eagerly, in one tcp segment: the receiver wakes once for
    the header and its payload, the sender once for the ack (a rendezvous took three more
    wake-ups per write: ready-to-receive, the data, and segments of 8 KiB)."""
    config = {"ucx_tls": "tcp", "same_host_lane": False}
    rx = await make_agent(8, 64 * 1024, peer_id="rx", **config)
    tx = await make_agent(8, 64 * 1024, peer_id="tx", **config)
    await asyncio.wait_for(tx.connect(rx.control_address), 10)
    tx.region.array[1] = 7
    async with asyncio.timeout(20):
        for _ in range(10):  # warm-up: UCX wires the tcp connection on first use
            await tx.write_blocks("rx", [1], [2])
        lanes = [tx.transport.lane("rx"), rx.transport.lane("tx")]
        before = sum(lane.wakeups for lane in lanes)
        writes = 50
        for _ in range(writes):
            await tx.write_blocks("rx", [1], [2])
    assert np.all(rx.region.array[2] == 7)
    per_write = (sum(lane.wakeups for lane in lanes) - before) / writes
    assert per_write <= 3, f"{per_write} lane wake-ups per 1-block write over tcp (rendezvous: 6)"


def test_iov_of_runs_names_the_rows_of_each_run_in_every_array_in_payload_order():
    """The gathered payload's IOV computed from the runs is the IOV of the rows themselves:
    run by run, and within a run array by array (regions of different row lengths)."""
    from omni_async.region import plan_runs

    arrays = [np.zeros((64, 256), np.uint8), np.zeros((64, 96), np.uint8)]
    rng = np.random.default_rng(5)
    local = [int(i) for i in rng.choice(60, 30, replace=False)] + [60, 61, 62, 63]
    runs = plan_runs(local, list(range(34)), 64, 64)
    assert any(run[2] > 1 for run in runs) and any(run[2] == 1 for run in runs)
    rows = [array[local : local + length].reshape(-1) for local, _remote, length in runs for array in arrays]
    assert np.array_equal(iov.iov_of_runs(arrays, runs), iov.iov_of(rows))
    assert iov.iov_of_runs(arrays, runs).dtype == np.uint64


def test_puts_of_runs_name_each_runs_rows_here_and_in_the_peers_regions():
    """A put's local bytes are the run's rows of each array (as the gathered IOV names them),
    its remote address the peer region's base plus the run's first remote row, its key that
    region's: run by run, region by region (regions of different row lengths)."""
    from omni_async.region import plan_runs

    arrays = [np.zeros((64, 256), np.uint8), np.zeros((64, 96), np.uint8)]
    local = [5, 6, 7, 40, 2, 63]
    remote = [10, 11, 12, 0, 33, 1]
    runs = plan_runs(local, remote, 64, 64)
    assert runs == [(5, 10, 3), (40, 0, 1), (2, 33, 1), (63, 1, 1)]
    bases, keys = [1 << 40, (1 << 63) + 4096], [0xDEAD, (1 << 64) - 2]
    puts = rma.puts_of_runs(arrays, runs, bases, keys).tolist()
    expected = [
        [address, length, bases[i] + run[1] * arrays[i].shape[1], keys[i]]
        for (address, length), run, i in zip(
            iov.iov_of_runs(arrays, runs).tolist(), [run for run in runs for _ in arrays], [0, 1] * len(runs),
            strict=True,
        )
    ]
    assert puts == expected
    assert puts[0][:2] == [arrays[0][5:8].ctypes.data, 3 * 256]
    assert all(type(value) is int for put in puts for value in put)


def test_address_of_is_the_first_byte_of_any_flat_byte_array():
    """The lane's contiguous sends and receives name a buffer by this address: writable
    (region rows, a row in the middle of a region), read-only (encoded headers) and empty."""
    region = np.zeros((8, 1024), np.uint8)
    header = np.frombuffer(b"encoded header", np.uint8)
    for view in (region[3], region[2:5].reshape(-1), header, np.empty(0, np.uint8)):
        assert iov.address_of(view) == view.ctypes.data


async def test_a_lane_to_another_process_polls_a_moment_after_activity_then_sleeps(make_agent, spawn_peer, tmp_path):
    """Over tcp to a peer process, a lane keeps polling for a moment after its last activity
    (the next write, or an answer, then pays no wake-up), and then sleeps: not one progress
    pass while idle."""
    config = {"ucx_tls": "tcp", "same_host_lane": False}
    peer = await spawn_peer("serve", str(tmp_path / "region"), 8, 64 * 1024, {**config, "peer_id": "rx"})
    tx = await make_agent(8, 64 * 1024, peer_id="tx", **config)
    async with asyncio.timeout(30):
        await tx.connect(peer.info["address"])
        lane = tx.transport.lane("rx")
        polled = False
        for _ in range(500):  # on a loaded host the lane's gate may skip many windows
            await tx.write_blocks("rx", [1], [2])
            settled = lane.wakeups
            await asyncio.sleep(0)  # one loop turn: a lane that stays hot runs a pass in it
            polled = lane.wakeups > settled
            if polled:
                break
        await asyncio.sleep(0.2)  # far longer than the window
        idle = lane.wakeups
        await asyncio.sleep(0.5)
    assert polled, "the lane slept right after every write settled"
    assert lane.wakeups == idle, f"{lane.wakeups - idle} progress passes while idle"


async def test_a_lane_to_a_peer_in_this_process_never_polls_after_activity(make_agent):
    """A peer on this thread cannot answer while we poll: such a lane sleeps right away."""
    config = {"ucx_tls": "tcp", "same_host_lane": False}
    rx = await make_agent(8, 64 * 1024, peer_id="rx", **config)
    tx = await make_agent(8, 64 * 1024, peer_id="tx", **config)
    async with asyncio.timeout(20):
        await tx.connect(rx.control_address)
        # The remote keys are vetted in a child that connects to the peer's worker (a wake-up
        # of its lane): let that happen before counting.
        while any(getattr(a.transport.links.get(b), "remote_keys", None) is None for a, b in ((tx, "rx"), (rx, "tx"))):
            await asyncio.sleep(0.005)
        for _ in range(5):
            await tx.write_blocks("rx", [1], [2])
        lanes = [tx.transport.lane("rx"), rx.transport.lane("tx")]
        settled = sum(lane.wakeups for lane in lanes)
        await asyncio.sleep(0.2)
    assert sum(lane.wakeups for lane in lanes) == settled
