"""Event-loop selection: uvloop where installed (the default), else asyncio's own loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a new loop: uvloop if installed and wanted."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
