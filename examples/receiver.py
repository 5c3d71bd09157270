"""Demo receiver: serves a KV region, takes the sender's chunk plan and verifies every byte.

    python examples/receiver.py [--port 0]

Prints ``{"address": ...}`` as its first line, then one summary line; exits 0 only if every
chunk (checked by omni_async.workload against the plan) and every block matched.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib

import msgspec

from omni_async import workload
from omni_async.config import ServiceConfig, load_config
from omni_async.eventloop import run
from omni_async.service import ConnectorService

NUM_BLOCKS, BLOCK_LEN = 256, 64 * 1024


async def main(port: int) -> int:
    region = {"num_blocks": NUM_BLOCKS, "block_len": BLOCK_LEN}
    config = load_config({"agent": {"peer_id": "talker", "port": port}, "region": region}, schema=ServiceConfig)
    async with ConnectorService(config) as svc:
        print(json.dumps({"address": svc.control_address}), flush=True)
        sender = await svc.agent.wait_for_peer(timeout=60)
        plan = await workload.next_plan(svc, sender, 0, timeout=60)
        summary = await workload.receive(svc.adapter(plan.stage, source=sender), plan)

        blocks = await svc.connector.get("demo:blocks", timeout=60, source=sender)
        written = blocks["remote"]
        bad_blocks = sum(zlib.crc32(svc.region.array[b]) != crc for b, crc in zip(written, blocks["crcs"], strict=True))
        untouched = sorted(set(range(NUM_BLOCKS)) - set(written))
        bad_blocks += int(svc.region.array[untouched].any())  # nothing landed where it was not sent
        ok = summary.ok and bad_blocks == 0
        report = {**msgspec.to_builtins(summary), "blocks": len(written), "bad_blocks": bad_blocks, "ok": ok}
        print(json.dumps(report), flush=True)
        return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="control-plane port (0: any free port)")
    sys.exit(run(main(parser.parse_args().port)))
