"""Metrics: stats() snapshot and the Prometheus series, including the /metrics endpoint."""

import asyncio
import cProfile
import pstats
import select
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import REGISTRY, generate_latest

import omni_async.metrics as metrics_module
from omni_async import Agent, BlockRegion, InvalidBlocks
from omni_async.errors import ClosedError, ConfigError
from omni_async.metrics import METRICS_CONNECTIONS, METRICS_IO_TIMEOUT, Metrics

from .conftest import fast_config

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def metrics_threads() -> list[threading.Thread]:
    """The /metrics server's threads: its listener and one per connection being served."""
    return [t for t in threading.enumerate() if t.name.startswith("omni-async-metrics")]


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def closed_by_server(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the server closed (end of stream, or reset)."""
    readable, _, _ = select.select(sockets, [], [], 0)
    closed = 0
    for s in readable:
        try:
            closed += s.recv(1) == b""
        except ConnectionResetError:
            closed += 1
    return closed


async def test_stats_and_prometheus(make_agent):
    port = free_port()
    a = await make_agent(peer_id="ma", metrics_port=port)
    b = await make_agent(peer_id="mb", claimed_blocks=1000)  # a sender may ask for rows it does not have
    await a.connect(b.control_address)
    await asyncio.wait_for(b.wait_for_peer("ma"), 5)
    await asyncio.wait_for(a.write_blocks("mb", [0, 1, 2], [3, 4, 5]), 5)
    b.set_message_sink(lambda *args: None)
    await asyncio.wait_for(a.send_message("mb", "k", b"", [b"12345"]), 5)
    with pytest.raises(InvalidBlocks):
        await asyncio.wait_for(a.write_blocks("mb", [0], [999]), 5)
    sa, sb = a.stats(), b.stats()
    assert sa["blocks.ok"] == 1 and sa["blocks.bytes_sent"] == 3 * 4096
    assert sa["messages.ok"] == 1 and sa["messages.bytes_sent"] == 5
    assert sa["blocks.invalid_blocks"] == 1
    assert sb["received.blocks.ok"] == 1 and sb["blocks.bytes_received"] == 3 * 4096
    assert sb["received.blocks.invalid_blocks"] == 1
    assert sa["peers"] == 1 and sa["peers.joined"] == 1
    body = await asyncio.to_thread(scrape, port)
    assert 'omni_async_transfers_total{agent="ma",kind="blocks",outcome="ok"} 1.0' in body
    assert 'omni_async_bytes_total{agent="mb",direction="received",kind="blocks"} 12288.0' in body
    assert 'omni_async_peers{agent="ma"} 1.0' in body


async def test_one_block_writes_answered_by_the_rings_consumption_are_each_counted(make_agent):
    """One-block writes to a same-host peer are answered by the consumption of their ring
    records and counted at the end of the receiver's ring batch: several taken in one batch
    count one each, with their bytes, on both sides and per peer."""
    a = await make_agent(peer_id="ta")
    b = await make_agent(peer_id="tb")
    await a.connect(b.control_address)
    await asyncio.wait_for(b.wait_for_peer("ta"), 5)
    link = a.transport.links["tb"]
    assert link.ring_out is not None and link.ring_in is not None  # so the writes go as `tail`
    writes = [a.write_blocks("tb", [i], [i + 8]) for i in range(6)]  # all in the ring before b's turn
    await asyncio.wait_for(asyncio.gather(*writes), 5)
    await asyncio.wait_for(a.write_blocks("tb", [7], [15]), 5)
    sa, sb = a.stats(), b.stats()
    assert sa["blocks.ok"] == 7 and sa["blocks.bytes_sent"] == 7 * 4096
    assert sb["received.blocks.ok"] == 7 and sb["blocks.bytes_received"] == 7 * 4096
    meter = b.metrics._meters["ta"]
    assert (meter.received, meter.received_bytes) == (7, 7 * 4096)


async def test_writes_answered_by_consumption_count_when_the_peer_is_removed_within_their_batch(make_agent):
    """Three one-block writes and a message taken in one ring batch; handling the message
    removes the peer, so the batch never ends: the three writes, consumed (answered) before,
    still count on the receiver."""
    a = await make_agent(peer_id="ra")
    b = await make_agent(peer_id="rb")
    await a.connect(b.control_address)
    await asyncio.wait_for(b.wait_for_peer("ra"), 5)
    b.set_message_sink(lambda *_args: b.transport.remove_peer("ra"))
    writes = [a.write_blocks("rb", [i], [i]) for i in range(3)]
    message = a.send_message("rb", "k", b"", [b"x"])
    async with asyncio.timeout(10):
        while b.transport.links:  # removed within the batch (a is not told: it would time out)
            await asyncio.sleep(0.01)
    assert b.stats()["received.blocks.ok"] == 3 and b.stats()["blocks.bytes_received"] == 3 * 4096
    a.transport.cancel([t.id for t in (*writes, message)])


async def test_transfers_run_no_prometheus_code(make_agent):
    """Metrics are plain numbers while transfers run: prometheus_client only runs at scrape time."""
    a = await make_agent(peer_id="mc")
    b = await make_agent(peer_id="md", claimed_blocks=1000)  # so that a refusal settles through the peer
    await a.connect(b.control_address)
    await asyncio.wait_for(b.wait_for_peer("mc"), 5)
    b.set_message_sink(lambda *args: None)
    await asyncio.wait_for(a.write_blocks("md", [0], [1]), 5)  # lanes wired before profiling
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        async with asyncio.timeout(10):
            for _ in range(20):
                await a.write_blocks("md", [0, 1], [2, 3])
                await a.send_message("md", "k", b"", [b"x" * 100])
            with pytest.raises(InvalidBlocks):
                await a.write_blocks("md", [0], [999])
    finally:
        profiler.disable()
    ran = {path for path, _line, _name in pstats.Stats(profiler).stats}  # type: ignore[attr-defined]
    assert not [path for path in ran if "prometheus_client" in path]
    assert a.stats()["blocks.ok"] == 21 and a.stats()["blocks.invalid_blocks"] == 1
    assert a.stats()["messages.ok"] == 20 and b.stats()["received.blocks.ok"] == 21
    assert b.stats()["received.blocks.invalid_blocks"] == 1


def test_export_sums_agents_of_one_name_and_keeps_closed_ones():
    """The scrape-time export: cumulative buckets (le inclusive), sum, agents of one name summed,
    a closed agent's counts kept with omni_async_peers at 0 (as labelled children were)."""
    first, second = Metrics("mx-export"), Metrics("mx-export")
    first.peer_event("joined", "p", "", 1)
    first.settled("blocks", 10, "ok", 50e-6, "p")  # exactly on a bound: counted in le="5e-05"
    first.settled("blocks", 0, "peer_lost", 1.0, "p")
    second.settled("blocks", 20, "ok", 3.0, "q")  # past the last bound: only in +Inf
    second.answered("messages", 7, "ok", "q")
    second.close()
    body = generate_latest(REGISTRY).decode()
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in body.splitlines() if 'agent="mx-export"' in line}
    bucket = 'omni_async_transfer_seconds_bucket{{agent="mx-export",kind="blocks",le="{}"}}'
    assert series[bucket.format("2.5e-05")] == 0 and series[bucket.format("5e-05")] == 1
    assert series[bucket.format("2.5")] == 1 and series[bucket.format("+Inf")] == 2
    assert series['omni_async_transfer_seconds_sum{agent="mx-export",kind="blocks"}'] == pytest.approx(3.00005)
    assert series['omni_async_transfers_total{agent="mx-export",kind="blocks",outcome="ok"}'] == 2
    assert series['omni_async_transfers_total{agent="mx-export",kind="blocks",outcome="peer_lost"}'] == 1
    assert series['omni_async_bytes_total{agent="mx-export",direction="sent",kind="blocks"}'] == 30
    assert series['omni_async_bytes_total{agent="mx-export",direction="received",kind="messages"}'] == 7
    assert series['omni_async_peer_events_total{agent="mx-export",event="joined",reason=""}'] == 1
    assert 'omni_async_transfers_created{agent="mx-export",kind="blocks",outcome="ok"}' in series
    assert series['omni_async_peers{agent="mx-export"}'] == 0  # the last agent to set it closed
    assert first.snapshot() == {"blocks.ok": 1, "blocks.bytes_sent": 10, "blocks.peer_lost": 1, "peers.joined": 1}
    first.close()
    first.close()  # idempotent
    again = generate_latest(REGISTRY).decode()
    assert 'omni_async_bytes_total{agent="mx-export",direction="sent",kind="blocks"} 30.0' in again

