"""The shared workload: plan, chunk generation and verification without sockets; send/receive
between two real services on loopback."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from omni_async import workload as wl
from omni_async.adapter import Chunk

PLAN = wl.Plan(stage="st", requests=3, chunks=4, sizes=(10, 300, 7), seed=9, session="s1")


# -- plan and generation (sans-I/O) ---------------------------------------------------------------
def test_a_plan_round_trips_through_the_wire_and_names_its_requests() -> None:
    assert msgspec.convert(msgspec.to_builtins(PLAN), wl.Plan) == PLAN
    assert [PLAN.request_id(r) for r in range(3)] == ["s1-0", "s1-1", "s1-2"]
    assert [PLAN.size(1, i) for i in range(4)] == [300, 7, 10, 300]
    assert PLAN.total_chunks == 12 and PLAN.total_bytes == 4 * (10 + 300 + 7)
    for requests, chunks, sizes in ((5, 7, (3, 1, 4, 1, 5)), (2, 1, (9, 2)), (0, 3, (1,)), (4, 2, (8,))):
        plan = wl.Plan(stage="a", requests=requests, chunks=chunks, sizes=sizes)
        assert plan.total_bytes == sum(plan.size(r, i) for r in range(requests) for i in range(chunks))
    assert wl.plan_key("tx", 3) == "workload-plan:tx:3"
    assert wl.Plan(stage="a", requests=1, chunks=1, sizes=(1,)).session != wl.Plan(
        stage="a", requests=1, chunks=1, sizes=(1,)).session


@pytest.mark.parametrize("fields", [
    {"requests": -1}, {"chunks": 0}, {"sizes": ()}, {"sizes": (4, 0)}, {"stage": "a:b"}, {"stage": ""},
    {"session": "x:y"}, {"seed": "x"}, {"surprise": 1},
])
def test_a_malformed_plan_from_a_peer_is_a_validation_error(fields: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**msgspec.to_builtins(PLAN), **fields}, wl.Plan)


def test_chunks_are_a_pure_function_of_seed_request_and_index() -> None:
    plan = msgspec.structs.replace(PLAN, sizes=(4096, 4000))
    one = wl.make_chunk(plan, 1, 2)["data"]
    assert one.dtype == np.uint8 and one.shape == (plan.size(1, 2),)
    assert np.array_equal(one, wl.make_chunk(plan, 1, 2)["data"])
    others = [wl.chunk_data(plan, 2, 1), wl.chunk_data(plan, 0, 0), wl.chunk_data(plan, 2, 0),
              wl.chunk_data(msgspec.structs.replace(plan, seed=10), 1, 2)]
    for other in others:  # every byte differs from a chunk of another (seed, request, index)
        n = min(one.size, other.size)
        assert (one[: n - n % 8] != other[: n - n % 8]).mean() > 0.9


# -- verification (sans-I/O) ----------------------------------------------------------------------
def feed(verifier: wl.Verifier, request: int, indices: list[int]) -> list[str]:
    return [verifier.check(request, i, wl.make_chunk(verifier.plan, request, i)) for i in indices]


def test_every_chunk_in_order_is_ok() -> None:
    verifier = wl.Verifier(PLAN)
    for r in range(3):
        assert feed(verifier, r, [0, 1, 2, 3]) == ["ok"] * 4
    summary = verifier.summary(0.5)
    assert summary.ok and summary.ok_chunks == 12 and summary.bad == 0 and summary.bytes == PLAN.total_bytes
    assert msgspec.convert(msgspec.to_builtins(summary), wl.Summary) == summary


def test_a_flipped_byte_a_wrong_type_and_a_chunk_beyond_the_plan_are_corrupted() -> None:
    verifier = wl.Verifier(PLAN)
    flipped = wl.chunk_data(PLAN, 0, 0).copy()
    flipped[5] ^= 1
    assert verifier.check(0, 0, {"data": flipped}) == "corrupted"
    assert verifier.check(0, 1, {"data": wl.chunk_data(PLAN, 0, 1).view(np.int8)}) == "corrupted"
    assert verifier.check(0, 2, {"data": bytes(wl.chunk_data(PLAN, 0, 2))}) == "corrupted"
    assert verifier.check(0, 3, {}) == "corrupted"
    assert feed(verifier, 1, [0, 1, 2, 3]) == ["ok"] * 4
    assert verifier.check(1, 4, {"data": wl.chunk_data(PLAN, 1, 0)}) == "corrupted"
    summary = verifier.summary(1.0)
    assert not summary.ok and summary.corrupted == 5 and summary.ok_chunks == 4
    assert summary.missing == 12 - 9  # request 2 never came


def test_a_skipped_or_repeated_index_is_reordered_and_what_never_came_is_missing() -> None:
    verifier = wl.Verifier(PLAN)
    assert feed(verifier, 0, [0, 2, 1, 3]) == ["ok", "reordered", "reordered", "reordered"]
    assert feed(verifier, 1, [0, 0]) == ["ok", "reordered"]
    verifier.failed(2, ConnectionError("gone"))
    summary = verifier.summary(1.0)
    assert (summary.ok_chunks, summary.reordered, summary.missing) == (2, 4, 6)
    assert summary.errors == ("s1-2: ConnectionError: gone",) and not summary.ok


# -- over real services ---------------------------------------------------------------------------
async def test_send_and_receive_verify_every_chunk_between_two_services(make_service) -> None:
    tx, rx = await make_service("tx"), await make_service("rx")
    plan = wl.Plan(stage="wl", requests=4, chunks=6, sizes=(1000, 70_000, 3))
    seen: list[tuple[Chunk, str]] = []
    acked: list[int] = []
    async with asyncio.timeout(30):
        await tx.agent.connect(rx.control_address)
        announced = asyncio.create_task(wl.announce(tx, "rx", plan, 0))
        got = await wl.next_plan(rx, "tx", 0)
        await announced
        assert got == plan
        receiving = asyncio.create_task(
            wl.receive(rx.adapter("wl", source="tx"), got, on_chunk=lambda c, v: seen.append((c, v))))
        report = await wl.send(tx.adapter("wl", peer_id="rx"), plan, window=2, on_ack=acked.append)
        summary = await receiving
    assert summary.ok and summary.ok_chunks == 24 and summary.bytes == plan.total_bytes, summary
    assert report.chunks == 24 and report.bytes == plan.total_bytes == sum(acked) and len(report.latencies) == 24
    assert {v for _, v in seen} == {"ok"} and len(seen) == 24


async def test_a_sender_that_stops_midway_leaves_missing_chunks_and_a_reason(make_service) -> None:
    tx, rx = await make_service("tx"), await make_service("rx", adapter={"stall_timeout": 0.5})
    plan = wl.Plan(stage="wl", requests=2, chunks=5, sizes=(64,))
    short = msgspec.structs.replace(plan, chunks=3)  # same session and data, the last chunks never sent
    async with asyncio.timeout(30):
        await tx.agent.connect(rx.control_address)
        receiving = asyncio.create_task(wl.receive(rx.adapter("wl", source="tx"), plan))
        sender = tx.adapter("wl", peer_id="rx")
        for r in range(2):
            for i in range(3):
                await sender.save(short.request_id(r), wl.make_chunk(short, r, i))
        summary = await receiving
    assert (summary.ok_chunks, summary.missing) == (6, 4) and len(summary.errors) == 2, summary
    assert all("DeadlineExceeded" in e for e in summary.errors) and not summary.ok
