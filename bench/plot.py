"""Charts of a ``blocks`` or ``chunks`` report: grouped bars per workload, one bar per contender.

Each chart has two panels, throughput rows (GB/s, higher is better; log scale for chunks, where
memcpy dwarfs the rest) and latency rows (p50 µs, lower is better, log scale), and the run's
provenance (:func:`bench.provenance.provenance_text`) as its caption, so a chart never travels
without its date, tree and host load.  Every bar comes from the report it is drawn from: one
run.  The format follows the file name (``.svg``, ``.png``, ``.pdf``).  Needs matplotlib (the
``bench`` extra); nothing else in the bench does.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

from .provenance import provenance_text

Series = tuple[str, Callable[[str, dict[str, Any]], dict[str, float] | None]]
"""(legend label, row name and row → that contender's summary of it or None)."""

BLOCK_SERIES: tuple[Series, ...] = (
    ("omni_async", lambda _, r: r["omni_async"]),
    ("NIXL", lambda _, r: r["nixl"]),
    ("memcpy (fancy index)", lambda _, r: r["memcpy"]),
    ("rows copy", lambda _, r: r["memcpy_rows"]),
)
CHUNK_SERIES: tuple[Series, ...] = (
    ("omni_async", lambda _, r: r["omni_async"]),
    ("pyzmq + msgspec", lambda _, r: r["zmq"]),
    ("memcpy", lambda _, r: r["memcpy"]),
)
COLORS = ("#1f77b4", "#d62728", "#7f7f7f", "#bcbd22", "#2ca02c", "#9467bd", "#ff7f0e")


def _facade_series(report: dict[str, Any]) -> tuple[Series, ...]:
    """The facade's bars (``compat_*`` rows) on the async row each repeats."""
    compat = report.get("compat_results") or {}
    by_row = {c["of"]: c for c in compat.values()}

    def pick(poll: str) -> Callable[[str, dict[str, Any]], dict[str, float] | None]:
        return lambda row, _: by_row[row][poll] if row in by_row else None

    if not by_row:
        return ()
    return (("facade, tight poll", pick("tight")), ("facade, poll per 200 µs step", pick("step")))


def _label(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _panel(ax: Any, kind: str, rows: dict[str, dict[str, Any]], series: tuple[Series, ...], log: bool) -> None:
    names = list(rows)
    width = 0.8 / len(series)
    for i, (label, pick) in enumerate(series):
        xs, heights = [], []
        for x, name in enumerate(names):
            summary = pick(name, rows[name])
            if summary is not None:
                xs.append(x + (i - (len(series) - 1) / 2) * width)
                heights.append(summary["p50_us"] if kind == "latency" else summary["gbps"])
        bars = ax.bar(xs, heights, width, label=label, color=COLORS[i % len(COLORS)])
        ax.bar_label(bars, labels=[_label(h) for h in heights], fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(names)), [f"{n}\n{textwrap.fill(rows[n]['workload'], 16)}" for n in names], fontsize=7)
    if log:
        ax.set_yscale("log")
    scale = " (log)" if log else ""
    if kind == "latency":
        ax.set_ylabel(f"p50 latency, µs{scale}: lower is better")
    else:
        ax.set_ylabel(f"GB/s of the median transfer{scale}: higher is better")
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


def plot(
    report: dict[str, Any], path: str, title: str, series: tuple[Series, ...], note: str = "",
    log_throughput: bool = False,
) -> None:
    """Draw ``report["results"]`` with one bar per entry of ``series`` to ``path`` (latency on a log
    scale; throughput too if ``log_throughput``)."""
    from matplotlib.figure import Figure  # the bench extra; imported only when a chart is asked for

    results: dict[str, dict[str, Any]] = report["results"]
    panels = [
        (kind, {row: r for row, r in results.items() if r["kind"] == kind}) for kind in ("throughput", "latency")
    ]
    panels = [(kind, rows) for kind, rows in panels if rows]
    widths = [max(2, len(rows)) for _, rows in panels]
    fig = Figure(figsize=(max(9.0, 1.5 * sum(widths)), 6.5), layout="constrained")
    axes = fig.subplots(1, len(panels), width_ratios=widths, squeeze=False)[0]
    for ax, (kind, rows) in zip(axes, panels, strict=True):
        _panel(ax, kind, rows, series, log=kind == "latency" or log_throughput)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    caption = "\n".join(textwrap.fill(line, 160) for line in [*provenance_text(report).splitlines(), note] if line)
    fig.supxlabel(caption, fontsize=6.5, ha="left", x=0.01)
    fig.savefig(path)


def plot_blocks(report: dict[str, Any], path: str) -> None:
    plot(report, path, "omni_async block writes vs NIXL, memcpy and the sync facade",
         BLOCK_SERIES + _facade_series(report),
         "facade: SyncDataTransport, write_blocks then poll() until done; NIXL: "
         + "; ".join(f"{mode} {'available' if info['available'] else 'unavailable: ' + str(info['reason'])}"
                     for mode, info in report["nixl"].items()))


def plot_chunks(report: dict[str, Any], path: str) -> None:
    plot(report, path, "omni_async chunk streams vs a pyzmq + msgspec script and memcpy", CHUNK_SERIES,
         f"pyzmq: {report['zmq']['what']}; NIXL: {report['nixl']['reason']}", log_throughput=True)
