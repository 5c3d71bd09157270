"""Hostile and broken peers on a live agent: garbage, truncation, oversize, replay, bad
addresses and a handshake flood, while a healthy peer keeps transferring at full correctness."""

import asyncio
import gc
import logging
import os
from collections import Counter

import numpy as np
import pytest
import zmq
import zmq.asyncio

from omni_async.transport.lane import load_ucxx, new_context
from omni_async.wire import (
    MAX_CONTROL_BYTES,
    PROTOCOL_VERSION,
    Bye,
    Heartbeat,
    Hello,
    Reject,
    Welcome,
    decode_control,
    encode_control,
)

from .helpers.procfs import fd_targets

pytestmark = pytest.mark.timeout(120)


_workers = []


def real_address() -> bytes:
    """The address of a live UCX worker (kept alive for the whole test session)."""
    worker = load_ucxx().UCXWorker(new_context("^cma"), enable_delayed_submission=False, enable_python_future=False)
    _workers.append(worker)
    return bytes(worker.address.tobytes())


def hello(peer_id: str, metadata: bytes, **overrides) -> Hello:
    fields = dict(version=PROTOCOL_VERSION, peer_id=peer_id, nonce=1, agent_metadata=metadata, base_addr=4096,
                  num_blocks=64, block_len=4096, fingerprint="")
    fields.update(overrides)
    return Hello(**fields)


async def answer(sock):
    """The next control message on ``sock`` that is not a heartbeat (once welcomed, the agent
    heartbeats this socket too, so one may come before the answer)."""
    while True:
        msg = decode_control(await sock.recv())
        if not isinstance(msg, Heartbeat):
            return msg


async def healthy_traffic(a, b, rounds: int) -> int:
    rng = np.random.default_rng(3)
    for i in range(rounds):
        a.region.array[:] = rng.integers(0, 256, a.region.array.shape, dtype=np.uint8)
        idx = rng.permutation(64)[:16].tolist()
        await asyncio.wait_for(a.write_blocks("b", idx, idx), 5)
        assert np.array_equal(b.region.array[idx], a.region.array[idx])
    return rounds


async def test_garbage_and_replays_do_not_disturb_a_healthy_peer(make_agent):
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b", lane_close_grace=1.0)  # the intruder's lane never answers its close
    await a.connect(b.control_address)
    ctx = zmq.asyncio.Context()
    try:
        traffic = asyncio.ensure_future(healthy_traffic(a, b, 200))
        sock = ctx.socket(zmq.DEALER)
        sock.connect(b.control_address)
        stray_welcome = Welcome(**{f: getattr(hello("x", b"x" * 20), f) for f in Hello.__struct_fields__})
        for junk in (b"", b"\x00", os.urandom(64), encode_control(hello("x", real_address()))[:-7],
                     b"\x92\xa2hb\x01", encode_control(stray_welcome)):
            await sock.send(junk)
        await sock.send_multipart([b"two", b"frames"])
        # A valid hello, then the same hello replayed on the same connection.
        good = encode_control(hello("intruder", real_address()))
        await sock.send(good)
        first = await asyncio.wait_for(answer(sock), 10)
        await sock.send(good)
        second = await asyncio.wait_for(answer(sock), 10)
        assert isinstance(first, Welcome)
        assert isinstance(second, Reject) and "already" in second.reason
        # Oversized: ZeroMQ drops the connection, the agent never sees it.
        big = ctx.socket(zmq.DEALER)
        big.connect(b.control_address)
        await big.send(b"\x00" * (MAX_CONTROL_BYTES + 10))
        big.close(0)
        assert await asyncio.wait_for(traffic, 60) == 200
        assert b.control.stats.protocol_errors >= 5
        assert set(b.peers) >= {"a"}
        sock.close(0)
    finally:
        ctx.destroy(0)


