"""Smoke test of ``python -m bench``: each command runs, quickly, and prints one JSON object.

The numbers of a smoke run mean nothing (a few iterations, a shared CPU); only the shape of
the report and the sign of its numbers are checked (every contender verifies its bytes: a
mismatch fails the run).  NIXL is optional: where it is not installed its ratios are null.
The plots (``--plot``) need the ``bench`` extra: without matplotlib the rest is checked and the
test then skips, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO_KEYS = {"a", "b", "c", "a_tcp", "b_tcp", "c_tcp"}
COMPAT_KEYS = {"compat_a", "compat_b", "compat_c"}
CHUNK_ZMQ_KEYS = {"chunk_a", "chunk_8k", "chunk_256k"}
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def plot_args(path: Path) -> list[str]:
    return ["--plot", str(path)] if HAS_MATPLOTLIB else []


def check_plot(path: Path, report: dict[str, Any], labels: list[str]) -> None:
    """The SVG exists, names every contender and row, and carries the run's provenance."""
    if not HAS_MATPLOTLIB:
        pytest.skip("matplotlib (the bench extra) is not installed: --plot not checked")
    svg = path.read_text()
    assert svg.startswith("<?xml") and "<svg" in svg
    for text in [*labels, *report["results"], report["omni_async_tree"]["head"], report["date"]]:
        assert text in svg, text


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
def test_blocks_quick_reports_ratios(tmp_path: Path) -> None:
    plot = tmp_path / "blocks.svg"
    report = bench("blocks", "--quick", "--iters", "2", *plot_args(plot), timeout=100)
    ratios = report["ratios"]
    assert report["host"]["c_loops"] is True  # the run says which copy path it measured
    assert "cpu" in report["host"]
    assert set(ratios) >= RATIO_KEYS | COMPAT_KEYS
    for name in report["results"]:
        ratio = ratios[name]
        assert ratio["vs_memcpy"] > 0, name
        assert ratio["vs_rows"] > 0, name
        assert ratio["vs_nixl"] is None or ratio["vs_nixl"] > 0, name
    for name, row in report["results"].items():
        speed = row["omni_async"]["p50_us"] if row["kind"] == "latency" else row["omni_async"]["gbps"]
        assert speed > 0, name
        assert row["memcpy_rows"]["n"] > 0, name
    for info in report["nixl"].values():
        assert info["available"] or info["reason"]
    # facade rows: both poll modes measured, the ratio is the worse of the two
    assert set(report["compat_results"]) == COMPAT_KEYS
    for name in COMPAT_KEYS:
        row, ratio = report["compat_results"][name], ratios[name]
        assert row["of"] == name.removeprefix("compat_")
        assert row["tight"]["n"] >= 1 and row["step"]["n"] >= 1, name
        assert ratio["vs_async_tight"] > 0 and ratio["vs_async_step"] > 0, name
        assert ratio["vs_async"] == min(ratio["vs_async_tight"], ratio["vs_async_step"]), name
    assert {t["row"] for t in report["targets"].values()} >= COMPAT_KEYS | {"a", "b", "c", "a_tcp"}
    check_plot(plot, report, ["omni_async", "NIXL", "rows copy", "facade, tight poll"])


@pytest.mark.timeout(60)
def test_idle_reports_cpu() -> None:
    report = bench("idle", "--seconds", "1", timeout=50)
    cpu = report["cpu_pct_of_one_core"]
    assert {"receiver", "dialer", "total"} <= set(cpu)
    assert all(value >= 0 for value in cpu.values())
    assert cpu["total"] > 0  # heartbeats cost something; zero would mean nothing was measured
    assert report["seconds"] >= 1


@pytest.mark.timeout(60)
def test_chunks_quick_reports_ratios(tmp_path: Path) -> None:
    plot = tmp_path / "chunks.svg"
    report = bench("chunks", "--quick", *plot_args(plot), timeout=50)
    assert {"chunk_a", "chunk_stream", "chunk_a_tcp", "chunk_stream_tcp", "notice_rt", "notice_rt_tcp"} \
        | CHUNK_ZMQ_KEYS <= set(report["ratios"])
    for name, ratio in report["ratios"].items():
        assert ratio["vs_memcpy"] > 0, name
        # the pyzmq baseline ran beside every row, same shapes (its receiver checked every chunk)
        assert ratio["vs_zmq"] > 0, name
        row = report["results"][name]
        assert row["zmq"]["n"] == row["omni_async"]["n"], name
        assert row["zmq_chunks_per_s"] > 0, name
        # the CPU of both processes of both contenders over the timed batches of throughput rows
        cpu = row["cpu_us_per_chunk"]
        if row["kind"] == "throughput":
            assert {who: set(sides) for who, sides in cpu.items()} == {
                "omni_async": {"sender_us", "receiver_us"}, "zmq": {"sender_us", "receiver_us"}}, name
            assert all(value > 0 for sides in cpu.values() for value in sides.values()), (name, cpu)
        else:
            assert cpu is None, name
    assert report["zmq"]["available"]
    assert {t["row"] for t in report["targets"].values()} == CHUNK_ZMQ_KEYS
    check_plot(plot, report, ["omni_async", "pyzmq + msgspec", "memcpy"])


