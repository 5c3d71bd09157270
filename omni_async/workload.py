"""One test workload: announce a plan, stream deterministic chunks, verify every byte.

Used by the ``omni-async send``/``recv`` commands, the examples and the tests, so that there is
one way to say "R requests of C chunks" and one way to check what arrived.

* :class:`Plan` (sans-I/O): what the sender will stream, under which stage and request ids.  The
  sender announces it to the receiver with :func:`announce` under :func:`plan_key`.
* :func:`make_chunk` (sans-I/O): chunk ``index`` of request number ``request`` is a pure
  function of ``(plan.seed, request, index)``, so the receiver recomputes what it should have
  received instead of being told.  Chunks travel through a
  :class:`~omni_async.adapter.TransferAdapter`, i.e. under its key scheme
  ``{request_id}:{stage}:{chunk_index}``.
* :class:`Verifier` (sans-I/O): classifies every received chunk (ok / corrupted / reordered) and
  sums up a :class:`Summary` (plus the chunks that never came: missing).
* :func:`send` / :func:`receive`: the asyncio halves over a ``TransferAdapter``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from .errors import OmniAsyncError

if TYPE_CHECKING:
    from .adapter import Chunk, TransferAdapter
    from .service import ConnectorService

PLAN_KEY = "workload-plan"
"""Prefix of the keys plans are announced under: ``workload-plan:{sender}:{number}``."""

Verdict = Literal["ok", "corrupted", "reordered"]


def _new_session() -> str:
    return os.urandom(4).hex()


class Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a sender streams: ``requests`` requests of ``chunks`` chunks each, on ``stage``.

    Chunk ``index`` of request number ``r`` (request id :meth:`request_id`) holds
    :meth:`size` bytes: ``sizes[(r + index) % len(sizes)]``, made by :func:`chunk_data` from
    ``(seed, r, index)``.
    Invalid values raise ``ValueError`` (``msgspec.ValidationError`` when decoded).
    """

    stage: str
    requests: int
    chunks: int
    sizes: tuple[int, ...]
    seed: int = 0
    session: str = msgspec.field(default_factory=_new_session)
    """Makes request ids unique across plans: ``{session}-{r}``."""

    def __post_init__(self) -> None:
        if self.requests < 0 or self.chunks < 1:
            raise ValueError(f"a plan needs requests >= 0 and chunks >= 1, got {self.requests} and {self.chunks}")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"chunk sizes must be >= 1 byte, got {list(self.sizes)}")
        if ":" in self.stage or ":" in self.session or not self.stage or not self.session:
            raise ValueError(f"stage and session must be non-empty without ':', got {self.stage!r}, {self.session!r}")

    def request_id(self, request: int) -> str:
        return f"{self.session}-{request}"

    def size(self, request: int, index: int) -> int:
        return self.sizes[(request + index) % len(self.sizes)]

    @property
    def total_chunks(self) -> int:
        return self.requests * self.chunks

    @property
    def total_bytes(self) -> int:
        cycles, rest = divmod(self.chunks, len(self.sizes))
        twice = self.sizes * 2  # chunk sizes cycle: whole cycles, then ``rest`` sizes from the request's offset
        return sum(cycles * sum(self.sizes) + sum(twice[o: o + rest])
                   for o in (r % len(self.sizes) for r in range(self.requests)))


def plan_key(sender: str, number: int) -> str:
    """The key plan ``number`` of peer ``sender`` is announced under."""
    return f"{PLAN_KEY}:{sender}:{number}"


