"""The facade contender: :class:`~omni_async.compat.SyncDataTransport` polled like NIXL.

A receiver and a sender process (``bench.compat_peer``), one transport per geometry on each
side, same-host defaults; each side's view maps a sealed memfd (:class:`~bench.shm.ShmFile`),
which the receiver offers as that file, so the sender maps it (the ``"file"`` same-host lane, reported in ``config``).
Rows ``compat_a``, ``compat_b``, ``compat_c`` repeat workloads a, b and c through the facade in
two poll modes (see :mod:`bench.compat_peer`): ``tight`` and ``step``.  Iteration counts are
capped (:data:`MAX_ITERS`) and each timed loop is time-boxed (``budget_s``): the facade was
once ~400× slower than the async path under a tight poll.
"""

from __future__ import annotations

import json

from .compat_peer import STEP_S
from .modes import SHM
from .procs import Child, Children
from .shm import ShmFile
from .workloads import Geometry

POLL_MODES = ("tight", "step")
ROWS = {"compat_a": "a", "compat_b": "b", "compat_c": "c"}
"""Facade row → the async row it repeats (and is compared with)."""
MAX_ITERS = {"latency": 200, "throughput": 20}
"""At most this many timed writes per round and poll mode (fewer with ``--quick`` or ``--iters``)."""
BUDGET_S = {False: 1.0, True: 0.1}
"""Seconds after which a timed loop stops (keyed by ``--quick``): a starved facade finishes in seconds."""


class CompatSide:
    """Connected facade sender/receiver processes, one transport pair per geometry."""

    def __init__(self) -> None:
        self._sender: Child | None = None
        self._index: dict[str, int] = {}
        self._direct: list[str | None] = []

    @property
    def config(self) -> dict[str, object]:
        return {"mode": SHM.name, "poll_modes": list(POLL_MODES), "step_us": round(STEP_S * 1e6),
                "max_iters": MAX_ITERS, "budget_s": {"full": BUDGET_S[False], "quick": BUDGET_S[True]},
                "direct": dict(zip(self._index, self._direct, strict=False))}

    async def start(self, children: Children, src: ShmFile, dst: ShmFile, geometries: list[Geometry]) -> CompatSide:
        def spec(role: str, file: ShmFile) -> str:
            return json.dumps([
                {"path": file.path, "num_blocks": g.num_blocks, "block_len": g.block_len,
                 "config": SHM.omni_config(f"compat-{role}-{g.name}")}
                for g in geometries
            ])

        receiver = await children.start("bench.compat_peer", ["recv", spec("recv", dst)])
        self._sender = await children.start("bench.compat_peer", ["send", spec("send", src)])
        connected = await self._sender.request({"cmd": "connect", "peers": receiver.ready["peers"]})
        self._index = {g.name: i for i, g in enumerate(geometries)}
        self._direct = list(connected["direct"])
        return self

    async def time_writes(
        self, geometry: Geometry, local: list[int], remote: list[int], iters: int, warmup: int, poll: str,
        budget_s: float,
    ) -> list[int]:
        """Nanoseconds of each timed write (write_blocks → the poll that reports it done)."""
        assert self._sender is not None, "start first"
        answer = await self._sender.request(
            {"cmd": "run", "index": self._index[geometry.name], "local": local, "remote": remote,
             "iters": iters, "warmup": warmup, "poll": poll, "budget_s": budget_s},
            timeout=budget_s + 120,
        )
        return [int(ns) for ns in answer["ns"]]
