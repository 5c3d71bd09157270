"""``python -m bench layers``: a KV-cache shaped write, 64 scattered blocks × 32 layers.

The cache is 32 per-layer regions of ``LAYER_BLOCKS`` blocks of ``BLOCK_LEN`` bytes (together
:data:`~bench.workloads.REGION_BYTES`); one transfer moves the same 64 scattered block indices
in every layer.  Contenders, each verified byte for byte after its timed loop:

* **omni_async**: a :class:`~omni_async.region.RegionSet` of 32 regions here (views of the
  source file) writing to a child agent with its own set of 32 regions (memfds, which this
  process maps to check them), one ``write_blocks`` per transfer;
* **NIXL** (if installed): its sender and receiver processes of ``bench blocks``, one
  ``make_prepped_xfer`` per transfer over descriptor lists with one descriptor per block and
  layer (2,048);
* **memcpy**: numpy copying the same rows in this process.

Both modes (same-host defaults, ``UCX_TLS=tcp``).  Numbers taken on a loaded host mean little.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from omni_async import Agent, BlockRegion, load_config
from omni_async.region import RegionSet
from omni_async.transport.shared import MappedRegion
from omni_async.wire import RegionShare

from .memcpy import time_copies
from .modes import SHM, TCP, Mode
from .nixl_side import NixlSide
from .procs import ChildError, Children
from .provenance import stamp
from .report import speed_ratio
from .shm import ShmFile, fill_random
from .stats import summarize
from .workloads import REGION_BYTES, Geometry

LAYERS = 32
BLOCKS = 64
BLOCK_LEN = 16 * 1024
LAYER_BLOCKS = REGION_BYTES // LAYERS // BLOCK_LEN
"""Blocks per layer region (128)."""
ROW = "kv_64x32"


class VerificationError(RuntimeError):
    """A contender's destination rows differ from the source after its timed loop."""


def indices(seed: int = 4321) -> tuple[list[int], list[int]]:
    """The 64 scattered ``(local, remote)`` block indices of every layer."""
    rng = np.random.default_rng(seed)
    local = rng.choice(LAYER_BLOCKS, BLOCKS, replace=False)
    remote = rng.choice(LAYER_BLOCKS, BLOCKS, replace=False)
    return [int(i) for i in local], [int(i) for i in remote]


def flat_rows(blocks: list[int]) -> list[int]:
    """Rows of the whole file (layer after layer) that hold ``blocks`` of every layer."""
    return [layer * LAYER_BLOCKS + block for layer in range(LAYERS) for block in blocks]


def layer_views(rows: npt.NDArray[np.uint8]) -> list[npt.NDArray[np.uint8]]:
    return [rows[layer * LAYER_BLOCKS : (layer + 1) * LAYER_BLOCKS] for layer in range(LAYERS)]


async def _time_omni(
    children: Children, src_rows: npt.NDArray[np.uint8], mode: Mode, local: list[int], remote: list[int],
    iters: int, warmup: int,
) -> list[int]:
    spec = [{"path": None, "num_blocks": LAYER_BLOCKS, "block_len": BLOCK_LEN, "layers": LAYERS,
             "config": mode.omni_config(f"layers-recv-{mode.name}")}]
    child = await children.start("bench.omni_peer", ["serve", json.dumps(spec)])
    shares = [msgspec.convert(share, RegionShare) for share in child.ready["layer_shares"][0]]
    mapped = [MappedRegion(share, LAYER_BLOCKS, BLOCK_LEN) for share in shares]
    try:
        regions = RegionSet([BlockRegion.wrap(view) for view in layer_views(src_rows)])
        config = load_config(mode.omni_config(f"layers-send-{mode.name}"), environ={})
        async with Agent(regions, config) as agent:
            peer = await agent.connect(child.ready["addresses"][0])
            clock, samples = time.perf_counter_ns, []
            for i in range(warmup + iters):
                t0 = clock()
                await agent.write_blocks(peer, local, remote)
                if i >= warmup:
                    samples.append(clock() - t0)
        for dst, src in zip(mapped, layer_views(src_rows), strict=True):
            if not np.array_equal(dst.rows[remote], src[local]):
                raise VerificationError(f"omni_async {mode.name}: a layer's rows differ from the source")
        return samples
    finally:
        for region in mapped:
            region.close()


