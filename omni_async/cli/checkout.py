"""``demo`` and ``bench``: run ``examples/demo.py`` / ``python -m bench`` from the repository checkout."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from .output import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, err


def find_checkout(relative: str) -> Path | None:
    """The repository checkout holding ``relative``: the package's parent dir, else the cwd."""
    here = Path(__file__).resolve().parent.parent.parent
    for root in (here, Path.cwd()):
        if (root / relative).is_file():
            return root
    return None


def _run_child(argv: list[str], cwd: Path, timeout: float | None) -> int:
    """Run a child process in the foreground; Ctrl-C and the timeout stop it (SIGINT, then kill)."""
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    proc = subprocess.Popen(argv, cwd=cwd, env=env)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        err(f"{' '.join(argv[1:])} did not finish within {timeout:.0f}s; stopping it")
        _stop_child(proc)
        return EXIT_FAILED
    except KeyboardInterrupt:
        _stop_child(proc)
        return EXIT_INTERRUPTED


def _stop_child(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _in_checkout(command: str, needs: str, relative: str, argv: list[str], timeout: float | None) -> int:
    """Run ``python ARGV`` in the checkout holding ``relative``; exit 2 naming ``needs`` if there is none."""
    root = find_checkout(relative)
    if root is None:
        err(f"{command} needs the repository checkout ({needs}), which is not next to this installation "
            f"nor in the current directory; run it from a clone: `make {command}`")
        return EXIT_USAGE
    return _run_child([sys.executable, *argv], root, timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    return _in_checkout("demo", "examples/demo.py", "examples/demo.py", ["examples/demo.py"], args.timeout)


def cmd_bench(args: argparse.Namespace) -> int:
    extra = list(args.bench_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return _in_checkout("bench", "the bench/ package", "bench/__main__.py", ["-m", "bench", *extra], args.timeout)
