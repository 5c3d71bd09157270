"""``recv`` and ``send``: a receiver that verifies what arrives, and a sender that streams to it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import zlib
from typing import TYPE_CHECKING, Any

import msgspec

from ..workload import Plan, all_or_first_error, receive, send
from .output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Progress, emit_json, err, summary_table
from .running import run_async

if TYPE_CHECKING:
    from ..adapter import Chunk

SESSION_KEY = "omni-cli"
"""Key prefix of the session manifests ``send`` puts for ``recv``: ``omni-cli:{sender}:{n}``."""
DEFAULT_STAGE = "omni-cli"


def advertised(address: str, host: str | None) -> str:
    """``address`` with its host replaced by ``host``, or by this machine's name when it is a wildcard."""
    endpoint, sep, key = address.partition("?key=")
    bound, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not host and bound in ("0.0.0.0", "*", "[::]", "::"):
        import socket

        host = socket.gethostname()
    return f"tcp://{host or bound}:{port}{sep}{key}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def service_config(args: argparse.Namespace, **agent: Any) -> Any:
    """Load the ServiceConfig for recv/send: file, then command-line overrides, then env."""
    from ..config import ServiceConfig, load_config

    overrides = {k: v for k, v in agent.items() if v is not None}
    data: dict[str, Any] = {"agent": overrides} if overrides else {}
    return load_config(data, path=args.config, schema=ServiceConfig)


# -- command: recv ------------------------------------------------------------------------------
class _Session(msgspec.Struct, forbid_unknown_fields=False):
    """What ``send`` announces before its chunks (the manifest under ``omni-cli:{sender}:{n}``):
    the chunk streams' plan, and the KV blocks it wrote with their CRC-32s."""

    plan: Plan
    blocks: list[int] = []
    block_crcs: list[int] = []


def cmd_recv(args: argparse.Namespace) -> int:
    import zmq

    from ..errors import ConfigError, OmniAsyncError

    try:
        config = service_config(args, peer_id=args.peer_id, host=args.host, port=args.port)
    except ConfigError as exc:
        err(f"config error: {exc}")
        return EXIT_FAILED
    try:
        return run_async(_recv(args, config))
    except (OmniAsyncError, OSError, zmq.ZMQError) as exc:  # e.g. the port is taken, the host not ours
        err(f"recv failed: {type(exc).__name__}: {exc}")
        return EXIT_FAILED