@pytest.mark.timeout(120)
def test_layers_quick_reports_a_region_set_beside_nixl() -> None:
    report = bench("layers", "--quick", timeout=100)
    assert set(report["results"]) == {"kv_64x32", "kv_64x32_tcp"}
    for name, ratio in report["ratios"].items():
        assert ratio["vs_memcpy"] > 0, name  # every contender verified its bytes, or the run failed
        row = report["results"][name]
        assert row["bytes"] == 64 * 32 * 16 * 1024 and row["omni_async"]["gbps"] > 0
        nixl = report["nixl"][row["mode"]]
        assert (ratio["vs_nixl"] is not None and ratio["vs_nixl"] > 0) == nixl["available"], (name, nixl)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["a", "message"])
def test_profile_reports_per_transfer_costs(kind: str) -> None:
    report = bench("profile", "--kind", kind, "--writes", "50", "--top", "5", timeout=50)
    assert report["kind"] == kind and report["transfers"] == 50
    assert report["p50_us_unprofiled"] > 0
    rows = report["functions"]
    assert len(rows) == 5 and all(row["calls_per_transfer"] > 0 for row in rows)
    # sorted by own time, the costliest first
    assert [row["own_us_per_transfer"] for row in rows] == sorted((row["own_us_per_transfer"] for row in rows), reverse=True)


def test_gc_reports_every_collector_mode_and_restores_the_collector() -> None:
    import gc

    from bench.collector import MODES, _collector, _Pauses

    report = bench("gc", "--rounds", "1", timeout=50)
    assert set(report["cpu_us_per_chunk"]) == set(MODES) and all(v > 0 for v in report["cpu_us_per_chunk"].values())
    assert report["ratios"]["default"] == 1.0
    assert [c["generation"] for c in report["default_collections"]] == [0, 1, 2]
    assert report["default_collections"][0]["count"] > 0  # thousands of chunks: the young generation ran
    callbacks = list(gc.callbacks)
    for mode in MODES:  # each mode is undone after its round, even when the round fails
        with pytest.raises(RuntimeError), _collector(mode, None):
            raise RuntimeError("a failed round")
        assert gc.isenabled() and gc.get_freeze_count() == 0 and gc.callbacks == callbacks
    with pytest.raises(RuntimeError), _collector("default", _Pauses()):
        raise RuntimeError("a failed round")
    assert gc.callbacks == callbacks


def test_chunk_check_is_exact_and_cheap() -> None:
    """The receivers' per-chunk check (ours and the pyzmq baseline's) is bit-exact and costs
    far less than moving the chunk: a float16 ``==`` took ~250 µs per 256 KiB chunk."""
    import time

    import numpy as np

    from bench.chunk_data import chunk_ok, make_chunk

    chunk = make_chunk(3, 1, 144)
    assert chunk_ok(chunk, 3, 1, 144) and not chunk_ok(chunk, 3, 2, 144)
    hidden = chunk["hidden"].copy()
    hidden[7, 5] = np.float16(0.5)
    assert not chunk_ok({**chunk, "hidden": hidden}, 3, 1, 144)
    small = make_chunk(3, 1, 5)  # compared as bytes (the large one as integers)
    assert chunk_ok(small, 3, 1, 5) and not chunk_ok(small, 3, 2, 5) and not chunk_ok(small, 3, 1, 6)
    for key, last in (("hidden", -1), ("hidden", 0), ("codes", -1), ("codes", 0)):
        changed = small[key].copy()
        changed.view(np.uint8).flat[last] ^= 0x80  # one bit of the first or last byte
        assert not chunk_ok({**small, key: changed}, 3, 1, 5), (key, last)
    assert chunk_ok({**small, "hidden": np.asfortranarray(small["hidden"])}, 3, 1, 5)  # any layout
    assert not chunk_ok({**small, "meta": {**small["meta"], "index": 2}}, 3, 1, 5)
    best = float("inf")
    for _ in range(20):  # the fastest of 20: a call preempted by another test's process says nothing
        start = time.perf_counter()
        chunk_ok(chunk, 3, 1, 144)
        best = min(best, time.perf_counter() - start)
    assert best < 100e-6


