"""One lane, or two lanes in one process, over real UCX workers."""

import asyncio

import numpy as np
import pytest

from omni_async import TransferFailed
from omni_async.transport.lane import Lane, new_context
from omni_async.wire import FULL_MASK

pytestmark = pytest.mark.timeout(60)

TAG = 7


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
