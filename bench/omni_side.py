"""The omni_async contender: sender agents in the bench process, receivers in a child.

:class:`OmniSide` starts one child (``bench.omni_peer serve``) hosting one receiving agent per
(mode, geometry) over a region the agent allocates (a memfd, as a service's is; this process maps
it to check the bytes), and one sending agent per (mode, geometry) here, over the source file,
each connected to its counterpart.  :meth:`OmniSide.time_writes` awaits
``agent.write_blocks`` in a loop, one transfer in flight; a transfer settles on the
receiver's acknowledgement, so the bytes are in place when the await returns.
"""

from __future__ import annotations

import contextlib
import json
import time

import msgspec
import numpy as np
import numpy.typing as npt

from omni_async import Agent, AgentConfig, BlockRegion, load_config
from omni_async.transport.shared import MappedRegion
from omni_async.wire import RegionShare

from .modes import Mode
from .procs import Children
from .shm import ShmFile
from .workloads import Geometry


class OmniSide:
    """Connected sender/receiver agent pairs, keyed by (mode name, geometry name)."""

    def __init__(self) -> None:
        self._senders: dict[tuple[str, str], tuple[Agent, str]] = {}
        self._destinations: dict[tuple[str, str], MappedRegion] = {}
        self._stack = contextlib.AsyncExitStack()
        self.config: dict[str, dict[str, object]] = {}

    async def start(
        self, children: Children, src: ShmFile, modes: list[Mode], geometries: list[Geometry]
    ) -> OmniSide:
        """Spawn the receiver child and connect one sender per (mode, geometry)."""
        pairs = [(m, g) for m in modes for g in geometries]
        spec = [
            {
                "path": None,
                "num_blocks": g.num_blocks,
                "block_len": g.block_len,
                "config": m.omni_config(f"recv-{m.name}-{g.name}"),
            }
            for m, g in pairs
        ]
        receiver = await children.start("bench.omni_peer", ["serve", json.dumps(spec)])
        try:
            ready = receiver.ready
            for (mode, geometry), address, share in zip(pairs, ready["addresses"], ready["shares"], strict=True):
                region_share = msgspec.convert(share, RegionShare)
                self._destinations[mode.name, geometry.name] = MappedRegion(
                    region_share, geometry.num_blocks, geometry.block_len
                )
                config: AgentConfig = load_config(mode.omni_config(f"send-{mode.name}-{geometry.name}"), environ={})
                self.config[mode.name] = {"ucx_tls": config.ucx_tls, "ucx_net_devices": config.ucx_net_devices}
                region = BlockRegion.wrap(src.rows(geometry.block_len))
                agent = await self._stack.enter_async_context(Agent(region, config))
                peer = await agent.connect(address)
                self._senders[mode.name, geometry.name] = (agent, peer)
        except BaseException:
            await self.close()
            raise
        return self

    def destination(self, mode: Mode, geometry: Geometry) -> npt.NDArray[np.uint8]:
        """The receiving agent's region for (mode, geometry), mapped here to reset and check it."""
        return self._destinations[mode.name, geometry.name].rows

    async def time_writes(
        self, mode: Mode, geometry: Geometry, local: list[int], remote: list[int], iters: int, warmup: int
    ) -> list[int]:
        """Nanoseconds of each of ``iters`` awaited ``write_blocks(local -> remote)``."""
        agent, peer = self._senders[mode.name, geometry.name]
        clock = time.perf_counter_ns
        samples: list[int] = []
        for i in range(warmup + iters):
            t0 = clock()
            await agent.write_blocks(peer, local, remote)
            t1 = clock()
            if i >= warmup:
                samples.append(t1 - t0)
        return samples

    async def close(self) -> None:
        """Close every sender agent (the receiver child is stopped by its :class:`Children`)."""
        self._senders.clear()
        await self._stack.aclose()
        for mapped in self._destinations.values():
            mapped.close()
        self._destinations.clear()
