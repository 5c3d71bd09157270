"""``python -m bench chunks``: per-request chunk streams through the adapter, vs memcpy.

The sender is a :class:`~omni_async.service.ConnectorService` in this process with a
:class:`~omni_async.adapter.TransferAdapter`; the receiver is another service in a child
(:mod:`bench.chunk_peer`) that streams every request and checks every chunk.  Rows:

* ``chunk_a``: one chunk per request, saved one at a time: latency of ``await adapter.save``
  (it resolves on the receiver's acknowledgement), p50/p99;
* ``chunk_stream``: many requests at once, each a stream of chunks (the demo's shape): GB/s of
  array bytes from the first save to the last acknowledgement, one sample per batch.

Both also with ``UCX_TLS=tcp`` (suffix ``_tcp``).  The limit is numpy copying the same arrays
in this process.  NIXL has no message API, so it has no column here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from omni_async.config import ServiceConfig, load_config
from omni_async.service import ConnectorService

from .chunk_data import chunk_nbytes, make_chunk
from .hostload import ForeignLoad
from .modes import SHM, TCP, Mode
from .procs import Children
from .provenance import stamp
from .stats import speed, summarize

STAGE = "bench-chunks"


class ChunkVerificationError(RuntimeError):
    """The receiver saw a missing or wrong chunk."""


@dataclass(frozen=True, slots=True)
class ChunkWorkload:
    name: str
    kind: Literal["latency", "throughput"]
    requests: int
    chunks: int
    tokens: int
    iters: int
    """Latency: saves timed; throughput: batches timed."""

    @property
    def nbytes(self) -> int:
        """Array bytes of one timed sample."""
        per_sample = 1 if self.kind == "latency" else self.requests * self.chunks
        return per_sample * chunk_nbytes(self.tokens)

    def describe(self) -> str:
        size = chunk_nbytes(self.tokens) / 1024
        if self.kind == "latency":
            return f"1 chunk of {size:.1f} KiB per save"
        return f"{self.requests} requests × {self.chunks} chunks of {size:.1f} KiB"


def chunk_workloads(quick: bool) -> list[ChunkWorkload]:
    return [
        ChunkWorkload("chunk_a", "latency", 1, 1, 16, 30 if quick else 500),
        ChunkWorkload("chunk_stream", "throughput", 16, 32, 16, 1 if quick else 5),
        # The shapes: 64 requests x 100 chunks of ~8 KiB, and of ~256 KiB (fewer chunks:
        # the sender keeps every chunk of a batch in memory).
        ChunkWorkload("chunk_8k", "throughput", 64, 100 if not quick else 4, 5, 1 if quick else 3),
        ChunkWorkload("chunk_256k", "throughput", 64, 8 if not quick else 2, 144, 1 if quick else 3),
    ]


def _service_config(mode: Mode, peer_id: str) -> ServiceConfig:
    return load_config(
        {"agent": mode.omni_config(peer_id), "region": {"num_blocks": 1, "block_len": 4096}},
        schema=ServiceConfig, environ={},
    )


class _Sender:
    """The sending service, connected to one receiver child, running numbered plans."""

    def __init__(self, svc: ConnectorService, receiver: str) -> None:
        self.svc = svc
        self.receiver = receiver
        self.adapter = svc.adapter(STAGE, peer_id=receiver)
        self.plans = 0

    async def run(self, w: ChunkWorkload) -> list[int]:
        n, self.plans = self.plans, self.plans + 1
        requests = w.iters if w.kind == "latency" else w.requests * w.iters
        plan = {"requests": list(range(requests)), "chunks": w.chunks, "tokens": w.tokens}
        await self.svc.connector.put(self.receiver, f"bench:plan:{n}", plan)
        chunks = {(r, i): make_chunk(r, i, w.tokens) for r in range(requests) for i in range(w.chunks)}
        clock, samples = time.perf_counter_ns, []
        if w.kind == "latency":
            for r in range(requests):
                t0 = clock()
                await self.adapter.save(f"r{n}-{r}", chunks[r, 0], final=True)
                samples.append(clock() - t0)
        else:
            for batch in range(w.iters):
                first = batch * w.requests
                t0 = clock()
                await asyncio.gather(*(
                    self.adapter.save_async(f"r{n}-{r}", chunks[r, i], final=i == w.chunks - 1)
                    for r in range(first, first + w.requests) for i in range(w.chunks)
                ))
                samples.append(clock() - t0)
        done = await self.svc.connector.get(f"bench:done:{n}", timeout=60, source=self.receiver)
        if done["bad"] or done["chunks"] != requests * w.chunks:
            raise ChunkVerificationError(f"{w.name}: receiver got {done['chunks']} chunks, {done['bad']} bad")
        return samples


def _time_memcpy(w: ChunkWorkload, iters: int) -> list[int]:
    """Copy the arrays of one sample's chunks into preallocated arrays, ``iters`` times."""
    count = 1 if w.kind == "latency" else w.requests * w.chunks
    src = [make_chunk(0, i, w.tokens) for i in range(count)]
    dst = [{k: np.empty_like(v) for k, v in c.items() if isinstance(v, np.ndarray)} for c in src]
    clock, samples = time.perf_counter_ns, []
    for _ in range(iters):
        t0 = clock()
        for s, d in zip(src, dst, strict=True):
            for key, out in d.items():
                np.copyto(out, s[key])
        samples.append(clock() - t0)
    return samples