def test_latencies_counted_in_bulk_match_one_by_one_and_a_reader_never_sees_one_twice():
    """The latency histogram keeps observations pending and counts them into its buckets in
    bulk: what it reports equals counting each one as it came (bounds inclusive, past the last
    bound in +Inf), before and after a bulk count, in a scrape too, and once the agent closed
    (its counts kept under its name, the pending ones included); a thread reading while the
    loop observes sees counts that only grow and never exceed what was observed."""
    from bisect import bisect_left

    metrics = Metrics("mx-bulk")
    metrics.peer_event("joined", "p", "", 1)
    values = [*metrics_module.BUCKETS, 0.0, 1e-9, 7.0, *(i * 37e-6 for i in range(1300))]
    expected = [0] * (len(metrics_module.BUCKETS) + 1)
    histogram = metrics._latency["blocks"]
    seen: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.append(sum(histogram.figures()[0]))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n, seconds in enumerate(values, 1):
            metrics.settled("blocks", 1, "ok", seconds, "p")
            expected[bisect_left(metrics_module.BUCKETS, seconds)] += 1
            if n in (1, 511, 512, 513, len(values)):  # around the first bulk count, and at the end
                counts, total = histogram.figures()
                assert counts == expected and total == pytest.approx(sum(values[:n]))
    finally:
        stop.set()
        reader.join(10)
    assert seen and seen == sorted(seen) and seen[-1] <= len(values)
    body = generate_latest(REGISTRY).decode()
    assert f'omni_async_transfer_seconds_count{{agent="mx-bulk",kind="blocks"}} {float(len(values))}' in body
    metrics.close()  # its counts stay under its name, pending ones included
    again = generate_latest(REGISTRY).decode()
    assert f'omni_async_transfer_seconds_count{{agent="mx-bulk",kind="blocks"}} {float(len(values))}' in again
    inf = 'omni_async_transfer_seconds_bucket{agent="mx-bulk",kind="blocks",le="+Inf"}'
    assert f"{inf} {float(len(values))}" in again