async def test_malformed_agent_metadata_is_refused_without_crashing(make_agent):
    """UCX aborts on some malformed worker addresses; the agent must refuse them and live on."""
    b = await make_agent(peer_id="b", lane_close_grace=1.0)  # welcomed fakes never answer a lane close
    address = real_address()
    candidates = [b"", b"\xff" * 100, os.urandom(200), bytes([address[0] ^ 0xFF]) + address[1:]]
    candidates += [address[:n] for n in range(16, len(address), 3)]  # truncations
    ctx = zmq.asyncio.Context()
    verdicts = []
    try:
        for i, metadata in enumerate(candidates):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(b.control_address)
            await sock.send(encode_control(hello(f"m{i}", metadata)))
            verdicts.append(type(decode_control(await asyncio.wait_for(sock.recv(), 20))))
            sock.close(0)
    finally:
        ctx.destroy(0)
    assert verdicts[:4] == [Reject] * 4
    assert all(v in (Reject, Welcome) for v in verdicts)
    # Still alive and serving a real peer.
    a = await make_agent(peer_id="a")
    await a.connect(b.control_address)
    await asyncio.wait_for(healthy_traffic(a, b, 5), 20)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_second_hello_on_one_connection_is_refused_and_leaks_no_slot(make_agent):
    """Two hellos back to back on one connection: the second is bad input (ignored, counted),
    the first is admitted; once that peer leaves, its slot is free again (the second hello used
    to overwrite the first's bookkeeping, leaving a stale admission that held a slot)."""
    b = await make_agent(peer_id="b", max_peers=1, lane_close_grace=1.0)  # the fake's lane never answers its close
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(b.control_address)
        first = hello("twice", real_address())
        await sock.send(encode_control(first))
        await sock.send(encode_control(first))
        assert isinstance(await asyncio.wait_for(answer(sock), 10), Welcome)
        assert b.control.stats.protocol_errors == 1
        await sock.send(encode_control(Bye(reason="done")))
        async with asyncio.timeout(5):
            while "twice" in b.peers:
                await asyncio.sleep(0.01)
    finally:
        sock.close(0)
        ctx.term()
    a = await make_agent(peer_id="a")
    assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"


async def test_a_handshakes_end_removes_only_its_own_entries(make_agent):
    """A handshake's done callback runs a loop turn after it answered: a later hello on the same
    connection may have taken its place in the tables by then.  The callback removed whatever
    handshake the connection had, and the later one's admission then never went (a review saw
    4-11 of 40 racing hellos each hold a ``max_peers`` slot for good, and handshake tasks die of
    a ``KeyError``).  It removes only its own entries."""
    b = await make_agent(peer_id="b")
    control, ident = b.control, b"one-connection"
    first, later = (asyncio.get_running_loop().create_task(asyncio.sleep(10)) for _ in range(2))
    try:
        control._handshakes[ident], control._admitting["later"] = later, later
        control._handshake_done(ident, "first", first)  # the first one's callback, a turn late
        assert control._handshakes[ident] is later and control._admitting["later"] is later
        control._handshake_done(ident, "later", later)
        assert ident not in control._handshakes and "later" not in control._admitting
    finally:
        for task in (first, later):
            task.cancel()
        await asyncio.gather(first, later, return_exceptions=True)


async def test_refused_hellos_of_one_connection_are_logged_once(make_agent, caplog):
    """50 hellos of an unsupported version, then 50 past ``max_peers``, all on one connection:
    each is refused and counted, one warning in all (each was a warning of its own)."""
    b = await make_agent(peer_id="b", max_peers=1)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(b.control_address)

    async def refused(count: int, **overrides) -> None:
        for i in range(count):
            await sock.send(encode_control(hello(f"p{i}", b"\0" * 16, **overrides)))
            assert not isinstance(await asyncio.wait_for(answer(sock), 10), Welcome)

    try:
        with caplog.at_level(logging.WARNING, logger="omni_async.control"):
            await refused(50, version=PROTOCOL_VERSION + 1)
            a = await make_agent(peer_id="a")
            await asyncio.wait_for(a.connect(b.control_address), 10)  # b is full now
            await refused(50)
    finally:
        sock.close(0)
        ctx.term()
    warnings = [r for r in caplog.records if r.name == "omni_async.control" and r.levelno >= logging.WARNING]
    assert b.control.stats.rejected == 100 and len(warnings) == 1, [r.getMessage() for r in warnings]


