"""Demo sender: streams chunks for many concurrent requests and writes KV blocks.

    python examples/sender.py tcp://127.0.0.1:PORT

Connects to the receiver, writes scattered KV blocks, streams ``REQUESTS × CHUNKS`` chunks (all
requests at once, each in order), then tells the receiver which blocks it wrote.
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


async def main(address: str) -> int:
    config = load_config(
        {"agent": {"peer_id": "thinker"}, "region": {"num_blocks": wl.NUM_BLOCKS, "block_len": wl.BLOCK_LEN}},
        schema=ServiceConfig,
    )
    async with ConnectorService(config) as svc:
        for block in range(wl.NUM_BLOCKS):
            svc.region.array[block] = wl.block_pattern(block)
        receiver = await svc.agent.connect(address)
        await svc.connector.put(receiver, "demo:manifest", {"requests": wl.REQUESTS, "chunks": wl.CHUNKS})
        rng = np.random.default_rng(5)
        local = rng.permutation(wl.NUM_BLOCKS)[:192].tolist()
        remote = rng.permutation(wl.NUM_BLOCKS)[:192].tolist()
        # The first write pays one-time costs (UCX wire-up, first touch of the receiver's pages):
        # time the second, identical one.
        for _ in range(2):
            started = time.perf_counter()
            await asyncio.gather(
                *(svc.agent.write_blocks(receiver, local[i : i + 64], remote[i : i + 64]) for i in range(0, 192, 64))
            )
            block_seconds = time.perf_counter() - started
        gbps = round(192 * wl.BLOCK_LEN / block_seconds / 1e9, 2)
        adapter = svc.adapter(wl.STAGE, peer_id=receiver)

        async def produce(request: int) -> None:
            for index in range(wl.CHUNKS):
                chunk = wl.make_chunk(request, index)
                chunk["sent_at"] = time.time()
                await adapter.save(f"req-{request}", chunk, final=index == wl.CHUNKS - 1)

        started = time.perf_counter()
        await asyncio.gather(*(produce(r) for r in range(wl.REQUESTS)))
        chunk_seconds = time.perf_counter() - started

        await svc.connector.put(receiver, "demo:blocks", {"local": local, "remote": remote, "gbps": gbps})
        print(json.dumps({"sent_chunks": wl.REQUESTS * wl.CHUNKS, "chunk_seconds": round(chunk_seconds, 3),
                          "blocks": len(local), "block_GBps": gbps}), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="the receiver's control address, as it printed it")
    sys.exit(run(main(parser.parse_args().address)))
