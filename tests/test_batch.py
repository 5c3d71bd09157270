"""Batches of payloads: the sans-I/O rules (:mod:`omni_async.batch`), and the connector and the
adapter sending small payloads together over real lanes, each keeping its own outcome."""

import asyncio

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async import BufferFull, PeerLost, ProtocolError, TransferCancelled, TransferRefused, batch
from omni_async.config import AdapterOptions
from omni_async.connector import Connector
from omni_async.errors import BatchRefused
from omni_async.transport.messages import BATCH_LANE_BYTES, BATCH_RING_BYTES
from omni_async.wire import MAX_FRAMES

from .test_adapter import chunk

pytestmark = pytest.mark.timeout(60)


# -- the rules, no I/O ------------------------------------------------------------------------
def test_plan_cuts_by_count_bytes_meta_and_frames_and_lets_a_large_payload_go_alone():
    small = (100, 50, 2)
    assert batch.plan([small] * 3, 10_000) == []
    assert batch.plan([small] * (2 * batch.MAX_ITEMS + 1), 10**9) == [batch.MAX_ITEMS, 2 * batch.MAX_ITEMS]
    assert batch.plan([small] * 5, 300) == [2, 4]  # 150 bytes each (frames and meta): two fit in 300
    assert batch.plan([(10, batch.MAX_META // 2, 1)] * 3, 10**9) == [2]  # meta budget
    assert batch.plan([(10, 10, MAX_FRAMES // 2)] * 3, 10**9) == [2]  # the wire's frames per message
    assert batch.plan([small, (5000, 50, 2), small], 1000) == [1, 2]  # too large: alone, others around it
    assert batch.plan([(5000, 50, 2)], 1000) == []  # one payload: one group, whatever its size
    assert batch.plan([], 1000) == []


def test_meta_round_trips_and_every_malformed_batch_is_a_protocol_error():
    items = [batch.Item("s:a:0", b"h0", 2), batch.Item("s:a:1", b"h1", 0)]
    assert batch.decode(batch.encode(items), 2) == items
    encode = msgspec.msgpack.encode
    for meta, frames, why in [
        (b"\xc1", 0, "not msgpack"),
        (encode({"k": 1}), 0, "not a list"),
        (encode([["k", b"h", 1]]), 1, "one item"),
        (encode([["k", b"h", 0]] * (batch.MAX_ITEMS + 1)), 0, "too many items"),
        (encode([["k", "h", 1], ["l", b"h", 0]]), 1, "a header that is not bytes"),
        (encode([["k", b"h", -1], ["l", b"h", 2]]), 1, "a negative frame count"),
        (encode([["", b"h", 0], ["l", b"h", 0]]), 0, "an empty key"),
        (encode([["k", b"h", 0, 9], ["l", b"h", 0]]), 0, "an item of four fields"),
        (encode([["k", b"h", 1], ["l", b"h", 1]]), 3, "frame counts that do not add up"),
        (encode([["k", b"h", 0], ["k", b"h", 0]]), 0, "a key twice"),
        (encode([["\x00x", b"h", 0], ["l", b"h", 0]]), 0, "a reserved key"),
    ]:
        with pytest.raises(ProtocolError):
            batch.decode(meta, frames)
            pytest.fail(why)


def _decode_or_protocol_error(meta: bytes, frames: int) -> None:
    try:
        items = batch.decode(meta, frames)
    except ProtocolError:
        return
    assert 2 <= len(items) <= batch.MAX_ITEMS and sum(item.frames for item in items) == frames
    assert len({item.key for item in items}) == len(items)
    assert all(isinstance(item, batch.Item) and not item.key.startswith(batch.RESERVED) for item in items)


@given(st.binary(max_size=512), st.integers(0, 2000))
def test_fuzz_batch_random_bytes(meta, frames):
    _decode_or_protocol_error(meta, frames)


@given(st.data())
def test_fuzz_batch_mutations(data):
    items = [batch.Item(f"k{i}", bytes(i), i % 3) for i in range(data.draw(st.integers(2, 5)))]
    meta = bytearray(batch.encode(items))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, max(len(meta) - 1, 0)))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and meta:
            meta[pos] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del meta[pos:]
        else:
            meta[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    _decode_or_protocol_error(bytes(meta), data.draw(st.integers(0, 12)))


@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=6) | st.binary(max_size=6),
    lambda children: st.lists(children, max_size=6),
    max_leaves=30,
), st.integers(0, 40))
def test_fuzz_batch_structured_values(value, frames):
    """Well-formed msgpack of the wrong shape is a ProtocolError too."""
    _decode_or_protocol_error(msgspec.msgpack.encode(value), frames)


# -- the connector, over real lanes ----------------------------------------------------------
async def pair(make_service, **rx_sections):
    """Two joined services in this process, once their same-host rings are up (what a batch
    may hold depends on them: ``Agent.batch_bytes``)."""
    tx = await make_service("tx")
    rx = await make_service("rx", **rx_sections)
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    async with asyncio.timeout(5):
        while tx.agent.transport.links["rx"].ring_out is None or rx.agent.transport.links.get("tx") is None:
            await asyncio.sleep(0.01)
    return tx, rx


def count_messages(service):
    """Fault-injection wrapper around a real agent: records the key of every message it sends."""
    keys, send = [], service.agent.send_message
    service.agent.send_message = lambda peer, key, meta, frames: (keys.append(key), send(peer, key, meta, frames))[1]
    return keys


async def put_many(connector, peer, items):
    """``put_many_nowait`` as a list of outcomes, one per item, in order."""
    outcomes: list[asyncio.Future] = [asyncio.get_running_loop().create_future() for _ in items]
    connector.put_many_nowait(peer, items, lambda index, error: outcomes[index].set_result(error))
    return await asyncio.wait_for(asyncio.gather(*outcomes), 10)


async def test_small_payloads_travel_together_and_land_under_their_own_keys(make_service):
    tx, rx = await pair(make_service)
    keys = count_messages(tx)
    early = rx.connector.wait_for("b:3")  # one of them is awaited: handed over, not buffered
    items = [(f"b:{i}", {"n": i, "x": np.full(100, i, np.int64)}) for i in range(10)]
    assert await put_many(tx.connector, "rx", items) == [None] * 10
    assert keys == [batch.BATCH_KEY]
    assert (await asyncio.wait_for(early, 5))["n"] == 3
    assert rx.connector.buffered[0] == 9
    for i in range(10):
        if i != 3:
            payload = await rx.connector.get(f"b:{i}", timeout=5)
            assert payload["n"] == i and (payload["x"] == i).all()
    assert rx.connector.buffered == (0, 0)


async def test_a_batch_is_cut_to_what_travels_whole_and_large_payloads_go_alone(make_service):
    tx, rx = await pair(make_service)
    keys = count_messages(tx)
    limit = tx.agent.batch_bytes("rx")
    assert limit == BATCH_RING_BYTES  # the ring is up: records through the shared pool
    big = {"x": np.zeros(limit, np.uint8)}
    items = [("s:0", {"x": np.zeros(8, np.uint8)}), ("s:1", big), ("s:2", {"y": 1}), ("s:3", {"y": 2})]
    assert await put_many(tx.connector, "rx", items) == [None] * 4
    assert keys == ["s:0", "s:1", batch.BATCH_KEY]
    items = [(f"t:{i}", {"x": np.zeros(limit // 3, np.uint8)}) for i in range(4)]
    assert await put_many(tx.connector, "rx", items) == [None] * 4
    assert keys[3:] == [batch.BATCH_KEY, batch.BATCH_KEY]  # two of a third each, twice
    for key in ["s:0", "s:1", "s:2", "s:3", "t:0", "t:1", "t:2", "t:3"]:
        await rx.connector.get(key, timeout=5)


async def test_over_ucx_a_batch_is_one_eager_message_and_arrives_whole(make_service):
    tx = await make_service("tx", agent={"same_host_lane": False})
    rx = await make_service("rx", agent={"same_host_lane": False})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    assert tx.agent.batch_bytes("rx") == BATCH_LANE_BYTES
    keys = count_messages(tx)
    items = [(f"u:{i}", {"x": np.full(4096, i, np.uint8)}) for i in range(20)]  # ~80 KiB: two batches
    assert await put_many(tx.connector, "rx", items) == [None] * 20
    assert keys == [batch.BATCH_KEY, batch.BATCH_KEY]
    for i in range(20):
        assert ((await rx.connector.get(f"u:{i}", timeout=5))["x"] == i).all()


async def test_a_batch_not_taken_whole_is_sent_again_item_by_item_each_with_its_own_outcome(make_service):
    tx, rx = await pair(make_service)
    keys = count_messages(tx)
    rx.connector.discard("gone:", refuse_later=True)  # a cleaned-up request
    other = rx.connector.wait_for("mine:0", source="someone-else")  # awaited from another peer
    items = [("ok:0", {"i": 0}), ("gone:0", {"i": 1}), ("mine:0", {"i": 2}), ("ok:1", {"i": 3})]
    outcomes = await put_many(tx.connector, "rx", items)
    assert outcomes[0] is None and outcomes[3] is None
    assert isinstance(outcomes[1], TransferCancelled) and not isinstance(outcomes[1], BatchRefused)
    assert isinstance(outcomes[2], TransferRefused) and not isinstance(outcomes[2], BatchRefused)
    assert keys == [batch.BATCH_KEY, "ok:0", "gone:0", "mine:0", "ok:1"]
    assert (await rx.connector.get("ok:0", timeout=5))["i"] == 0
    assert (await rx.connector.get("ok:1", timeout=5))["i"] == 3
    assert not other.done()
    other.cancel()


async def test_buffer_limits_refuse_a_batch_whole_and_each_item_meets_them_alone(make_service):
    tx, rx = await pair(make_service, connector={"name": "ucx", "extra": {"max_buffered_payloads": 3}})
    keys = count_messages(tx)
    outcomes = await put_many(tx.connector, "rx", [(f"f:{i}", {"i": i}) for i in range(5)])
    assert outcomes[:3] == [None] * 3 and all(isinstance(o, BufferFull) for o in outcomes[3:])
    assert keys == [batch.BATCH_KEY, "f:0", "f:1", "f:2", "f:3", "f:4"]
    assert rx.connector.buffered[0] == 3


async def test_an_item_that_cannot_start_fails_alone(make_service):
    tx, rx = await pair(make_service)
    items = [("u:0", {"i": 0}), ("u:1", {"bad": object()}), ("\x00u", {"i": 2}), ("u:3", {"i": 3})]
    outcomes = await put_many(tx.connector, "rx", items)
    assert outcomes[0] is None and outcomes[3] is None
    assert isinstance(outcomes[1], TypeError) and isinstance(outcomes[2], ValueError)
    with pytest.raises(ValueError, match="the connector's own"):
        tx.connector.put_nowait("rx", batch.BATCH_KEY, {"i": 0})
    outcomes = await put_many(tx.connector, "nobody", [("v:0", {}), ("v:1", {})])
    assert all(isinstance(o, KeyError) for o in outcomes)  # UnknownPeer, each on its own


async def test_a_key_the_wire_cannot_carry_fails_only_its_own_item(make_service):
    """A key over the wire's ``MAX_KEY`` or with no UTF-8 form (a lone surrogate) fails its
    own item with InvalidMessage, batched or alone; the items beside it arrive.  (Batched, the
    long key made the receiver refuse the whole batch as malformed, every item failing with
    ProtocolError; the surrogate raised out of ``put_many_nowait``.)"""
    from omni_async import InvalidMessage

    tx, rx = await pair(make_service)
    items = [("k:0", {"i": 0}), ("x" * 1100, {"i": 1}), ("\ud800", {"i": 2}), ("k:3", {"i": 3})]
    outcomes = await put_many(tx.connector, "rx", items)
    assert outcomes[0] is None and outcomes[3] is None, outcomes
    assert isinstance(outcomes[1], InvalidMessage) and isinstance(outcomes[2], InvalidMessage), outcomes
    assert (await rx.connector.get("k:3", timeout=5)) == {"i": 3}
    for key in ("x" * 1100, "\ud800"):
        with pytest.raises(InvalidMessage):
            tx.connector.put_nowait("rx", key, {"i": 0})


async def test_batches_stay_within_the_receivers_max_message_bytes(make_service):
    """A receiver with a small ``max_message_bytes``: payloads that each fit it are batched
    only as many as fit it together (a batch over it failed every item in it)."""
    tx, rx = await pair(make_service, agent={"max_message_bytes": 16 * 1024})
    assert tx.agent.batch_bytes("rx") == 16 * 1024
    keys = count_messages(tx)
    items = [(f"m:{i}", {"x": np.full(4096, i, np.uint8)}) for i in range(8)]
    assert await put_many(tx.connector, "rx", items) == [None] * 8
    assert 2 <= keys.count(batch.BATCH_KEY) < 8  # several batches, each within the limit
    for i in range(8):
        assert (await rx.connector.get(f"m:{i}", timeout=5))["x"][0] == i


async def test_a_malformed_batch_fails_its_sender_and_the_receiver_serves_on(make_service):
    tx, rx = await pair(make_service)
    garbage = msgspec.msgpack.encode([["k", b"h", 5], ["l", b"h", 0]])  # names 5 frames, none come
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(tx.agent.send_message("rx", batch.BATCH_KEY, garbage, []), 5)
    undecodable = batch.encode([batch.Item("w:0", b"\xc1", 0), batch.Item("w:1", b"\xc1", 0)])
    with pytest.raises(BatchRefused):  # items that do not decode: each alone says why
        await asyncio.wait_for(tx.agent.send_message("rx", batch.BATCH_KEY, undecodable, []), 5)
    assert rx.connector.buffered == (0, 0)
    await asyncio.wait_for(tx.connector.put("rx", "after", {"ok": True}), 5)
    assert (await rx.connector.get("after", timeout=5)) == {"ok": True}


async def test_batches_carry_checksums_and_are_checked(make_service):
    tx = await make_service("tx", connector={"name": "ucx", "extra": {"checksum": True}})
    rx = await make_service("rx", connector={"name": "ucx", "extra": {"checksum": True}})
    await asyncio.wait_for(tx.agent.connect(rx.control_address), 5)
    keys = count_messages(tx)  # (the batch fits either way to go: no wait for the rings)
    items = [(f"c:{i}", {"x": np.arange(50) + i}) for i in range(4)]
    assert await put_many(tx.connector, "rx", items) == [None] * 4
    assert keys == [batch.BATCH_KEY]
    assert (await rx.connector.get("c:2", timeout=5))["x"][0] == 2


# -- the adapter ------------------------------------------------------------------------------
async def test_saves_queued_behind_the_window_go_in_batches_in_order(make_service):
    tx, rx = await pair(make_service)
    keys = count_messages(tx)
    sender = tx.adapter("st", peer_id="rx", options=AdapterOptions(max_in_flight=8))
    receiver = rx.adapter("st", source="tx")
    saves = [sender.save_async(f"r{r}", chunk(r, i), final=i == 19) for i in range(20) for r in range(4)]

    async def consume(r):
        return [c.index async for c in receiver.stream(f"r{r}") if (c.data["hidden"] == r * 1000 + c.index).all()]

    assert await asyncio.wait_for(asyncio.gather(*(consume(r) for r in range(4))), 20) == [list(range(20))] * 4
    await asyncio.wait_for(asyncio.gather(*saves), 10)
    assert batch.BATCH_KEY in keys and len(keys) < 40  # 80 saves, most of them together


async def test_a_cleaned_up_request_fails_its_batched_saves_and_no_other(make_service):
    tx, rx = await pair(make_service)
    sender = tx.adapter("st", peer_id="rx", options=AdapterOptions(max_in_flight=2))
    receiver = rx.adapter("st", source="tx")
    receiver.cleanup("dead")  # its chunks are refused from now on
    saves = [sender.save_async(name, {"i": i}) for i in range(6) for name in ("live", "dead")]
    outcomes = await asyncio.wait_for(asyncio.gather(*saves, return_exceptions=True), 10)
    assert outcomes[0::2] == [None] * 6
    assert all(isinstance(o, TransferCancelled) for o in outcomes[1::2])
    assert [(await receiver.load("live")).data["i"] for _ in range(6)] == list(range(6))


async def test_a_lost_peer_fails_every_item_of_a_batch_in_flight(make_service):
    tx, rx = await pair(make_service)
    keys = count_messages(tx)
    outcomes = [asyncio.get_running_loop().create_future() for _ in range(5)]
    tx.connector.put_many_nowait("rx", [(f"l:{i}", {"i": i}) for i in range(5)],
                                 lambda index, error: outcomes[index].set_result(error))
    assert await tx.agent.remove_peer("rx")  # before its answer could come: no loop turn in between
    results = await asyncio.wait_for(asyncio.gather(*outcomes), 10)
    assert keys == [batch.BATCH_KEY] and all(isinstance(r, PeerLost) for r in results)


async def test_the_connector_default_sends_each_item_alone_with_its_own_outcome(make_service):
    """``Connector.put_many_nowait`` as a connector without batches inherits it (run here on
    a real UcxConnector): each item is a ``put_nowait`` of its own, and an item that cannot
    start is reported at once, in its place."""
    tx, rx = await pair(make_service)
    keys = count_messages(tx)
    outcomes: list[asyncio.Future] = [asyncio.get_running_loop().create_future() for _ in range(3)]
    items = [("d:0", {"n": 0}), ("\x00d:1", {"n": 1}), ("d:2", {"n": 2})]
    Connector.put_many_nowait(tx.connector, "rx", items, lambda index, error: outcomes[index].set_result(error))
    assert isinstance(outcomes[1].result(), ValueError)  # reported before put_many_nowait returned
    assert await asyncio.wait_for(asyncio.gather(*outcomes), 10) == [None, outcomes[1].result(), None]
    assert keys == ["d:0", "d:2"]
    assert [(await rx.connector.get(f"d:{i}", timeout=5))["n"] for i in (0, 2)] == [0, 2]
