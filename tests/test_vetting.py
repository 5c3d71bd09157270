"""Address vetting is bounded: a flood of crash-inducing addresses (each kills a real vetting
process) neither delays a legitimate handshake past its timeout nor waits forever."""

import asyncio
import time

import pytest

from omni_async import ProtocolError
from omni_async.transport.vetting import AddressVetter, NotVetted, shared_vetter

from .test_hostile import real_address

pytestmark = pytest.mark.timeout(120)


def crashing(address: bytes) -> bytes:
    """A worker address with a wrong version byte: UCX aborts the process that unpacks it
    (the lane's structural check refuses it before vetting; here it goes to the vetter directly,
    as an address that passes the structural check but crashes UCX would)."""
    return bytes([address[0] ^ 0xFF]) + address[1:]


async def test_flood_of_crashing_addresses_does_not_delay_a_handshake(make_agent):
    calm = {"handshake_timeout": 3.0, "heartbeat_interval": 0.5, "heartbeat_timeout": 10.0}
    a = await make_agent(peer_id="a", **calm)
    b = await make_agent(peer_id="b", **calm)
    vetter = shared_vetter(b.config.ucx_tls, b.config.ucx_net_devices)  # the one both agents use
    bad = crashing(real_address())
    flood = [asyncio.ensure_future(vetter.check(bad)) for _ in range(40)]
    await asyncio.sleep(0.05)
    started = time.monotonic()
    assert await a.connect(b.control_address) == "b"  # both sides vet under the flood
    assert time.monotonic() - started < 3.0
    results = await asyncio.wait_for(asyncio.gather(*flood, return_exceptions=True), 30)
    assert all(isinstance(r, ProtocolError) for r in results), results
    a.region.array[0] = 5
    await asyncio.wait_for(a.write_blocks("b", [0], [1]), 5)
    assert (b.region.array[1] == 5).all()


async def test_checks_have_a_deadline_and_a_bound():
    vetter = AddressVetter("^cma", "lo", workers=1, max_pending=4)
    try:
        good, bad = real_address(), crashing(real_address())
        await vetter.check(good, timeout=30)  # starts the zygote
        # More waiting than allowed: refused at once; the rest settle within their deadline.
        started = time.monotonic()
        checks = [asyncio.ensure_future(vetter.check(bad, timeout=1.0)) for _ in range(12)]
        results = await asyncio.wait_for(asyncio.gather(*checks, return_exceptions=True), 10)
        assert time.monotonic() - started < 3.0
        assert all(isinstance(r, ProtocolError) for r in results)
        assert sum("saturated" in str(r) for r in results) >= 12 - 4 - 1
        await vetter.check(good, timeout=5)  # and a good address still passes
    finally:
        await asyncio.get_running_loop().run_in_executor(None, vetter.close)


async def test_servers_are_retired_and_legitimate_checks_keep_passing():
    """A server is retired after SERVER_CHECKS checks (its never-progressed endpoints only
    grow); checks on either side of each retirement pass."""
    from omni_async.transport.vetting import SERVER_CHECKS

    vetter = AddressVetter("^cma", "lo", workers=1)
    try:
        good = real_address()
        for _ in range(2 * SERVER_CHECKS + 3):
            await vetter.check(good, timeout=30)
        assert vetter.refused == 0
    finally:
        await asyncio.get_running_loop().run_in_executor(None, vetter.close)


async def test_a_zygote_busy_in_another_thread_does_not_block_the_loop():
    """The vetter is shared by every loop of a process: while another thread holds the zygote
    (a restart takes as long as a Python start), a check that needs a new server waits for it
    off the loop, and the loop keeps running its other callbacks meanwhile (10 ms timers; the
    bound leaves room for a loaded machine, a blocked loop would miss it by seconds)."""
    import threading

    vetter = AddressVetter("^cma", "lo", workers=1)
    try:
        good, bad = real_address(), crashing(real_address())
        await vetter.check(good, timeout=30)  # starts the zygote and a first server
        with pytest.raises(ProtocolError):
            await vetter.check(bad, timeout=30)  # kills it (and the fresh one it retries on)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with vetter._zygote_start:
                held.set()
                release.wait(4)  # bounded: the loop it would block is the one to release it

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            held.wait(5)
            check = asyncio.ensure_future(vetter.check(good, timeout=10))  # needs a new server
            loop, longest = asyncio.get_running_loop(), 0.0
            until = loop.time() + 1.5
            while loop.time() < until:
                before = loop.time()
                await asyncio.sleep(0.01)
                longest = max(longest, loop.time() - before)
            assert not check.done()  # it waits for the zygote ...
            assert longest < 1.0  # ... without holding the loop (blocked, it would wait ~4 s)
        finally:
            release.set()
            holder.join(5)
        await asyncio.wait_for(check, 10)  # and passes once the zygote is free
    finally:
        await asyncio.get_running_loop().run_in_executor(None, vetter.close)


