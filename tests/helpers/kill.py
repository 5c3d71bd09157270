"""What a peer's ``kill -9`` must do to the transfers in flight towards it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

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
