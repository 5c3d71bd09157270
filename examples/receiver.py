"""Demo receiver: serves a KV region, streams every request's chunks and verifies every byte.

    python examples/receiver.py [--port 0]

Prints ``{"address": ...}`` as its first line, then one summary line; exits 0 only if every
chunk and every block matched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np
import workload as wl

from omni_async.config import ServiceConfig, load_config
from omni_async.eventloop import run
from omni_async.service import ConnectorService


async def main(port: int) -> int:
    config = load_config(
        {
            "agent": {"peer_id": "talker", "port": port},
            "region": {"num_blocks": wl.NUM_BLOCKS, "block_len": wl.BLOCK_LEN},
        },
        schema=ServiceConfig,
    )
    async with ConnectorService(config) as svc:
        print(json.dumps({"address": svc.control_address}), flush=True)
        sender = await svc.agent.wait_for_peer(timeout=60)
        adapter = svc.adapter(wl.STAGE, source=sender)
        manifest = await svc.connector.get("demo:manifest", timeout=60, source=sender)
        latencies: list[float] = []
        started = time.perf_counter()

        async def consume(request: int) -> tuple[int, int, int]:
            chunks = bad = nbytes = 0
            async for chunk in adapter.stream(f"req-{request}"):
                latencies.append(time.time() - chunk.data["sent_at"])
                want = wl.make_chunk(request, chunk.index)
                bad += not wl.same_chunk(chunk.data, want)
                chunks += 1
                nbytes += chunk.data["hidden"].nbytes + chunk.data["codes"].nbytes
            return chunks, bad, nbytes

        results = await asyncio.gather(*(consume(r) for r in range(manifest["requests"])))
        elapsed = time.perf_counter() - started
        blocks = await svc.connector.get("demo:blocks", timeout=60, source=sender)
        remote = blocks["remote"]
        bad_blocks = sum(
            not np.array_equal(svc.region.array[dst], wl.block_pattern(src))
            for src, dst in zip(blocks["local"], remote, strict=True)
        )
        untouched = sorted(set(range(wl.NUM_BLOCKS)) - set(remote))
        bad_blocks += int(svc.region.array[untouched].any())
        chunks = sum(r[0] for r in results)
        bad_chunks = sum(r[1] for r in results)
        chunk_bytes = sum(r[2] for r in results)
        lat = np.array(latencies) * 1e6
        summary = {
            "requests": len(results),
            "chunks": chunks,
            "chunks_expected": manifest["requests"] * manifest["chunks"],
            "bad_chunks": bad_chunks,
            "blocks": len(remote),
            "bad_blocks": bad_blocks,
            "bytes": chunk_bytes + len(remote) * wl.BLOCK_LEN,
            "chunk_MBps": round(chunk_bytes / elapsed / 1e6, 1),
            "chunks_per_s": round(chunks / elapsed),
            "block_GBps": blocks["gbps"],
            "latency_p50_us": round(float(np.percentile(lat, 50)), 1),
            "latency_p99_us": round(float(np.percentile(lat, 99)), 1),
        }
        ok = bad_chunks == 0 and bad_blocks == 0 and chunks == summary["chunks_expected"]
        summary["ok"] = ok
        print(json.dumps(summary), flush=True)
        return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="control-plane port (0: any free port)")
    sys.exit(run(main(parser.parse_args().port)))