async def run_chunks(quick: bool = False, modes: tuple[str, ...] = ("shm", "tcp")) -> dict[str, Any]:
    """Run every chunk workload in every mode; return summaries and ratios."""
    results: dict[str, Any] = {}
    load = ForeignLoad()
    for mode in (m for m in (SHM, TCP) if m.name in modes):
        async with Children() as children:
            config = _service_config(mode, f"chunk-recv-{mode.name}")
            child = await children.start("bench.chunk_peer", [json.dumps(msgspec.to_builtins(config)), STAGE])
            async with ConnectorService(_service_config(mode, f"chunk-send-{mode.name}")) as svc:
                sender = _Sender(svc, await svc.agent.connect(child.ready["address"]))
                for w in chunk_workloads(quick):
                    await sender.run(dataclasses.replace(w, iters=max(1, w.iters // 10)))  # warm-up
                    samples = await sender.run(w)
                    memcpy = _time_memcpy(w, max(len(samples), 50))
                    omni_s = summarize(w.nbytes, samples)
                    memcpy_s = summarize(w.nbytes, memcpy)
                    results[w.name + mode.suffix] = {
                        "workload": w.describe(), "mode": mode.name, "kind": w.kind, "bytes": w.nbytes,
                        "memcpy": memcpy_s, "omni_async": omni_s, "nixl": None,
                        "chunks_per_s": round(w.nbytes / chunk_nbytes(w.tokens) / (np.median(samples) / 1e9), 1),
                    }
    ratios = {
        row: {"vs_nixl": None, "vs_memcpy": round(speed(r["kind"], r["omni_async"]) / speed(r["kind"], r["memcpy"]), 4)}
        for row, r in results.items()
    }
    report = stamp()
    report["host"]["load"] = load.stop()
    return {**report, "results": results, "ratios": ratios,
            "nixl": {"available": False, "reason": "NIXL has no message API: no chunk-stream counterpart"}}


def _cell(kind: str, s: dict[str, float]) -> str:
    return f"{s['p50_us']:.1f}/{s['p99_us']:.1f} µs" if kind == "latency" else f"{s['gbps']:.3f} GB/s"


def table(report: dict[str, Any]) -> str:
    """The chunk results as a Markdown table."""
    head = ["row", "workload", "memcpy", "omni_async", "chunks/s", "vs memcpy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r in report["results"].items():
        cells = [row, r["workload"], _cell(r["kind"], r["memcpy"]), _cell(r["kind"], r["omni_async"]),
                 f"{r['chunks_per_s']:.0f}", f"{report['ratios'][row]['vs_memcpy']:.3f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"NIXL: {report['nixl']['reason']}")
    load = report["host"]["load"]
    lines.append(f"over the {load['wall_s']} s run other processes used {load['foreign_cores']} cores")
    return "\n".join(lines)
