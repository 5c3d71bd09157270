"""Chunk streams between two services over real UCX lanes and ZeroMQ, in one process."""

import asyncio
import gc
import time

import numpy as np
import pytest

from omni_async import (
    BufferFull,
    ClosedError,
    DeadlineExceeded,
    PeerLost,
    ProtocolError,
    TransferCancelled,
    TransferRefused,
)
from omni_async.adapter import TransferAdapter
from omni_async.config import AdapterOptions
from omni_async.window import SaveWindow

pytestmark = pytest.mark.timeout(60)


async def linked(make_service, tx_adapter=None, rx_adapter=None, **rx_sections):
    tx = await make_service("tx")
    rx = await make_service("rx", **rx_sections)
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    sender = tx.adapter("thinker", peer_id="rx", options=tx_adapter)
    receiver = rx.adapter("thinker", source="tx", options=rx_adapter)
    return tx, rx, sender, receiver


def chunk(request: int, index: int, size: int = 64):
    return {"hidden": np.full(size, request * 1000 + index, dtype=np.int32), "codes": [request, index], "tag": f"r{request}"}


async def test_ordered_streams_for_many_concurrent_requests(make_service):
    _, rx, sender, receiver = await linked(make_service)
    requests, chunks = 32, 16
    sizes = [16, 40000, 8, 20000]  # mixed sizes: big chunks finish after small ones on the wire
    saves = []
    for i in range(chunks):
        for r in range(requests):
            saves.append(sender.save_async(f"req{r}", chunk(r, i, sizes[(r + i) % 4]), final=i == chunks - 1))

    async def consume(r):
        got = []
        async for c in receiver.stream(f"req{r}"):
            assert c.data["codes"] == [r, c.index] and c.data["tag"] == f"r{r}"
            assert (c.data["hidden"] == r * 1000 + c.index).all()
            got.append(c.index)
        return got

    results = await asyncio.wait_for(asyncio.gather(*(consume(r) for r in range(requests))), 30)
    assert results == [list(range(chunks))] * requests
    await asyncio.wait_for(asyncio.gather(*saves), 10)
    assert receiver.active_requests == 0 and rx.connector.buffered == (0, 0) and rx.connector.waiting == 0


async def test_final_chunk_ends_the_stream(make_service):
    _, _, sender, receiver = await linked(make_service)
    await sender.save("r", {"x": 1})
    await sender.save("r", {"x": 2}, final=True)
    got = [c async for c in receiver.stream("r")]
    assert [(c.index, c.data, c.final) for c in got] == [(0, {"x": 1}, False), (1, {"x": 2}, True)]
    assert receiver.active_requests == 0


async def test_a_buffered_chunk_loads_without_a_loop_hop(make_service):
    """A chunk that arrived before its load is handed over by the load itself: the future
    ``load_async`` returns is done already (no connector future, no callback round)."""
    _, rx, sender, receiver = await linked(make_service)
    await sender.save("r", chunk(1, 0))
    await sender.save("r", chunk(1, 1), final=True)
    assert rx.connector.buffered[0] == 2
    first = receiver.load_async("r")
    assert first.done() and first.result().index == 0 and first.result().data["codes"] == [1, 0]
    second = receiver.load_async("r")
    assert second.done() and second.result().final and (second.result().data["hidden"] == 1001).all()
    assert receiver.active_requests == 0 and rx.connector.buffered == (0, 0) and rx.connector.waiting == 0
    later = receiver.load_async("s")  # nothing buffered: it waits as before
    assert not later.done()
    await sender.save("s", chunk(2, 0), final=True)
    assert (await asyncio.wait_for(later, 5)).data["tag"] == "r2"


async def test_load_takes_buffered_chunks_and_their_failures_in_order(make_service):
    """``load`` (and ``stream``) take a chunk that is here already without waiting: in order,
    with the final one ending the request, and a buffered chunk that cannot be loaded (not an
    envelope, or the sender's cancel marker) raises from ``load`` and cleans its request up."""
    tx, rx, sender, receiver = await linked(make_service)
    for i in range(3):
        await sender.save("r", chunk(1, i), final=i == 2)
    assert rx.connector.buffered[0] == 3
    assert (await receiver.load("r")).index == 0
    assert [c.index for c in [c async for c in receiver.stream("r")]] == [1, 2]
    assert receiver.active_requests == 0 and rx.connector.buffered == (0, 0)
    await asyncio.wait_for(tx.connector.put("rx", "c:thinker:0", {"not": "an envelope"}), 5)
    with pytest.raises(ProtocolError, match="not a chunk envelope"):
        await receiver.load("c")
    with pytest.raises(TransferCancelled):  # cleaned up: its later chunks are refused
        await asyncio.wait_for(tx.connector.put("rx", "c:thinker:1", envelope({"late": 1})), 5)
    await sender.save("k", {"i": 0})
    sender.cancel("k")
    await asyncio.wait_for(asyncio.gather(*sender._unsettled), 5)  # the cancel marker is buffered behind chunk 0
    assert rx.connector.buffered[0] == 2
    assert (await receiver.load("k")).index == 0
    with pytest.raises(TransferCancelled, match="cancelled by its sender"):
        await asyncio.wait_for(receiver.load("k"), 5)
    assert receiver.active_requests == 0


