"""``python -m bench blocks``: block writes, omni_async side by side with memcpy and NIXL.

For every workload (see :mod:`bench.workloads`) and mode (same-host defaults, and
``UCX_TLS=tcp``), in each of several rounds: numpy memcpy in this process, then omni_async
(sender agent here, receiver agent in a child), then NIXL (sender and receiver children), then
for a, b and c in the same-host mode the synchronous facade (rows ``compat_a|b|c``, sender and
receiver children, see :mod:`bench.compat_side`).  The rounds interleave the contenders so a
neighbour's load hits them alike; samples of all rounds are pooled and summarized by their
median (p50/p99 for latency).  Before each timed loop the
destination rows are zeroed, after it every byte is compared with the source: a mismatch
raises :class:`VerificationError`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .compat_side import BUDGET_S, MAX_ITERS, POLL_MODES, CompatSide
from .compat_side import ROWS as COMPAT_ROWS
from .hostload import ForeignLoad
from .memcpy import time_copies
from .modes import SHM, TCP, Mode
from .nixl_side import DEFAULT_ERROR_HANDLING, NixlSide
from .omni_side import OmniSide
from .procs import ChildError, Children
from .progress import advance, steps
from .provenance import stamp
from .report import ratios_and_targets
from .shm import ShmFile, blocks_match, fill_random
from .stats import summarize
from .workloads import GEOMETRIES, REGION_BYTES, Workload, workloads

TCP_WORKLOADS = ("a", "b", "c")
"""Workloads also run with ``UCX_TLS=tcp`` (rows ``a_tcp``, ``b_tcp``, ``c_tcp``)."""


class VerificationError(RuntimeError):
    """A contender's destination blocks differ from the source after its timed loop."""


@dataclass(frozen=True, slots=True)
class Options:
    quick: bool = False
    iters: int | None = None
    modes: tuple[str, ...] = ("shm", "tcp")
    rounds: int | None = None
    nixl: bool = True
    compat: bool = True
    progress: bool = True
    """A bar on stderr while it runs (only if stderr is a terminal)."""
    nixl_error_handling: str = DEFAULT_ERROR_HANDLING


