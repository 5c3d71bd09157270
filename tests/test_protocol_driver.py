"""The UCX driver carries out the lane protocol's deadlines and drain (real agents, real UCX):
one deadline timer per lane instead of one per transfer, and a drain that waits for events
instead of polling."""

import asyncio

import pytest

from omni_async import DeadlineExceeded, OmniAsyncError
from omni_async.transport.peers import DRAIN_TIMEOUT
from omni_async.wire import HEADER_TAG, MessageHeader, encode_header
from tests.helpers.rogue import Rogue
from tests.test_agent import pair


async def test_transfers_share_one_deadline_timer_and_expire_in_start_order(make_agent, monkeypatch):
    timeout = 0.5
    a, b = await pair(make_agent, transfer_timeout=timeout)
    loop = asyncio.get_running_loop()
    never = loop.create_future()
    b.set_message_sink(lambda *args: never)
    timers = []  # when each timer of a's transport was set to go off
    call_at = loop.call_at

    def counting_call_at(when, callback, *args, **kwargs):  # a wrapper around the real loop's
        if getattr(callback, "__self__", None) is a.transport:
            timers.append(when)
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    started, expired, transfers = {}, [], []
    for batch in range(2):
        for i in range(25):
            before = loop.time()  # the transfer starts after this, whatever the call then costs
            transfer = a.send_message("b", f"k{batch}.{i}", b"", [b"x"])
            started[transfer.id] = before
            transfer.add_done_callback(lambda done: expired.append((done.id, loop.time())))
            transfers.append(transfer)
        await asyncio.sleep(0.05)
    async with asyncio.timeout(10):
        for transfer in transfers:
            with pytest.raises(DeadlineExceeded):
                await transfer
    assert [transfer_id for transfer_id, _ in expired] == [transfer.id for transfer in transfers]
    assert all(when >= started[transfer_id] + timeout - 0.01 for transfer_id, when in expired)
    assert 1 <= len(timers) <= 10, f"{len(timers)} deadline timers for 50 transfers"  # was one each
    never.cancel()


async def test_a_drain_that_waits_does_not_poll(make_agent, monkeypatch):
    """A peer that never says Goodbye and owes a payload: the orderly close waits DRAIN_TIMEOUT
    for events (the lane's progress), scheduling no timer but its bound meanwhile (it slept
    5 ms at a time before), then releases the lane."""
    b = await make_agent(peer_id="b", heartbeat_timeout=30.0)
    loop = asyncio.get_running_loop()
    async with Rogue.join(b.control_address) as rogue:
        rogue.send(encode_header(MessageHeader(1, 0, "k", b"", [100])), HEADER_TAG)  # no payload follows
        link = b.transport.links["rogue"]
        async with asyncio.timeout(5):
            while not link.inbox.expecting:
                await asyncio.sleep(0.01)
        closed = loop.create_future()
        close = link.lane.close

        def noting_close(*args, **kwargs):
            if not closed.done():
                closed.set_result(loop.time())
            close(*args, **kwargs)

        short = []  # timers of under 20 ms set while the lane drained
        call_at = loop.call_at

        def counting_call_at(when, callback, *args, **kwargs):  # a wrapper around the real loop's
            if not closed.done() and when - loop.time() < 0.02:
                short.append(callback)
            return call_at(when, callback, *args, **kwargs)

        monkeypatch.setattr(link.lane, "close", noting_close)
        monkeypatch.setattr(loop, "call_at", counting_call_at)
        start = loop.time()
        assert await b.remove_peer("rogue")
        released = await asyncio.wait_for(closed, 5)
        assert released - start >= DRAIN_TIMEOUT - 0.05
        assert len(short) < 10, f"{len(short)} short timers while draining: {short[:5]}"
        await asyncio.wait_for(link.lane.wait_closed(), 10)


async def test_a_removed_peer_whose_lane_drains_writes_no_row(make_agent):
    """Between this side's removal of a peer and the end of the lane's drain, a write the peer
    had already sent is taken into scratch, not into our rows (its notice book is gone: rows
    written then would change unannounced)."""
    a, b = await pair(make_agent, same_host_lane=False)
    a.region.array[:4] = 7
    assert b.transport.remove_peer("a", orderly=True)
    late = a.write_blocks("b", [0, 1, 2, 3], [0, 1, 2, 3])  # a has not seen b's Goodbye yet
    with pytest.raises(OmniAsyncError):
        await asyncio.wait_for(late, 5)
    await asyncio.sleep(0.2)  # anything still in flight lands meanwhile
    assert not b.region.array[:4].any()
