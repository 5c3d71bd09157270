"""A peer process for two-process tests: serves a region kept in a shared file.

``python -m tests.helpers.peer serve REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON``
  starts an agent over the memory-mapped file, prints ``{"address": ...}`` and serves until
  its stdin closes (or it is killed).  Chunk messages it receives are appended to
  ``REGION_FILE.messages`` as JSON lines (not for a REGION_FILE under ``/proc``: a sealed
  memfd of the test process, ``/proc/<pid>/fd/<n>``, mapped like any file).

``python -m tests.helpers.peer write REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON ADDRESS [FIRST COUNT [once]]``
  fills its region with random bytes, connects to ADDRESS, prints ``{"connected": peer_id}``
  (with ``"puts": true`` over tcp with ``ucx_puts``, once the peer's remote keys are in) and writes its blocks there in a loop until killed: all of them to the same rows, or, with
  FIRST and COUNT, its first COUNT blocks to the peer's rows FIRST.. .  With ``once`` it writes
  one time, prints ``{"written": COUNT}`` and waits until its stdin closes.

``python -m tests.helpers.peer pump REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON ADDRESS``
  like ``write`` with 8 writes in flight, printing ``{"ok": n}`` every 20 completed writes and
  ``{"failed": ErrorType, "at": monotonic}`` once when writes start failing; then, for each
  ``reconnect`` line on stdin, connects again, writes every block once and prints
  ``{"reconnected": peer_id}``.

``python -m tests.helpers.peer notices REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON``
  like ``serve``, and prints ``{"notice": data, "failed": ErrorType or null, "rows": n}`` for
  every notice of a write it receives, before the write is acknowledged.

``python -m tests.helpers.peer notify REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON ADDRESS``
  connects to ADDRESS and writes all its blocks there with 8 writes in flight until killed,
  each with the notice ``b"%d" % n`` (n = 0, 1, ... in write order).

``python -m tests.helpers.peer doomed REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON ADDRESS``
  fills its region with ``random_rows(seed=23)``, connects to ADDRESS, waits until the peer's
  same-host ring is up, prints ``{"connected": peer_id, "direct": kind}`` and writes all its
  blocks there with the notice ``b"doomed"``; fault injection: the same-host copy of that write
  is the real one, and right after it the process SIGKILLs itself (before it can say more).

``python -m tests.helpers.peer streams REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON``
  runs a ConnectorService (the config is its ``agent`` section), prints ``{"address": ...}``,
  waits for one sender, then for each :class:`omni_async.workload.Plan` it announces (0, 1, ...)
  receives and verifies every chunk (:func:`omni_async.workload.receive`) and prints
  ``{"verified": ok chunks, "bad": corrupted + reordered + missing}``.

``serve`` and ``notices`` take an optional sixth argument, block lengths separated by commas:
the agent then serves a region set of that many regions (allocated, REGION_FILE unused).

A REGION_FILE ending in ``.memfd`` is not used: the region is allocated (in a memfd, see
:mod:`omni_async.memfd`) instead of mapped from the file, and ``serve`` adds the process id
and the memfd's ``fd`` and ``token`` to its first line.

``python -m tests.helpers.peer race REGION_FILE NUM_BLOCKS BLOCK_LEN CONFIG_JSON``
  starts an agent, prints ``{"address": ..., "peer_id": ...}``, then answers one stdin line at
  a time: ``dial ADDRESS`` connects and prints ``{"dialled": peer_id | null, "error": ErrorType
  | null}``; ``check PEER`` waits until PEER is joined and no handshake of it is in progress,
  writes block 0 to its block 1 and prints ``{"peers": [...], "dialled_by": id, "joined": n,
  "left": n}`` (peer events since the last ``check``); ``gone PEER`` waits until PEER is gone and
  prints ``{"gone": PEER, "joined": n, "left": n}``.

``serve`` also prints ``{"event": "joined"|"left", "peer": id, "error": ErrorType, "at": t}``
for every peer event, and ``{"tls": ...}`` (the UCX transports in use) after its address.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from omni_async import Agent, BlockRegion, OmniAsyncError, load_config
from omni_async.eventloop import run
from omni_async.region import RegionSet


def region_file(path: str, num_blocks: int, block_len: int) -> BlockRegion:
    if path.endswith(".memfd"):
        return BlockRegion.allocate(num_blocks, block_len)
    return BlockRegion.wrap(np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_blocks, block_len)))


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def main(argv: list[str]) -> None:
    role, path, num_blocks, block_len, config_json = argv[:5]
    if role == "streams":
        await streams(path, json.loads(config_json))
        return
    region: BlockRegion | RegionSet = region_file(path, int(num_blocks), int(block_len))
    if role in ("serve", "notices") and len(argv) > 5:
        region = RegionSet.allocate(int(num_blocks), [int(n) for n in argv[5].split(",")])
    config = load_config(json.loads(config_json), environ={})
    async with Agent(region, config) as agent:
        if role == "notices":
            agent.set_notice_sink(lambda n: say({
                "notice": n.data.decode(), "rows": len(n.remote_idxs),
                "failed": type(n.failed).__name__ if n.failed else None}))
        if role in ("serve", "notices"):
            log = open(os.devnull if path.startswith("/proc/") else path + ".messages", "a")

            def sink(peer_id: str, key: str, meta: bytes, frames: list[Any]) -> None:
                log.write(json.dumps({"peer": peer_id, "key": key, "meta": meta.hex(),
                                      "frames": [bytes(f).hex() for f in frames]}) + "\n")
                log.flush()

            agent.set_message_sink(sink)
            agent.add_peer_listener(lambda e: say({
                "event": e.kind, "peer": e.peer_id, "at": time.monotonic(),
                "error": type(e.error).__name__ if e.error else None}))
            segment = agent.region.segment
            shared = {"pid": os.getpid(), "fd": segment.fd, "token": segment.token} if segment else {}
            say({"address": agent.control_address, "peer_id": agent.peer_id, **shared})
            say({"tls": agent.transport.ucx_config["TLS"]})
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, sys.stdin.read)
        elif role == "write":
            await write(agent, argv[5], *argv[6:])
        elif role == "pump":
            await pump(agent, argv[5])
        elif role == "chat":
            await chat(agent, *argv[5:])
        elif role == "notify":
            await notify(agent, argv[5])
        elif role == "doomed":
            await doomed(agent, argv[5])
        elif role == "race":
            await race(agent)


async def streams(path: str, config: dict[str, Any]) -> None:
    from omni_async import workload
    from omni_async.config import ServiceConfig
    from omni_async.service import ConnectorService

    settings = load_config({"agent": config, "region": {"num_blocks": 1, "block_len": 4096}},
                           environ={}, schema=ServiceConfig)
    async with ConnectorService(settings) as svc:
        say({"address": svc.control_address})
        sender = await svc.agent.wait_for_peer()
        for number in itertools.count():
            plan = await workload.next_plan(svc, sender, number)
            summary = await workload.receive(svc.adapter(plan.stage, source=sender), plan)
            say({"verified": summary.ok_chunks, "bad": summary.bad})


async def write(agent: Agent, address: str, first: str = "0", count: str = "", once: str = "") -> None:
    region = agent.region.array
    region[:] = np.random.default_rng(17).integers(0, 256, region.shape, dtype=np.uint8)
    if isinstance(region, np.memmap):
        region.flush()  # the test reads what was sent from the file
    peer = await agent.connect(address)
    say({"connected": peer, **({"puts": True} if await _puts(agent, peer) else {})})
    local = list(range(int(count) if count else agent.region.num_blocks))
    remote = [int(first) + i for i in local]
    while True:
        await agent.write_blocks(peer, local, remote)
        if once:
            say({"written": len(local)})
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            return


async def _puts(agent: Agent, peer: str) -> bool:
    """Whether writes to ``peer`` go as UCX puts: over tcp with puts on, once its keys came."""
    if not (agent.config.ucx_puts and agent.config.ucx_tls == "tcp"):
        return False
    link = agent.transport.links[peer]
    async with asyncio.timeout(10):
        while link.remote_keys is None:
            await asyncio.sleep(0.005)
    return True


async def notify(agent: Agent, address: str) -> None:
    peer = await agent.connect(address)
    say({"connected": peer})
    blocks = list(range(agent.region.num_blocks))
    numbers = itertools.count()

    async def writer() -> None:
        while True:
            await agent.write_blocks(peer, blocks, blocks, notice=b"%d" % next(numbers))

    await asyncio.gather(*(writer() for _ in range(8)))


def random_rows(shape: tuple[int, ...], seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


async def doomed(agent: Agent, address: str) -> None:
    agent.region.array[:] = random_rows(agent.region.array.shape, 23)
    peer = await agent.connect(address)
    link = agent.transport.links[peer]
    async with asyncio.timeout(10):
        while link.ring_out is None:  # the intent of a same-host write with a notice goes there
            await asyncio.sleep(0.005)
    writers = link.direct
    assert writers is not None, "no same-host writer to the peer"
    copy = writers.place

    def copy_then_die(srcs: Any, runs: Any) -> None:
        copy(srcs, runs)
        os.kill(os.getpid(), signal.SIGKILL)

    writers.place = copy_then_die  # type: ignore[method-assign]
    say({"connected": peer, "direct": writers.kind})
    await agent.write_blocks(peer, list(range(agent.region.num_blocks)), list(range(agent.region.num_blocks)),
                             notice=b"doomed")
    say({"survived": True})  # never: the copy killed this process


async def pump(agent: Agent, address: str) -> None:
    region = agent.region.array
    region[:] = np.random.default_rng(11).integers(0, 256, region.shape, dtype=np.uint8)
    peer = await agent.connect(address)
    say({"connected": peer})
    blocks = list(range(agent.region.num_blocks))
    done = 0

    async def writer() -> None:
        nonlocal done
        while True:
            await agent.write_blocks(peer, blocks, blocks)
            done += 1
            if done % 20 == 0:
                say({"ok": done})

    results = await asyncio.gather(*(writer() for _ in range(8)), return_exceptions=True)
    say({"failed": type(results[0]).__name__, "at": time.monotonic(), "kinds": sorted({type(r).__name__ for r in results})})
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "reconnect":
        peer = await agent.connect(address)
        await agent.write_blocks(peer, blocks, blocks)
        say({"reconnected": peer})


async def chat(agent: Agent, address: str, size: str = "8192") -> None:
    """Send chunk messages of one ``size``-byte frame (``arange`` modulo 256) to the peer at
    ``address`` from 8 streams until killed."""
    peer = await agent.connect(address)
    say({"connected": peer})
    frame = np.arange(int(size), dtype=np.uint8)

    async def stream(number: int) -> None:
        while True:
            await agent.send_message(peer, f"s{number}", b"m", [frame])

    await asyncio.gather(*(stream(i) for i in range(8)))


async def race(agent: Agent) -> None:
    counts = {"joined": 0, "left": 0}
    agent.add_peer_listener(lambda e: counts.__setitem__(e.kind, counts[e.kind] + 1))
    say({"address": agent.control_address, "peer_id": agent.peer_id})
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).split():
        command, arg = line
        if command == "dial":
            try:
                say({"dialled": await agent.connect(arg), "error": None})
            except OmniAsyncError as exc:
                say({"dialled": None, "error": type(exc).__name__})
        elif command == "check":
            await agent.wait_for_peer(arg, timeout=10)
            async with asyncio.timeout(10):
                while agent.session_phase(arg) != "joined" or agent.handshakes_in_progress(arg):
                    await asyncio.sleep(0.002)
            await agent.write_blocks(arg, [0], [1])
            say({"peers": sorted(agent.peers), "dialled_by": agent.dialled_by(arg), **counts})
            counts.update(joined=0, left=0)
        elif command == "gone":
            async with asyncio.timeout(10):
                while agent.session_phase(arg) != "gone":
                    await asyncio.sleep(0.002)
            say({"gone": arg, **counts})
            counts.update(joined=0, left=0)


if __name__ == "__main__":
    run(main(sys.argv[1:]))