async def run_layers(quick: bool = False, nixl: bool = True) -> dict[str, Any]:
    """Every contender in both modes; returns summaries and ratios."""
    iters, warmup = (3, 1) if quick else (50, 3)
    local, remote = indices()
    flat_local, flat_remote = flat_rows(local), flat_rows(remote)
    nbytes = BLOCKS * LAYERS * BLOCK_LEN
    geometry = Geometry("16k", BLOCK_LEN)
    results: dict[str, Any] = {}
    nixl_reason: dict[str, str | None] = {}
    files = [ShmFile(REGION_BYTES) for _role in ("layers-src", "layers-nixl", "layers-memcpy")]
    try:
        src, dst_nixl, dst_memcpy = files
        fill_random(src.flat, seed=11)
        src_rows = src.rows(BLOCK_LEN)
        for mode in (SHM, TCP):
            async with Children() as children:
                memcpy = time_copies(src_rows, dst_memcpy.rows(BLOCK_LEN), flat_local, flat_remote, iters, warmup)
                omni = await _time_omni(children, src_rows, mode, local, remote, iters, warmup)
                nixl_samples = None
                side = NixlSide(mode)
                if nixl:
                    await side.start(children, src, dst_nixl)
                else:
                    side.reason = "disabled (--no-nixl)"
                if side.available:
                    try:
                        nixl_samples = await side.time_writes(geometry, flat_local, flat_remote, iters, warmup)
                    except ChildError as exc:
                        side.reason = f"failed: {exc}"
                    else:
                        dst = dst_nixl.rows(BLOCK_LEN)
                        if not np.array_equal(dst[flat_remote], src_rows[flat_local]):
                            raise VerificationError(f"nixl {mode.name}: rows differ from the source")
                nixl_reason[mode.name] = side.reason
            row = ROW + mode.suffix
            results[row] = {
                "workload": f"{BLOCKS} scattered blocks × {LAYERS} layers of {BLOCK_LEN // 1024} KiB",
                "mode": mode.name, "kind": "throughput", "bytes": nbytes,
                "memcpy": summarize(nbytes, memcpy), "omni_async": summarize(nbytes, omni),
                "nixl": summarize(nbytes, nixl_samples) if nixl_samples else None,
            }
    finally:
        for file in files:
            file.close()
    ratios = {row: {"vs_memcpy": speed_ratio("throughput", r["omni_async"], r["memcpy"]),
                    "vs_nixl": speed_ratio("throughput", r["omni_async"], r["nixl"])} for row, r in results.items()}
    return {**stamp(), "results": results, "ratios": ratios,
            "nixl": {mode: {"available": reason is None, "reason": reason} for mode, reason in nixl_reason.items()}}


def table(report: dict[str, Any]) -> str:
    lines = ["| row | workload | memcpy | omni_async | NIXL | vs memcpy | vs NIXL |", "|---|---|---|---|---|---|---|"]
    for row, r in report["results"].items():
        ratio = report["ratios"][row]
        cells = [row, r["workload"], *(f"{r[c]['gbps']:.3f} GB/s" if r[c] else "n/a"
                                       for c in ("memcpy", "omni_async", "nixl")),
                 f"{ratio['vs_memcpy']:.3f}×", "n/a" if ratio["vs_nixl"] is None else f"{ratio['vs_nixl']:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    for mode, nixl in report["nixl"].items():
        if not nixl["available"]:
            lines.append(f"NIXL ({mode}): {nixl['reason']}")
    return "\n".join(lines)

