"""The :class:`ConnectorService`: the one object a serving process creates.

It owns, in dependency order, the block region, the :class:`~omni_async.agent.Agent` (control
plane + UCX transport), the connector named by the config, and every adapter made through
:meth:`ConnectorService.adapter`; ``async with`` (or ``await close()``) closes them in reverse.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Self

from .adapter import TransferAdapter
from .agent import Agent
from .config import AdapterOptions, ServiceConfig, load_config
from .connector import Connector, create_connector
from .errors import ClosedError, ConfigError
from .lifecycle import Startable, close_task, started
from .region import BlockRegion

if TYPE_CHECKING:
    from .discovery.etcd import Discovery


class ConnectorService(Startable):
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
        self._discovery: Discovery | None = None
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        """The close in progress (or done): every :meth:`close` call waits for this one."""

    async def start(self) -> Self:
        """Start the agent, build the connector and, when configured, start discovery.  Returns self."""
        if self._closed:
            raise ClosedError("service is closed")
        if self._connector is None:
            await self.agent.start()
            try:
                self._connector = create_connector(self.config.connector, self.agent)
                if self.config.discovery.etcd:
                    self._discovery = await _discovery(self.agent, self.config).start()
            except BaseException:
                await self.close()
                raise
        return self

    @property
    def connector(self) -> Connector:
        return started(self._connector, "service")

    @property
    def discovery(self) -> Discovery | None:
        """The etcd discovery of this service (None unless ``config.discovery.etcd`` is set)."""
        return self._discovery

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
        """Leave discovery, close adapters (draining their saves), the connector and the agent.
        Idempotent, and whole when it returns: a second call waits for the first one's end, and
        a call cut short (its caller cancelled) does not cut the close short: it goes on, and
        the next call waits for it."""
        if self._close_task is None:
            self._closed = True
            self._close_task = close_task(self._close(), "omni-service-close")
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        if self._discovery is not None:
            await self._discovery.close()
        for adapter in self._adapters:
            await adapter.close()
        if self._connector is not None:
            await self._connector.close()
        await self.agent.close()


def _discovery(agent: Agent, config: ServiceConfig) -> Discovery:
    try:
        from .discovery.etcd import Discovery
    except ImportError as exc:
        raise ConfigError(
            f"discovery.etcd is set but its client is missing ({exc}): pip install 'omni_async[discovery]'"
        ) from None
    return Discovery(agent, config.discovery)
