"""Smoke test of ``python -m bench``: each command runs, quickly, and prints one JSON object.

The numbers of a smoke run mean nothing (a few iterations, a shared CPU); only the shape of
the report and the sign of its numbers are checked.  NIXL is optional: where it is not
installed its ratios are null.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO_KEYS = {"a", "b", "c", "a_tcp", "b_tcp", "c_tcp"}


def bench(*args: str, timeout: float) -> dict[str, Any]:
    """Run ``python -m bench ARGS --json`` and return its JSON object (stdout holds only that)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.mark.timeout(120)
def test_blocks_quick_reports_ratios() -> None:
    report = bench("blocks", "--quick", "--iters", "2", timeout=100)
    ratios = report["ratios"]
    assert set(ratios) >= RATIO_KEYS
    for name, ratio in ratios.items():
        assert ratio["vs_memcpy"] > 0, name
        assert ratio["vs_nixl"] is None or ratio["vs_nixl"] > 0, name
    for name, row in report["results"].items():
        speed = row["omni_async"]["p50_us"] if row["kind"] == "latency" else row["omni_async"]["gbps"]
        assert speed > 0, name
    for info in report["nixl"].values():
        assert info["available"] or info["reason"]


@pytest.mark.timeout(60)
def test_idle_reports_cpu() -> None:
    report = bench("idle", "--seconds", "1", timeout=50)
    cpu = report["cpu_pct_of_one_core"]
    assert {"receiver", "dialer", "total"} <= set(cpu)
    assert all(value >= 0 for value in cpu.values())
    assert cpu["total"] > 0  # heartbeats cost something; zero would mean nothing was measured
    assert report["seconds"] >= 1


@pytest.mark.timeout(60)
def test_chunks_quick_reports_ratios() -> None:
    report = bench("chunks", "--quick", timeout=50)
    assert {"chunk_a", "chunk_stream", "chunk_a_tcp", "chunk_stream_tcp"} <= set(report["ratios"])
    for name, ratio in report["ratios"].items():
        assert ratio["vs_memcpy"] > 0, name
