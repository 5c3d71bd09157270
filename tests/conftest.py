"""Shared fixtures: agents that are always closed, and a check that nothing is left running."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from omni_async import Agent, AgentConfig, BlockRegion

# `make test` runs a modest number of generated cases; `make fuzz` sets HYPOTHESIS_PROFILE=fuzz.
settings.register_profile("default", max_examples=200, deadline=None)
settings.register_profile(
    "fuzz", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Loopback only; keep UCX on the lo interface in every test process.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

FAST = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "handshake_timeout": 5.0, "ucx_net_devices": "lo"}
"""Timings that keep liveness tests short."""


def fast_config(**overrides: Any) -> AgentConfig:
    return AgentConfig(**{**FAST, **overrides})


def leftover_tasks() -> list[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not current and not t.done()]


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """Python's own SIGINT handler (``KeyboardInterrupt``) for the test, the one before restored
    after it: a process started with SIGINT ignored (a shell's background job, ``nohup``) keeps
    it ignored, and a test of what Ctrl-C does would see nothing happen."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
async def owned() -> AsyncIterator[list[Any]]:
    """A list to put started agents/services in: each is closed at teardown, which then fails
    the test if any task is still pending or the loop saw an error."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    objects: list[Any] = []
    yield objects
    for obj in objects:
        await asyncio.wait_for(obj.close(), 15)
    await asyncio.sleep(0)
    await grpc_calls_ended()
    assert leftover_tasks() == []
    assert errors == [], errors


async def grpc_calls_ended(seconds: float = 5.0) -> None:
    """Wait (at most ``seconds``) for the tasks grpc.aio runs per call to end: a closed etcd
    client's channel cancels its calls, and their status tasks end a few loop turns later (a
    loaded run saw one still pending right after a discovery closed).  Nothing of ours is
    waited for here: any other task left must be gone already."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(
        getattr(task.get_coro(), "__qualname__", "").startswith("_AioCall.") for task in leftover_tasks()
    ):
        await asyncio.sleep(0.01)


@pytest.fixture
def make_agent(owned: list[Any]) -> Callable[..., Any]:
    """``await make_agent(num_blocks, block_len, **config)``: a started agent closed at teardown.

    Fault injection: with ``claimed_blocks`` the agent tells peers its region has that many blocks.
    """

    async def factory(num_blocks: int = 64, block_len: int = 4096, *, claimed_blocks: int | None = None,
                      **config: Any) -> Agent:
        agent = Agent(BlockRegion.allocate(num_blocks, block_len), fast_config(**config))
        if claimed_blocks is not None:
            agent.identity = dataclasses.replace(agent.identity, num_blocks=claimed_blocks)
        owned.append(agent)
        return await agent.start()

    return factory


@pytest.fixture
def make_service(owned: list[Any]) -> Callable[..., Any]:
    """``await make_service(peer_id, **sections)``: a started ConnectorService closed at teardown."""
    from omni_async.config import ServiceConfig, load_config
    from omni_async.service import ConnectorService

    async def factory(peer_id: str, *, agent: dict[str, Any] | None = None, **sections: Any) -> ConnectorService:
        data = {"agent": {**FAST, "peer_id": peer_id, **(agent or {})},
                "region": {"num_blocks": 32, "block_len": 4096}, **sections}
        service = ConnectorService(load_config(data, environ={}, schema=ServiceConfig))
        owned.append(service)
        return await service.start()

    return factory


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PeerProcess:
    """A ``tests.helpers.peer`` child process; ``info`` is the first JSON line it printed."""

    def __init__(self, proc: asyncio.subprocess.Process, info: dict[str, Any]) -> None:
        self.proc = proc
        self.info = info

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    async def stop(self) -> int:
        """Close its stdin (orderly stop) and wait for it; kill it after 10 s."""
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return self.proc.returncode or 0


@pytest.fixture
async def spawn_peer() -> AsyncIterator[Callable[..., Any]]:
    """``await spawn_peer(role, region_path, num_blocks, block_len, config, *extra)``."""
    import json
    import sys

    procs: list[PeerProcess] = []

    async def factory(role: str, path: str, num_blocks: int, block_len: int,
                      config: dict[str, Any], *extra: str) -> PeerProcess:
        with open(path, "ab") as f:
            f.truncate(num_blocks * block_len)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.helpers.peer", role, path, str(num_blocks), str(block_len),
            json.dumps({**FAST, **config}), *extra,
            cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
        except TimeoutError:
            proc.kill()
            raise
        if not line:
            await proc.wait()
            raise RuntimeError(f"peer process exited with {proc.returncode} before it was ready")
        peer = PeerProcess(proc, json.loads(line))
        procs.append(peer)
        return peer

    yield factory
    for peer in procs:
        peer.kill()
        await asyncio.wait_for(peer.proc.wait(), 10)