async def _recv(args: argparse.Namespace, config: Any) -> int:
    from ..agent import PeerEvent
    from ..errors import OmniAsyncError
    from ..service import ConnectorService

    def say(event: str, text: str, **fields: Any) -> None:
        if args.json:
            emit_json({"event": event, **fields})
        else:
            print(text, flush=True)

    results: list[bool] = []
    finished = asyncio.Event()
    bars = Progress(args.progress == "always" or (
        args.progress == "auto" and not args.json and sys.stderr.isatty() and (args.quiet or not sys.stdout.isatty())))
    tasks: set[asyncio.Task[None]] = set()

    async with ConnectorService(config) as svc:
        adapters: dict[tuple[str, str], Any] = {}

        async def session(peer: str, manifest: _Session) -> bool:
            plan = manifest.plan
            say("session", f"session {plan.session} from {peer}: {plan.requests} requests × "
                f"{plan.chunks} chunks of {plan.sizes[0]} B, {len(manifest.blocks)} blocks",
                peer=peer, session=plan.session, requests=plan.requests, chunks=plan.chunks,
                chunk_bytes=plan.sizes[0], blocks=len(manifest.blocks))
            num_blocks = svc.region.num_blocks
            bad_blocks = abs(len(manifest.blocks) - len(manifest.block_crcs)) + sum(
                not 0 <= b < num_blocks or zlib.crc32(svc.region.array[b]) != crc
                for b, crc in zip(manifest.blocks, manifest.block_crcs, strict=False)
            )
            if manifest.blocks:
                say("blocks", f"  blocks: {len(manifest.blocks)} written by {peer}, {bad_blocks} bad",
                    peer=peer, session=plan.session, blocks=len(manifest.blocks), bad=bad_blocks)
            key = (peer, plan.stage)
            if key not in adapters:
                adapters[key] = svc.adapter(plan.stage, source=peer)
            with bars.task(f"receiving {plan.session} from {peer}", plan.total_bytes) as advance:
                def arrived(chunk: Chunk, verdict: str) -> None:
                    nbytes = int(getattr(chunk.data.get("data"), "nbytes", 0))
                    advance(nbytes)
                    if not args.quiet:
                        ok = verdict == "ok"
                        say("chunk", f"  chunk {chunk.request_id} #{chunk.index} {nbytes} B "
                            f"{'ok' if ok else 'BAD'}{' final' if chunk.final else ''}",
                            peer=peer, request=chunk.request_id, index=chunk.index, bytes=nbytes, ok=ok,
                            final=chunk.final)

                summary = await receive(adapters[key], plan, on_chunk=arrived)
            ok = summary.ok and bad_blocks == 0
            bad_chunks = summary.corrupted + summary.reordered
            say("summary", f"session {plan.session}: {summary.received}/{summary.chunks_expected} chunks "
                f"({bad_chunks} bad), {summary.bytes / 1e6:.2f} MB in {summary.seconds:.2f}s, "
                f"{len(manifest.blocks)} blocks ({bad_blocks} bad) -> {'OK' if ok else 'FAILED'}"
                + "".join(f"\n  error: {e}" for e in summary.errors[:5]),
                peer=peer, session=plan.session, chunks=summary.received, chunks_expected=summary.chunks_expected,
                bad_chunks=bad_chunks, bytes=summary.bytes, seconds=round(summary.seconds, 4),
                blocks=len(manifest.blocks), bad_blocks=bad_blocks, errors=list(summary.errors), ok=ok)
            return ok

        async def serve(peer: str) -> None:
            """Sessions of one peer, in order, until it leaves."""
            number = 0
            while True:
                try:
                    raw = await svc.connector.get(f"{SESSION_KEY}:{peer}:{number}", source=peer)
                    manifest = msgspec.convert(raw, _Session)
                except OmniAsyncError:
                    return  # the peer left (PeerLost) or the service is closing
                except msgspec.ValidationError as exc:
                    say("error", f"bad session manifest from {peer}: {exc}", peer=peer, error=str(exc))
                    return
                number += 1
                try:
                    results.append(await session(peer, manifest))
                except (ValueError, TypeError) as exc:  # e.g. a stage name the adapter refuses
                    say("error", f"session {manifest.plan.session} from {peer} is unusable: {exc}", peer=peer,
                        session=manifest.plan.session, error=str(exc))
                    results.append(False)
                if args.sessions and len(results) >= args.sessions:
                    finished.set()

        def on_peer(event: PeerEvent) -> None:
            if event.kind == "joined":
                say("peer", f"peer {event.peer_id} joined", peer=event.peer_id, kind="joined")
                loop = asyncio.get_running_loop()
                task = loop.create_task(serve(event.peer_id), name=f"omni-cli-serve-{event.peer_id}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            else:
                reason = f": {event.error}" if event.error else ""
                say("peer", f"peer {event.peer_id} left{reason}", peer=event.peer_id, kind="left",
                    reason=str(event.error) if event.error else None)

        svc.agent.add_peer_listener(on_peer)  # before the address is out: no join is missed
        address = advertised(svc.control_address, args.advertise)
        say("listening", f"listening on {address} as {svc.agent.peer_id!r}\n"
            f"  send to it with: omni-async send '{address}'",
            address=address, bound=svc.control_address, peer_id=svc.agent.peer_id,
            num_blocks=svc.region.num_blocks, block_len=svc.region.block_len)
        reason = "sessions"
        with bars:
            try:
                async with asyncio.timeout(args.duration):
                    await finished.wait()
            except TimeoutError:
                reason = "duration"
            except asyncio.CancelledError:  # Ctrl-C / SIGTERM: the normal way to stop a receiver
                reason = "signal"
            finally:
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    ok = all(results)
    say("stopped", f"stopped ({reason}): {len(results)} sessions, {sum(results)} ok", reason=reason,
        sessions=len(results), ok_sessions=sum(results), ok=ok)
    return EXIT_OK if ok else EXIT_FAILED


# -- command: send ------------------------------------------------------------------------------
def cmd_send(args: argparse.Namespace) -> int:
    from ..errors import ConfigError

    try:
        config = service_config(args, peer_id=args.peer_id, host=args.host)
    except ConfigError as exc:
        err(f"config error: {exc}")
        return EXIT_FAILED
    if ":" in args.stage:
        err("--stage must not contain ':'")
        return EXIT_USAGE
    return run_async(_send(args, config))


async def _send(args: argparse.Namespace, config: Any) -> int:
    import numpy as np
    import zmq

    from ..errors import HandshakeTimeout, OmniAsyncError
    from ..service import ConnectorService

    total_bytes = args.requests * args.chunks * args.chunk_size
    show_progress = args.progress == "always" or (
        args.progress == "auto" and not args.json and sys.stderr.isatty() and total_bytes >= 32 << 20
    )
    report: dict[str, Any] = {"ok": False, "address": args.address}
    deadline = asyncio.timeout(args.timeout)
    try:
        async with deadline, ConnectorService(config) as svc:
            handshake = 4 * config.agent.handshake_timeout
            try:
                async with asyncio.timeout(handshake):
                    peer = await svc.agent.connect(args.address)
            except TimeoutError as exc:
                if isinstance(exc, OmniAsyncError):
                    raise
                raise HandshakeTimeout(f"no handshake with {args.address} within {handshake}s") from None
            report["peer"] = peer
            remote = svc.agent.peers[peer]
            rng = np.random.default_rng()

            # KV blocks first: local 0..n-1 into the peer's 0..n-1, 64 per write.
            block_indices = list(range(args.blocks))
            block_crcs: list[int] = []
            if args.blocks:
                limit = min(svc.region.num_blocks, remote.num_blocks)
                if args.blocks > limit:
                    raise ValueError(f"--blocks {args.blocks} exceeds the regions ({limit} blocks; "
                                     "raise region.num_blocks on both sides)")
                svc.region.array[: args.blocks] = rng.integers(0, 256, (args.blocks, svc.region.block_len),
                                                               dtype=np.uint8)
                block_crcs = [zlib.crc32(svc.region.array[b]) for b in block_indices]
                started = time.perf_counter()

                async def write(batch: list[int]) -> None:
                    await svc.agent.write_blocks(peer, batch, batch)

                await all_or_first_error([write(block_indices[i: i + 64]) for i in range(0, args.blocks, 64)])
                seconds = time.perf_counter() - started
                report.update(blocks=args.blocks, block_bytes=args.blocks * svc.region.block_len,
                              block_seconds=round(seconds, 4),
                              block_GBps=round(args.blocks * svc.region.block_len / seconds / 1e9, 3))

            # Then the chunk streams: announce them, then all requests at once, each in order.
            plan = Plan(stage=args.stage, requests=args.requests, chunks=args.chunks, sizes=(args.chunk_size,),
                        seed=int(rng.integers(1 << 32)))
            manifest = _Session(plan=plan, blocks=block_indices, block_crcs=block_crcs)
            await svc.connector.put(peer, f"{SESSION_KEY}:{svc.agent.peer_id}:0", msgspec.to_builtins(manifest))
            with Progress(show_progress) as bars, bars.task("sending", total_bytes) as advance:
                sent = await send(svc.adapter(args.stage, peer_id=peer), plan, window=args.window, on_ack=advance)
            chunks, seconds = sent.chunks, sent.seconds
            report.update(
                session=plan.session, requests=args.requests, chunks=chunks, chunk_bytes=args.chunk_size,
                bytes=sent.bytes, seconds=round(seconds, 4),
                MBps=round(sent.bytes / seconds / 1e6, 2), chunks_per_s=round(chunks / seconds, 1),
                latency_p50_us=round(percentile(list(sent.latencies), 50) * 1e6, 1),
                latency_p99_us=round(percentile(list(sent.latencies), 99) * 1e6, 1), ok=True,
            )
    except OmniAsyncError as exc:  # before TimeoutError: HandshakeTimeout and DeadlineExceeded are both
        report["error"] = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        report["error"] = f"did not finish within {args.timeout}s" if deadline.expired() else "timed out"
    except (ValueError, OSError, zmq.ZMQError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"

    if args.json:
        emit_json(report)
    elif report["ok"]:
        rows = [("peer", report["peer"]), ("session", report["session"]),
                ("requests × chunks", f"{args.requests} × {args.chunks}"),
                ("chunk size", f"{args.chunk_size} B"), ("chunk bytes", f"{total_bytes / 1e6:.2f} MB"),
                ("time", f"{report['seconds']:.3f} s"), ("throughput", f"{report['MBps']} MB/s"),
                ("chunks/s", f"{report['chunks_per_s']}"),
                ("ack latency p50 / p99", f"{report['latency_p50_us']} / {report['latency_p99_us']} µs")]
        if args.blocks:
            rows += [("blocks", f"{args.blocks} ({report['block_bytes'] / 1e6:.2f} MB)"),
                     ("block throughput", f"{report['block_GBps']} GB/s")]
        summary_table(rows, f"sent to {args.address}")
    else:
        err(f"send failed: {report.get('error')}")
    return EXIT_OK if report["ok"] else EXIT_FAILED

