"""Event-loop selection: uvloop where installed (the default), else asyncio's own loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")


def _uvloop(wanted: bool) -> ModuleType | None:
    """The uvloop module if wanted and installed, else None."""
    if not wanted:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a new loop: uvloop if installed and wanted."""
    uvloop = _uvloop(use_uvloop)
    if uvloop is not None:
        result: T = uvloop.run(main)
        return result
    return asyncio.run(main)


def new_event_loop(*, use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """A new loop, not running yet (uvloop if installed and wanted); the caller runs and closes it."""
    uvloop = _uvloop(use_uvloop)
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
    return loop
