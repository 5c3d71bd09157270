"""What a peer's ``kill -9`` must do to the transfers in flight towards it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from omni_async import Agent, PeerLost

from ..conftest import FAST


async def assert_lost_in_time(agent: Agent, transfers: list[Awaitable[None]], killed_at: float) -> None:
    """``transfers`` (to a peer killed at ``killed_at``, ``time.monotonic()``) all settle; at
    least one failed (else the kill came too late to prove anything), every failure is
    :class:`PeerLost`, all within the heartbeat timeout (+ 2 s) of the kill, and ``agent`` has
    no peer left."""
    results = await asyncio.wait_for(asyncio.gather(*transfers, return_exceptions=True), 15)
    elapsed = time.monotonic() - killed_at
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures, "no transfer was in flight at the kill"
    assert all(isinstance(r, PeerLost) for r in failures), {type(r) for r in failures}
    assert elapsed < FAST["heartbeat_timeout"] + 2.0
    assert agent.peers == {}


async def writer_killed_then_serve_another(
    agent: Agent, spawn_peer: Any, tmp_path: Path, num_blocks: int, block_len: int, region_suffix: str
) -> None:
    """A writer process ("tx") writes into ``agent``'s region for a while and is SIGKILLed:
    ``agent`` drops it within the heartbeat timeout (+ 2 s), then connects to a new peer ("o",
    region file ending in ``region_suffix``) and writes one block to it."""
    writer = await spawn_peer("write", str(tmp_path / "w.memfd"), num_blocks, block_len,
                              {"peer_id": "tx"}, agent.control_address)
    assert writer.info == {"connected": agent.peer_id}
    await asyncio.sleep(0.2)  # let it write for a while
    assert agent.stats()["received.blocks.ok"] > 0
    writer.kill()
    killed_at = time.monotonic()
    while "tx" in agent.peers:
        assert time.monotonic() - killed_at < FAST["heartbeat_timeout"] + 2.0
        await asyncio.sleep(0.02)
    await asyncio.wait_for(writer.proc.wait(), 10)
    other = await spawn_peer("serve", str(tmp_path / "o") + region_suffix, num_blocks, block_len, {"peer_id": "o"})
    await asyncio.wait_for(agent.connect(other.info["address"]), 10)
    agent.region.array[5] = 42
    await asyncio.wait_for(agent.write_blocks("o", [5], [6]), 10)


async def writes_through_a_kill(agent: Agent, peer_id: str, kill: Any, blocks: int) -> tuple[list[Awaitable[None]], float]:
    """Start ``blocks``-block writes to ``peer_id`` back to back for up to 0.4 s while a thread
    calls ``kill()`` 0.1 s in (it lands while the loop copies); return the writes and the
    kill's ``time.monotonic()``."""
    everything = list(range(blocks))
    killer = threading.Timer(0.1, kill)
    killer.start()
    transfers: list[Awaitable[None]] = []
    started = time.monotonic()
    while time.monotonic() - started < 0.4 and peer_id in agent.transport.peer_ids:
        transfers.append(agent.write_blocks(peer_id, everything, everything))
        await asyncio.sleep(0)
    killer.join()
    return transfers, started + 0.1