async def test_failures_land_on_the_right_futures(make_service):
    tx, rx, sender, receiver = await linked(make_service)
    good = sender.save_async("a", {"x": 1}, final=True)
    bad = sender.save_async("b", {"x": object()})
    with pytest.raises(TypeError):
        await asyncio.wait_for(bad, 5)
    await asyncio.wait_for(good, 5)
    assert (await receiver.load("a")).data == {"x": 1}
    # An invalid chunk arrives for request "c": its waiter fails, request "d" is untouched.
    waiter_c = receiver.load_async("c")
    waiter_d = receiver.load_async("d")
    await asyncio.wait_for(tx.connector.put("rx", "c:thinker:0", {"not": "an envelope"}), 5)
    with pytest.raises(ProtocolError, match="not a chunk envelope"):
        await asyncio.wait_for(waiter_c, 5)
    await sender.save("d", {"y": 2}, final=True)
    assert (await asyncio.wait_for(waiter_d, 5)).data == {"y": 2}


async def test_stall_deadline_fails_waiter_and_cleans_up(make_service):
    _, rx, sender, receiver = await linked(make_service, rx_adapter=AdapterOptions(stall_timeout=0.3))
    await sender.save("slow", {"i": 0})
    assert (await receiver.load("slow")).index == 0
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(receiver.load("slow"), 5)
    assert 0.25 < time.monotonic() - started < 2
    assert receiver.active_requests == 0 and rx.connector.waiting == 0
    # A chunk that arrives after the cleanup is refused, not buffered forever.
    with pytest.raises(TransferCancelled):
        await asyncio.wait_for(sender.save("slow", {"i": 1}), 5)
    assert rx.connector.buffered == (0, 0)


async def test_each_chunk_restarts_the_stall_clock_of_a_request_still_waited_for(make_service):
    """Chunks 0.15 s apart keep a request with a 0.4 s stall deadline alive well past 0.4 s;
    once they stop, the load still waiting fails about 0.4 s after the last one."""
    _, _, sender, receiver = await linked(make_service, rx_adapter=AdapterOptions(stall_timeout=0.4))
    loads = [receiver.load_async("s") for _ in range(6)]
    started = time.monotonic()
    for i in range(5):
        await asyncio.sleep(0.15)
        await asyncio.wait_for(sender.save("s", {"i": i}), 5)
    last = time.monotonic()
    assert [(await asyncio.wait_for(load, 5)).data["i"] for load in loads[:5]] == list(range(5))
    assert last - started > 0.7
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(loads[5], 5)
    assert 0.3 < time.monotonic() - last < 1.5
    assert receiver.active_requests == 0


async def test_cleanup_and_cancel_are_idempotent_and_leave_nothing(make_service):
    _, rx, sender, receiver = await linked(make_service)
    await sender.save("r1", {"i": 0})
    await sender.save("r1", {"i": 1})
    waiter = receiver.load_async("r2")
    receiver.cleanup("r1")
    receiver.cleanup("r1")
    receiver.cancel("r2")
    receiver.cancel("r2")
    with pytest.raises(TransferCancelled):
        await waiter
    assert receiver.active_requests == 0
    assert rx.connector.buffered == (0, 0) and rx.connector.waiting == 0


async def test_cleanup_reaches_only_the_keys_of_its_own_request(make_service):
    """Request ids may contain ':' (a stage may not): ``cleanup("a")`` drops, fails and refuses
    the keys ``"a:thinker:<index>"`` of request "a" only, not those of a request whose id starts
    with ``"a:thinker:"`` (keys ``"a:thinker:x:thinker:0"``: its buffered chunk was dropped,
    its waiting load failed)."""
    _, rx, sender, receiver = await linked(make_service)
    await sender.save("a", {"a": 0})
    await sender.save("a:thinker:x", {"x": 0})
    waiting = receiver.load_async("a:thinker:y")
    receiver.cleanup("a")
    assert rx.connector.buffered[0] == 1 and rx.connector.waiting == 1  # "a"'s chunk alone is gone
    await asyncio.wait_for(sender.save("a:thinker:y", {"y": 0}, final=True), 5)  # not refused
    assert (await asyncio.wait_for(waiting, 5)).data == {"y": 0}
    assert (await receiver.load("a:thinker:x")).data == {"x": 0}
    with pytest.raises(TransferCancelled):  # request "a" itself stays cleaned up
        await asyncio.wait_for(sender.save("a", {"a": 1}), 5)


async def test_sender_cancel_reaches_the_receiver(make_service):
    _, _, sender, receiver = await linked(make_service)
    await sender.save("r", {"i": 0})
    assert (await receiver.load("r")).index == 0
    waiter = receiver.load_async("r")
    sender.cancel("r")
    with pytest.raises(TransferCancelled, match="cancelled by its sender"):
        await asyncio.wait_for(waiter, 5)


async def test_a_request_id_reused_after_the_senders_cancel_keeps_its_new_chunks(make_service):
    """The sender cancels a request and starts a new one under the same id (its index back to
    0) before the receiver took the cancel: the new chunk 0 was buffered and acknowledged, and
    taking the cancel cleaned the request up, dropping it (the sender told it was delivered,
    the receiver's next load waiting out the stall timeout).  The cancel ends the old stream
    only: loads made beyond it fail, the new stream's chunks are kept and loaded."""
    _, rx, sender, receiver = await linked(make_service, rx_adapter=AdapterOptions(stall_timeout=2.0))
    await sender.save("r", {"old": 0})
    assert (await asyncio.wait_for(receiver.load("r"), 5)).data == {"old": 0}
    beyond = [receiver.load_async("r") for _ in range(2)]  # the cancel, and one past it
    sender.cancel("r")
    for load in beyond:
        with pytest.raises(TransferCancelled, match="cancelled by its sender"):
            await asyncio.wait_for(load, 5)
    await sender.save("q", {"old": 0})
    assert (await asyncio.wait_for(receiver.load("q"), 5)).data == {"old": 0}
    sender.cancel("q")
    await asyncio.wait_for(asyncio.gather(*sender._unsettled), 5)  # the cancel, buffered
    await asyncio.wait_for(sender.save("q", {"new": 0}, final=True), 5)  # a new stream under the id: acknowledged
    with pytest.raises(TransferCancelled, match="cancelled by its sender"):
        await asyncio.wait_for(receiver.load("q"), 5)
    assert [c.data async for c in receiver.stream("q")] == [{"new": 0}]
    assert receiver.active_requests == 0 and rx.connector.buffered == (0, 0)


