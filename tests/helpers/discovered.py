"""A discovering agent in its own process, for tests/test_discovery.py.

``python -m tests.helpers.discovered REGION_FILE NUM_BLOCKS BLOCK_LEN INDEX SERVICE_CONFIG_JSON``
runs a ConnectorService whose region is the memory-mapped file (so the test can check what
lands in it) and whose config enables discovery.  It prints ``{"address": ..., "peer_id": ...}``,
then for every peer that joins it writes its block INDEX into the peer's block INDEX and prints
``{"wrote": peer_id, "ok": true}`` (or ``"ok": false, "error": ...``).  It runs until its stdin
closes or it is killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import numpy as np

from omni_async import BlockRegion, PeerEvent, load_config
from omni_async.config import ServiceConfig
from omni_async.eventloop import run
from omni_async.service import ConnectorService


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def main(path: str, num_blocks: int, block_len: int, index: int, config_json: str) -> None:
    region = BlockRegion.wrap(np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_blocks, block_len)))
    config = load_config(json.loads(config_json), environ={}, schema=ServiceConfig)
    async with ConnectorService(config, region=region) as service:
        agent = service.agent
        writes: set[asyncio.Task[None]] = set()

        async def write(peer_id: str) -> None:
            try:
                await asyncio.wait_for(agent.write_blocks(peer_id, [index], [index]), 10)
            except Exception as exc:
                say({"wrote": peer_id, "ok": False, "error": repr(exc)})
            else:
                say({"wrote": peer_id, "ok": True})

        def on_peer(event: PeerEvent) -> None:
            if event.kind == "joined":
                task = asyncio.get_running_loop().create_task(write(event.peer_id))
                writes.add(task)
                task.add_done_callback(writes.discard)

        agent.add_peer_listener(on_peer)
        say({"address": agent.control_address, "peer_id": agent.peer_id})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        for task in writes:
            task.cancel()
        await asyncio.gather(*writes, return_exceptions=True)


if __name__ == "__main__":
    path, num_blocks, block_len, index, config_json = sys.argv[1:6]
    run(main(path, int(num_blocks), int(block_len), int(index), config_json))
