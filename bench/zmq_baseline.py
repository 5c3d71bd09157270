"""The pyzmq + msgspec baseline of ``chunks``: what a user would write instead of omni_async.

A DEALER socket here (in the bench process, on its uvloop) and a ROUTER in a child
(:mod:`bench.zmq_peer`), over TCP loopback.  A chunk is one multipart message: a msgspec
header (:class:`ChunkHead`: stream, index, final, meta, and dtype/shape per array) followed by
one frame per numpy array, sent zero-copy (``copy=False``).  The receiver rebuilds the arrays
as views of the frames, checks every chunk like the omni_async receiver does, and answers one
:class:`Ack` per chunk.  Each stream sends its chunks in order, the next once the previous is
acknowledged; a throughput sample runs ``requests`` streams at once (64 for the issue's
shapes), a latency sample is one chunk, save → ack.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from .chunk_data import make_chunk
from .hostload import CpuMeter
from .procs import Child, Children


class ChunkHead(msgspec.Struct, array_like=True, tag="c"):
    stream: str
    index: int
    final: bool
    meta: dict[str, Any]
    arrays: list[tuple[str, str, tuple[int, ...]]]
    """(key, dtype, shape) of each array frame that follows, in order."""


class StatsAsk(msgspec.Struct, array_like=True, tag="s"):
    """Ask the receiver for its counts since the last ask (and reset them)."""


class Ack(msgspec.Struct, array_like=True, tag="a"):
    stream: str
    index: int


class Stats(msgspec.Struct, array_like=True, tag="t"):
    chunks: int
    bad: int


ENCODER = msgspec.msgpack.Encoder()
TO_RECEIVER = msgspec.msgpack.Decoder(ChunkHead | StatsAsk)
TO_SENDER = msgspec.msgpack.Decoder(Ack | Stats)


def encode_chunk(stream: str, index: int, final: bool, chunk: dict[str, Any]) -> list[Any]:
    """The frames of one chunk (arrays plus a ``meta`` dict): header, then each array's buffer (no copy)."""
    arrays = [(k, v) for k, v in chunk.items() if isinstance(v, np.ndarray)]
    head = ChunkHead(stream, index, final, chunk["meta"], [(k, v.dtype.str, v.shape) for k, v in arrays])
    return [ENCODER.encode(head), *(memoryview(v) for _, v in arrays)]


def decode_chunk(head: ChunkHead, frames: list[zmq.Frame]) -> dict[str, Any]:
    """The chunk as a dict of arrays (views of the received frames) plus ``meta``."""
    data: dict[str, Any] = {"meta": head.meta}
    for (key, dtype, shape), frame in zip(head.arrays, frames, strict=True):
        data[key] = np.frombuffer(frame.buffer, dtype=np.dtype(dtype)).reshape(shape)
    return data


class ZmqBaseline:
    """The sending DEALER, connected to one receiver child; :meth:`run` times a workload."""

    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._acks: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._stats: asyncio.Future[Stats] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._runs = 0
        self.meter: CpuMeter
        """CPU of both sides during the timed batches of throughput runs (made by :meth:`start`)."""

    async def start(self, children: Children) -> ZmqBaseline:
        child: Child = await children.start("bench.zmq_peer", [])
        self.meter = CpuMeter(child.pid)
        self._sock.connect(child.ready["address"])
        self._reader = asyncio.create_task(self._read(), name="zmq-baseline-acks")
        return self

    async def _read(self) -> None:
        """Resolve the future of each ack (and of the stats answer) as replies arrive; if reading
        fails, every waiter gets the error instead of waiting for the run's timeout."""
        try:
            while True:
                reply = TO_SENDER.decode(await self._sock.recv())
                if isinstance(reply, Ack):
                    future = self._acks.pop((reply.stream, reply.index), None)
                    if future is not None and not future.done():
                        future.set_result(None)
                elif self._stats is not None and not self._stats.done():
                    self._stats.set_result(reply)
        except Exception as exc:
            waiters = [*self._acks.values(), *([self._stats] if self._stats is not None else [])]
            self._acks.clear()
            for future in waiters:
                if not future.done():
                    future.set_exception(RuntimeError(f"zmq baseline: reading acks failed: {exc!r}"))
            raise

    async def _send(self, stream: str, index: int, final: bool, chunk: dict[str, Any]) -> None:
        """Send one chunk and wait for its ack."""
        future = asyncio.get_running_loop().create_future()
        self._acks[stream, index] = future
        await self._sock.send_multipart(encode_chunk(stream, index, final, chunk), copy=False)
        await future

    async def _stream(self, stream: str, chunks: list[dict[str, Any]]) -> None:
        for i, chunk in enumerate(chunks):
            await self._send(stream, i, i == len(chunks) - 1, chunk)

    async def run(self, kind: str, requests: int, chunks: int, tokens: int, iters: int) -> tuple[list[int], Stats]:
        """Nanoseconds per sample and the receiver's counts; like ``bench.chunks._Sender.run``:
        latency: ``iters`` single-chunk saves one after another; throughput: ``iters`` batches of
        ``requests`` concurrent streams of ``chunks`` chunks."""
        n, self._runs = self._runs, self._runs + 1
        total = iters if kind == "latency" else requests * iters
        data = {r: [make_chunk(r, i, tokens) for i in range(chunks)] for r in range(total)}
        clock, samples = time.perf_counter_ns, []
        async with asyncio.timeout(300):
            if kind == "latency":
                for r in range(total):
                    t0 = clock()
                    await self._send(f"z{n}-{r}", 0, True, data[r][0])
                    samples.append(clock() - t0)
            else:
                for batch in range(iters):
                    first = batch * requests
                    streams = range(first, first + requests)
                    with self.meter.measure():
                        t0 = clock()
                        await asyncio.gather(*(self._stream(f"z{n}-{r}", data[r]) for r in streams))
                        samples.append(clock() - t0)
            self._stats = asyncio.get_running_loop().create_future()
            await self._sock.send(ENCODER.encode(StatsAsk()))
            stats = await self._stats
        return samples, stats

    async def close(self) -> None:
        """Stop the ack reader, close the socket and the context.  Idempotent."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)  # its error reached the waiters
            self._reader = None
        self._sock.close(linger=0)
        self._ctx.term()
