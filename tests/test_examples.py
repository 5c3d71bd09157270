"""The example pair, end to end, exactly as `make demo` runs it."""

import asyncio
import json
import subprocess
import sys

import pytest

from omni_async import workload

from .conftest import ROOT


@pytest.mark.timeout(150)
def test_demo_pair_verifies_everything():
    result = subprocess.run([sys.executable, "examples/demo.py"], cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert "2048/2048 chunks (0 bad)" in summary and "192 blocks (0 bad)" in summary and summary.endswith("OK")


async def test_the_example_receiver_fails_a_corrupted_chunk(make_service):
    """The receiver checks every byte against the announced plan: one flipped byte fails the run."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "examples/receiver.py", cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(60):
            address = json.loads(await proc.stdout.readline())["address"]
            tx = await make_service("thinker", region={"num_blocks": 1, "block_len": 64 * 1024})
            receiver = await tx.agent.connect(address)
            plan = workload.Plan(stage="thinker-talker", requests=2, chunks=3, sizes=(4096,))
            await workload.announce(tx, receiver, plan, 0)
            adapter = tx.adapter(plan.stage, peer_id=receiver)
            for r in range(plan.requests):
                for i in range(plan.chunks):
                    chunk = workload.make_chunk(plan, r, i)
                    if (r, i) == (1, 1):
                        chunk["data"] = chunk["data"].copy()
                        chunk["data"][100] ^= 0xFF
                    await adapter.save(plan.request_id(r), chunk, final=i == plan.chunks - 1)
            await tx.connector.put(receiver, "demo:blocks", {"remote": [], "crcs": []})
            out = await proc.stdout.read()
            assert await proc.wait() == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    report = json.loads(out.splitlines()[-1])
    assert not report["ok"] and (report["ok_chunks"], report["corrupted"], report["missing"]) == (5, 1, 0)
