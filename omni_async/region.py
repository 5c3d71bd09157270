"""Block memory regions, config fingerprints and index-run planning.  No I/O.

A :class:`BlockRegion` is a ``num_blocks × block_len`` uint8 array.  Remote peers write into it
(the transport posts receives straight into its row slices), so it must stay alive and must not
be resized while a transport uses it.  An allocated region lives in shared memory that peers
on the same host may map (:mod:`omni_async.memfd`); a wrapped one may already (a shared
mapping of a tmpfs file sealed against shrinking: :meth:`BlockRegion.shared_file`).  Building the one and finding the
other are the only I/O here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ConfigError, InvalidBlocks
from .memfd import SharedFile, SharedSegment
from .wire import MAX_LAYERS

log = logging.getLogger(__name__)

__all__ = ["BlockRegion", "Run", "config_fingerprint", "plan_runs", "run_table"]


def config_fingerprint(fields: Mapping[str, Any] | None) -> str:
    """Content hash of model config fields; ``""`` (compatible with anyone) for None or empty.

    Identical to the seed transport: sha256 of the canonical JSON (sorted keys, no spaces),
    hex, first 16 characters.
    """
    if not fields:
        return ""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def fingerprints_compatible(a: str, b: str) -> bool:
    """Two fingerprints are compatible unless both are non-empty and differ."""
    return not a or not b or a == b


class BlockRegion:
    """A 2-D ``num_blocks × block_len`` uint8 region, owned here or wrapping a caller's buffer.

    Wrapping does not copy: the caller keeps ownership of the memory and must keep it alive
    for as long as the region is in use.  A read-only buffer is refused, because peers write
    into it.
    """

    __slots__ = ("_array", "_file", "_segment")

    def __init__(self, array: npt.NDArray[np.uint8], segment: SharedSegment | None = None) -> None:
        if not isinstance(array, np.ndarray) or array.ndim != 2 or array.dtype != np.uint8:
            raise ConfigError("a block region must be a 2-D uint8 numpy array")
        if not array.flags.c_contiguous:
            raise ConfigError("a block region must be C-contiguous")
        if not array.flags.writeable:
            raise ConfigError("a block region must be writeable")
        if array.shape[0] < 1 or array.shape[1] < 1:
            raise ConfigError(f"a block region needs at least one block of one byte, got {array.shape}")
        self._array = array
        self._segment = segment
        # The tmpfs file a wrapped region maps: False until looked up (never, if allocated)
        self._file: SharedFile | bool | None = None if segment is not None else False

    @classmethod
    def allocate(cls, num_blocks: int, block_len: int) -> BlockRegion:
        """A new zero-filled region owned by the returned object.

        It lives in a sealed memfd (:class:`~omni_async.memfd.SharedSegment`) that peers on
        this host may map to write blocks with one copy; where the kernel has no memfd, in
        private memory.
        """
        for name, value in (("num_blocks", num_blocks), ("block_len", block_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        try:
            segment = SharedSegment(num_blocks * block_len)
        except OSError as exc:
            log.info("no memfd for a block region (%s): allocating private memory", exc)
            return cls(np.zeros((num_blocks, block_len), dtype=np.uint8))
        return cls(segment.array.reshape(num_blocks, block_len), segment)

    @classmethod
    def wrap(cls, buffer: Any) -> BlockRegion:
        """Wrap a caller's 2-D buffer (numpy array or memoryview) without copying."""
        if isinstance(buffer, memoryview):
            if buffer.readonly:
                raise ConfigError("a block region must be writeable")
            if buffer.ndim != 2:
                raise ConfigError(f"a block region must be 2-D, got {buffer.ndim}-D")
            array = np.frombuffer(buffer.cast("B"), dtype=np.uint8).reshape(buffer.shape)
        elif isinstance(buffer, np.ndarray):
            if buffer.ndim != 2:
                raise ConfigError(f"a block region must be 2-D, got {buffer.ndim}-D")
            if not buffer.flags.c_contiguous:
                raise ConfigError("a block region must be C-contiguous")
            array = buffer if buffer.dtype == np.uint8 else buffer.view(np.uint8)
        else:
            raise ConfigError(f"cannot wrap {type(buffer).__name__} as a block region")
        return cls(array)

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The whole region as a 2-D uint8 array (a view, not a copy)."""
        return self._array

    @property
    def segment(self) -> SharedSegment | None:
        """The shared memory the region lives in (allocated regions), or None (wrapped ones)."""
        return self._segment

    def shared_file(self) -> SharedFile | None:
        """For a wrapped region that is a shared, writable mapping of a tmpfs file sealed against
        shrinking (a memfd with ``F_SEAL_SHRINK``: e.g. an allocated region's array, wrapped;
        never a plain ``/dev/shm`` file, which could shrink under a peer's mapping), that
        file, opened so that peers on this host can map it (looked up in ``/proc/self/maps`` on the first call,
        then kept, with its descriptor, as long as the region lives); None otherwise (an
        allocated region: see :attr:`segment`)."""
        if self._file is False:
            self._file = SharedFile.find(self.base_addr, self.nbytes)
        return self._file if isinstance(self._file, SharedFile) else None

    def release_shared_file(self) -> None:
        """Close the descriptor :meth:`shared_file` opened, if it did (peers' mappings stay
        valid; a later :meth:`shared_file` looks the file up again).  Idempotent."""
        if isinstance(self._file, SharedFile):
            self._file.close()
            self._file = False

    @property
    def num_blocks(self) -> int:
        return int(self._array.shape[0])

    @property
    def block_len(self) -> int:
        return int(self._array.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self._array.nbytes)

    @property
    def base_addr(self) -> int:
        """Address of the first byte of the region in this process."""
        return int(self._array.__array_interface__["data"][0])

    def block(self, index: int) -> npt.NDArray[np.uint8]:
        """Zero-copy view of one block."""
        row: npt.NDArray[np.uint8] = self._array[index]
        return row

    def blocks(self, start: int, count: int) -> npt.NDArray[np.uint8]:
        """Zero-copy contiguous view of ``count`` blocks from ``start`` (a 1-D byte array)."""
        view: npt.NDArray[np.uint8] = self._array[start : start + count].reshape(-1)
        return view


class RegionSet:
    """Regions that share ``num_blocks`` (one per layer, or K and V separately), each with its
    own ``block_len``: block index ``i`` names block ``i`` of every region, and a transfer of
    it moves it in all of them.  A single :class:`BlockRegion` is the one-region case.
    """

    __slots__ = ("block_bytes", "block_lens", "regions")

    def __init__(self, regions: Sequence[BlockRegion]) -> None:
        if not regions:
            raise ConfigError("a region set needs at least one region")
        if len(regions) > MAX_LAYERS:
            raise ConfigError(f"a region set holds at most {MAX_LAYERS} regions, got {len(regions)}")
        counts = {region.num_blocks for region in regions}
        if len(counts) != 1:
            raise ConfigError(f"the regions of a set must share num_blocks, got {sorted(counts)}")
        self.regions: tuple[BlockRegion, ...] = tuple(regions)
        self.block_lens: tuple[int, ...] = tuple(region.block_len for region in self.regions)
        """Block length of each region, the first one first."""
        self.block_bytes: int = sum(self.block_lens)
        """Bytes one block index moves (its block in every region)."""

    @classmethod
    def allocate(cls, num_blocks: int, block_lens: Sequence[int]) -> RegionSet:
        """New zero-filled regions (each in its own memfd, see :meth:`BlockRegion.allocate`)."""
        return cls([BlockRegion.allocate(num_blocks, block_len) for block_len in block_lens])

    def __len__(self) -> int:
        return len(self.regions)

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def arrays(self) -> list[npt.NDArray[np.uint8]]:
        return [region.array for region in self.regions]


def as_region_set(region: BlockRegion | RegionSet) -> RegionSet:
    return region if isinstance(region, RegionSet) else RegionSet([region])


Run = tuple[int, int, int]
"""``(local, remote, length)``: ``length`` consecutive blocks from ``local`` written to as many
consecutive ones at ``remote``.  A plain tuple, not a named one: a plan of hundreds of one-block
runs costs a quarter less (256 scattered pairs: 45 µs instead of 59).  (Checking and coalescing
with numpy instead was measured slower where it counts: right after a large copy, which
evicts numpy's machinery from the caches, 64 µs instead of 47 for 256 scattered pairs.)
Lists that count up by one on both sides (a contiguous write) are recognised by comparisons
that run in C and planned as one run without the loop."""

def run_table(runs: Sequence[Run]) -> npt.NDArray[np.uint64]:
    """``runs`` as a ``(len(runs), 3)`` array of (local, remote, count).  Raises
    :class:`OverflowError` for a negative value."""
    return np.fromiter(chain.from_iterable(runs), np.uint64, 3 * len(runs)).reshape(-1, 3)


def plan_runs(
    local_idxs: Sequence[int], remote_idxs: Sequence[int], local_blocks: int, remote_blocks: int
) -> list[Run]:
    """Check paired index lists and coalesce them into runs contiguous on both sides, in order.

    Raises :class:`InvalidBlocks` if the lengths differ, an index is not an int, or an index
    falls outside ``[0, local_blocks)`` / ``[0, remote_blocks)``.
    """
    if len(local_idxs) != len(remote_idxs):
        raise InvalidBlocks(
            f"local_idxs has {len(local_idxs)} entries but remote_idxs has {len(remote_idxs)}"
        )
    single = _single_run(local_idxs, remote_idxs, local_blocks, remote_blocks)
    if single is not None:
        return [single]
    runs: list[Run] = []
    start_l = start_r = count = 0
    for li, ri in zip(local_idxs, remote_idxs, strict=True):
        if type(li) is not int or type(ri) is not int:
            li, ri = _as_index(li, "local"), _as_index(ri, "remote")
        if not 0 <= li < local_blocks:
            raise InvalidBlocks(f"local block index {li} out of range [0, {local_blocks})")
        if not 0 <= ri < remote_blocks:
            raise InvalidBlocks(f"remote block index {ri} out of range [0, {remote_blocks})")
        if count and li == start_l + count and ri == start_r + count:
            count += 1
            continue
        if count:
            runs.append((start_l, start_r, count))
        start_l, start_r, count = li, ri, 1
    if count:
        runs.append((start_l, start_r, count))
    return runs


def _single_run(
    local_idxs: Sequence[int], remote_idxs: Sequence[int], local_blocks: int, remote_blocks: int
) -> Run | None:
    """The one run of two lists of Python ints that count up by one from in-range starts (a
    contiguous write: its plan in C-speed comparisons, 256 pairs 23-34 -> 9-11 µs, or 58-64 ->
    28-30 µs right after a large copy), else None (the caller's loop plans, and rejects,
    everything else)."""
    count = len(local_idxs)
    if count < 2 or type(local_idxs) is not list or type(remote_idxs) is not list:
        return None
    first_l, first_r = local_idxs[0], remote_idxs[0]
    if (
        type(first_l) is not int
        or type(first_r) is not int
        or first_l < 0
        or first_l + count > local_blocks
        or first_r < 0
        or first_r + count > remote_blocks
        or local_idxs[-1] != first_l + count - 1
        or remote_idxs[-1] != first_r + count - 1
    ):
        return None
    # Equal to the ranges *and* all of type int (1.0 == 1 and True == 1, but neither is an index).
    if local_idxs != list(range(first_l, first_l + count)) or remote_idxs != list(range(first_r, first_r + count)):
        return None
    if set(map(type, local_idxs)) != {int} or set(map(type, remote_idxs)) != {int}:
        return None
    return (first_l, first_r, count)


def _as_index(value: object, side: str) -> int:
    """Accept Python and numpy integers (not bools, not floats) as block indices."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidBlocks(f"{side} block index {value!r} is not an int")
    return int(value)
