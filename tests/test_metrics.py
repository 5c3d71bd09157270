"""Metrics: stats() snapshot and the Prometheus series, including the /metrics endpoint."""

import asyncio
import socket
import urllib.request

import pytest

from omni_async import InvalidBlocks

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    assert 'omni_async_transfers_total{agent="ma",kind="blocks",outcome="ok"} 1.0' in body
    assert 'omni_async_bytes_total{agent="mb",direction="received",kind="blocks"} 12288.0' in body
    assert 'omni_async_peers{agent="ma"} 1.0' in body
