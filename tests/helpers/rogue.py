"""A rogue data-plane peer: a real handshake over ZeroMQ, then raw UCX messages on its lane.

In-process: ``async with Rogue.join(address) as rogue`` (the agent sees a peer ``rogue``;
``rogue.lane`` is connected to its lane and the rogue keeps heartbeating).

``python -m tests.helpers.rogue flood ADDRESS`` joins, prints ``{"joined": true}`` and then
sends valid empty chunk messages as fast as it can until killed.

``python -m tests.helpers.rogue ring-flood OFFER_JSON SECONDS`` maps the same-host ring a
:class:`~omni_async.wire.RingOffer` names (a real one, of an agent on this host), prints
``{"mapped": true}``, and on a line on stdin writes harmless records into it (answers, with a
reason, to a transfer that does not exist) as fast as it can for SECONDS, waking the receiver
when it sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from omni_async.transport.lane import Lane, new_context
from omni_async.wire import (
    HEADER_TAG,
    PROTOCOL_VERSION,
    Ack,
    Heartbeat,
    Hello,
    MessageHeader,
    RingOffer,
    Welcome,
    decode_control,
    encode_control,
    encode_header,
    encode_record,
)


class Rogue:
    def __init__(self, lane: Lane, sock: Any) -> None:
        self.lane = lane
        self.sock = sock

    @classmethod
    @contextlib.asynccontextmanager
    async def join(cls, address: str, peer_id: str = "rogue", *, tls: str = "^cma",
                   **hello_fields: Any) -> AsyncIterator[Rogue]:
        lane = Lane(new_context(tls, "lo"), asyncio.get_running_loop())
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        beat: asyncio.Task[None] | None = None
        try:
            sock.connect(address)
            hello = Hello(version=PROTOCOL_VERSION, peer_id=peer_id, nonce=1, agent_metadata=lane.address, base_addr=4096,
                          num_blocks=64, block_len=4096, fingerprint="", **hello_fields)
            await sock.send(encode_control(hello))
            welcome = decode_control(await asyncio.wait_for(sock.recv(), 20))
            assert isinstance(welcome, Welcome), welcome
            lane.connect(welcome.agent_metadata)
            rogue = cls(lane, sock)
            beat = asyncio.create_task(rogue.heartbeat(), name="rogue-heartbeat")
            yield rogue
        finally:
            if beat is not None:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
            lane.close()
            await lane.wait_closed()
            sock.close(0)
            ctx.term()

    async def heartbeat(self) -> None:
        """Send a heartbeat every 50 ms (forever: cancel it)."""
        while True:
            await self.sock.send(encode_control(Heartbeat()))
            await asyncio.sleep(0.05)

    def send(self, buffer: Any, tag: int) -> None:
        self.lane.send(buffer, tag, lambda _error: None)


async def _flood(address: str) -> None:
    async with Rogue.join(address) as rogue:
        print(json.dumps({"joined": True}), flush=True)
        # Valid, empty chunk messages: each costs the receiver far more than the sender.
        header = encode_header(MessageHeader(1 << 40, 0, "k", b"", []))
        while True:
            for _ in range(1000):
                rogue.send(header, HEADER_TAG)
            await asyncio.sleep(0)


def _ring_flood(offer_json: str, seconds: float) -> None:
    import msgspec

    from omni_async.transport.samehost import KIND_HEADER, RingSender

    sender = RingSender(msgspec.json.decode(offer_json, type=RingOffer))
    record = encode_record(Ack(1 << 40, "failed", "x" * 1000))
    print(json.dumps({"mapped": True}), flush=True)
    sys.stdin.readline()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(100):
            sender.send(KIND_HEADER, (record,))


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if sys.argv[1] == "flood":
        asyncio.run(_flood(sys.argv[2]))
    elif sys.argv[1] == "ring-flood":
        _ring_flood(sys.argv[2], float(sys.argv[3]))
