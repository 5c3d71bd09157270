"""``python -m bench chunks``: per-request chunk streams through the adapter, vs memcpy.

The sender is a :class:`~omni_async.service.ConnectorService` in this process with a
:class:`~omni_async.adapter.TransferAdapter`; the receiver is another service in a child
(:mod:`bench.chunk_peer`) that streams every request and checks every chunk.  Rows:

* ``chunk_a``: one chunk per request, saved one at a time: latency of ``await adapter.save``
  (it resolves on the receiver's acknowledgement), p50/p99;
* ``chunk_stream``: many requests at once, each a stream of chunks (the demo's shape): GB/s of
  array bytes from the first save to the last acknowledgement, one sample per batch.

* ``chunk_8k``, ``chunk_256k``: the issue's shapes, 64 requests at once.
* ``notice_rt``: a block write with a notice, echoed: this side writes one 4 KiB block with
  ``notice=``, the receiver's notice sink writes it back with the same notice, and the sample
  ends when this side's sink has the echo (two notices, p50/p99).  Its pyzmq column is the
  baseline's one-small-message round trip (``chunk_a``'s shape); memcpy copies one block.

Both also with ``UCX_TLS=tcp`` (suffix ``_tcp``).  The limit is numpy copying the same arrays
in this process.  Beside each row, in the same run, the pyzmq + msgspec baseline
(:mod:`bench.zmq_baseline`) moves the same chunks, in rounds that alternate with ours
(:data:`ROUNDS`: a slow phase of a noisy machine falls on both); ``ratios[row]["vs_zmq"]`` is
omni_async's chunks/s over the baseline's (for ``chunk_a``: the baseline's p50 latency over ours).  NIXL has
no message API, so it has no column here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from omni_async.config import ServiceConfig, load_config
from omni_async.service import ConnectorService
from omni_async.transport.notices import Notice

from .chunk_data import chunk_nbytes, make_chunk
from .hostload import CpuMeter, ForeignLoad
from .modes import SHM, TCP, Mode
from .procs import Children
from .progress import Progress, advance, steps
from .provenance import provenance_text, stamp
from .report import CPU_TABLE_HEAD, speed_ratio, verdict_lines, verdicts
from .stats import summarize
from .zmq_baseline import ZmqBaseline

STAGE = "bench-chunks"
TARGETS = (
    ("chunk_8k", "vs_zmq", 3.0, "chunk_8k ≥ 3× the pyzmq baseline's chunks/s"),
    ("chunk_256k", "vs_zmq", 3.0, "chunk_256k ≥ 3× the pyzmq baseline's chunks/s"),
    ("chunk_a", "vs_zmq", 2.0, "chunk_a ≤ 0.5× the pyzmq baseline's latency (ratio ≥ 2)"),
)
"""(row, ratio, threshold, description): issue 9's targets for ``chunks``."""


NOTICE_RT = "notice_rt"
BLOCK_LEN = 4096
"""Bytes of the one block of the services' regions (what ``notice_rt`` writes)."""


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
        if self.name == NOTICE_RT:
            return f"1 block of {BLOCK_LEN // 1024} KiB with a notice, echoed back with one"
        size = chunk_nbytes(self.tokens) / 1024
        if self.kind == "latency":
            return f"1 chunk of {size:.1f} KiB per save"
        return f"{self.requests} requests × {self.chunks} chunks of {size:.1f} KiB"


def notice_workload(quick: bool) -> ChunkWorkload:
    return ChunkWorkload(NOTICE_RT, "latency", 1, 1, 16, 30 if quick else 500)


