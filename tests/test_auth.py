"""CURVE-authenticated control plane: allow-listed peers join, strangers learn nothing."""

import asyncio

import pytest
import zmq
import zmq.asyncio

from omni_async import ConfigError, HandshakeRejected, HandshakeTimeout
from omni_async.auth import generate_keypair, public_key, split_address
from omni_async.config import AgentConfig
from omni_async.wire import encode_control

from .test_hostile import hello, real_address

pytestmark = pytest.mark.timeout(60)


def test_keys_and_config_validation():
    pub, sec = generate_keypair()
    assert public_key(sec) == pub and len(pub) == 40
    AgentConfig(curve_secret_key=sec, curve_allowed_keys=[pub])
    with pytest.raises(ConfigError, match="curve_allowed_keys"):
        AgentConfig(curve_secret_key=sec)
    with pytest.raises(ConfigError, match="Z85"):
        AgentConfig(curve_secret_key="short", curve_allowed_keys=[pub])
    with pytest.raises(ConfigError):
        AgentConfig(curve_allowed_keys=[pub])


async def test_allow_listed_peer_joins_and_transfers(make_agent):
    a_pub, a_sec = generate_keypair()
    b_pub, b_sec = generate_keypair()
    a = await make_agent(peer_id="a", curve_secret_key=a_sec, curve_allowed_keys=[b_pub])
    b = await make_agent(peer_id="b", curve_secret_key=b_sec, curve_allowed_keys=[a_pub])
    assert split_address(b.control_address)[1] == b_pub
    assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"
    a.region.array[2] = 9
    await asyncio.wait_for(a.write_blocks("b", [2], [3]), 5)
    assert (b.region.array[3] == 9).all()
    assert b.control.unauthenticated == 0


async def test_stranger_is_refused_and_counted(make_agent):
    b_pub, b_sec = generate_keypair()
    friend_pub, _ = generate_keypair()
    b = await make_agent(peer_id="b", curve_secret_key=b_sec, curve_allowed_keys=[friend_pub])
    # A peer with keys that are not on the list: its CURVE handshake is refused.
    s_pub, s_sec = generate_keypair()
    stranger = await make_agent(peer_id="s", handshake_timeout=0.5, curve_secret_key=s_sec, curve_allowed_keys=[b_pub])
    with pytest.raises(HandshakeTimeout):
        await stranger.connect(b.control_address)
    # A plain-text client: nothing reaches the agent, no answer comes back.
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(split_address(b.control_address)[0])
        try:  # the refused CURVE handshake may leave the DEALER with no pipe to queue on
            await asyncio.wait_for(sock.send(encode_control(hello("plain", real_address())), zmq.NOBLOCK), 2)
        except zmq.Again:
            pass
        assert await asyncio.wait_for(sock.poll(500), 5) == 0
    finally:
        sock.close(0)
        ctx.term()
    await asyncio.sleep(0.1)
    assert b.peers == {} and b.control.unauthenticated >= 1
    assert b.control.stats.protocol_errors == 0  # the agent never saw a byte of theirs


async def test_curve_side_needs_the_server_key(make_agent):
    b = await make_agent(peer_id="b")
    pub, sec = generate_keypair()
    a = await make_agent(peer_id="a", curve_secret_key=sec, curve_allowed_keys=[pub])
    with pytest.raises(HandshakeRejected, match="key="):
        await a.connect(b.control_address)