async def test_remote_keys_are_unpacked_in_the_child_first():
    """A peer's packed remote keys are unpacked on an endpoint to its address in a vetting
    child (UCX trusts them: it attaches the shared memory segments they name): a real key
    passes, malformed ones are refused with ProtocolError, and this process is untouched."""
    import numpy as np

    from omni_async.transport.lane import Lane, new_context
    from omni_async.transport.rma import Registration

    context = new_context("^cma", "lo")
    lane = Lane(context, asyncio.get_running_loop())
    registration = Registration(context, [np.zeros((4, 4096), np.uint8)])
    vetter = AddressVetter("^cma", "lo", workers=1)
    try:
        (key,) = registration.keys
        await vetter.check(lane.address, timeout=30, keys=registration.keys)
        malformed = [b"\xff" * len(key), b"\x04" + b"\x00" * 9 + b"\xff" * 32, b"\x08" + b"\x00" * 9 + b"\xff" * 32]
        for bad in malformed:
            with pytest.raises(ProtocolError, match="remote keys"):
                await vetter.check(lane.address, timeout=10, keys=[bad])
        await vetter.check(lane.address, timeout=10, keys=[key, key])  # and real ones still pass
        # No verdict in time: the transport keeps the peer, on tags.  The one worker's slot is
        # held here, so the check cannot start before its deadline (racing a real check
        # against a short deadline failed now and then under load: a check takes ~0.6 ms).
        await vetter._acquire()
        try:
            with pytest.raises(NotVetted):
                await vetter.check(lane.address, timeout=0.05, keys=[key])
        finally:
            vetter._release()
        await vetter.check(lane.address, timeout=10, keys=[key])  # the slot is free again
    finally:
        await asyncio.get_running_loop().run_in_executor(None, vetter.close)
        lane.close()
        await lane.wait_closed()
        registration.close()
        registration.close()  # idempotent



async def test_a_vetting_child_that_dies_is_no_verdict_on_the_address():
    """The zygote dies (SIGKILL, as by the OOM killer) while a check waits for it to fork a
    server: the check has no verdict (NotVetted: not the address's fault) and a later check
    vets the address with a restarted zygote.  (It refused the good address as unusable,
    ProtocolError: a handshake rejected, or a healthy peer's keys dropping it.)"""
    import os
    import signal

    loop = asyncio.get_running_loop()
    vetter = AddressVetter("^cma", "lo", workers=1)
    good = real_address()
    try:
        await loop.run_in_executor(None, vetter.warm_up)
        zygote = vetter._zygote
        assert zygote is not None and zygote.poll() is None
        os.kill(zygote.pid, signal.SIGSTOP)  # the fork request stays queued in its socket
        check = asyncio.ensure_future(vetter.check(good, timeout=10))
        await asyncio.sleep(0.3)
        assert not check.done()
        os.kill(zygote.pid, signal.SIGKILL)
        with pytest.raises(NotVetted, match="could not be started"):
            await asyncio.wait_for(check, 15)
        await vetter.check(good, timeout=10)  # a fresh zygote vets it
    finally:
        await loop.run_in_executor(None, vetter.close)



async def test_a_stopped_vetting_child_cannot_hold_the_vetter():
    """The zygote stops (SIGSTOP) and fork requests pile up unread until its socket is full: a
    request then gives up after ``DEADLINE`` and the zygote is replaced, so ``close()`` returns.
    (One executor thread blocked in ``send_fds`` for good, holding the
    zygote's lock: every later request and ``close()``, which atexit runs, waited for ever.)"""
    import contextlib
    import os
    import signal
    import threading

    loop = asyncio.get_running_loop()
    vetter = AddressVetter("^cma", "lo", workers=64, max_pending=4096)
    good = real_address()
    await loop.run_in_executor(None, vetter.warm_up)
    zygote = vetter._zygote
    assert zygote is not None
    os.kill(zygote.pid, signal.SIGSTOP)
    try:
        for _ in range(8):
            await asyncio.gather(*(vetter.check(good, timeout=0.2) for _ in range(64)), return_exceptions=True)
        closed = threading.Event()
        threading.Thread(target=lambda: (vetter.close(), closed.set()), daemon=True).start()
        for _ in range(100):  # (not to_thread: the default executor is what may be stuck)
            if closed.is_set():
                break
            await asyncio.sleep(0.1)
        assert closed.is_set(), "vetter.close() blocked behind a request to the stopped zygote"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(zygote.pid, signal.SIGKILL)
        await loop.run_in_executor(None, vetter.close)