class _Samples:
    """Pooled per-iteration samples, keyed by (row, contender)."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, str], list[int]] = {}

    def add(self, row: str, contender: str, samples: list[int]) -> None:
        self.data.setdefault((row, contender), []).extend(samples)

    def get(self, row: str, contender: str) -> list[int]:
        return self.data.get((row, contender), [])


async def run_blocks(opts: Options) -> dict[str, Any]:
    """Run every workload in every mode; return the raw summaries, ratios and run metadata."""
    modes = [m for m in (SHM, TCP) if m.name in opts.modes]
    plan: list[tuple[Mode, Workload]] = [
        (m, w) for m in modes for w in workloads(opts.quick, opts.iters)
        if m is SHM or w.name in TCP_WORKLOADS
    ]
    rounds = opts.rounds or (1 if opts.quick else 5)
    load = ForeignLoad()
    samples = _Samples()
    files: list[ShmFile] = []
    omni = OmniSide()
    nixl: dict[str, NixlSide] = {}
    compat = CompatSide() if opts.compat and SHM in modes else None
    try:
        for _role in ("src", "dst-nixl", "dst-memcpy", "dst-compat"):
            files.append(ShmFile(REGION_BYTES))
        src, dst_nixl, dst_memcpy, dst_compat = files
        fill_random(src.flat, seed=7)
        async with Children() as children:
            try:
                async with asyncio.TaskGroup() as starting:  # children start side by side
                    starting.create_task(omni.start(children, src, modes, list(GEOMETRIES)))
                    if compat is not None:
                        starting.create_task(compat.start(children, src, dst_compat, list(GEOMETRIES)))
                    for mode in modes:
                        side = nixl[mode.name] = NixlSide(mode, opts.nixl_error_handling)
                        if opts.nixl:
                            starting.create_task(side.start(children, src, dst_nixl))
                        else:
                            side.reason = "disabled (--no-nixl)"
                with steps("bench blocks", rounds * len(plan), show=opts.progress) as progress:
                    for _ in range(rounds):
                        for mode, workload in plan:
                            await _one(
                                mode, workload, samples, omni, nixl[mode.name], src, dst_nixl, dst_memcpy
                            )
                            if compat is not None and mode is SHM and workload.name in COMPAT_ROWS.values():
                                await _one_compat(workload, samples, compat, src, dst_compat, opts.quick)
                            advance(progress, f"{workload.name} {mode.name}")
            finally:
                await omni.close()
    finally:
        for file in files:
            file.close()
    result = _result(opts, rounds, plan, samples, omni, nixl, compat)
    result["host"]["load"] = load.stop()
    return result


async def _one(
    mode: Mode, w: Workload, samples: _Samples, omni: OmniSide, nixl: NixlSide,
    src: ShmFile, dst_nixl: ShmFile, dst_memcpy: ShmFile,
) -> None:
    """One round of one row: memcpy, omni_async, NIXL, each verified after its loop."""
    row = w.name + mode.suffix
    g = w.geometry
    local, remote = w.indices()
    src_rows = src.rows(g.block_len)

    def reset(dst: npt.NDArray[np.uint8]) -> None:
        dst[remote] = 0

    def verify(dst: npt.NDArray[np.uint8], who: str) -> None:
        if not blocks_match(src_rows, dst, local, remote):
            raise VerificationError(f"{who}: destination blocks of {row} differ from the source")

    memcpy_rows = dst_memcpy.rows(g.block_len)
    reset(memcpy_rows)
    samples.add(row, "memcpy", time_copies(src_rows, memcpy_rows, local, remote, w.iters, w.warmup))
    verify(memcpy_rows, "memcpy")
    reset(memcpy_rows)
    rows_copy = time_copies(src_rows, memcpy_rows, local, remote, w.iters, w.warmup, per_block=True)
    samples.add(row, "memcpy_rows", rows_copy)
    verify(memcpy_rows, "memcpy_rows")

    omni_rows = omni.destination(mode, g)
    reset(omni_rows)
    samples.add(row, "omni_async", await omni.time_writes(mode, g, local, remote, w.iters, w.warmup))
    verify(omni_rows, "omni_async")
    del omni_rows  # the mapping closes with the side

    if nixl.available:
        nixl_rows = dst_nixl.rows(g.block_len)
        reset(nixl_rows)
        try:
            samples.add(row, "nixl", await nixl.time_writes(g, local, remote, w.iters, w.warmup))
        except ChildError as exc:
            nixl.reason = f"failed during {row}: {exc}"
            return
        verify(nixl_rows, "nixl")


async def _one_compat(
    w: Workload, samples: _Samples, compat: CompatSide, src: ShmFile, dst: ShmFile, quick: bool
) -> None:
    """One round of a facade row: workload ``w`` in each poll mode, capped and time-boxed, verified."""
    g = w.geometry
    local, remote = w.indices()
    row = next(name for name, of in COMPAT_ROWS.items() if of == w.name)
    iters = min(w.iters, MAX_ITERS[w.kind])
    for poll in POLL_MODES:
        dst.rows(g.block_len)[remote] = 0
        samples.add(row, poll, await compat.time_writes(g, local, remote, iters, 1 if quick else 2, poll,
                                                        budget_s=BUDGET_S[quick]))
        if not blocks_match(src.rows(g.block_len), dst.rows(g.block_len), local, remote):
            raise VerificationError(f"compat ({poll} poll): destination blocks of {row} differ from the source")


def _compat_results(plan: list[tuple[Mode, Workload]], samples: _Samples) -> dict[str, Any]:
    """``compat_*`` rows: the facade's summary per poll mode, beside the async row it repeats."""
    out: dict[str, Any] = {}
    for row, of in COMPAT_ROWS.items():
        w = next((w for m, w in plan if m is SHM and w.name == of), None)
        if w is None or not samples.get(row, POLL_MODES[0]):
            continue
        out[row] = {"workload": w.describe(), "of": of, "mode": SHM.name, "kind": w.kind, "bytes": w.nbytes,
                    **{poll: summarize(w.nbytes, samples.get(row, poll)) for poll in POLL_MODES}}
    return out


def _result(
    opts: Options, rounds: int, plan: list[tuple[Mode, Workload]], samples: _Samples,
    omni: OmniSide, nixl: dict[str, NixlSide], compat: CompatSide | None,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mode, w in plan:
        row = w.name + mode.suffix
        nixl_ok = nixl[mode.name].available and samples.get(row, "nixl")
        results[row] = {
            "workload": w.describe(),
            "mode": mode.name,
            "kind": w.kind,
            "bytes": w.nbytes,
            "runs": len(w.indices()[0]) if w.scattered else 1,
            "memcpy": summarize(w.nbytes, samples.get(row, "memcpy")),
            "memcpy_rows": summarize(w.nbytes, samples.get(row, "memcpy_rows")),
            "omni_async": summarize(w.nbytes, samples.get(row, "omni_async")),
            "nixl": summarize(w.nbytes, samples.get(row, "nixl")) if nixl_ok else None,
        }
    compat_rows = _compat_results(plan, samples)
    ratios, targets = ratios_and_targets(results, compat_rows)
    return {
        **stamp(),
        "settings": {"quick": opts.quick, "rounds": rounds, "iters": {w.name: w.iters for _, w in plan},
                     "gb": "10^9 bytes", "verified": "every byte, after each timed loop"},
        "omni_async": {"config": omni.config},
        "nixl": {
            mode: {"available": side.available, "reason": side.reason, "config": side.config}
            for mode, side in nixl.items()
        },
        "compat": {"config": compat.config if compat else None, "available": bool(compat_rows)},
        "results": results,
        "compat_results": compat_rows,
        "ratios": ratios,
        "targets": targets,
    }
