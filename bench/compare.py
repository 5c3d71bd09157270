"""Side-by-side Markdown tables of saved ``make bench`` runs, for docs/performance.md.

``make bench`` leaves each command's JSON report in ``bench/out`` (``blocks.json``,
``chunks.json``, ``layers.json``, ``idle.json``).  Copy that folder once per run, then
``python -m bench compare RUN_A RUN_B …``: every cell lists the runs' values in order
(``A / B``), so the page shows every run, not a chosen one.  A report missing from a run is
shown as ``n/a``; no number is computed here that the reports do not hold, except the
target table's verdict (met only if every run met it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .provenance import provenance_text
from .report import CPU_TABLE_HEAD

REPORTS = ("blocks", "chunks", "layers", "idle")
"""The JSON reports ``make bench`` writes, by file stem."""

Run = dict[str, Any]
"""One run: report name → its parsed JSON (missing reports absent)."""


def load_run(folder: Path) -> Run:
    """The reports found in ``folder`` (a copy of ``bench/out`` after ``make bench``)."""
    return {name: json.loads(path.read_text()) for name in REPORTS if (path := folder / f"{name}.json").is_file()}


def _join(values: list[str]) -> str:
    return " / ".join(values)


def _value(kind: str, summary: dict[str, float] | None) -> str:
    if summary is None:
        return "n/a"
    return f"{summary['p50_us']:.1f}" if kind == "latency" else f"{summary['gbps']:.2f}"


def _unit(kind: str) -> str:
    return "µs" if kind == "latency" else "GB/s"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def _rows(runs: list[Run], report: str, section: str = "results") -> list[str]:
    """Row names in the order of the first run that has them."""
    for run in runs:
        if report in run:
            return list(run[report].get(section) or {})
    return []


def _per_run(runs: list[Run], report: str, row: str) -> list[tuple[dict[str, Any], dict[str, Any]] | None]:
    """Each run's ``(result, ratios)`` of ``row`` in ``report``, or None where it lacks one."""
    out: list[tuple[dict[str, Any], dict[str, Any]] | None] = []
    for run in runs:
        result = run.get(report, {}).get("results", {}).get(row)
        out.append(None if result is None else (result, run[report]["ratios"][row]))
    return out


def _column(found: list[tuple[dict[str, Any], dict[str, Any]] | None], key: str, kind: str | None) -> str:
    """``A / B`` of a result's summary ``key`` (``kind`` given) or of a ratio ``key`` (None)."""
    cells = []
    for entry in found:
        if entry is None:
            cells.append("n/a")
        elif kind is None:
            cells.append(_ratio(entry[1][key]))
        else:
            cells.append(_value(kind, entry[0][key]))
    return _join(cells)


def blocks_table(runs: list[Run]) -> str:
    """Block rows: rows copy, omni_async, NIXL, vs NIXL, vs rows (each ``A / B``)."""
    lines = ["| row | workload | rows copy | omni_async | NIXL | vs NIXL | vs rows |", "|---|---|---|---|---|---|---|"]
    for row in _rows(runs, "blocks"):
        found = _per_run(runs, "blocks", row)
        first = next(entry[0] for entry in found if entry is not None)
        kind, unit = first["kind"], _unit(first["kind"])
        lines.append("| " + " | ".join([
            row, first["workload"], _column(found, "memcpy_rows", kind) + f" {unit}",
            _column(found, "omni_async", kind) + f" {unit}", _column(found, "nixl", kind) + f" {unit}",
            _column(found, "vs_nixl", None), _column(found, "vs_rows", None),
        ]) + " |")
    return "\n".join(lines)


def compat_table(runs: list[Run]) -> str:
    """Facade rows: the async path, tight poll, per-step poll, and the ratios to the async path."""
    lines = ["| row | async path | facade, tight poll | facade, poll per 200 µs step | vs async, tight | "
             "vs async, step | worst |", "|---|---|---|---|---|---|---|"]
    for row in _rows(runs, "blocks", "compat_results"):
        cells: dict[str, list[str]] = {key: [] for key in ("async", "tight", "step", "rt", "rs", "worst")}
        kind = "throughput"
        for run in runs:
            report = run.get("blocks", {})
            compat = (report.get("compat_results") or {}).get(row)
            if compat is None:
                for values in cells.values():
                    values.append("n/a")
                continue
            kind = compat["kind"]
            ratio = report["ratios"][row]
            cells["async"].append(_value(kind, report["results"][compat["of"]]["omni_async"]))
            cells["tight"].append(_value(kind, compat["tight"]))
            cells["step"].append(_value(kind, compat["step"]))
            cells["rt"].append(_ratio(ratio["vs_async_tight"]))
            cells["rs"].append(_ratio(ratio["vs_async_step"]))
            cells["worst"].append(_ratio(ratio["vs_async"]))
        unit = _unit(kind)
        lines.append("| " + " | ".join([
            row, _join(cells["async"]) + f" {unit}", _join(cells["tight"]) + f" {unit}",
            _join(cells["step"]) + f" {unit}", _join(cells["rt"]), _join(cells["rs"]), _join(cells["worst"]),
        ]) + " |")
    return "\n".join(lines)


