"""One session per peer: both sides of a pair may dial at any moment, both at once too, and end
with exactly one session (the connection dialled by the smaller peer id), in two processes."""

import asyncio
import json

import pytest

from omni_async import AlreadyConnected

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