async def test_handshake_flood_is_bounded(make_agent):
    """300 fake peers, each with its own real UCX worker that is destroyed once its handshake
    was answered: the admitted ones become real lost lanes (silent peer, dead worker).  At most
    max_peers are joined at once, every one is dropped, every lane is released, and the
    descriptor count comes back to where it was (2 of slack)."""
    b = await make_agent(peer_id="b", max_peers=8, heartbeat_interval=0.1, heartbeat_timeout=0.5, lane_close_grace=1.0)
    live, peak = set(), [0]

    def track(event):
        (live.add if event.kind == "joined" else live.discard)(event.peer_id)
        peak[0] = max(peak[0], len(live))

    b.add_peer_listener(track)
    context = new_context("^cma", "lo")  # the fakes' context (its descriptors are not b's) ...
    load_ucxx().UCXWorker(context, enable_delayed_submission=False, enable_python_future=False)
    gc.collect()  # ... nor what its first worker leaves allocated in it
    fds_before = fds()
    targets_before = fd_targets()
    ctx = zmq.asyncio.Context()
    welcomed = 0
    try:
        for batch in range(10):
            workers, socks = [], []
            for i in range(batch * 30, batch * 30 + 30):
                worker = load_ucxx().UCXWorker(context, enable_delayed_submission=False, enable_python_future=False)
                workers.append(worker)
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(b.control_address)
                await sock.send(encode_control(hello(f"fake{i}", bytes(worker.address.tobytes()), nonce=i + 1)))
                socks.append(sock)
            replies = [decode_control(await asyncio.wait_for(s.recv(), 20)) for s in socks]
            assert all(isinstance(r, (Welcome, Reject)) for r in replies)
            welcomed += sum(isinstance(r, Welcome) for r in replies)
            for sock in socks:
                sock.close(0)
            del worker
            workers.clear()  # the fakes die: their workers are destroyed, nobody answers b's lanes
            gc.collect()
        assert 1 <= peak[0] <= 8, peak  # never more than max_peers at once (silent fakes expire)
        assert welcomed >= 10, welcomed  # enough real lanes were made and then lost
        assert b.control.stats.rejected == 300 - welcomed
        for _ in range(100):  # the fakes never heartbeat: they are dropped
            if not b.peers:
                break
            await asyncio.sleep(0.05)
        assert b.peers == {}
    finally:
        ctx.destroy(0)
    for _ in range(200):  # lost lanes are released within the lane close grace (1 s: their peers never answer)
        if fds() <= fds_before + 2:
            break
        await asyncio.sleep(0.05)
    assert fds() <= fds_before + 2, Counter(fd_targets()) - Counter(targets_before)
    # b still serves a real peer.
    a = await make_agent(peer_id="a")
    await a.connect(b.control_address)
    await asyncio.wait_for(healthy_traffic(a, b, 5), 20)


async def test_a_message_on_an_unknown_tag_is_taken_and_drops_the_sender(make_agent):
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", heartbeat_timeout=30.0)
    left = []
    b.add_peer_listener(lambda event: left.append(event.peer_id) if event.kind == "left" else None)
    async with Rogue.join(b.control_address) as rogue:
        assert "rogue" in b.peers
        rogue.send(np.ones(100, np.uint8), 5 << 60)
        async with asyncio.timeout(5):
            while "rogue" in b.peers:
                await asyncio.sleep(0.01)
    assert left == ["rogue"]


@pytest.mark.parametrize("keys", [[b"\xff" * 9], [b"\x01" + b"\x00" * 9], [b"\x00" * 9] * 2],
                         ids=["unusable", "unusable-md", "two-for-one-region"])
async def test_bad_remote_keys_drop_the_peer(make_agent, keys):
    """A peer (over tcp, where puts are offered) whose remote keys UCX refuses, or that offers
    a key count other than its region count, is dropped; its keys are unpacked in the vetting
    child first, and this process keeps serving (with puts) its other peers."""
    from omni_async.wire import HEADER_TAG, RkeyOffer, encode_header
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", heartbeat_timeout=30.0, ucx_tls="tcp")
    a = await make_agent(peer_id="a", ucx_tls="tcp")
    await a.connect(b.control_address)
    async with Rogue.join(b.control_address, tls="tcp") as rogue:
        rogue.send(encode_header(RkeyOffer(keys)), HEADER_TAG)
        async with asyncio.timeout(10):
            while "rogue" in b.peers:
                await asyncio.sleep(0.01)
    async with asyncio.timeout(10):
        while a.transport.links["b"].remote_keys is None or b.transport.links["a"].remote_keys is None:
            await asyncio.sleep(0.005)
    await asyncio.wait_for(healthy_traffic(a, b, 5), 20)