def chunks_table(runs: list[Run]) -> str:
    """Chunk rows: omni_async and the pyzmq baseline (chunks/s, or p50 µs for latency rows)."""
    lines = ["| row | workload | omni_async | pyzmq | vs pyzmq |", "|---|---|---|---|---|"]
    for row in _rows(runs, "chunks"):
        found = _per_run(runs, "chunks", row)
        first = next(entry[0] for entry in found if entry is not None)
        if first["kind"] == "latency":
            mine, theirs, unit = _column(found, "omni_async", "latency"), _column(found, "zmq", "latency"), "µs"
        else:
            mine, theirs, unit = _rate(found, "chunks_per_s"), _rate(found, "zmq_chunks_per_s"), "chunks/s"
        ratio = _column(found, "vs_zmq", None)
        lines.append(f"| {row} | {first['workload']} | {mine} {unit} | {theirs} {unit} | {ratio} |")
    return "\n".join(lines)


def cpu_table(runs: list[Run]) -> str:
    """Throughput chunk rows: CPU per chunk of each side during the timed batches, ours and
    the baseline's (µs, ``A / B``); rows of reports without it are left out."""
    lines = list(CPU_TABLE_HEAD)
    for row in _rows(runs, "chunks"):
        found = _per_run(runs, "chunks", row)
        cpus = [None if entry is None else entry[0].get("cpu_us_per_chunk") for entry in found]
        if all(cpu is None for cpu in cpus):
            continue
        cells = [
            _join(["n/a" if cpu is None or who not in cpu else f"{cpu[who][side]:.0f}" for cpu in cpus])
            for who in ("omni_async", "zmq") for side in ("sender_us", "receiver_us")
        ]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _rate(found: list[tuple[dict[str, Any], dict[str, Any]] | None], key: str) -> str:
    return _join(["n/a" if entry is None or entry[0][key] is None else f"{entry[0][key]:,.0f}" for entry in found])


def layers_table(runs: list[Run]) -> str:
    """KV-shaped rows: omni_async and NIXL GB/s, and the ratio."""
    lines = ["| row | workload | omni_async | NIXL | vs NIXL |", "|---|---|---|---|---|"]
    for row in _rows(runs, "layers"):
        found = _per_run(runs, "layers", row)
        first = next(entry[0] for entry in found if entry is not None)
        lines.append(f"| {row} | {first['workload']} | {_column(found, 'omni_async', 'throughput')} GB/s | "
                     f"{_column(found, 'nixl', 'throughput')} GB/s | {_column(found, 'vs_nixl', None)} |")
    return "\n".join(lines)


def idle_line(runs: list[Run]) -> str:
    """The idle pair's CPU, % of one core, per run."""
    values = [f"{run['idle']['cpu_pct_of_one_core']['total']:.3f} %" if "idle" in run else "n/a" for run in runs]
    return f"Idle pair (`python -m bench idle`): {_join(values)} of one core."


def targets_table(runs: list[Run]) -> str:
    """Every target of the blocks and chunks reports: each run's ratio, and met in all runs or not."""
    lines = ["| target | " + " / ".join(chr(ord("A") + i) for i in range(len(runs))) + " | verdict |", "|---|---|---|"]
    texts: list[str] = []
    for report in ("blocks", "chunks"):
        for run in runs:
            texts += [t for t in run.get(report, {}).get("targets", {}) if t not in texts]
    for text in texts:
        found = [run[r]["targets"][text] for run in runs for r in ("blocks", "chunks")
                 if text in run.get(r, {}).get("targets", {})]
        met = [f["met"] for f in found]
        verdict = "**met**" if met and all(m is True for m in met) else ("unknown" if None in met else "missed")
        lines.append(f"| {text} | {_join([_ratio(f['ratio']) for f in found])} | {verdict} |")
    if any("idle" in run for run in runs):
        met = [run["idle"]["met"] for run in runs if "idle" in run]
        values = _join([f"{run['idle']['cpu_pct_of_one_core']['total']:.3f} %" for run in runs if "idle" in run])
        lines.append(f"| idle pair < 1 % of a core | {values} | {'**met**' if all(met) else 'missed'} |")
    return "\n".join(lines)


def provenance(runs: list[Run]) -> str:
    """Each run's reports' provenance lines (when, which tree, how quiet the host was)."""
    lines = []
    for i, run in enumerate(runs):
        for name, report in run.items():
            text = provenance_text(report).replace("\n", "; ")
            lines.append(f"- {chr(ord('A') + i)}, {name}: {text}")
    return "\n".join(lines)


def compare(folders: list[Path]) -> str:
    """All tables for the runs saved in ``folders`` (A, B, … in that order)."""
    runs = [load_run(folder) for folder in folders]
    parts = [
        ("Block rows", blocks_table(runs)), ("The sync facade", compat_table(runs)),
        ("Chunk rows", chunks_table(runs)), ("CPU per chunk (µs)", cpu_table(runs)),
        ("KV-shaped rows", layers_table(runs)),
        ("Targets", targets_table(runs)),
    ]
    out = [f"### {title}\n\n{table}\n" for title, table in parts]
    out.append(idle_line(runs) + "\n")
    out.append("Runs:\n\n" + provenance(runs) + "\n")
    return "\n".join(out)