def chunk_workloads(quick: bool) -> list[ChunkWorkload]:
    return [
        ChunkWorkload("chunk_a", "latency", 1, 1, 16, 30 if quick else 500),
        ChunkWorkload("chunk_stream", "throughput", 16, 32, 16, 1 if quick else 5),
        # The shapes: 64 requests x 100 chunks of ~8 KiB, and of ~256 KiB (fewer chunks:
        # the sender keeps every chunk of a batch in memory).
        ChunkWorkload("chunk_8k", "throughput", 64, 100 if not quick else 4, 5, 1 if quick else 5),
        ChunkWorkload("chunk_256k", "throughput", 64, 8 if not quick else 2, 144, 1 if quick else 5),
    ]


def _service_config(mode: Mode, peer_id: str) -> ServiceConfig:
    return load_config(
        {"agent": mode.omni_config(peer_id), "region": {"num_blocks": 1, "block_len": BLOCK_LEN}},
        schema=ServiceConfig, environ={},
    )


class _Sender:
    """The sending service, connected to one receiver child, running numbered plans."""

    def __init__(self, svc: ConnectorService, receiver: str, receiver_pid: int) -> None:
        self.svc = svc
        self.receiver = receiver
        self.meter = CpuMeter(receiver_pid)
        """CPU of both sides during the timed batches of throughput rows."""
        self.adapter = svc.adapter(STAGE, peer_id=receiver)
        self.plans = 0
        self.echoes: asyncio.Queue[Notice] = asyncio.Queue()
        svc.agent.set_notice_sink(self.echoes.put_nowait)

    async def notice_round_trips(self, iters: int) -> list[int]:
        """Time ``iters`` writes with a notice until the receiver's echo is here; check each."""
        clock, samples = time.perf_counter_ns, []
        region = self.svc.agent.region.array
        for i in range(iters):
            region[0] = i % 251
            tag = b"%d" % i
            t0 = clock()
            write = self.svc.agent.write_blocks(self.receiver, [0], [0], notice=tag)
            echo = await asyncio.wait_for(self.echoes.get(), 10)
            samples.append(clock() - t0)
            await write
            if echo.data != tag or echo.failed is not None or echo.remote_idxs != (0,):
                raise ChunkVerificationError(f"notice echo {i}: {echo}")
        return samples

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
                with self.meter.measure():
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


def _time_block_copy(iters: int) -> list[int]:
    """Copy one block (``notice_rt``'s payload) ``iters`` times."""
    src, dst = np.ones(BLOCK_LEN, np.uint8), np.empty(BLOCK_LEN, np.uint8)
    clock, samples = time.perf_counter_ns, []
    for _ in range(iters):
        t0 = clock()
        np.copyto(dst, src)
        samples.append(clock() - t0)
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


async def _time_zmq(zmq: ZmqBaseline, w: ChunkWorkload) -> list[int]:
    """The baseline on workload ``w``, every chunk checked by the receiver."""
    samples, stats = await zmq.run(w.kind, w.requests, w.chunks, w.tokens, w.iters)
    expected = (w.iters if w.kind == "latency" else w.requests * w.iters) * w.chunks
    if stats.bad or stats.chunks != expected:
        raise ChunkVerificationError(f"zmq baseline {w.name}: receiver got {stats.chunks} chunks, {stats.bad} bad")
    return samples


ROUNDS = 5
"""Rounds a workload's samples are taken in, ours and the baseline's alternating (a throughput
workload's batches one per round, at most; a latency workload's saves in equal parts), so a slow
phase of the machine falls on both contenders rather than on one."""


