"""The receiving side of the pyzmq baseline (:mod:`bench.zmq_baseline`): a ROUTER in a child.

``python -m bench.zmq_peer`` binds a ROUTER to a free TCP port on 127.0.0.1, prints
``{"address"}``, then answers every chunk with an :class:`~bench.zmq_baseline.Ack` after checking
it (:func:`bench.chunk_data.chunk_ok`), and every :class:`~bench.zmq_baseline.StatsAsk` with the
counts since the previous one, until stdin closes.  uvloop, like the omni_async receiver; it
imports neither omni_async nor ucxx.
"""

from __future__ import annotations

import asyncio

import uvloop
import zmq
import zmq.asyncio

from .chunk_data import chunk_ok
from .procs import say, until_stdin_closes
from .zmq_baseline import ENCODER, TO_RECEIVER, Ack, ChunkHead, Stats, decode_chunk


async def _serve(sock: zmq.asyncio.Socket) -> None:
    chunks = bad = 0
    while True:
        identity, head_frame, *frames = await sock.recv_multipart(copy=False)
        head = TO_RECEIVER.decode(head_frame.buffer)
        if isinstance(head, ChunkHead):
            meta = head.meta
            chunks += 1
            bad += not chunk_ok(decode_chunk(head, frames), int(meta["request"]), head.index, int(meta["tokens"]))
            await sock.send_multipart([identity, ENCODER.encode(Ack(head.stream, head.index))])
        else:
            await sock.send_multipart([identity, ENCODER.encode(Stats(chunks, bad))])
            chunks = bad = 0


async def main() -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        say({"address": f"tcp://127.0.0.1:{port}"})
        server = asyncio.create_task(_serve(sock), name="zmq-peer")
        closed = asyncio.create_task(until_stdin_closes(), name="zmq-peer-stdin")
        try:
            done, _ = await asyncio.wait({server, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (server, closed):
                task.cancel()
            await asyncio.gather(server, closed, return_exceptions=True)
        if server in done:
            server.result()  # a failed receiver says why (its error line), instead of leaving acks unanswered
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    try:
        uvloop.run(main())
    except Exception as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None
