"""The :class:`ConnectorService`: the one object a serving process creates.

It owns, in dependency order, the block region, the :class:`~omni_async.agent.Agent` (control
plane + UCX transport), the connector named by the config, and every adapter made through
:meth:`ConnectorService.adapter`; ``async with`` (or ``await close()``) closes them in reverse.
"""

from __future__ import annotations

from typing import Any

from .adapter import TransferAdapter
from .agent import Agent
from .config import AdapterOptions, ServiceConfig, load_config
from .connector import Connector, create_connector
from .errors import ClosedError
from .region import BlockRegion


class ConnectorService:
    """Region, agent, connector and adapters of one process, built from one config.

    ``region`` may wrap the caller's memory (e.g. a KV cache); by default one is allocated
    from ``config.region``.
    """

    def __init__(
        self, config: ServiceConfig | dict[str, Any] | None = None, *, region: BlockRegion | None = None
    ) -> None:
        if config is None or isinstance(config, dict):
            config = load_config(config, schema=ServiceConfig)
        self.config = config
        self.region = region or BlockRegion.allocate(config.region.num_blocks, config.region.block_len)
        self.agent = Agent(self.region, config.agent)
        self.agent.metrics.streams = self._stream_counts
        self._connector: Connector | None = None
        self._adapters: list[TransferAdapter] = []
        self._closed = False

    async def start(self) -> ConnectorService:
        """Start the agent and build the connector.  Returns self."""
        if self._closed:
            raise ClosedError("service is closed")
        if self._connector is None:
            await self.agent.start()
            try:
                self._connector = create_connector(self.config.connector, self.agent)
            except BaseException:
                await self.agent.close()
                raise
        return self

    async def __aenter__(self) -> ConnectorService:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def connector(self) -> Connector:
        if self._connector is None:
            raise ClosedError("service is not started")
        return self._connector

    @property
    def control_address(self) -> str:
        return self.agent.control_address

    def adapter(
        self,
        stage: str,
        *,
        peer_id: str | None = None,
        source: str | None = None,
        options: AdapterOptions | None = None,
    ) -> TransferAdapter:
        """A chunk-stream adapter for ``stage``, closed with the service (see TransferAdapter)."""
        adapter = TransferAdapter(
            self.connector, stage, peer_id=peer_id, source=source, options=options or self.config.adapter
        )
        self._adapters.append(adapter)
        return adapter

    def _stream_counts(self) -> list[tuple[str, int, int]]:
        """``(stage, active streams, stalls)`` of each adapter, for ``/metrics`` (scrape thread)."""
        return [(adapter.stage, adapter.active_requests, adapter.stalls) for adapter in list(self._adapters)]

    async def close(self) -> None:
        """Close adapters (draining their saves), the connector and the agent.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for adapter in self._adapters:
            await adapter.close()
        if self._connector is not None:
            await self._connector.close()
        await self.agent.close()