async def test_abandoned_load_keeps_the_stream_usable(make_service):
    _, _, sender, receiver = await linked(make_service)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(receiver.load("r"), 0.1)
    await sender.save("r", {"i": 0}, final=True)
    assert (await asyncio.wait_for(receiver.load("r"), 5)).data == {"i": 0}


async def test_back_pressure_when_the_receiver_is_slow(make_service):
    chunk_bytes = 64 * 1024
    _, rx, sender, receiver = await linked(
        make_service,
        tx_adapter=AdapterOptions(max_in_flight=4),
        connector={"name": "ucx", "extra": {"max_buffered_bytes": 4 * chunk_bytes}},
    )
    saves = [sender.save_async("r", {"x": np.zeros(chunk_bytes, np.uint8)}, final=i == 39) for i in range(40)]
    await asyncio.sleep(0.5)
    done = sum(s.done() for s in saves)
    stored = rx.connector.buffered
    assert done <= 8, f"{done} saves completed while nobody read"
    assert stored[1] <= (4 + 4) * chunk_bytes
    got = [c.index async for c in receiver.stream("r")]  # the slow reader catches up
    assert got == list(range(40))
    await asyncio.wait_for(asyncio.gather(*saves), 10)


async def test_a_save_with_room_in_the_window_is_sent_at_once_and_order_holds(make_service):
    """A save that finds nothing of the adapter's in flight or queued (and room in the window)
    goes out before ``save_async`` returns (no hop through the save loop: a loop turn per
    chunk); saves made while others are in flight queue, leave together from the save loop
    (batched as far as the window allows) and still in order, each request's chunks and
    across requests."""
    tx, _, sender, receiver = await linked(make_service, tx_adapter=AdapterOptions(max_in_flight=3))
    first = sender.save_async("a", chunk(0, 0))
    assert len(tx.agent.transport.in_flight("rx")) == 1  # sent, not just queued
    saves = [first] + [sender.save_async(f"{'ab'[i % 2]}", chunk(i, i // 2), final=i >= 10) for i in range(1, 12)]
    assert len(tx.agent.transport.in_flight("rx")) == 1  # the others wait for the save loop, in order
    got = await asyncio.wait_for(asyncio.gather(
        *(asyncio.gather(*(receiver.load(r) for _ in range(6))) for r in "ab")), 10)
    assert [[c.index for c in chunks] for chunks in got] == [list(range(6))] * 2
    assert [c.data["codes"] for c in got[0]] == [[i, i // 2] for i in range(0, 12, 2)]
    await asyncio.wait_for(asyncio.gather(*saves), 10)


async def test_adapters_given_one_save_window_share_its_bound(make_service):
    """Two adapters given the same SaveWindow of 2 shares: while the receiver's sink holds
    every chunk back, at most 2 saves of both together are sent; all complete once it lets go."""
    tx = await make_service("tx")
    rx = await make_service("rx")
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    await asyncio.wait_for(rx.agent.wait_for_peer("tx"), 5)
    release = asyncio.Event()
    sink = rx.agent.transport.message_sink

    async def held(*args):  # the receiver acknowledges nothing until released
        await release.wait()
        result = sink(*args)
        if result is not None:
            await result

    rx.agent.transport.message_sink = held
    window = SaveWindow(2)
    first = TransferAdapter(tx.connector, "one", peer_id="rx", window=window)
    second = TransferAdapter(tx.connector, "two", peer_id="rx", window=window)
    assert isinstance(TransferAdapter(tx.connector, "three", peer_id="rx")._window, SaveWindow)
    saves = [adapter.save_async("r", {"i": i}) for i in range(4) for adapter in (first, second)]
    await asyncio.sleep(0.3)
    assert len(tx.agent.transport.in_flight("rx")) <= 2 and window.locked()
    release.set()
    await asyncio.wait_for(asyncio.gather(*saves), 10)
    assert not window.locked()
    await first.close()
    await second.close()


async def test_close_while_busy(make_service):
    tx, rx, sender, receiver = await linked(make_service)
    saves = [sender.save_async("r", {"x": np.zeros(1000, np.uint8)}) for _ in range(50)]
    waiter = receiver.load_async("other")
    await sender.close()
    await sender.close()
    assert all(s.done() for s in saves)
    assert all(s.exception() is None for s in saves)  # drained, not dropped
    with pytest.raises(ClosedError):
        sender.save_async("r", {})
    await receiver.close()
    with pytest.raises(ClosedError):
        await waiter


async def test_source_peer_loss_fails_waiters(make_service):
    tx, rx, sender, receiver = await linked(make_service)
    waiter = receiver.load_async("r")
    await tx.close()
    with pytest.raises(PeerLost):
        await asyncio.wait_for(waiter, 5)


async def test_receiver_restart(make_service):
    tx, rx, sender, receiver = await linked(make_service)
    await sender.save("r1", {"i": 0}, final=True)
    await rx.close()
    await asyncio.sleep(0.1)
    rx2 = await make_service("rx")
    await asyncio.wait_for(tx.agent.connect(rx2.control_address), 5)
    receiver2 = rx2.adapter("thinker", source="tx")
    await asyncio.wait_for(sender.save("r2", {"i": 5}, final=True), 5)
    assert (await asyncio.wait_for(receiver2.load("r2"), 5)).data == {"i": 5}


async def test_idle_adapters_do_not_poll(make_service):
    _, _, sender, receiver = await linked(make_service, )
    await sender.save("r", {"i": 0})
    waiter = receiver.load_async("r")
    later = receiver.load_async("r")  # a receive is awaited the whole time
    cpu0 = time.process_time()
    await asyncio.sleep(1.0)
    used = time.process_time() - cpu0
    assert used < 0.1, f"{used:.3f}s CPU in 1s idle"
    assert waiter.done() and not later.done()
    later.cancel()


async def test_checksums_end_to_end(make_service):
    sections = {"connector": {"name": "ucx", "extra": {"checksum": True}}}
    tx = await make_service("tx", **sections)
    rx = await make_service("rx", **sections)
    await tx.agent.connect(rx.control_address)
    payload = {"x": np.arange(1000, dtype=np.float32), "b": b"bytes"}
    await asyncio.wait_for(tx.connector.put("rx", "k", payload), 5)
    got = await rx.connector.get("k", timeout=5)
    assert np.array_equal(got["x"], payload["x"]) and got["b"] == b"bytes"


async def test_checksum_mismatch_is_caught(make_service):
    """Fault injection: corrupt a frame after its digest was computed."""
    from omni_async import serde
    from omni_async.connector import _digest

    tx = await make_service("tx")
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"checksum": True}})
    await tx.agent.connect(rx.control_address)
    data = np.arange(100, dtype=np.int64)
    header, frames = serde.encode({"x": data})
    meta = _digest(header, frames) + header
    data[3] = -1  # corrupted after the digest
    waiter = rx.connector.wait_for("k")
    with pytest.raises(ProtocolError, match="checksum"):
        await asyncio.wait_for(tx.agent.send_message("rx", "k", meta, frames), 5)
    with pytest.raises(ProtocolError, match="checksum"):
        await asyncio.wait_for(waiter, 5)


async def test_a_chunk_the_codec_cannot_carry_fails_only_its_own_save(make_service):
    """An int beyond 64 bits cannot travel: that save fails with TypeError, and the adapter's
    save loop lives on (it used to die, leaving this and every later save hanging)."""
    _, _, sender, receiver = await linked(make_service)
    bad = sender.save_async("big", {"x": 2**70})
    later = [sender.save_async("ok", {"i": i}, final=i == 2) for i in range(3)]
    with pytest.raises(TypeError):
        await asyncio.wait_for(bad, 5)
    await asyncio.wait_for(asyncio.gather(*later), 5)
    got = await asyncio.wait_for(asyncio.gather(*(receiver.load("ok") for _ in range(3))), 5)
    assert [c.data["i"] for c in got] == [0, 1, 2]
    with pytest.raises(TypeError):  # and again, on a live loop
        await asyncio.wait_for(sender.save("big2", {"x": [-(2**64)]}), 5)


async def test_a_failed_save_nobody_awaits_is_logged_once_not_left_unretrieved(make_service, caplog):
    """save_async's failure is logged by the adapter; a future nobody awaits must not also end
    as asyncio's "Future exception was never retrieved" when it is collected."""
    _, _, sender, _ = await linked(make_service)
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    try:
        bad = sender.save_async("big", {"x": 2**70})
        async with asyncio.timeout(5):
            while not bad.done():
                await asyncio.sleep(0.01)
        await asyncio.wait_for(sender.save("ok", {"i": 0}), 5)  # the save loop lets go of the failed one
        del bad
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert reported == []
    assert "chunk save failed" in caplog.text


class _BreakableWindow(asyncio.Semaphore):
    """Fault injection in a real window semaphore: once ``broken`` is set, acquiring it raises."""

    broken = False

    async def acquire(self) -> bool:
        if self.broken:
            raise RuntimeError("injected fault in the save loop")
        return await super().acquire()


async def test_a_save_loop_that_dies_breaks_the_adapter_loudly(make_service):
    """An unexpected exception that ends the save loop fails every unsettled save at once and
    makes later saves raise, instead of leaving them waiting forever."""
    tx, _, _, _ = await linked(make_service)
    window = _BreakableWindow(4)
    async with TransferAdapter(tx.connector, "thinker", peer_id="rx", window=window) as sender:
        await asyncio.wait_for(sender.save("r", {"i": 0}), 5)
        window.broken = True
        pending = [sender.save_async("r", {"i": i}) for i in range(1, 4)]
        for save in pending:
            with pytest.raises(ClosedError, match="broken"):
                await asyncio.wait_for(save, 5)
        with pytest.raises(ClosedError, match="broken"):
            sender.save_async("r", {"i": 9})


def envelope(data, final=False):
    return {"final": final, "cancelled": False, "data": data}


async def test_keys_belong_to_their_sender(make_service):
    """Three agents: a stream loaded from source="tx" takes chunks from tx only; a third peer's
    chunk for the same key is refused (its put fails), the legitimate stream is unaffected."""
    tx, rx, sender, receiver = await linked(make_service)
    ev = await make_service("ev")
    await asyncio.wait_for(ev.agent.connect(rx.control_address), 5)
    waiter = receiver.load_async("r")  # chunk 0 is awaited from tx
    with pytest.raises(TransferRefused, match="awaited from 'tx'"):
        await asyncio.wait_for(ev.connector.put("rx", "r:thinker:0", envelope({"who": "ev"})), 5)
    assert not waiter.done()
    await asyncio.wait_for(sender.save("r", {"who": "tx"}), 5)
    assert (await asyncio.wait_for(waiter, 5)).data == {"who": "tx"}
    # Arriving before anyone waits: both are buffered, the load from tx picks tx's, ev's is dropped.
    await asyncio.wait_for(ev.connector.put("rx", "r:thinker:1", envelope({"who": "ev"}, final=True)), 5)
    await asyncio.wait_for(sender.save("r", {"who": "tx"}, final=True), 5)
    chunk1 = await asyncio.wait_for(receiver.load("r"), 5)
    assert chunk1.data == {"who": "tx"} and chunk1.final
    assert rx.connector.buffered == (0, 0) and receiver.active_requests == 0
    assert set(rx.agent.peers) == {"tx", "ev"}  # refused, not dropped


async def test_buffer_limits_are_checked_before_storing(make_service):
    """Payloads nobody asked for: acknowledged while they fit, held (back-pressure) while as many
    bytes again fit, then refused with BufferFull; never stored past the limits."""
    size = 64 * 1024
    tx = await make_service("tx")
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"max_buffered_bytes": 4 * size,
                                                                       "max_buffered_payloads": 12}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    puts = [tx.connector.put_nowait("rx", f"k{i}", {"x": np.full(size, i, np.uint8)}) for i in range(12)]
    for _ in range(200):
        if sum(p.done() for p in puts) >= 8 and rx.connector.buffered[0] >= 8:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # nothing more settles while nobody reads
    outcomes = [type(p.error()).__name__ if p.done() else "held" for p in puts]
    assert outcomes == ["NoneType"] * 4 + ["held"] * 4 + ["BufferFull"] * 4, outcomes
    assert rx.connector.buffered == (8, 8 * size)
    for i in range(8):  # a reader frees space: the held ones are acknowledged in order
        assert (await rx.connector.get(f"k{i}", timeout=5))["x"][0] == i
    await asyncio.wait_for(asyncio.gather(*puts[:8]), 5)
    assert rx.connector.buffered == (0, 0)
    # The count limit holds for empty payloads too.
    small = [tx.connector.put_nowait("rx", f"e{i}", {}) for i in range(13)]
    results = await asyncio.wait_for(asyncio.gather(*small, return_exceptions=True), 5)
    assert [type(r).__name__ for r in results] == ["NoneType"] * 12 + ["BufferFull"]
    assert rx.connector.buffered == (12, 0)


async def test_a_payload_given_up_before_it_arrived_is_never_delivered(make_service):
    """Over tcp a 4 MiB payload follows its header; its put is cancelled at once, so the
    sender's ``Abort`` reaches the receiver between the header and the payload.  The payload is
    answered as cancelled when it lands, never delivered (the Abort found nothing to retract
    yet, and the payload was delivered after its put had failed)."""
    size = 4 << 20
    tcp = {"ucx_tls": "tcp", "same_host_lane": False}
    tx = await make_service("tx", agent=tcp)
    rx = await make_service("rx", agent=tcp)
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    for i in range(3):
        late = tx.connector.put_nowait("rx", f"k{i}", {"x": np.ones(size, np.uint8)})
        late.cancel()
        with pytest.raises(TransferCancelled):
            await asyncio.wait_for(late, 5)
    await asyncio.wait_for(tx.connector.put("rx", "last", {"x": np.zeros(8, np.uint8)}), 5)  # behind them
    assert (await rx.connector.get("last", timeout=5))["x"].nbytes == 8
    await asyncio.sleep(0.2)
    assert rx.connector.buffered == (0, 0), rx.connector.buffered
    assert not rx.agent.transport.links["tx"].arriving


async def test_a_retract_drops_only_the_payload_it_names(make_service):
    """A retract names the awaitable the sink returned for the message given up: a later
    payload under the same key from the same peer, held in its place, stays."""
    size = 64 * 1024
    tx = await make_service("tx")
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"max_buffered_bytes": size}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    await asyncio.wait_for(tx.connector.put("rx", "k0", {"x": np.zeros(size, np.uint8)}), 5)
    held = tx.connector.put_nowait("rx", "k1", {"x": np.ones(size, np.uint8)})
    async with asyncio.timeout(5):
        while rx.connector.buffered != (2, 2 * size):
            await asyncio.sleep(0.01)
    stale: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # an earlier message's
    rx.agent.transport.message_retract("tx", "k1", stale)
    assert rx.connector.buffered == (2, 2 * size) and not held.done()
    assert (await rx.connector.get("k0", timeout=1))["x"][0] == 0
    await asyncio.wait_for(held, 5)
    assert (await rx.connector.get("k1", timeout=1))["x"][0] == 1


