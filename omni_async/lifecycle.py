"""``Startable``: the one ``async with`` protocol of the objects that own tasks and sockets.

``async with X(...) as x`` is ``x = await X(...).start()`` then, whatever happens, ``await
x.close()``.  ``start`` returns the started object; ``close`` is idempotent and leaves no task
behind.  :func:`started` is how such an object hands out a part it builds in ``start``.  No I/O
here.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from typing import Any, Self, TypeVar

from .errors import ClosedError

T = TypeVar("T")

log = logging.getLogger(__name__)


class Startable(ABC):
    """Base of the objects used as ``async with``: :meth:`start` on entry, :meth:`close` on exit."""

    __slots__ = ()

    @abstractmethod
    async def start(self) -> Self:
        """Start (idempotent while started); return self."""

    @abstractmethod
    async def close(self) -> None:
        """Stop everything this object started.  Idempotent."""

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def started(part: T | None, owner: str) -> T:
    """``part``, which ``owner`` builds when it starts; raises :class:`ClosedError`
    (``"<owner> is not started"``) while it is None."""
    if part is None:
        raise ClosedError(f"{owner} is not started")
    return part


def close_task(close: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """The task that runs an object's close to its end, once: its ``close()`` callers wait for
    it shielded, so a caller cancelled (a timeout around it) does not cut the close short and
    the next caller waits for the same task.  Its failure is logged, so also when every caller
    was cancelled meanwhile."""
    task = asyncio.get_running_loop().create_task(close, name=name)
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s failed", task.get_name(), exc_info=task.exception())
