"""A rogue data-plane peer: a real handshake over ZeroMQ, then raw UCX messages on its lane.

In-process: ``async with Rogue.join(address) as rogue`` (the agent sees a peer ``rogue``;
``rogue.lane`` is connected to its lane and the rogue keeps heartbeating).  It takes every
header the agent sends it and answers a :class:`~omni_async.wire.ProofRequest` as an honest
peer does (the proof in this process), unless ``prove=False``.

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
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from omni_async.transport.lane import Lane, new_context
from omni_async.transport.pid_proof import make_proof
from omni_async.wire import (
    FULL_MASK,
    HEADER_TAG,
    PROTOCOL_VERSION,
    Ack,
    Heartbeat,
    Hello,
    MessageHeader,
    ProofReady,
    ProofRequest,
    RingOffer,
    Welcome,
    decode_control,
    decode_framed,
    encode_control,
    encode_header,
    encode_record,
)


class Rogue:
    def __init__(self, lane: Lane, sock: Any, agent_id: str, prove: bool) -> None:
        self.lane = lane
        self.sock = sock
        self.agent_id = agent_id
        self.prove = prove
        self.proof_fd = -1
        self.requests: list[ProofRequest] = []
        """The proof requests the agent sent us."""
        self.on_header: Callable[[Any], None] | None = None
        """Called with every other header the agent sends us (set by a test)."""
        lane.watch(HEADER_TAG, FULL_MASK, self._header_arrived)

    def _header_arrived(self, _tag: int, length: int, message: Any) -> None:
        buffer = np.empty(length, np.uint8)

        def done(error: BaseException | None) -> None:
            if error is not None:
                return
            header, _end = decode_framed(buffer.data)
            if isinstance(header, ProofRequest):
                self.requests.append(header)
                if self.prove and self.proof_fd < 0:
                    self.proof_fd = make_proof(header.nonce, self.agent_id)
                    self.send(encode_header(ProofReady(header.nonce, self.proof_fd)), HEADER_TAG)
            elif self.on_header is not None:
                self.on_header(header)

        self.lane.recv_arrived(buffer, message, done)

    @classmethod
    @contextlib.asynccontextmanager
    async def join(cls, address: str, peer_id: str = "rogue", *, tls: str = "^cma", prove: bool = True,
                   **hello_fields: Any) -> AsyncIterator[Rogue]:
        lane = Lane(new_context(tls, "lo"), asyncio.get_running_loop())
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        beat: asyncio.Task[None] | None = None
        rogue: Rogue | None = None
        try:
            sock.connect(address)
            fields = {"base_addr": 4096, "num_blocks": 64, "block_len": 4096, "fingerprint": "", **hello_fields}
            hello = Hello(version=PROTOCOL_VERSION, peer_id=peer_id, nonce=1, agent_metadata=lane.address, **fields)
            await sock.send(encode_control(hello))
            welcome = decode_control(await asyncio.wait_for(sock.recv(), 20))
            assert isinstance(welcome, Welcome), welcome
            lane.connect(welcome.agent_metadata)
            rogue = cls(lane, sock, welcome.peer_id, prove)
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
            if rogue is not None and rogue.proof_fd >= 0:
                os.close(rogue.proof_fd)

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
