"""What this process holds open, read from ``/proc/self`` (for the tests' leak checks)."""

from __future__ import annotations

import os


def fd_targets() -> list[str]:
    """What each open descriptor of this process points to (``readlink``), sorted; one closed
    while the directory is read is skipped."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(targets)
