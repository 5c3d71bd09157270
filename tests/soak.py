"""Soak: many chunk streams and block writes with receiver restarts; nothing lost, duplicated,
reordered or corrupted, and no growth in fds, tasks or memory.  ``make soak`` runs it.

    python -m tests.soak [--requests 1000] [--chunks 100] [--restarts 5] [--concurrency 64]

A request counts as delivered when the receiver verified its whole stream and told the sender
so.  One interrupted by a restart (a save fails, or the confirmation never comes) is sent
again, whole, under a new attempt number.  Every chunk the receiver sees must be in order and
byte-exact, no attempt may be delivered twice, and every request must end delivered.  Exits 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
from typing import Any

import numpy as np

from omni_async import OmniAsyncError
from omni_async.config import ServiceConfig, load_config
from omni_async.eventloop import run
from omni_async.service import ConnectorService

STAGE = "soak"
NUM_BLOCKS, BLOCK_LEN = 128, 16 * 1024
FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "ucx_net_devices": "lo"}


def chunk(request: int, attempt: int, index: int) -> dict[str, Any]:
    rng = np.random.default_rng((request * 1000 + attempt) * 1000 + index)
    size = int(rng.integers(1, 16_384))
    return {"x": rng.integers(0, 2**31, size, dtype=np.int32), "r": request, "a": attempt, "i": index}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def footprint() -> dict[str, float]:
    return {"fds": len(os.listdir("/proc/self/fd")), "tasks": len(asyncio.all_tasks()), "rss_mb": rss_mb()}


def service(peer_id: str) -> ConnectorService:
    return ConnectorService(load_config(
        {"agent": {**FAST, "peer_id": peer_id}, "region": {"num_blocks": NUM_BLOCKS, "block_len": BLOCK_LEN},
         "adapter": {"stall_timeout": 10.0}},
        environ={}, schema=ServiceConfig,
    ))


class Receiver:
    """One receiver incarnation: consumes announced requests and checks every chunk."""

    def __init__(self, svc: ConnectorService, ledger: dict[tuple[int, int], int], errors: list[str]) -> None:
        self.svc = svc
        self.ledger = ledger  # (request, attempt) -> chunks verified
        self.errors = errors
        self.adapter = svc.adapter(STAGE, source="tx")
        self.tasks: set[asyncio.Task[None]] = set()

    def consume(self, request: int, attempt: int, chunks: int) -> None:
        task = asyncio.get_running_loop().create_task(self._consume(request, attempt, chunks), name=f"soak-rx-{request}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _consume(self, request: int, attempt: int, chunks: int) -> None:
        key = (request, attempt)
        expected = 0
        try:
            async for got in self.adapter.stream(f"r{request}a{attempt}"):
                want = chunk(request, attempt, expected)
                if got.index != expected or got.data["i"] != expected:
                    self.errors.append(f"{key}: chunk {got.index} arrived where {expected} was due")
                elif not np.array_equal(got.data["x"], want["x"]) or got.data["r"] != request:
                    self.errors.append(f"{key}: chunk {expected} corrupted")
                expected += 1
            if expected != chunks:
                self.errors.append(f"{key}: stream ended after {expected} of {chunks} chunks")
            if key in self.ledger:
                self.errors.append(f"{key}: delivered twice")
            self.ledger[key] = expected
            await self.svc.connector.put("tx", f"done:{request}:{attempt}", {"n": expected})
        except OmniAsyncError:
            pass  # this attempt was interrupted by a restart; the sender retries it

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.svc.close()


async def soak(requests: int, chunks: int, restarts: int, concurrency: int) -> int:
    errors: list[str] = []
    ledger: dict[tuple[int, int], int] = {}
    sent_ok: set[tuple[int, int]] = set()
    blocks_ok = blocks_failed = retries = 0
    tx = await service("tx").start()
    rng = np.random.default_rng(1)
    tx.region.array[:] = rng.integers(0, 256, tx.region.array.shape, dtype=np.uint8)

    async def new_receiver() -> Receiver:
        svc = await service("rx").start()
        await tx.agent.connect(svc.control_address)
        return Receiver(svc, ledger, errors)

    rx = await new_receiver()
    sender = tx.adapter(STAGE, peer_id="rx")
    baseline: dict[str, float] | None = None
    restart_points = sorted(random.Random(2).sample(range(1, requests), min(restarts, requests - 1)))
    slots = asyncio.Semaphore(concurrency)
    started = time.perf_counter()
    done_requests = 0

    async def send_request(request: int) -> None:
        nonlocal retries, done_requests
        attempt = 0
        async with slots:
            while True:
                receiver = rx
                receiver.consume(request, attempt, chunks)
                futures = [sender.save_async(f"r{request}a{attempt}", chunk(request, attempt, i), final=i == chunks - 1)
                           for i in range(chunks)]
                results = await asyncio.gather(*futures, return_exceptions=True)
                if not any(isinstance(r, BaseException) for r in results):
                    try:  # end to end: the receiver verified the whole stream
                        await tx.connector.get(f"done:{request}:{attempt}", source="rx", timeout=30)
                    except OmniAsyncError:
                        pass
                    else:
                        sent_ok.add((request, attempt))
                        done_requests += 1
                        return
                retries += 1
                attempt += 1
                while rx is receiver:  # wait for the restart to finish before retrying
                    await asyncio.sleep(0.05)

    async def write_blocks() -> None:
        nonlocal blocks_ok, blocks_failed
        pick = random.Random(3)
        while True:
            local = pick.sample(range(NUM_BLOCKS), 16)
            remote = pick.sample(range(NUM_BLOCKS), 16)
            receiver = rx
            try:
                await tx.agent.write_blocks("rx", local, remote)
            except OmniAsyncError:
                blocks_failed += 1
                await asyncio.sleep(0.05)
                continue
            if receiver is rx and not np.array_equal(receiver.svc.region.array[remote], tx.region.array[local]):
                errors.append(f"blocks {local}->{remote} corrupted")
            blocks_ok += 1
            await asyncio.sleep(0.002)  # pace the writer so chunk streams get their share

    writer = asyncio.get_running_loop().create_task(write_blocks(), name="soak-blocks")
    senders = [asyncio.get_running_loop().create_task(send_request(r), name=f"soak-tx-{r}") for r in range(requests)]
    next_restart = 0
    while done_requests < requests:
        await asyncio.sleep(0.1)
        if baseline is None and done_requests >= min(50, requests // 4):
            baseline = footprint()
        if next_restart < len(restart_points) and done_requests >= restart_points[next_restart]:
            next_restart += 1
            old = rx
            await old.close()
            rx = await new_receiver()
            print(json.dumps({"restart": next_restart, "done": done_requests}), flush=True)
    await asyncio.gather(*senders)
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)
    for _ in range(50):  # let the last streams finish verifying
        if all(key in ledger for key in sent_ok):
            break
        await asyncio.sleep(0.1)
    elapsed = time.perf_counter() - started
    end = footprint()
    await rx.close()
    await tx.close()

    delivered = {request for request, _ in sent_ok}
    errors += [f"request {r} never delivered" for r in range(requests) if r not in delivered]
    errors += [f"{key}: {n} of {chunks} chunks" for key, n in ledger.items() if n != chunks]
    growth = {k: round(end[k] - baseline[k], 1) for k in end} if baseline else {}
    limits = {"fds": 32, "tasks": 16, "rss_mb": 300}
    errors += [f"{k} grew by {growth[k]} (limit {limits[k]})" for k in limits if growth.get(k, 0) > limits[k]]
    summary = {
        "requests": requests, "chunks_per_request": chunks, "verified_chunks": sum(ledger.values()),
        "retried_attempts": retries, "restarts": next_restart, "block_writes_ok": blocks_ok,
        "block_writes_failed_by_restart": blocks_failed, "seconds": round(elapsed, 1),
        "chunks_per_s": round(sum(ledger.values()) / elapsed), "growth": growth,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "errors": errors[:20], "ok": not errors,
    }
    print(json.dumps(summary), flush=True)
    return 0 if not errors else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    sys.exit(run(soak(args.requests, args.chunks, args.restarts, args.concurrency)))


if __name__ == "__main__":
    main()
