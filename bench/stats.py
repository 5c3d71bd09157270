"""Summaries of per-iteration timings (nanoseconds): medians, percentiles, GB/s (10^9 B/s)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile_us(samples_ns: Sequence[int], q: float) -> float:
    """The ``q``-th percentile of the samples, in microseconds."""
    return float(np.percentile(np.asarray(samples_ns, dtype=np.float64), q)) / 1e3


def gbps(nbytes: int, samples_ns: Sequence[int]) -> float:
    """Throughput of the median iteration: ``nbytes`` per median time, in GB/s."""
    median_ns = float(np.median(np.asarray(samples_ns, dtype=np.float64)))
    return nbytes / median_ns


def summarize(nbytes: int, samples_ns: Sequence[int]) -> dict[str, float]:
    """``{"p50_us", "p99_us", "gbps", "n"}`` for a contender's samples of one workload
    (``nbytes`` moved per sample).  Ratios compare ``gbps`` for throughput workloads and
    ``p50_us`` for latency ones (see :func:`speed`)."""
    if not samples_ns:
        raise ValueError("no samples")
    return {
        "p50_us": round(percentile_us(samples_ns, 50), 2),
        "p99_us": round(percentile_us(samples_ns, 99), 2),
        "gbps": round(gbps(nbytes, samples_ns), 3),
        "n": len(samples_ns),
    }


def speed(kind: str, summary: dict[str, float]) -> float:
    """Bigger-is-better figure of merit: GB/s, or 1/p50 latency (per µs) for latency workloads."""
    return 1.0 / summary["p50_us"] if kind == "latency" else summary["gbps"]
