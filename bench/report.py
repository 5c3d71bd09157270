"""Ratios, target checks and the human table for ``blocks`` results.

A ratio is omni_async's speed over the other contender's: GB/s over GB/s, or for latency rows
the other's p50 over omni_async's p50 (1/latency).  Above 1 means omni_async is faster.
"""

from __future__ import annotations

from typing import Any

from .stats import speed

TARGETS: tuple[tuple[str, str, float, str], ...] = (
    ("b", "vs_nixl", 1.0, "b ≥ 1.0× NIXL same-host"),
    ("c", "vs_nixl", 1.0, "c ≥ 1.0× NIXL same-host"),
    ("b", "vs_memcpy", 0.85, "b ≥ 0.85× memcpy"),
    ("c", "vs_memcpy", 0.85, "c ≥ 0.85× memcpy"),
    ("b_tcp", "vs_nixl", 1.0, "b_tcp ≥ 1.0× NIXL tcp"),
    ("c_tcp", "vs_nixl", 1.0, "c_tcp ≥ 1.0× NIXL tcp"),
    ("a", "vs_nixl", 1 / 1.5, "a latency ≤ 1.5× NIXL (ratio ≥ 0.667)"),
)
"""(row, ratio, threshold, description): the issue's targets."""


def _ratio(kind: str, mine: dict[str, float], other: dict[str, float] | None) -> float | None:
    if other is None:
        return None
    return round(speed(kind, mine) / speed(kind, other), 3)


def ratios_and_targets(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``ratios[row] = {"vs_nixl": float | None, "vs_memcpy": float}`` and the target verdicts."""
    ratios = {
        row: {
            "vs_nixl": _ratio(r["kind"], r["omni_async"], r["nixl"]),
            "vs_memcpy": _ratio(r["kind"], r["omni_async"], r["memcpy"]),
        }
        for row, r in results.items()
    }
    targets = {}
    for row, key, threshold, text in TARGETS:
        if row not in ratios:
            continue
        value = ratios[row][key]
        targets[text] = {"row": row, "ratio": value, "threshold": round(threshold, 3),
                         "met": None if value is None else value >= threshold}
    return ratios, targets


def _cell(kind: str, summary: dict[str, float] | None) -> str:
    if summary is None:
        return "n/a"
    if kind == "latency":
        return f"{summary['p50_us']:.1f}/{summary['p99_us']:.1f} µs"
    return f"{summary['gbps']:.2f} GB/s"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def table(report: dict[str, Any]) -> str:
    """The results as a Markdown table, NIXL availability, and the target verdicts."""
    head = ["row", "workload", "memcpy", "omni_async", "NIXL", "vs NIXL", "vs memcpy", "(rows copy)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r in report["results"].items():
        ratio = report["ratios"][row]
        cells = [row, r["workload"], _cell(r["kind"], r["memcpy"]), _cell(r["kind"], r["omni_async"]),
                 _cell(r["kind"], r["nixl"]), _fmt(ratio["vs_nixl"]), _fmt(ratio["vs_memcpy"]),
                 _cell(r["kind"], r.get("memcpy_rows"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("latency rows: p50/p99; throughput rows: GB/s (10^9 B/s) of the median iteration; "
                 "ratios > 1: omni_async faster; memcpy = fancy-index copy (gather+scatter, the ratio's "
                 "reference), rows copy = one copy per block")
    tree = report.get("omni_async_tree", {})
    lines.append(f"{report.get('date')}  `{report.get('command')}`  omni_async tree {tree.get('head')} "
                 f"+{tree.get('dirty_files')} changed files (diff {tree.get('diff_sha256')})")
    host = report.get("host", {})
    if "load" in host:
        load = host["load"]
        lines.append(f"host: {host['cpus']} CPUs; over the {load['wall_s']} s run the bench used "
                     f"{load['bench_cores']} cores, other processes {load['foreign_cores']} cores, steal "
                     f"{load['steal_cores']} (numbers are trustworthy only when those are near 0)")
    for mode, info in report["nixl"].items():
        if not info["available"]:
            lines.append(f"NIXL ({mode}) unavailable: {info['reason']}")
    lines.append("")
    for text, verdict in report["targets"].items():
        mark = {True: "met", False: "MISSED", None: "unknown"}[verdict["met"]]
        lines.append(f"- {text}: {_fmt(verdict['ratio'])} → {mark}")
    return "\n".join(lines)