def test_compare_lists_every_run_and_meets_a_target_only_if_every_run_met(tmp_path: Path) -> None:
    """``python -m bench compare A B`` shows both runs' numbers side by side, in order, and a
    target is met only if it was met in every run."""
    def summary(p50: float, gbps: float) -> dict[str, float]:
        return {"p50_us": p50, "p99_us": p50 * 2, "gbps": gbps, "n": 5}

    def blocks(omni_gbps: float, met: bool) -> dict[str, Any]:
        row = {"workload": "256×64 KiB scattered", "kind": "throughput", "memcpy": summary(1, 9.0),
               "memcpy_rows": summary(1, 12.0), "omni_async": summary(1, omni_gbps), "nixl": None}
        target = {"row": "b", "ratio": round(omni_gbps / 12.0, 3), "threshold": 0.85, "met": met}
        return {"date": "2026-12-01", "command": "python -m bench blocks", "results": {"b": row},
                "ratios": {"b": {"vs_nixl": None, "vs_memcpy": 1.0, "vs_rows": round(omni_gbps / 12.0, 3)}},
                "targets": {"b ≥ 0.85× rows copy": target}}

    folders = []
    for name, gbps, met in (("A", 11.0, True), ("B", 9.0, False)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "blocks.json").write_text(json.dumps(blocks(gbps, met)))
        (folder / "idle.json").write_text(json.dumps({"cpu_pct_of_one_core": {"total": 0.3}, "met": True}))
        folders.append(str(folder))
    proc = subprocess.run([sys.executable, "-m", "bench", "compare", *folders], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| b | 256×64 KiB scattered | 12.00 / 12.00 GB/s | 11.00 / 9.00 GB/s | n/a / n/a GB/s | n/a / n/a | 0.92× / 0.75× |" in out
    assert "| b ≥ 0.85× rows copy | 0.92× / 0.75× | missed |" in out
    assert "| idle pair < 1 % of a core | 0.300 % / 0.300 % | **met** |" in out


def test_compare_shows_each_runs_cpu_per_chunk_of_both_sides(tmp_path: Path) -> None:
    """The chunk reports' CPU per chunk (sender and receiver, ours and the baseline's) appears
    side by side for throughput rows; latency rows, which have none, are left out."""
    def chunks(cpu: dict[str, dict[str, float]]) -> dict[str, Any]:
        rate = {"p50_us": 1.0, "p99_us": 2.0, "gbps": 1.0, "n": 5}
        return {
            "date": "2026-12-03", "command": "python -m bench chunks", "targets": {},
            "results": {
                "chunk_a": {"workload": "1 chunk", "kind": "latency", "omni_async": rate, "zmq": rate,
                            "chunks_per_s": 1.0, "zmq_chunks_per_s": 1.0, "cpu_us_per_chunk": None},
                "chunk_8k": {"workload": "64 requests", "kind": "throughput", "omni_async": rate, "zmq": rate,
                             "chunks_per_s": 3.0, "zmq_chunks_per_s": 1.0, "cpu_us_per_chunk": cpu},
            },
            "ratios": {"chunk_a": {"vs_zmq": 1.0}, "chunk_8k": {"vs_zmq": 3.0}},
        }

    folders = []
    for name, mine, theirs in (("A", (60.4, 50.0), (120.0, 110.0)), ("B", (70.0, 55.0), (130.0, 115.0))):
        folder = tmp_path / name
        folder.mkdir()
        cpu = {"omni_async": {"sender_us": mine[0], "receiver_us": mine[1]},
               "zmq": {"sender_us": theirs[0], "receiver_us": theirs[1]}}
        (folder / "chunks.json").write_text(json.dumps(chunks(cpu)))
        folders.append(str(folder))
    proc = subprocess.run([sys.executable, "-m", "bench", "compare", *folders], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("### CPU per chunk (µs)", 1)[1].split("###", 1)[0]
    assert "| chunk_8k | 60 / 70 | 50 / 55 | 120 / 130 | 110 / 115 |" in table
    assert "chunk_a" not in table