def chunk_data(plan: Plan, request: int, index: int) -> np.ndarray:
    """The bytes of chunk ``index`` of request number ``request`` (a new uint8 array).

    A random pad seeded by ``plan.seed`` (made once per seed and size), each 8-byte word XORed
    with a 64-bit key mixed from ``(seed, request, index)``: every byte differs between chunks,
    and making or checking a chunk costs about one copy.
    """
    size = plan.size(request, index)
    pad = _pad(plan.seed, max(plan.sizes))
    return (pad[: -(-size // 8)] ^ np.uint64(_mix(plan.seed, request, index))).view(np.uint8)[:size]


@functools.lru_cache(maxsize=8)
def _pad(seed: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(-(-nbytes // 8) * 8), dtype=np.uint64)


def _mix(*values: int) -> int:
    """A 64-bit hash of ``values`` (splitmix64 steps)."""
    mask = (1 << 64) - 1
    state = 0
    for value in values:
        state = (state + 0x9E3779B97F4A7C15 + (value & mask)) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state


def make_chunk(plan: Plan, request: int, index: int) -> dict[str, Any]:
    """The payload saved for chunk ``index`` of request number ``request``: ``{"data": array}``."""
    return {"data": chunk_data(plan, request, index)}


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """What a receiver made of a plan: every expected chunk is ok, corrupted, reordered or missing."""

    session: str
    chunks_expected: int
    ok_chunks: int
    corrupted: int
    reordered: int
    missing: int
    bytes: int
    seconds: float
    errors: tuple[str, ...] = ()
    """Why streams ended early (``request_id: ErrorType: message``), at most one per request."""

    @property
    def received(self) -> int:
        return self.ok_chunks + self.corrupted + self.reordered

    @property
    def bad(self) -> int:
        return self.corrupted + self.reordered + self.missing

    @property
    def ok(self) -> bool:
        return self.ok_chunks == self.chunks_expected and self.bad == 0 and not self.errors


class Verifier:
    """Checks received chunks against a plan (sans-I/O: feed it chunks, ask for the summary).

    A chunk whose index is not the next one of its request is *reordered*; one whose payload is
    not exactly :func:`make_chunk` (or whose index is beyond the plan) is *corrupted*.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._next = [0] * plan.requests
        self._counts = {"ok": 0, "corrupted": 0, "reordered": 0}
        self._bytes = 0
        self._errors: list[str] = []

    def check(self, request: int, index: int, payload: Mapping[str, Any]) -> Verdict:
        """Classify chunk ``index`` of request number ``request``."""
        data = payload.get("data")
        self._bytes += int(data.nbytes) if isinstance(data, np.ndarray) else 0
        verdict: Verdict
        if index != self._next[request]:
            verdict = "reordered"
        elif index >= self.plan.chunks or not _same(data, chunk_data(self.plan, request, index)):
            verdict = "corrupted"
        else:
            verdict = "ok"
        self._next[request] = index + 1
        self._counts[verdict] += 1
        return verdict

    def failed(self, request: int, error: BaseException) -> None:
        """Request number ``request``'s stream ended with ``error`` (its remaining chunks are missing)."""
        self._errors.append(f"{self.plan.request_id(request)}: {type(error).__name__}: {error}")

    def summary(self, seconds: float) -> Summary:
        received = sum(self._counts.values())
        return Summary(
            session=self.plan.session, chunks_expected=self.plan.total_chunks, ok_chunks=self._counts["ok"],
            corrupted=self._counts["corrupted"], reordered=self._counts["reordered"],
            missing=max(0, self.plan.total_chunks - received), bytes=self._bytes, seconds=seconds,
            errors=tuple(self._errors),
        )


def _same(got: object, want: np.ndarray) -> bool:
    return isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape and bool(
        np.array_equal(got, want))


# -- the asyncio halves ---------------------------------------------------------------------------
async def announce(svc: ConnectorService, peer: str, plan: Plan, number: int) -> None:
    """Put ``plan`` for ``peer`` under ``plan_key(this peer, number)``; awaits the peer's ack."""
    await svc.connector.put(peer, plan_key(svc.agent.peer_id, number), msgspec.to_builtins(plan))


async def next_plan(svc: ConnectorService, sender: str, number: int, timeout: float | None = None) -> Plan:
    """Await plan ``number`` of ``sender``.  Raises what ``connector.get`` raises (``PeerLost``,
    ``DeadlineExceeded``), or ``msgspec.ValidationError`` for a malformed plan."""
    return msgspec.convert(await svc.connector.get(plan_key(sender, number), source=sender, timeout=timeout), Plan)


class SendReport(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`send` streamed: chunks and bytes acknowledged, seconds from the first save to
    the last ack, and each chunk's ack latency in seconds (save to ack)."""

    chunks: int
    bytes: int
    seconds: float
    latencies: tuple[float, ...]


async def send(adapter: TransferAdapter, plan: Plan, *, window: int = 8,
               on_ack: Callable[[int], None] | None = None) -> SendReport:
    """Stream every request of ``plan`` through ``adapter`` (its stage must be ``plan.stage``):
    all requests at once, each in order with at most ``window`` chunks unacknowledged.

    ``on_ack(nbytes)`` runs for each acknowledged chunk.  Raises the first save's error (the
    other requests' streams are cancelled then).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    latencies: list[float] = []
    acked = [0]

    def done(nbytes: int, saved_at: float, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            latencies.append(time.perf_counter() - saved_at)
            acked[0] += nbytes
            if on_ack is not None:
                on_ack(nbytes)

    async def produce(request: int) -> None:
        request_id = plan.request_id(request)
        pending: list[asyncio.Future[None]] = []
        for index in range(plan.chunks):
            if len(pending) >= window:
                await pending.pop(0)
            chunk = make_chunk(plan, request, index)
            future = adapter.save_async(request_id, chunk, final=index == plan.chunks - 1)
            future.add_done_callback(partial(done, chunk["data"].nbytes, time.perf_counter()))
            pending.append(future)
        await asyncio.gather(*pending)

    started = time.perf_counter()
    await all_or_first_error([produce(r) for r in range(plan.requests)])
    return SendReport(chunks=len(latencies), bytes=acked[0], seconds=time.perf_counter() - started,
                      latencies=tuple(latencies))


async def receive(adapter: TransferAdapter, plan: Plan, *,
                  on_chunk: Callable[[Chunk, Verdict], None] | None = None) -> Summary:
    """Stream every request of ``plan`` from ``adapter`` (all at once, each to its final chunk)
    and verify each chunk; ``on_chunk(chunk, verdict)`` runs for each.  A stream that fails
    (``PeerLost``, a stall's ``DeadlineExceeded``) ends that request: its error is in the
    summary and its remaining chunks count as missing.  Never raises ``OmniAsyncError``."""
    verifier = Verifier(plan)

    async def consume(request: int) -> None:
        try:
            async for chunk in adapter.stream(plan.request_id(request)):
                verdict = verifier.check(request, chunk.index, chunk.data)
                if on_chunk is not None:
                    on_chunk(chunk, verdict)
        except OmniAsyncError as exc:
            verifier.failed(request, exc)

    started = time.perf_counter()
    await asyncio.gather(*(consume(r) for r in range(plan.requests)))
    return verifier.summary(time.perf_counter() - started)


async def all_or_first_error(coros: list[Coroutine[Any, Any, Any]]) -> None:
    """Run ``coros`` concurrently; on the first failure cancel the rest, await them, then raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
