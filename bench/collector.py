"""``python -m bench gc``: what Python's garbage collector costs a chunk stream, per chunk.

The chunk_8k shape (64 requests × 100 chunks of 8.9 KiB, every chunk checked) through two
:class:`~omni_async.service.ConnectorService` adapters on one event loop, same-host lane, in
three collector modes that alternate round by round: ``default`` (as Python starts),
``frozen`` (:func:`gc.freeze` once the services run and the chunks exist, undone after the
round) and ``disabled`` (:func:`gc.disable`, the floor).  Reported: CPU µs per chunk (both
sides, ``time.process_time``) per mode, and in ``default`` mode the collections per generation
with their pause times (:data:`gc.callbacks`).  omni_async never calls :func:`gc.freeze`
itself: it is process-wide, and what is alive when it runs is never collected afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omni_async.adapter import TransferAdapter
from omni_async.config import ServiceConfig, load_config
from omni_async.service import ConnectorService

from .chunk_data import chunk_ok, make_chunk
from .modes import SHM
from .provenance import provenance_text, stamp

MODES = ("default", "frozen", "disabled")
REQUESTS, CHUNKS, TOKENS = 64, 100, 5
STAGE = "bench-gc"


class _Pauses:
    """Collections and their pause time by generation, from :data:`gc.callbacks`."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.count[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started


@contextmanager
def _collector(mode: str, pauses: _Pauses | None) -> Iterator[None]:
    if pauses is not None:
        gc.callbacks.append(pauses)
    if mode == "frozen":
        gc.freeze()
    elif mode == "disabled":
        gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.enable()
        if pauses is not None:
            gc.callbacks.remove(pauses)


ROUND_TIMEOUT_S = 60.0
"""A round that takes longer failed (a few hundred milliseconds is usual)."""


async def _stream(out: TransferAdapter, inp: TransferAdapter, chunks: dict[tuple[int, int], Any], n: int) -> None:
    """Every chunk of round ``n`` saved, received and checked (raises on a wrong one, and
    ``TimeoutError`` after :data:`ROUND_TIMEOUT_S`)."""

    async def consume(request: int) -> int:
        bad = 0
        async for chunk in inp.stream(f"r{n}-{request}"):
            bad += not chunk_ok(chunk.data, request, chunk.index, TOKENS)
        return bad

    async with asyncio.timeout(ROUND_TIMEOUT_S), asyncio.TaskGroup() as group:  # a failed round cancels its consumers
        consumers = [group.create_task(consume(r)) for r in range(REQUESTS)]
        await asyncio.gather(*(
            out.save_async(f"r{n}-{r}", chunks[r, i], final=i == CHUNKS - 1)
            for r in range(REQUESTS) for i in range(CHUNKS)
        ))
    if sum(task.result() for task in consumers):
        raise RuntimeError(f"round {n}: a chunk arrived wrong")


def _config(peer_id: str) -> ServiceConfig:
    return load_config({"agent": SHM.omni_config(peer_id), "region": {"num_blocks": 1, "block_len": 4096}},
                       schema=ServiceConfig, environ={})


async def run_gc(rounds: int = 4) -> dict[str, Any]:
    """``rounds`` rounds of every mode (after one warm-up round); CPU µs per chunk by mode."""
    chunks = {(r, i): make_chunk(r, i, TOKENS) for r in range(REQUESTS) for i in range(CHUNKS)}
    per_chunk: dict[str, list[float]] = {mode: [] for mode in MODES}
    pauses = _Pauses()
    async with ConnectorService(_config("gc-rx")) as rx, ConnectorService(_config("gc-tx")) as tx:
        peer = await tx.agent.connect(rx.control_address)
        await rx.agent.wait_for_peer(peer_id="gc-tx", timeout=10)
        out, inp = tx.adapter(STAGE, peer_id=peer), rx.adapter(STAGE, source="gc-tx")
        await _stream(out, inp, chunks, 0)
        n = 1
        for _ in range(rounds):
            for mode in MODES:
                with _collector(mode, pauses if mode == "default" else None):
                    started = time.process_time()
                    await _stream(out, inp, chunks, n)
                    per_chunk[mode].append((time.process_time() - started) / (REQUESTS * CHUNKS) * 1e6)
                n += 1
    chunks_timed = rounds * REQUESTS * CHUNKS
    medians = {mode: round(statistics.median(values), 1) for mode, values in per_chunk.items()}
    return {
        **stamp(),
        "workload": f"{REQUESTS} requests × {CHUNKS} chunks of 8.9 KiB, both sides in one process, same-host lane",
        "rounds": rounds,
        "cpu_us_per_chunk": medians,
        "rounds_us_per_chunk": {mode: [round(v, 1) for v in values] for mode, values in per_chunk.items()},
        "ratios": {mode: round(medians["default"] / medians[mode], 3) for mode in MODES},
        "default_collections": [
            {"generation": g, "count": pauses.count[g], "total_ms": round(pauses.seconds[g] * 1e3, 1),
             "each_us": round(pauses.seconds[g] / pauses.count[g] * 1e6) if pauses.count[g] else 0,
             "us_per_chunk": round(pauses.seconds[g] / chunks_timed * 1e6, 2)}
            for g in range(3)
        ],
    }


def table(report: dict[str, Any]) -> str:
    cpu, ratios = report["cpu_us_per_chunk"], report["ratios"]
    lines = [f"bench gc: {report['workload']}, {report['rounds']} rounds, modes alternating", "",
             "| collector | CPU µs/chunk (median) | default ÷ this |", "|---|---|---|"]
    lines += [f"| {mode} | {cpu[mode]} | {ratios[mode]}× |" for mode in MODES]
    lines += ["", "collections in default mode:", "", "| generation | count | each | per chunk |", "|---|---|---|---|"]
    lines += [f"| {c['generation']} | {c['count']} | {c['each_us']} µs | {c['us_per_chunk']} µs |"
              for c in report["default_collections"]]
    return "\n".join([*lines, "", provenance_text(report)])
