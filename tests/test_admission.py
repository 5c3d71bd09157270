"""Admission is all-or-nothing: a refused hello never hurts the joined peer it names, a peer id
belongs to the CURVE key that first used it, and a handshake that fails or is cancelled at any
point (on either side) leaves no half-joined peer behind."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from omni_async import HandshakeRejected
from omni_async.auth import generate_keypair
from omni_async.wire import Reject, decode_control, encode_control

from .test_hostile import hello, real_address

pytestmark = pytest.mark.timeout(90)

CALM = {"heartbeat_interval": 0.5, "heartbeat_timeout": 10.0}
"""Liveness is not under test here: a loaded machine must not drop peers by heartbeat timeout."""


async def raw_hello(address: str, message) -> object:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        await sock.send(encode_control(message))
        return decode_control(await asyncio.wait_for(sock.recv(), 10))
    finally:
        sock.close(0)
        ctx.term()


async def test_refused_hello_naming_a_joined_peer_does_not_hurt_it(make_agent):
    a = await make_agent(peer_id="a", **CALM)
    b = await make_agent(peer_id="b", **CALM)
    await a.connect(b.control_address)
    left = []
    b.add_peer_listener(lambda event: left.append(event) if event.kind == "left" else None)
    b.region.array[:4] = 7
    in_flight = b.write_blocks("a", [0, 1, 2, 3], [4, 5, 6, 7])
    # Each names "a" with a new nonce, and each is refused: a bad version, then an address
    # that is not a UCX worker address (refused by the accept callback, after the rules).
    for bad in (hello("a", real_address(), nonce=12345, version=999),
                hello("a", b"\x07" * 100, nonce=12346)):
        assert isinstance(await raw_hello(b.control_address, bad), Reject)
    await asyncio.wait_for(in_flight, 5)
    assert (a.region.array[4:8] == 7).all()
    assert left == [] and set(b.peers) == {"a"} and set(b.control.peers) == {"a"}
    await asyncio.wait_for(b.write_blocks("a", [0], [9]), 5)
    await asyncio.wait_for(a.write_blocks("b", [4], [10]), 5)


async def test_curve_peer_id_belongs_to_the_first_key(make_agent):
    a_pub, a_sec = generate_keypair()
    b_pub, b_sec = generate_keypair()
    c_pub, c_sec = generate_keypair()
    b = await make_agent(peer_id="b", curve_secret_key=b_sec, curve_allowed_keys=[a_pub, c_pub], **CALM)
    a = await make_agent(peer_id="a", curve_secret_key=a_sec, curve_allowed_keys=[b_pub], **CALM)
    await asyncio.wait_for(a.connect(b.control_address), 10)
    # Another allow-listed key claims the joined id "a" (as a restarted "a" would): refused.
    impostor = await make_agent(peer_id="a", curve_secret_key=c_sec, curve_allowed_keys=[b_pub], **CALM)
    with pytest.raises(HandshakeRejected, match="another CURVE key"):
        await asyncio.wait_for(impostor.connect(b.control_address), 10)
    assert set(b.peers) == {"a"} and b.peers["a"].nonce == a.identity.nonce
    a.region.array[1] = 3
    await asyncio.wait_for(a.write_blocks("b", [1], [2]), 5)
    assert (b.region.array[2] == 3).all()
    # ... also once "a" has left: the id stays bound to a's key.
    await a.remove_peer("b")
    await wait_until(lambda: not b.peers)
    with pytest.raises(HandshakeRejected, match="another CURVE key"):
        await asyncio.wait_for(impostor.connect(b.control_address), 10)
    assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"


async def wait_until(condition, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def joined(agent) -> tuple[list[str], list[str]]:
    return sorted(agent.peers), sorted(agent.control.peers)


async def test_cancelled_connect_leaves_nothing_behind(make_agent):
    # Heartbeats far apart: the far side must learn of a rollback from a Bye, not a timeout.
    slow = {"heartbeat_interval": 5.0, "heartbeat_timeout": 30.0}
    a = await make_agent(peer_id="a", **slow)
    b = await make_agent(peer_id="b", **slow)
    durations = []
    for _ in range(3):  # the quickest of a few connects (the first one also starts vetting servers)
        started = time.perf_counter()
        await a.connect(b.control_address)
        durations.append(time.perf_counter() - started)
        await a.remove_peer("b")
        await wait_until(lambda: joined(b) == ([], []))
    full = min(durations)
    # Cancel at points spread over a whole connect: before the hello, while the far side
    # vets and admits, while this side adds its lane, and after.
    cancelled = 0
    for step in range(16):
        try:
            await asyncio.wait_for(a.connect(b.control_address), full * step / 12)
        except TimeoutError:
            cancelled += 1
            await wait_until(lambda: joined(a) == ([], []) and joined(b) == ([], [])
                             and not b.control.is_admitting("a"))
        else:
            assert joined(a) == (["b"], ["b"]) and joined(b) == (["a"], ["a"])
            await a.remove_peer("b")
            await wait_until(lambda: joined(b) == ([], []))
        # A plain reconnect always succeeds, and each side sees exactly one peer.
        assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"
        assert joined(a) == (["b"], ["b"]) and joined(b) == (["a"], ["a"])
        b.region.array[0] = step
        await asyncio.wait_for(b.write_blocks("a", [0], [1]), 5)
        assert (a.region.array[1] == step).all()
        await a.remove_peer("b")
        await wait_until(lambda: joined(b) == ([], []))
    assert cancelled >= 3