async def test_metrics_endpoint_is_closed_with_its_agent(make_agent):
    """close() is whole: the /metrics server an agent started goes with it (port free, no thread
    left, also of a connection still open), and an agent started again in this process with
    the same metrics_port serves it."""
    port = free_port()
    agent = await make_agent(peer_id="mclose", metrics_port=port)
    assert "omni_async_peers" in await asyncio.to_thread(scrape, port)
    idle = socket.create_connection(("127.0.0.1", port))
    try:
        await asyncio.sleep(0.2)  # its thread is serving it
        began = time.monotonic()
        await asyncio.wait_for(agent.close(), 10)
        assert time.monotonic() - began < METRICS_IO_TIMEOUT  # the open connection was ended, not waited out
        assert not port_open(port), "the closed agent's /metrics server still accepts connections"
        assert not metrics_threads(), f"threads left by the closed agent's /metrics server: {metrics_threads()}"
        assert closed_by_server([idle]) == 1
    finally:
        idle.close()
    again = await make_agent(peer_id="mclose2", metrics_port=port)  # raised OSError: address already in use
    assert 'agent="mclose2"' in await asyncio.to_thread(scrape, port)
    await again.close()
    assert not port_open(port)


async def test_idle_metrics_connections_are_bounded_and_time_out(make_agent, monkeypatch):
    """Connections that send nothing hold at most METRICS_CONNECTIONS threads (each held one for
    ever: 300 held 300): those beyond are closed at once, the others after the I/O timeout
    (METRICS_IO_TIMEOUT, 1 s here), and the endpoint answers again."""
    io_timeout = 1.0
    monkeypatch.setattr(metrics_module._Handler, "timeout", io_timeout)
    port = free_port()
    await make_agent(peer_id="midle", metrics_port=port)
    sockets: list[socket.socket] = []
    try:
        before = threading.active_count()
        for _ in range(2 * METRICS_CONNECTIONS + 8):
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        await asyncio.sleep(0.5)
        held = threading.active_count() - before
        assert held <= METRICS_CONNECTIONS, f"{held} threads held by {len(sockets)} idle connections"
        assert closed_by_server(sockets) >= len(sockets) - METRICS_CONNECTIONS
        await asyncio.sleep(io_timeout + 1)
        assert closed_by_server(sockets) == len(sockets)
        assert len(metrics_threads()) == 1  # the listener alone
        assert 'agent="midle"' in await asyncio.to_thread(scrape, port)
    finally:
        for s in sockets:
            s.close()


async def test_a_metrics_port_already_taken_is_a_config_error(make_agent):
    """A metrics_port taken by another process, or by another agent of this one, fails start()
    with ConfigError naming it (it raised a raw OSError); the failed agent is closed and its
    /metrics server leaves no thread."""
    port = free_port()
    await make_agent(peer_id="mtaken", metrics_port=port)
    outside = socket.socket()
    try:
        outside.bind(("127.0.0.1", 0))
        outside.listen()
        for taken in (port, outside.getsockname()[1]):
            threads = {t.ident for t in metrics_threads()}
            agent = Agent(BlockRegion.allocate(8, 4096), fast_config(peer_id="mtaken2", metrics_port=taken))
            with pytest.raises(ConfigError, match=f"metrics_port {taken}"):
                await agent.start()
            with pytest.raises(ClosedError):
                await agent.start()
            assert {t.ident for t in metrics_threads()} == threads
    finally:
        outside.close()
    assert 'agent="mtaken"' in await asyncio.to_thread(scrape, port)  # the first agent still serves