async def test_a_key_offer_on_a_removed_peers_draining_lane_starts_no_vetting(make_agent):
    """A remote key offer handled on a removed peer's lane (it drains: headers still come) starts
    no key vetting: nothing would write to that peer, and the task outlived the agent's close."""
    from omni_async.wire import RkeyOffer
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", ucx_tls="tcp")
    async with Rogue.join(b.control_address, tls="tcp") as rogue:
        assert rogue is not None
        link = b.transport.links["rogue"]
        await asyncio.wait_for(b.remove_peer("rogue"), 5)
        b.transport._on_rkey_offer(link, RkeyOffer([b"\x00" * 9]))  # as when it comes now
        assert link.keying is None
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "omni-rkeys-rogue" and not t.done()]


def warnings_about(caplog, peer_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and peer_id in r.getMessage()]


async def test_an_offer_of_a_ring_too_small_for_every_header_drops_the_peer(make_agent, caplog):
    """A same-host peer offers a real, mappable ring of 64 bytes, whose records carry 24 bytes
    (a write of a few runs needs more): a protocol violation, the peer is dropped, logged once.
    Before, the ring was taken, and a later ``write_blocks`` to the peer raised an untyped
    ValueError after copying its rows, leaving its transfer in flight with no handle."""
    from omni_async.memfd import SharedSegment
    from omni_async.transport.ring import ring_size
    from omni_async.wire import HEADER_TAG, RingOffer, encode_header
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", heartbeat_timeout=30.0)
    segment = SharedSegment(ring_size(64))
    read, write = os.pipe()
    try:
        async with Rogue.join(b.control_address, host_id=b.transport.host_id) as rogue:
            link = b.transport.links["rogue"]
            assert link.ring_in is not None  # a peer on b's host: b offered it a ring
            offer = RingOffer(pid=os.getpid(), fd=segment.fd, token=segment.token, wake_fd=write, capacity=64)
            with caplog.at_level(logging.WARNING):
                rogue.send(encode_header(offer), HEADER_TAG)
                async with asyncio.timeout(5):
                    while "rogue" in b.peers and link.ring_out is None:
                        await asyncio.sleep(0.01)
                assert link.ring_out is None and "rogue" not in b.peers
            assert len(warnings_about(caplog, "rogue")) == 1
    finally:
        os.close(read)
        os.close(write)
        segment.close()


@pytest.mark.parametrize("first", ["mappable", "unmappable"])
async def test_a_second_ring_offer_drops_the_peer_and_an_unmappable_one_is_logged_once(make_agent, caplog, first):
    """A link takes one ring offer.  A first one that cannot be mapped (a peer in another mount
    namespace makes such in good faith) is logged once and the link stays on UCX; any offer
    after the first, mappable or not, breaks the protocol: the peer is dropped, logged once.
    Before, each further offer was a warning of its own (each unmappable one /proc look-ups
    too) and the peer was never dropped."""
    import msgspec

    from omni_async.transport.samehost import RingReceiver
    from omni_async.wire import HEADER_TAG, encode_header
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", heartbeat_timeout=30.0)
    ring = RingReceiver(asyncio.get_running_loop(), lambda kind, payload: None, lambda exc: None, lambda: False)
    offer = ring.offer() if first == "mappable" else msgspec.structs.replace(ring.offer(), token="0" * 32)
    try:
        async with Rogue.join(b.control_address, host_id=b.transport.host_id) as rogue:
            link = b.transport.links["rogue"]
            with caplog.at_level(logging.WARNING):
                rogue.send(encode_header(offer), HEADER_TAG)
                async with asyncio.timeout(5):
                    while link.ring_out is None and not warnings_about(caplog, "rogue"):
                        await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
                assert "rogue" in b.peers and (link.ring_out is None) == (first == "unmappable")
                assert len(warnings_about(caplog, "rogue")) == (first == "unmappable")
                for _ in range(200):
                    rogue.send(encode_header(offer), HEADER_TAG)
                async with asyncio.timeout(5):
                    while "rogue" in b.peers:
                        await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # the rest of the offers arrive
            assert link.ring_out is None
            warned = warnings_about(caplog, "rogue")
            assert len(warned) == 1 + (first == "unmappable") and "a second ring offer" in warned[-1], warned
    finally:
        ring.close()


