"""What a report was measured with: package versions and the state of the omni_async tree
(the package is under active development; a number without its tree state means little)."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Any

from omni_async.transport import native

from .procs import ROOT


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("omni_async", "ucxx-cu12", "libucx-cu12", "nixl-cu12", "numpy", "pyzmq", "uvloop"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def tree_state() -> dict[str, Any]:
    """``{"head", "dirty_files", "diff_sha256"}`` of ``omni_async/`` (None values outside git)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                                  timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--", "omni_async")
    diff = git("diff", "HEAD", "--", "omni_async")
    return {
        "head": head.strip() if head else None,
        "dirty_files": len(status.splitlines()) if status is not None else None,
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:12] if diff else None,
    }


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; None where there is none): machines of one kind
    differ (an AMD and an Intel VM both passed for this project's 2-core machine)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def stamp() -> dict[str, Any]:
    """Date (UTC), command line, host and the above, for the top of a report."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
        "host": {"cpus": os.cpu_count(), "cpu": cpu_model(), "platform": platform.platform(),
                 "loadavg": os.getloadavg(), "c_loops": native.built()},
        "versions": versions(),
        "omni_async_tree": tree_state(),
    }


def provenance_text(report: dict[str, Any]) -> str:
    """When, with what command, on which tree, and (second line) how quiet the host was."""
    tree = report.get("omni_async_tree", {})
    line = (f"{report.get('date')}  `{report.get('command')}`  omni_async tree {tree.get('head')} "
            f"+{tree.get('dirty_files')} changed files (diff {tree.get('diff_sha256')})")
    host = report.get("host", {})
    if "load" in host:
        load = host["load"]
        c_loops = {True: "built", False: "NOT built (Python fallbacks)"}.get(host.get("c_loops"), "unknown")
        line += (f"\nhost: {host['cpus']} CPUs ({host.get('cpu') or 'model unknown'}), omni_async's C loops "
                 f"{c_loops}; over the {load['wall_s']} s run the bench used "
                 f"{load['bench_cores']} cores, other processes {load['foreign_cores']} cores, steal "
                 f"{load['steal_cores']} (numbers are trustworthy only when those are near 0)")
    return line
