"""One session per peer: both sides of a pair may dial at any moment, both at once too, and end
with exactly one session (the connection dialled by the smaller peer id), in two processes."""

import asyncio
import json

import pytest

from omni_async import AlreadyConnected

from .conftest import FAST

pytestmark = pytest.mark.timeout(60)

RACES = 50


async def ask(peer, line: str) -> dict:
    peer.proc.stdin.write(line.encode() + b"\n")
    await peer.proc.stdin.drain()
    return json.loads(await asyncio.wait_for(peer.proc.stdout.readline(), 15))


async def test_simultaneous_dials_end_with_one_session(make_agent, spawn_peer, tmp_path):
    """50 races, each side dialling the other at once; half with this side's id the smaller
    ("a" < "m"), half the larger ("z" > "m").  Each ends with one session on both sides, over
    the connection dialled by the smaller id, usable both ways, reported as one join."""
    calm = {"heartbeat_interval": 0.5, "heartbeat_timeout": 10.0}
    child = await spawn_peer("race", str(tmp_path / "region"), 8, 4096, {"peer_id": "m", **calm})
    locals_ = [await make_agent(8, 4096, peer_id=pid, **calm) for pid in ("a", "z")]
    joins = {agent.peer_id: [] for agent in locals_}
    for agent in locals_:
        agent.add_peer_listener(lambda e, seen=joins[agent.peer_id]: seen.append(e.kind))
    outcomes = set()
    async with asyncio.timeout(40):
        for race in range(RACES):
            agent = locals_[race % 2]
            line = f"dial {agent.control_address}\n".encode()
            child.proc.stdin.write(line)  # the child dials as this side does
            await child.proc.stdin.drain()
            try:
                mine = await agent.connect(child.info["address"])
            except AlreadyConnected:
                mine = None
            theirs = json.loads(await asyncio.wait_for(child.proc.stdout.readline(), 15))
            assert mine in ("m", None) and theirs["dialled"] in (agent.peer_id, None), (race, mine, theirs)
            assert mine or theirs["dialled"], f"race {race}: neither dial joined ({theirs})"
            outcomes.add((agent.peer_id, mine is not None, theirs["dialled"] is not None))
            await agent.wait_for_peer("m", timeout=10)
            state = await ask(child, f"check {agent.peer_id}")
            smaller = min(agent.peer_id, "m")
            assert state["peers"] == [agent.peer_id] and state["dialled_by"] == smaller, (race, state)
            assert (state["joined"], state["left"]) == (1, 0), (race, state)
            assert set(agent.peers) == {"m"} and agent.dialled_by("m") == smaller, race
            await asyncio.wait_for(agent.write_blocks("m", [0], [2]), 10)
            assert joins[agent.peer_id] == ["joined"], (race, joins)
            await agent.remove_peer("m")
            assert await ask(child, f"gone {agent.peer_id}") == {"gone": agent.peer_id, "joined": 0, "left": 1}
            joins[agent.peer_id].clear()
    assert await child.stop() == 0
    print(sorted(outcomes))


async def test_every_session_move_is_an_event_and_peer_events_stay_as_before(make_agent):
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b")
    moves, peer_events = [], []
    a.add_session_listener(lambda e: moves.append((e.peer_id, e.old, e.new, type(e.error).__name__)))
    a.add_peer_listener(lambda e: peer_events.append((e.kind, e.peer_id)))
    assert a.session_phase("b") == "gone"
    assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"
    assert a.session_phase("b") == "joined" and a.handshakes_in_progress("b") == 0
    assert await a.remove_peer("b") and a.session_phase("b") == "gone"
    assert moves == [("b", "gone", "admitting", "NoneType"), ("b", "admitting", "joined", "NoneType"),
                     ("b", "joined", "leaving", "PeerLost"), ("b", "leaving", "gone", "PeerLost")]
    assert peer_events == [("joined", "b"), ("left", "b")]
    assert await a.remove_peer("b") is False


