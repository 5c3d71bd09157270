"""Two "hosts": network namespaces joined by a veth pair, a service in each, then the link is cut.

Both namespaces share one kernel, so shared memory would bypass the veth: these tests force the
cross-host path (``UCX_TLS=tcp`` on the veth device) and assert it is the one in use.
Needs root and iproute2; skipped otherwise.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from .conftest import ROOT

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (ip netns)"),
]

NUM_BLOCKS, BLOCK_LEN = 32, 64 * 1024
HEARTBEAT = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "handshake_timeout": 5.0}
CROSS_HOST = {"ucx_tls": "tcp", "same_host_lane": False}
"""Both namespaces share one kernel (one host_id): keep blocks on the network path, as between hosts."""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def hosts():
    """Two namespaces, ``a`` (10.77.0.1, dev va) and ``b`` (10.77.0.2, dev vb), linked by a veth."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"oa-{tag}-a", f"oa-{tag}-b"
    ip("netns", "add", a)
    ip("netns", "add", b)
    try:
        ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        ip("link", "set", f"va{tag}", "netns", a, "name", "va")
        ip("link", "set", f"vb{tag}", "netns", b, "name", "vb")
        for ns, dev, addr in ((a, "va", "10.77.0.1/24"), (b, "vb", "10.77.0.2/24")):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield {"a": a, "b": b}
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


class Proc:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self, timeout: float = 20) -> dict:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert raw, f"process exited with {await self.proc.wait()}"
        return json.loads(raw)

    async def until(self, key: str, timeout: float = 20) -> dict:
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.line(timeout)
                if key in msg:
                    return msg

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")


async def start(ns: str, role: str, path: str, config: dict, *extra: str) -> Proc:
    with open(path, "ab") as f:
        f.truncate(NUM_BLOCKS * BLOCK_LEN)
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", ns, sys.executable, "-m", "tests.helpers.peer", role, path,
        str(NUM_BLOCKS), str(BLOCK_LEN), json.dumps(config), *extra,
        cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    return Proc(proc)


async def test_link_cut_fails_both_sides_in_time_then_reconnects(hosts, tmp_path):
    rx = await start(hosts["b"], "serve", str(tmp_path / "rx"),
                     {"peer_id": "rx", "host": "10.77.0.2", **CROSS_HOST, "ucx_net_devices": "vb", **HEARTBEAT})
    tx = None
    try:
        address = (await rx.line())["address"]
        assert address.startswith("tcp://10.77.0.2:")
        assert (await rx.line())["tls"] == "tcp"  # the cross-host path, not shared memory
        tx = await start(hosts["a"], "pump", str(tmp_path / "tx"),
                         {"peer_id": "tx", "host": "10.77.0.1", **CROSS_HOST, "ucx_net_devices": "va", **HEARTBEAT},
                         address)
        assert (await tx.until("connected"))["connected"] == "rx"
        assert (await rx.until("event"))["event"] == "joined"
        await tx.until("ok")  # data is flowing across the veth

        ip("-n", hosts["a"], "link", "set", "va", "down")
        cut_at = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable with the children's
        failed = await tx.until("failed", timeout=15)
        left = await rx.until("event", timeout=15)
        assert failed["kinds"] == ["PeerLost"], failed
        assert left == {**left, "event": "left", "peer": "tx", "error": "PeerLost"}
        limit = HEARTBEAT["heartbeat_timeout"] + 1.5
        assert failed["at"] - cut_at < limit and left["at"] - cut_at < limit, (failed, left, cut_at)

        ip("-n", hosts["a"], "link", "set", "va", "up")
        await asyncio.sleep(0.5)
        tx.send("reconnect")
        assert (await tx.until("reconnected"))["reconnected"] == "rx"
        joined = await rx.until("event")
        assert joined["event"] == "joined" and joined["peer"] == "tx"
        # Every block arrived intact after the reconnect.
        sent = np.memmap(str(tmp_path / "tx"), dtype=np.uint8, mode="r", shape=(NUM_BLOCKS, BLOCK_LEN))
        got = np.memmap(str(tmp_path / "rx"), dtype=np.uint8, mode="r", shape=(NUM_BLOCKS, BLOCK_LEN))
        assert np.array_equal(sent, got)
    finally:
        for p in (tx, rx):
            if p is not None and p.proc.returncode is None:
                p.proc.kill()
                await p.proc.wait()
