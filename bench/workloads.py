"""The block workloads: region geometries, sizes, iteration counts and seeded index lists.

Every workload writes ``count`` blocks of one geometry from a source region to a destination
region of the same geometry.  Scattered workloads draw distinct random block indices on each
side (seeded, so every contender moves exactly the same blocks); contiguous ones use
``0..count-1`` on both sides (one run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

KIB = 1024
MIB = 1024 * KIB
REGION_BYTES = 64 * MIB
"""Every region (source and destinations) is this large; each geometry views it as rows."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """``num_blocks × block_len`` rows over a :data:`REGION_BYTES` region."""

    name: str
    block_len: int

    @property
    def num_blocks(self) -> int:
        return REGION_BYTES // self.block_len


GEOMETRIES = (Geometry("64k", 64 * KIB), Geometry("1m", MIB))


@dataclass(frozen=True, slots=True)
class Workload:
    """One measurement: ``count`` blocks per transfer, timed ``iters`` times after ``warmup``."""

    name: str
    geometry: Geometry
    count: int
    scattered: bool
    kind: Literal["latency", "throughput"]
    iters: int
    warmup: int

    @property
    def nbytes(self) -> int:
        """Bytes moved by one transfer."""
        return self.count * self.geometry.block_len

    def indices(self, seed: int = 1234) -> tuple[list[int], list[int]]:
        """``(local, remote)`` block indices, the same for every contender."""
        if not self.scattered:
            return list(range(self.count)), list(range(self.count))
        rng = np.random.default_rng([seed, self.count, self.geometry.block_len])
        n = self.geometry.num_blocks
        local = rng.choice(n, self.count, replace=False)
        remote = rng.choice(n, self.count, replace=False)
        return [int(i) for i in local], [int(i) for i in remote]

    def describe(self) -> str:
        size = f"{self.geometry.block_len // KIB} KiB" if self.geometry.block_len < MIB else "1 MiB"
        return f"{self.count}×{size} {'scattered' if self.scattered else 'contiguous'}"


def workloads(quick: bool = False, iters: int | None = None) -> list[Workload]:
    """a, b, c, b_contig, c_contig.  ``quick`` cuts iterations (numbers then are only indicative);
    ``iters`` overrides the throughput iteration count (latency runs 20× as many)."""
    g64, g1m = GEOMETRIES
    tput = iters if iters is not None else (3 if quick else 50)
    lat = tput * 20 if iters is not None else (40 if quick else 1000)
    warm = 1 if quick else 3
    return [
        Workload("a", g64, 1, True, "latency", lat, warm * 20),
        Workload("b", g64, 256, True, "throughput", tput, warm),
        Workload("c", g1m, 16, True, "throughput", tput, warm),
        Workload("b_contig", g64, 256, False, "throughput", tput, warm),
        Workload("c_contig", g1m, 16, False, "throughput", tput, warm),
    ]