async def test_a_later_dial_keeps_the_smaller_ids_connection(make_agent):
    """Not only a race: the pair always ends on the connection dialled by the smaller id.  The
    larger id's dial of a joined pair is refused; the smaller id's takes over, silently."""
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b")
    events = []
    for agent in (a, b):
        agent.add_peer_listener(lambda e, me=agent.peer_id: events.append((me, e.kind)))
    assert await asyncio.wait_for(b.connect(a.control_address), 10) == "a"
    await asyncio.wait_for(a.wait_for_peer("b"), 10)
    assert a.dialled_by("b") == b.dialled_by("a") == "b"
    assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"
    async with asyncio.timeout(10):
        while b.dialled_by("a") != "a" or b.handshakes_in_progress("a"):
            await asyncio.sleep(0.005)
    assert a.dialled_by("b") == "a"
    with pytest.raises(AlreadyConnected):
        await asyncio.wait_for(b.connect(a.control_address), 10)
    assert a.dialled_by("b") == b.dialled_by("a") == "a"
    a.region.array[0], b.region.array[0] = 1, 2
    await asyncio.wait_for(a.write_blocks("b", [0], [3]), 5)
    await asyncio.wait_for(b.write_blocks("a", [0], [3]), 5)
    assert (b.region.array[3] == 1).all() and (a.region.array[3] == 2).all()
    assert sorted(events) == [("a", "joined"), ("b", "joined")]


async def test_a_dial_whose_offered_lane_the_winner_closed_ends_crossed(make_agent):
    """z dials a and a answers with a new lane; before z connects that lane, a's own dial wins
    the tie-break and a closes it.  z's dial must end as crossed (AlreadyConnected: the pair is
    joined), not as a rejection of unusable agent metadata."""
    a = await make_agent(peer_id="a")
    z = await make_agent(peer_id="z")
    connect_lane = z.transport.connect_lane
    calls = 0

    async def winner_first(peer, lane):  # fault injection around the real method
        nonlocal calls
        calls += 1
        if calls == 1:  # z's own dial: a's dial joins the pair and a closes the offered lane
            assert await asyncio.wait_for(a.connect(z.control_address), 10) == "z"
            closing = [lane.wait_closed() for lane in a.transport._closing]
            assert closing, "a closed no lane when its dial took over"
            await asyncio.wait_for(asyncio.gather(*closing), 10)
        await connect_lane(peer, lane)

    z.transport.connect_lane = winner_first
    with pytest.raises(AlreadyConnected):
        await asyncio.wait_for(z.connect(a.control_address), 10)
    assert calls == 2
    assert a.dialled_by("z") == z.dialled_by("a") == "a"
    a.region.array[0], z.region.array[0] = 5, 6
    await asyncio.wait_for(a.write_blocks("z", [0], [3]), 5)
    await asyncio.wait_for(z.write_blocks("a", [0], [3]), 5)
    assert (z.region.array[3] == 5).all() and (a.region.array[3] == 6).all()


async def test_a_dialler_still_vetting_our_address_is_not_dropped_as_silent(make_agent):
    """The listener joins the pair before it welcomes the dialler, and counts the dialler's
    silence from then; the dialler joins only after vetting the listener's address (a check
    in a child process: up to its 2 s deadline, longer in a queue).  A dialler that took
    longer than the listener's heartbeat timeout was dropped as silent, and its handshake then
    failed on the listener's closed lane.  It sends heartbeats while it finishes."""
    a = await make_agent(peer_id="a")
    b = await make_agent(peer_id="b")
    left: list[str] = []
    b.add_peer_listener(lambda event: left.append(event.peer_id) if event.kind == "left" else None)
    real_connect_lane = a.transport.connect_lane

    async def slow_connect_lane(*args, **kwargs):  # the dialler's vetting of b's address, slowed
        await asyncio.sleep(FAST["heartbeat_timeout"] * 2)
        await real_connect_lane(*args, **kwargs)

    a.transport.connect_lane = slow_connect_lane
    assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"
    await asyncio.sleep(FAST["heartbeat_timeout"] * 1.5)  # joined on both sides, and staying
    assert left == [] and set(b.peers) == {"a"} and set(a.peers) == {"b"}
    await asyncio.wait_for(a.write_blocks("b", [0], [1]), 5)


async def test_a_pair_with_a_heartbeat_timeout_beyond_tcp_keepalives_range_joins(make_agent):
    """The control sockets' TCP keepalive idles for the heartbeat timeout, which Linux takes up
    to 32,767 s: beyond it, unclamped, every connection failed and the handshake timed out."""
    calm = {"heartbeat_timeout": 1e6, "handshake_timeout": 5.0}
    a = await make_agent(peer_id="a", **calm)
    b = await make_agent(peer_id="b", **calm)
    assert await asyncio.wait_for(a.connect(b.control_address), 10) == "b"
    await asyncio.wait_for(a.write_blocks("b", [0], [1]), 5)