async def test_payloads_whose_headers_decode_into_many_objects_are_charged_for_them(make_service):
    """Frameless payloads whose 16 KB headers decode into 1.1 MB of objects each count (a bound
    on) that against ``max_buffered_bytes``: acknowledged while they fit, held while as many again fit,
    then refused.  Before, they counted 0 bytes: a peer could buffer ``max_buffered_payloads`` of
    them whatever the limit (65,536 x 3.5 MiB with 48 KiB headers)."""
    from omni_async import serde
    from omni_async.connector import charge

    limit = 4 << 20
    tx = await make_service("tx")
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"max_buffered_bytes": limit}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    payload = {"junk": [{}] * 16000}
    each = charge(serde.encode(payload)[0], [])
    fits = limit // each
    assert each > 1_000_000 and fits == 2
    puts = [tx.connector.put_nowait("rx", f"j{i}", payload) for i in range(8)]
    async with asyncio.timeout(10):
        while sum(p.done() for p in puts) < 8 - fits or rx.connector.buffered[0] < 2 * fits:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # nothing more settles while nobody reads
    outcomes = [type(p.error()).__name__ if p.done() else "held" for p in puts]
    assert outcomes == ["NoneType"] * fits + ["held"] * fits + ["BufferFull"] * (8 - 2 * fits), outcomes
    assert rx.connector.buffered == (2 * fits, 2 * fits * each)
    for i in range(2 * fits):  # a reader frees space: the held ones are acknowledged in order
        assert len((await rx.connector.get(f"j{i}", timeout=5))["junk"]) == 16000
    await asyncio.wait_for(asyncio.gather(*puts[: 2 * fits]), 5)
    assert rx.connector.buffered == (0, 0)


