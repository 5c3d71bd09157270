"""Running a command's coroutine: on omni_async's loop, stopped by SIGINT/SIGTERM, interrupts → 130."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..eventloop import run
from .output import EXIT_INTERRUPTED, EXIT_OK

T = TypeVar("T")


async def until_signalled(work: Coroutine[Any, Any, T]) -> tuple[T | None, bool]:
    """Run ``work``; SIGINT/SIGTERM cancel it (its ``async with`` blocks close their services).

    Returns ``(result, interrupted)``.  After the first signal the default handlers are back, so
    a second Ctrl-C interrupts the cleanup itself.
    """
    loop = asyncio.get_running_loop()
    task = loop.create_task(work)
    interrupted = False
    signals = (signal.SIGINT, signal.SIGTERM)

    def on_signal() -> None:
        nonlocal interrupted
        interrupted = True
        for sig in signals:
            loop.remove_signal_handler(sig)
        task.cancel()

    installed: list[signal.Signals] = []
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
    try:
        return await task, interrupted
    except asyncio.CancelledError:
        if interrupted:
            return None, True
        raise
    finally:
        if not interrupted:
            for sig in installed:
                loop.remove_signal_handler(sig)


def run_async(work: Coroutine[Any, Any, int]) -> int:
    """Run a command coroutine on omni_async's loop (uvloop if installed); map interrupts to 130."""
    try:
        result, interrupted = run(until_signalled(work))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if interrupted and result is None:
        return EXIT_INTERRUPTED
    return result if result is not None else EXIT_OK

