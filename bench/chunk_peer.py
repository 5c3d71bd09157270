"""The receiving stage of ``chunks``: a :class:`~omni_async.service.ConnectorService` in a child.

``python -m bench.chunk_peer SERVICE_CONFIG_JSON STAGE``
prints ``{"address", "peer_id"}``, then serves plans until stdin closes.  A plan arrives over
the connector itself under ``bench:plan:N`` (``{"requests": [numbers], "chunks": C,
"tokens": T}``); the peer streams every listed request through its adapter (all at once, each
in order), checks every chunk, and answers ``bench:done:N`` with ``{"chunks", "bad"}``.
Every block write with a notice it receives is echoed: it writes its block 0 back with the
same notice (``notice_rt``).
"""

from __future__ import annotations

import asyncio
import json
import sys

from omni_async.adapter import TransferAdapter
from omni_async.agent import Agent
from omni_async.config import ServiceConfig, load_config
from omni_async.eventloop import run
from omni_async.service import ConnectorService
from omni_async.transport.notices import Notice

from .chunk_data import chunk_ok
from .procs import say, until_stdin_closes


async def _consume(adapter: TransferAdapter, request_id: str, request: int, tokens: int) -> tuple[int, int]:
    """Stream one request to its final chunk; return (chunks seen, chunks wrong)."""
    seen = bad = 0
    async for chunk in adapter.stream(request_id):
        bad += not chunk_ok(chunk.data, request, chunk.index, tokens)
        seen += 1
    return seen, bad


async def _serve(svc: ConnectorService, stage: str) -> None:
    sender = await svc.agent.wait_for_peer()
    adapter = svc.adapter(stage, source=sender)
    for n in range(sys.maxsize):
        plan = await svc.connector.get(f"bench:plan:{n}", source=sender)
        chunks, tokens = int(plan["chunks"]), int(plan["tokens"])

        counts = await asyncio.gather(*(_consume(adapter, f"r{n}-{r}", r, tokens) for r in plan["requests"]))
        got, bad = sum(c[0] for c in counts), sum(c[1] for c in counts)
        bad += got != chunks * len(plan["requests"])
        await svc.connector.put(sender, f"bench:done:{n}", {"chunks": got, "bad": bad})


def _echo(agent: Agent, notice: Notice) -> None:
    """Write block 0 back to the notice's sender with the same notice (not awaited: the
    echo's notice at the sender ends the round trip; a failed echo times the sender out)."""
    agent.write_blocks(notice.peer_id, [0], [0], notice=notice.data)


async def main(argv: list[str]) -> None:
    config = load_config(json.loads(argv[0]), schema=ServiceConfig, environ={})
    async with ConnectorService(config) as svc:
        agent = svc.agent
        agent.set_notice_sink(lambda n: _echo(agent, n))
        say({"address": svc.control_address, "peer_id": svc.agent.peer_id})
        server = asyncio.create_task(_serve(svc, argv[1]))
        try:
            await until_stdin_closes()
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)


if __name__ == "__main__":
    try:
        run(main(sys.argv[1:]))
    except Exception as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
