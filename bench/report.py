"""Ratios, target checks and the human table for ``blocks`` results.

A ratio is omni_async's speed over the other contender's: GB/s over GB/s, or for latency rows
the other's p50 over omni_async's p50 (1/latency).  Above 1 means omni_async is faster.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from .provenance import provenance_text
from .stats import speed

TARGETS: tuple[tuple[str, str, float, str], ...] = (
    *((row, "vs_nixl", 1.25, f"{row} ≥ 1.25× NIXL same-host") for row in ("b", "c", "b_contig", "c_contig")),
    *((row, "vs_rows", 0.85, f"{row} ≥ 0.85× rows copy") for row in ("b", "c", "b_contig", "c_contig")),
    ("a", "vs_nixl", 1.0, "a latency ≤ 1.0× NIXL (ratio ≥ 1.0)"),
    ("b_tcp", "vs_nixl", 1.0, "b_tcp ≥ 1.0× NIXL tcp"),
    ("c_tcp", "vs_nixl", 1.0, "c_tcp ≥ 1.0× NIXL tcp"),
    ("a_tcp", "vs_nixl", 1 / 1.5, "a_tcp latency ≤ 1.5× NIXL tcp (ratio ≥ 0.667)"),
    *((row, "vs_async", 0.67, f"{row} ≥ 0.67× the async path (worst of tight and step polling)")
      for row in ("compat_a", "compat_b", "compat_c")),
)
"""(row, ratio, threshold, description): issue 9's targets for ``blocks``."""


def speed_ratio(kind: str, mine: dict[str, float], other: dict[str, float] | None) -> float | None:
    """``mine``'s speed over ``other``'s (see the module doc) to four significant digits (a
    tiny ratio, such as a latency row's vs memcpy under load, stays above 0); None without
    ``other``."""
    if other is None:
        return None
    return float(f"{speed(kind, mine) / speed(kind, other):.4g}")


def ratios_and_targets(
    results: dict[str, Any], compat: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ratios and the target verdicts.

    ``ratios[row] = {"vs_nixl": float | None, "vs_memcpy": float, "vs_rows": float}`` for every
    block row; ``ratios["compat_x"] = {"vs_async": worst, "vs_async_tight": ..., "vs_async_step": ...}``
    for every facade row (the facade's speed over the async path's on the row it repeats).
    """
    ratios: dict[str, Any] = {
        row: {
            "vs_nixl": speed_ratio(r["kind"], r["omni_async"], r["nixl"]),
            "vs_memcpy": speed_ratio(r["kind"], r["omni_async"], r["memcpy"]),
            "vs_rows": speed_ratio(r["kind"], r["omni_async"], r["memcpy_rows"]),
        }
        for row, r in results.items()
    }
    for row, c in (compat or {}).items():
        of = results[c["of"]]
        modes = {f"vs_async_{poll}": speed_ratio(c["kind"], c[poll], of["omni_async"]) for poll in ("tight", "step")}
        ratios[row] = {"vs_async": min(v for v in modes.values() if v is not None), **modes}
    return ratios, verdicts(ratios, TARGETS)


def verdicts(ratios: dict[str, Any], targets: Iterable[tuple[str, str, float, str]]) -> dict[str, Any]:
    """``{description: {"row", "ratio", "threshold", "met"}}`` for each target whose row was run
    (``met`` is None where the ratio is unknown, e.g. NIXL unavailable)."""
    out = {}
    for row, key, threshold, text in targets:
        if row not in ratios:
            continue
        value = ratios[row].get(key)
        out[text] = {"row": row, "ratio": value, "threshold": round(threshold, 3),
                     "met": None if value is None else value >= threshold}
    return out


def verdict_lines(targets: dict[str, Any]) -> list[str]:
    """One ``- description: ratio → met|MISSED|unknown`` line per target."""
    marks = {True: "met", False: "MISSED", None: "unknown"}
    return [f"- {text}: {_fmt(v['ratio'])} → {marks[v['met']]}" for text, v in targets.items()]


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
    head = ["row", "workload", "memcpy", "rows copy", "omni_async", "NIXL", "vs NIXL", "vs memcpy", "vs rows"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r in report["results"].items():
        ratio = report["ratios"][row]
        cells = [row, r["workload"], _cell(r["kind"], r["memcpy"]), _cell(r["kind"], r["memcpy_rows"]),
                 _cell(r["kind"], r["omni_async"]), _cell(r["kind"], r["nixl"]), _fmt(ratio["vs_nixl"]),
                 _fmt(ratio["vs_memcpy"]), _fmt(ratio["vs_rows"])]
        lines.append("| " + " | ".join(cells) + " |")
    compat = report.get("compat_results") or {}
    if compat:
        lines += ["", "| row | workload | async path | facade, tight poll | facade, poll per step | vs async "
                  "(tight / step) |", "|---|---|---|---|---|---|"]
        for row, c in compat.items():
            ratio = report["ratios"][row]
            cells = [row, c["workload"], _cell(c["kind"], report["results"][c["of"]]["omni_async"]),
                     _cell(c["kind"], c["tight"]), _cell(c["kind"], c["step"]),
                     f"{_fmt(ratio['vs_async_tight'])} / {_fmt(ratio['vs_async_step'])}"]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("latency rows: p50/p99; throughput rows: GB/s (10^9 B/s) of the median iteration; "
                 "ratios > 1: omni_async faster; memcpy = fancy-index copy (gather+scatter), rows copy = "
                 "one copy per block (each byte once: the reference of vs rows); facade rows: "
                 "SyncDataTransport, write_blocks then poll() until done (step: 200 µs of Python per poll)")
    lines.append(provenance_text(report))
    for mode, info in report["nixl"].items():
        if not info["available"]:
            lines.append(f"NIXL ({mode}) unavailable: {info['reason']}")
    lines.append("")
    lines += verdict_lines(report["targets"])
    return "\n".join(lines)


CPU_TABLE_HEAD: Final = (
    "| row | omni_async sender | omni_async receiver | pyzmq sender | pyzmq receiver |",
    "|---|---|---|---|---|",
)
"""The head of the table of CPU per chunk (``bench chunks`` and ``bench compare``)."""
