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


def cmd_demo(args: argparse.Namespace) -> int:
    root = find_checkout("examples/demo.py")
    if root is None:
        err("demo needs the repository checkout (examples/demo.py), which is not next to this "
            "installation nor in the current directory; run it from a clone: `make demo`")
        return EXIT_USAGE
    return _run_child([sys.executable, str(root / "examples" / "demo.py")], root, args.timeout)


def cmd_bench(args: argparse.Namespace) -> int:
    root = find_checkout("bench/__main__.py")
    if root is None:
        err("bench needs the repository checkout (the bench/ package), which is not next to this "
            "installation nor in the current directory; run it from a clone: `make bench`")
        return EXIT_USAGE
    extra = list(args.bench_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return _run_child([sys.executable, "-m", "bench", *extra], root, args.timeout)

