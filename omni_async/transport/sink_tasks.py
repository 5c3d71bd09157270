"""The tasks that run what an application's sink returned (a coroutine, or another awaitable).

A notice sink or a message sink may be ``async``: what it returns runs as a task, which the
transport owns (:class:`SinkTasks`): named, held until it ends, cancelled and awaited when the
transport closes.  Its end, however it comes, runs the done callbacks the caller added (a
notice released, a message answered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


class SinkTasks:
    """The sink tasks still running, owned until they end (see the module)."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._running)

    def start(self, pending: Awaitable[Any], name: str) -> asyncio.Future[Any]:
        """Run ``pending`` (a coroutine becomes a task named ``name``) and hold it until it ends."""
        future = asyncio.ensure_future(pending)
        if isinstance(future, asyncio.Task):
            future.set_name(name)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        return future

    async def close(self) -> None:
        """Cancel what still runs and wait until it ended (its outcome is the callbacks' to read)."""
        running = list(self._running)
        for future in running:
            future.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
