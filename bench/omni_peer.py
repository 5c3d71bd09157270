"""omni_async agents in a child process: the receiving side of ``blocks``, or one half of ``idle``.

``python -m bench.omni_peer serve SPEC_JSON``
  SPEC is a list of ``{"path", "num_blocks", "block_len", "config"}`` (plus ``"layers": L`` for
  a region set of L allocated regions of that geometry): one :class:`Agent` per
  entry over the memory-mapped file ``path``, or, with ``path`` null, over a region it allocates
  (a memfd, as services do), configured by ``config`` (a mapping for
  :func:`omni_async.load_config`).  Prints ``{"addresses": [...], "peer_ids": [...], "shares":
  [...]}`` once all listen (``shares``: each region's same-host share, which the bench process maps
  to check the bytes), then serves until stdin closes.

``python -m bench.omni_peer dial SPEC_JSON ADDRESS``
  one agent (SPEC holds one entry; ``path`` may be null for an owned region) that connects to
  ADDRESS, prints ``{"connected": peer_id}`` and stays connected until stdin closes.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import msgspec
import numpy as np

from omni_async import Agent, BlockRegion, load_config
from omni_async.eventloop import run
from omni_async.region import RegionSet
from omni_async.transport.shared import advertise

from .procs import say, until_stdin_closes


def _region(entry: dict[str, Any]) -> BlockRegion | RegionSet:
    shape = (int(entry["num_blocks"]), int(entry["block_len"]))
    if entry.get("layers"):
        return RegionSet.allocate(shape[0], [shape[1]] * int(entry["layers"]))
    if entry.get("path") is None:
        return BlockRegion.allocate(*shape)
    mapped = np.memmap(entry["path"], dtype=np.uint8, mode="r+", shape=shape)
    return BlockRegion.wrap(mapped.view(np.ndarray))  # plain view: slicing a memmap costs µs


async def main(argv: list[str]) -> None:
    role, spec_json = argv[0], argv[1]
    spec: list[dict[str, Any]] = json.loads(spec_json)
    async with contextlib.AsyncExitStack() as stack:
        agents = [
            await stack.enter_async_context(Agent(_region(e), load_config(e.get("config") or {}, environ={})))
            for e in spec
        ]
        if role == "serve":
            say({
                "addresses": [a.control_address for a in agents],
                "peer_ids": [a.peer_id for a in agents],
                "shares": [msgspec.to_builtins(advertise(a.region)) for a in agents],
                "layer_shares": [[msgspec.to_builtins(advertise(r)) for r in a.regions.regions] for a in agents],
            })
        elif role == "dial":
            say({"connected": await agents[0].connect(argv[2])})
        else:
            raise SystemExit(f"unknown role {role!r}")
        await until_stdin_closes()


if __name__ == "__main__":
    try:
        run(main(sys.argv[1:]))
    except Exception as exc:  # one line the parent can report, not a traceback it cannot parse
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
