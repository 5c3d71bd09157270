"""A Ctrl-C storm: SIGINT sent to this process every ~1.3 ms by another process, so each lands at
any bytecode of the code under test (one sent from a thread of this process lands only where
that code blocks)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType


def ctrl_c_storm(call: Callable[[], object], seconds: float, check: Callable[[], object | None]) -> tuple[int, object | None]:
    """Call ``call()`` again and again in the main thread for ``seconds`` while SIGINTs arrive;
    after each ``KeyboardInterrupt`` it raised, ``check()`` returns None (all is well) or what
    leaked, which ends the storm.  Returns ``(interrupts caught, what leaked or None)``.  A
    SIGINT raises only inside ``call()`` (the handler disarms itself before raising)."""
    assert threading.current_thread() is threading.main_thread()
    armed = [False]  # (a plain flag: no call in the handler a SIGINT could land in again)

    def handler(_signum: int, _frame: FrameType | None) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    sender = subprocess.Popen(["/bin/sh", "-c", f"while kill -INT {os.getpid()} 2>/dev/null; do sleep 0.0013; done"])
    interrupts, leaked = 0, None
    end = time.monotonic() + seconds
    try:
        while leaked is None and time.monotonic() < end:
            try:
                armed[0] = True
                call()
                armed[0] = False
            except KeyboardInterrupt:
                interrupts += 1
                leaked = check()
    finally:
        armed[0] = False
        sender.terminate()
        sender.wait()
        signal.signal(signal.SIGINT, previous)
    return interrupts, leaked