@pytest.mark.parametrize("flood", ["messages", "writes"])
async def test_announced_payloads_that_never_come_are_bounded(make_agent, flood):
    """Headers whose payloads never come: the receiver drops the peer at its bounds (chunk
    buffers: receive_budget(max_message_bytes); payload messages: MAX_PENDING_PAYLOADS)."""
    from omni_async.transport.limits import receive_budget
    from omni_async.wire import HEADER_TAG, MAX_PENDING_PAYLOADS, MessageHeader, WriteRequest, encode_header
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", heartbeat_timeout=30.0, max_message_bytes=1 << 20)
    a = await make_agent(peer_id="a")
    await a.connect(b.control_address)
    async with Rogue.join(b.control_address) as rogue:
        if flood == "messages":
            frame = 1 << 20
            headers = [MessageHeader(i, i, "k", b"", [frame]) for i in range(receive_budget(1 << 20) // frame + 1)]
        else:
            runs = [(2 * i, 1) for i in range(32)]
            headers = [WriteRequest(i, 32 * i, runs, False) for i in range(MAX_PENDING_PAYLOADS // 32 + 1)]
        for header in headers:
            rogue.send(encode_header(header), HEADER_TAG)
        async with asyncio.timeout(10):
            while "rogue" in b.peers:
                await asyncio.sleep(0.01)
    await asyncio.wait_for(healthy_traffic(a, b, 5), 20)


async def test_a_payload_sequence_number_announced_twice_drops_the_peer(make_agent, caplog):
    """Two write headers naming one payload sequence number: the second overwrote the
    first's target, so the first write waited for good (its admitted bytes and pending slot
    held while the peer stayed).  Now the peer is dropped, logged once."""
    from omni_async.wire import HEADER_TAG, WriteRequest, encode_header
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", ucx_tls="tcp", heartbeat_timeout=30.0)
    async with Rogue.join(b.control_address, tls="tcp") as rogue:
        link = b.transport.links["rogue"]
        with caplog.at_level(logging.WARNING):
            rogue.send(encode_header(WriteRequest(1, 0, [(0, 1)], False)), HEADER_TAG)
            rogue.send(encode_header(WriteRequest(2, 0, [(1, 1)], False)), HEADER_TAG)
            async with asyncio.timeout(5):
                while "rogue" in b.peers:
                    await asyncio.sleep(0.01)
        assert link.inbox.pending == 0 and link.inbox.pending_bytes == 0
        assert len(warnings_about(caplog, "rogue")) == 1, warnings_about(caplog, "rogue")


async def test_a_flooding_peer_does_not_starve_the_others(make_agent):
    """A peer process floods valid headers that cost the receiver more than the sender;
    another peer's transfers and the control heartbeats keep working meanwhile (before
    lane progress was bounded per wake-up, the loop never left the flooding lane)."""
    import json
    import sys

    b = await make_agent(peer_id="b", heartbeat_timeout=30.0)
    a = await make_agent(peer_id="a", heartbeat_interval=0.1, heartbeat_timeout=3.0)
    await a.connect(b.control_address)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.helpers.rogue", "flood", b.control_address,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)) == {"joined": True}
        await asyncio.sleep(0.5)  # the flood is on
        assert await asyncio.wait_for(healthy_traffic(a, b, 50), 30) == 50
        await asyncio.sleep(3.5)  # longer than the heartbeat timeout between a and b
        assert proc.returncode is None  # still flooding
        assert set(a.peers) == {"b"} and "a" in b.peers and "rogue" in b.peers
    finally:
        proc.kill()
        await proc.wait()


@pytest.mark.parametrize("grow", ["parts", "one write", "writes"])
async def test_a_peer_cannot_grow_its_notice_book_without_bound(make_agent, caplog, grow):
    """Placed writes with a notice whose parts are each committed at once: the receiver keeps
    every part's runs until the write is notified.  A write of more than MAX_NOTICE_RUNS parts,
    one of more runs, or a peer's writes of more than NOTICE_BOOK_RUNS runs in all drop the
    peer (logged once).  Before, only ``part < parts`` (up to 2**63) and the number of writes
    were checked: 11.2 MiB of headers made the receiver keep 3.9 M runs (+282 MiB RSS), the
    peer stayed joined."""
    from omni_async.wire import HEADER_TAG, MAX_NOTICE_RUNS, NOTICE_BOOK_RUNS, Commit, WriteRequest, encode_header
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", heartbeat_timeout=30.0)
    runs = [(i % 64, 1) for i in range(2600)]  # a header < 8 KiB: eager, handled in order
    per_write = {"parts": 2**62, "one write": MAX_NOTICE_RUNS, "writes": MAX_NOTICE_RUNS // len(runs)}[grow]
    async with Rogue.join(b.control_address) as rogue:
        link = b.transport.links["rogue"]
        with caplog.at_level(logging.WARNING):
            for i in range(NOTICE_BOOK_RUNS // len(runs) + 1):
                transfer_id, part = divmod(i, per_write - 1)  # the last part never comes
                rogue.send(encode_header(WriteRequest(transfer_id, 0, runs, placed=True, notice=b"n", part=part,
                                                      parts=per_write)), HEADER_TAG)
                rogue.send(encode_header(Commit(transfer_id, part)), HEADER_TAG)
                if i % 50 == 0:
                    await asyncio.sleep(0.01)
                if "rogue" not in b.peers:
                    break
            async with asyncio.timeout(5):
                while "rogue" in b.peers:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the rest of the headers arrive
        assert link.notices.runs <= NOTICE_BOOK_RUNS and len(link.notices) == 0
        assert len(warnings_about(caplog, "rogue")) == 1, warnings_about(caplog, "rogue")


async def test_payloads_announced_by_no_header_are_bounded_in_bytes(make_agent, caplog):
    """Over tcp (headers always eager: a legitimate peer's payload never comes before its
    header) a peer sends 64 KiB payload messages that no header announces: UCX holds each
    whole.  Past MIN_RECEIVE_BUDGET (64 MiB) of them the peer is dropped, logged once, and they
    are taken.  Before, only their number was bounded (MAX_PENDING_PAYLOADS = 8,192): 8,000 of
    them held +535 MiB of the receiver and the peer stayed joined."""
    from omni_async.wire import MIN_RECEIVE_BUDGET, data_tag
    from tests.helpers.rogue import Rogue

    b = await make_agent(peer_id="b", ucx_tls="tcp", heartbeat_timeout=30.0)
    a = await make_agent(peer_id="a", ucx_tls="tcp")
    await a.connect(b.control_address)
    payload = np.ones(64 * 1024, np.uint8)
    async with Rogue.join(b.control_address, tls="tcp") as rogue:
        link = b.transport.links["rogue"]
        with caplog.at_level(logging.WARNING):
            for seq in range(MIN_RECEIVE_BUDGET // payload.nbytes + 16):
                rogue.send(payload, data_tag(1 << 40 | seq))
                if seq % 100 == 0:
                    await asyncio.sleep(0.01)
            async with asyncio.timeout(10):
                while "rogue" in b.peers:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the rest of the payloads arrive
        assert link.inbox.pending == 0 and link.inbox.early_bytes == 0
        assert len(warnings_about(caplog, "rogue")) == 1, warnings_about(caplog, "rogue")
    await asyncio.wait_for(healthy_traffic(a, b, 5), 20)


_FLOOD = """
import sys, time, zmq
from omni_async.wire import Heartbeat, encode_control
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(4)]
for sock in socks:
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sys.argv[1])
message = encode_control(Heartbeat())
print("flooding", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for sock in socks:
        for _ in range(100):
            sock.send(message)
"""


async def test_a_control_port_flood_neither_holds_the_loop_nor_aborts_the_process(make_agent, spawn_peer, tmp_path):
    """Four connections that never say hello send heartbeats as fast as they can for 3 s.  The
    victim's receive loop handled every queued message before yielding (its loop held for the
    whole flood: its peers dropped it as silent), and in most runs libzmq aborted the process
    (SIGABRT, `!_io_error`: ZeroMQ's heartbeat timeout firing on a connection paused by its
    full queue).  The victim lives, keeps its peer, and serves a write right after."""
    import sys

    b = await spawn_peer("serve", str(tmp_path / "b.region"), 64, 4096, {"peer_id": "b"})
    a = await make_agent(peer_id="a")
    assert await asyncio.wait_for(a.connect(b.info["address"]), 10) == "b"
    left: list[str] = []
    a.add_peer_listener(lambda event: left.append(event.peer_id) if event.kind == "left" else None)
    flood = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FLOOD, b.info["address"], "3", stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    try:
        assert (await asyncio.wait_for(flood.stdout.readline(), 30)).startswith(b"flooding")
        await asyncio.wait_for(flood.wait(), 30)
    finally:
        if flood.returncode is None:
            flood.kill()
            await flood.wait()
    await asyncio.sleep(0.5)
    assert b.proc.returncode is None, f"the flood killed the victim (exit status {b.proc.returncode})"
    assert left == [], "the victim's loop was held: its peer dropped it as silent"
    await asyncio.wait_for(a.write_blocks("b", [0], [1]), 10)