async def test_a_payload_larger_than_the_buffer_is_refused_at_once(make_service):
    """A payload nobody asked for that is larger than ``max_buffered_bytes`` could never be
    acknowledged: it is refused with BufferFull at once, with nothing held or stored (it was
    held, 16× over the limit, until its sender's timeout)."""
    limit = 64 * 1024
    tx = await make_service("tx")
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"max_buffered_bytes": limit}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    with pytest.raises(BufferFull, match="does not fit"):
        await asyncio.wait_for(tx.connector.put("rx", "big", {"x": np.zeros(16 * limit, np.uint8)}), 5)
    assert rx.connector.buffered == (0, 0)
    await asyncio.wait_for(tx.connector.put("rx", "small", {"x": np.zeros(limit // 2, np.uint8)}), 5)
    assert rx.connector.buffered == (1, limit // 2)


async def test_a_peer_that_left_releases_what_it_owned(make_service):
    """Its held payloads are released at once, waits naming it fail with PeerLost (also ones
    made later), and its acknowledged payloads are dropped after orphan_timeout."""
    size = 64 * 1024
    tx = await make_service("tx")
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"max_buffered_bytes": 2 * size,
                                                                       "orphan_timeout": 0.5}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    puts = [tx.connector.put_nowait("rx", f"k{i}", {"x": np.zeros(size, np.uint8)}) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*puts[:2]), 5)
    waiter = rx.connector.wait_for("other", source="tx")
    for _ in range(100):
        if rx.connector.buffered == (4, 4 * size):
            break
        await asyncio.sleep(0.02)
    assert rx.connector.buffered == (4, 4 * size)  # two acknowledged, two held
    await tx.close()
    with pytest.raises(PeerLost):
        await asyncio.wait_for(waiter, 5)
    assert rx.connector.buffered == (2, 2 * size)  # the held ones are gone with their sender
    with pytest.raises(PeerLost):
        await asyncio.wait_for(rx.connector.wait_for("later", source="tx"), 1)
    assert (await rx.connector.get("k0", timeout=1))["x"].nbytes == size  # a late reader still gets it
    await asyncio.sleep(0.7)
    assert rx.connector.buffered == (0, 0)  # nobody took k1: dropped after orphan_timeout


async def test_a_peer_that_joins_again_keeps_its_acknowledged_payloads(make_service):
    """A peer that left and joined again before ``orphan_timeout``: the payloads it was told
    were delivered stay for a reader (the timer dropped them anyway: data lost silently after
    a reconnect, such as a heartbeat blip); one that leaves again is dropped after it."""
    tx = await make_service("tx")
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"orphan_timeout": 0.5}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    await asyncio.wait_for(tx.connector.put("rx", "o:0", {"i": 0}), 5)  # acknowledged
    assert await rx.agent.remove_peer("tx")
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)  # back at once
    await asyncio.sleep(0.8)
    assert rx.connector.buffered[0] == 1
    assert await rx.agent.remove_peer("tx")
    await asyncio.sleep(0.8)
    assert rx.connector.buffered == (0, 0)


async def test_a_held_payload_expires_with_its_transfer(make_service):
    """A payload whose acknowledgement is held for want of buffer space is held at most the
    receiver's transfer_timeout, then dropped: its sender's put fails with DeadlineExceeded."""
    size = 64 * 1024
    tx = await make_service("tx")
    rx = await make_service("rx", agent={"transfer_timeout": 0.5},
                            connector={"name": "ucx", "extra": {"max_buffered_bytes": size}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    await asyncio.wait_for(tx.connector.put("rx", "k0", {"x": np.zeros(size, np.uint8)}), 5)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="buffer space"):
        await asyncio.wait_for(tx.connector.put("rx", "k1", {"x": np.zeros(size, np.uint8)}), 5)
    assert 0.4 < time.monotonic() - started < 3
    assert rx.connector.buffered == (1, size)
    assert (await rx.connector.get("k0", timeout=1))["x"].nbytes == size


@pytest.mark.parametrize("lane", ["same-host", "tcp"])
@pytest.mark.parametrize("given_up_by", ["deadline", "cancel"])
async def test_a_held_payload_its_sender_gave_up_is_never_delivered(make_service, given_up_by, lane):
    """The receiver holds a payload's acknowledgement (its buffer is full) and the sender gives
    the put up first: its deadline (the sender's transfer_timeout is the shorter one) or an
    immediate cancel.  Its put fails, and a reader who frees space later must not get it.
    Before, the held payload was acknowledged and buffered once space came: a put reported
    failed was delivered all the same.  Now the sender's ``Abort`` makes the receiver let it go."""
    size = 64 * 1024
    tcp = {"ucx_tls": "tcp", "same_host_lane": False} if lane == "tcp" else {}
    tx = await make_service("tx", agent={"transfer_timeout": 0.5, **tcp})
    rx = await make_service("rx", agent={"transfer_timeout": 30.0, **tcp},
                            connector={"name": "ucx", "extra": {"max_buffered_bytes": size}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    await asyncio.wait_for(tx.connector.put("rx", "k0", {"x": np.zeros(size, np.uint8)}), 5)
    late = tx.connector.put_nowait("rx", "k1", {"x": np.ones(size, np.uint8)})
    async with asyncio.timeout(5):
        while rx.connector.buffered != (2, 2 * size):  # k1 arrived and is held
            await asyncio.sleep(0.01)
    if given_up_by == "cancel":
        late.cancel()
    with pytest.raises(DeadlineExceeded if given_up_by == "deadline" else TransferCancelled):
        await asyncio.wait_for(late, 5)
    async with asyncio.timeout(5):
        while rx.connector.buffered != (1, size):  # let go at the receiver
            await asyncio.sleep(0.01)
    assert (await rx.connector.get("k0", timeout=1))["x"][0] == 0
    with pytest.raises(DeadlineExceeded):
        await rx.connector.get("k1", timeout=0.5)
    assert rx.connector.buffered == (0, 0)
    assert not rx.agent.transport.links["tx"].sinking and not rx.agent.transport.links["tx"].arriving
    await asyncio.wait_for(tx.connector.put("rx", "k1", {"x": np.ones(size, np.uint8)}), 5)  # sent again: arrives
    assert (await rx.connector.get("k1", timeout=1))["x"][0] == 1



def _envelope(data, final=False):
    """A chunk as an adapter's save sends it (to put it under a key of our choosing)."""
    return {"final": final, "cancelled": False, "data": data}


@pytest.mark.parametrize("ends_by", ["close", "stall"])
async def test_a_final_chunk_loaded_before_an_earlier_one_keeps_that_load_watched(make_service, ends_by):
    """Two loads of a request wait; its final chunk arrives (and is loaded) first.  The earlier
    load still waits: the request is kept until it ends, so its stall deadline and ``close()``
    still reach it (the request was forgotten: that load waited for ever)."""
    tx = await make_service("tx")
    rx = await make_service("rx")
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    receiver = rx.adapter("st", source="tx", options=AdapterOptions(stall_timeout=0.3))
    first, second = receiver.load_async("r"), receiver.load_async("r")
    await asyncio.wait_for(tx.connector.put("rx", "r:st:1", _envelope({"i": 1}, final=True)), 5)
    assert (await asyncio.wait_for(second, 5)).final
    if ends_by == "close":
        await receiver.close()
    with pytest.raises(ClosedError if ends_by == "close" else DeadlineExceeded):
        await asyncio.wait_for(first, 3)
    assert receiver.active_requests == 0


async def test_the_final_chunk_first_then_the_earlier_one_ends_the_request(make_service):
    """The same order, the earlier chunk coming after all: both loads get theirs, and the
    request is forgotten once the last load ended."""
    tx = await make_service("tx")
    rx = await make_service("rx")
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    receiver = rx.adapter("st", source="tx")
    first, second = receiver.load_async("r"), receiver.load_async("r")
    await asyncio.wait_for(tx.connector.put("rx", "r:st:1", _envelope({"i": 1}, final=True)), 5)
    assert (await asyncio.wait_for(second, 5)).final and receiver.active_requests == 1
    await asyncio.wait_for(tx.connector.put("rx", "r:st:0", _envelope({"i": 0})), 5)
    assert (await asyncio.wait_for(first, 5)).data == {"i": 0}
    assert receiver.active_requests == 0


async def test_a_close_cut_short_goes_on_and_the_next_close_waits_for_it(make_service):
    """``close()`` cut short while it drains (a timeout around it) does not cut the close
    short: the next ``close()`` returns once every save settled and the save task ended (it
    returned at once, leaving both pending for ever); a second caller waits for the first."""
    tx = await make_service("tx")
    rx = await make_service("rx")
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    window = asyncio.Semaphore(0)  # a window that never opens (shared with a stuck adapter, say)
    sender = TransferAdapter(tx.connector, "st", peer_id="rx", window=window,
                             options=AdapterOptions(drain_timeout=1.0))
    saves = [sender.save_async("r", {"i": i}) for i in range(3)]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sender.close(), 0.2)
    with pytest.raises(ClosedError):
        sender.save_async("r", {"i": 3})  # closing: no new save
    await asyncio.wait_for(asyncio.gather(sender.close(), sender.close()), 5)
    assert all(isinstance(s.exception(), ClosedError) for s in saves)
    assert sender._save_task is not None and sender._save_task.done()


async def test_a_service_close_cut_short_goes_on_and_the_next_close_waits_for_it(make_service):
    """The same for a whole service: a close cut short still closes its agent; the next
    ``close()`` waits for that (it returned at once, the agent left open)."""
    tx = await make_service("tx")
    rx = await make_service("rx")
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    adapter = tx.adapter("st", peer_id="rx", options=AdapterOptions(drain_timeout=0.5))
    adapter._window = asyncio.Semaphore(0)  # (fault injection: a window that never opens)
    save = adapter.save_async("r", {"i": 0})
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(tx.close(), 0.1)
    await asyncio.wait_for(tx.close(), 10)
    assert isinstance(save.exception(), ClosedError) and tx.agent._closed



@pytest.mark.parametrize("gives_up", ["timeout", "cancel"])
async def test_a_load_given_up_and_made_again_at_once_asks_for_the_same_chunk(make_service, gives_up):
    """A load abandoned (a timeout around it, or its future cancelled) and made again at once,
    before the abandoned one's callbacks ran: the new load asks for the same chunk, which
    arrives (it raised ValueError "somebody already waits", or failed the request as
    abandoned out of order)."""
    tx = await make_service("tx")
    rx = await make_service("rx")
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    sender = tx.adapter("st", peer_id="rx")
    receiver = rx.adapter("st", source="tx")
    if gives_up == "timeout":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await receiver.load("r")
        again = receiver.load_async("r")  # at once, as a retry loop does
    else:
        abandoned = receiver.load_async("r")
        abandoned.cancel()
        again = receiver.load_async("r")
    await asyncio.wait_for(sender.save("r", {"i": 0}, final=True), 5)
    chunk = await asyncio.wait_for(again, 5)
    assert chunk.index == 0 and chunk.data == {"i": 0}


def _deliver_with(rx, key, before=None, after=None):
    """Fault injection in rx's real message sink: ``before()`` / ``after()`` run in the turn
    the payload for ``key`` is delivered, just before / after the connector takes it."""
    transport = rx.agent.transport
    sink = transport.message_sink

    def delivering(peer_id, message_key, meta, frames):
        if message_key == key and before is not None:
            before()
        outcome = sink(peer_id, message_key, meta, frames)
        if message_key == key and after is not None:
            after()
        return outcome

    transport.message_sink = delivering


@pytest.mark.parametrize("first", ["given_up", "arrived"])
async def test_a_load_given_up_in_the_turn_its_chunk_arrives_leaves_the_chunk_to_the_next_load(make_service, first):
    """A load given up (its future cancelled, as a timeout around it does) in the same loop turn
    as its chunk's arrival, either one first: the sender has its acknowledgement, and the next
    load gets that chunk at once, the stream going on in order (the request was cleaned up as
    abandoned out of order and the chunk dropped: the next load waited for chunk 0 again until
    the stall deadline)."""
    tx, rx, sender, receiver = await linked(make_service, rx_adapter=AdapterOptions(stall_timeout=5))
    abandoned = receiver.load_async("r")
    if first == "given_up":
        _deliver_with(rx, "r:thinker:0", before=abandoned.cancel)
    else:
        _deliver_with(rx, "r:thinker:0", after=abandoned.cancel)
    await asyncio.wait_for(sender.save("r", {"i": 0}), 5)  # acknowledged: delivered
    assert abandoned.cancelled()
    again = receiver.load_async("r")
    assert again.done() and again.result().index == 0 and again.result().data == {"i": 0}
    await asyncio.wait_for(sender.save("r", {"i": 1}, final=True), 5)
    last = await asyncio.wait_for(receiver.load("r"), 2)
    assert (last.index, last.data, last.final) == (1, {"i": 1}, True)
    assert receiver.active_requests == 0 and rx.connector.buffered == (0, 0)


@pytest.mark.parametrize("final", [False, True])
async def test_a_load_cancelled_after_its_chunk_was_handed_to_it_leaves_the_chunk_to_the_next_load(
        make_service, final):
    """``load()`` cancelled once its chunk resolved its future but before it resumed (a timeout
    around it firing in that turn): the chunk goes to the next load, final or not (the
    CancelledError took it along: the next load waited for the chunk after it, to the stall
    deadline)."""
    tx, rx, sender, receiver = await linked(make_service, rx_adapter=AdapterOptions(stall_timeout=5))
    loop = asyncio.get_running_loop()
    loading = asyncio.ensure_future(receiver.load("r"))
    await asyncio.sleep(0)  # it waits for chunk 0
    # queued behind the callbacks that settle its future, ahead of its resumption:
    _deliver_with(rx, "r:thinker:0", after=lambda: loop.call_soon(loading.cancel))
    await asyncio.wait_for(sender.save("r", {"i": 0}, final=final), 5)
    with pytest.raises(asyncio.CancelledError):
        await loading
    again = receiver.load_async("r")
    assert again.done() and (again.result().index, again.result().data, again.result().final) == (0, {"i": 0}, final)
    assert receiver.active_requests == (0 if final else 1)


async def test_a_request_cleaned_up_as_its_load_was_abandoned_fails_later_loads_at_once(make_service):
    """The first of two loads made ahead is abandoned: the request cannot stay in order and is
    cleaned up; a later load of it fails at once with TransferCancelled saying why (it started
    again at chunk 0 and waited out the stall deadline for a chunk that is refused)."""
    tx, rx, sender, receiver = await linked(make_service, rx_adapter=AdapterOptions(stall_timeout=5))
    first, second = receiver.load_async("r"), receiver.load_async("r")
    first.cancel()
    with pytest.raises(TransferCancelled, match="abandoned out of order"):
        await asyncio.wait_for(second, 2)
    started = time.monotonic()
    with pytest.raises(TransferCancelled, match="cleaned up: a load of 'r' was abandoned out of order"):
        await asyncio.wait_for(receiver.load("r"), 2)
    assert time.monotonic() - started < 1
    with pytest.raises(TransferCancelled):  # and its chunks are refused
        await asyncio.wait_for(sender.save("r", {"i": 0}), 5)
    assert receiver.active_requests == 0 and rx.connector.waiting == 0