def _rounds(w: ChunkWorkload) -> list[ChunkWorkload]:
    """``w`` cut into the rounds its samples are taken in (their iterations add up to ``w.iters``)."""
    count = min(ROUNDS, w.iters)
    return [dataclasses.replace(w, iters=w.iters // count + (i < w.iters % count)) for i in range(count)]


async def _interleaved(
    ours: Callable[[ChunkWorkload], Awaitable[list[int]]], baseline: ZmqBaseline | None, w: ChunkWorkload,
    meters: tuple[CpuMeter, ...] = (),
) -> tuple[list[int], list[int] | None]:
    """Samples of ``ours`` and of the baseline on ``w``, each after a warm-up of a tenth of its
    iterations, in alternating rounds (see :data:`ROUNDS`); ``meters`` are reset after the warm-up."""
    warm = dataclasses.replace(w, iters=max(1, w.iters // 10))
    await ours(warm)
    if baseline is not None:
        await _time_zmq(baseline, warm)
    for meter in meters:
        meter.reset()
    samples: list[int] = []
    zmq_samples: list[int] = []
    for part in _rounds(w):
        samples += await ours(part)
        if baseline is not None:
            zmq_samples += await _time_zmq(baseline, part)
    return samples, zmq_samples if baseline is not None else None


def _cpu_per_chunk(
    w: ChunkWorkload, samples: list[int], zmq_samples: list[int] | None, meters: tuple[CpuMeter, ...]
) -> dict[str, dict[str, float]] | None:
    """A throughput row's CPU per chunk on each side during the timed batches (``sender_us``:
    this process, ``receiver_us``: the child), ours and the baseline's; None for latency rows."""
    if w.kind != "throughput":
        return None
    per_batch = w.requests * w.chunks
    cpu = {"omni_async": meters[0].per(len(samples) * per_batch)}
    if zmq_samples:
        cpu["zmq"] = meters[1].per(len(zmq_samples) * per_batch)
    return cpu


def _chunks_per_s(w: ChunkWorkload, samples: list[int]) -> float:
    return round(w.nbytes / chunk_nbytes(w.tokens) / (float(np.median(samples)) / 1e9), 1)


async def run_chunks(
    quick: bool = False, modes: tuple[str, ...] = ("shm", "tcp"), zmq: bool = True, progress: bool = True
) -> dict[str, Any]:
    """Run every chunk workload in every mode, each beside the pyzmq baseline (unless ``zmq`` is
    false); return summaries and ratios.  ``progress``: a bar on stderr if it is a terminal."""
    results: dict[str, Any] = {}
    load = ForeignLoad()
    plan = [m for m in (SHM, TCP) if m.name in modes]
    baseline = ZmqBaseline() if zmq else None
    async with Children() as zmq_children:
        try:
            if baseline is not None:
                await baseline.start(zmq_children)
            with steps("bench chunks", len(plan) * (len(chunk_workloads(quick)) + 1), show=progress) as bar:
                for mode in plan:
                    await _run_mode(mode, quick, baseline, results, bar)
        finally:
            if baseline is not None:
                await baseline.close()
    ratios = {
        row: {"vs_nixl": None, "vs_memcpy": speed_ratio(r["kind"], r["omni_async"], r["memcpy"]),
              "vs_zmq": speed_ratio(r["kind"], r["omni_async"], r["zmq"])}
        for row, r in results.items()
    }
    report = stamp()
    report["host"]["load"] = load.stop()
    return {**report, "results": results, "ratios": ratios, "targets": verdicts(ratios, TARGETS),
            "zmq": {"available": baseline is not None, "what": "pyzmq DEALER/ROUTER over tcp://127.0.0.1, msgspec "
                    "header + numpy frames (copy=False), one ack per chunk, each stream waits for its ack, uvloop"},
            "nixl": {"available": False, "reason": "NIXL has no message API: no chunk-stream counterpart"}}


async def _run_mode(
    mode: Mode, quick: bool, baseline: ZmqBaseline | None, results: dict[str, Any], bar: Progress | None
) -> None:
    """Every chunk workload in ``mode`` (one receiving child), each followed by the baseline."""
    async with Children() as children:
        config = _service_config(mode, f"chunk-recv-{mode.name}")
        child = await children.start("bench.chunk_peer", [json.dumps(msgspec.to_builtins(config)), STAGE])
        async with ConnectorService(_service_config(mode, f"chunk-send-{mode.name}")) as svc:
            sender = _Sender(svc, await svc.agent.connect(child.ready["address"]), child.pid)
            for w in chunk_workloads(quick):
                meters = (sender.meter,) if baseline is None else (sender.meter, baseline.meter)
                samples, zmq_samples = await _interleaved(sender.run, baseline, w, meters)
                memcpy = _time_memcpy(w, max(len(samples), 50))
                results[w.name + mode.suffix] = {
                    "workload": w.describe(), "mode": mode.name, "kind": w.kind, "bytes": w.nbytes,
                    "memcpy": summarize(w.nbytes, memcpy), "omni_async": summarize(w.nbytes, samples),
                    "zmq": summarize(w.nbytes, zmq_samples) if zmq_samples else None, "nixl": None,
                    "chunks_per_s": _chunks_per_s(w, samples),
                    "zmq_chunks_per_s": _chunks_per_s(w, zmq_samples) if zmq_samples else None,
                    "cpu_us_per_chunk": _cpu_per_chunk(w, samples, zmq_samples, meters),
                }
                advance(bar, f"{w.name} {mode.name}")
            w = notice_workload(quick)
            samples, zmq_samples = await _interleaved(lambda part: sender.notice_round_trips(part.iters), baseline, w)
            results[w.name + mode.suffix] = {
                "workload": w.describe(), "mode": mode.name, "kind": w.kind, "bytes": BLOCK_LEN,
                "memcpy": summarize(BLOCK_LEN, _time_block_copy(max(len(samples), 50))),
                "omni_async": summarize(BLOCK_LEN, samples),
                "zmq": summarize(BLOCK_LEN, zmq_samples) if zmq_samples else None, "nixl": None,
                "chunks_per_s": _chunks_per_s(w, samples),
                "zmq_chunks_per_s": _chunks_per_s(w, zmq_samples) if zmq_samples else None,
                "cpu_us_per_chunk": None,
            }
            advance(bar, f"{w.name} {mode.name}")


def _cell(kind: str, s: dict[str, float] | None) -> str:
    if s is None:
        return "n/a"
    return f"{s['p50_us']:.1f}/{s['p99_us']:.1f} µs" if kind == "latency" else f"{s['gbps']:.3f} GB/s"


def table(report: dict[str, Any]) -> str:
    """The chunk results as a Markdown table, with the run's provenance."""
    head = ["row", "workload", "memcpy", "omni_async", "pyzmq", "chunks/s", "pyzmq chunks/s", "vs memcpy", "vs pyzmq"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r in report["results"].items():
        ratio = report["ratios"][row]
        zmq_rate, vs_zmq = r["zmq_chunks_per_s"], ratio["vs_zmq"]
        cells = [row, r["workload"], _cell(r["kind"], r["memcpy"]), _cell(r["kind"], r["omni_async"]),
                 _cell(r["kind"], r["zmq"]), f"{r['chunks_per_s']:.0f}",
                 "n/a" if zmq_rate is None else f"{zmq_rate:.0f}", f"{ratio['vs_memcpy']:.3f}×",
                 "n/a" if vs_zmq is None else f"{vs_zmq:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "CPU per chunk during the timed batches (µs; sender: this process, receiver: the child):", "",
              *CPU_TABLE_HEAD]
    for row, r in report["results"].items():
        cpu = r["cpu_us_per_chunk"]
        if cpu is not None:
            cells = [f"{cpu[who][side]:.0f}" if who in cpu else "n/a"
                     for who in ("omni_async", "zmq") for side in ("sender_us", "receiver_us")]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"pyzmq: {report['zmq']['what']}" if report["zmq"]["available"] else "pyzmq baseline: not run")
    lines.append("vs pyzmq: chunks/s over the baseline's (latency rows: its p50 over ours); > 1: omni_async faster")
    lines.append(f"NIXL: {report['nixl']['reason']}")
    lines.append(provenance_text(report))
    lines.append("")
    lines += verdict_lines(report["targets"])
    return "\n".join(lines)
