"""Contract tests of ``SyncTransferAdapter`` against the seed ``OmniTransferAdapterBase`` text.

Written from the seed's method list and docstrings (``save_async`` / ``load_async`` submit,
``save`` / ``load`` are synchronous, ``get_finished_requests`` returns finished loaded or saved
requests, ``collect_failed_*`` drain ``{request_id: reason}``, ``shutdown`` stops the background
work), plus the facade's documented signatures.  Plain synchronous tests: two facades in one
process, each with its own loop thread and ConnectorService, connected over loopback.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from omni_async import ClosedError, DeadlineExceeded, TransferCancelled
from omni_async.compat import Chunk, SyncTransferAdapter

pytestmark = pytest.mark.timeout(30)

os.environ.setdefault("UCX_NET_DEVICES", "lo")

TIMINGS = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "handshake_timeout": 2.0, "ucx_net_devices": "lo"}
STAGE = "thinker-talker"
DEADLINE_S = 5.0


def service_config(peer_id: str, **adapter: Any) -> dict[str, Any]:
    return {"agent": {**TIMINGS, "peer_id": peer_id}, "region": {"num_blocks": 8, "block_len": 4096},
            "adapter": {"drain_timeout": 1.0, **adapter}}


def chunk(request: int, index: int) -> dict[str, Any]:
    return {"hidden": np.full((4, 8), request * 100 + index, dtype=np.float16), "index": index}


def until(probe: Callable[[], Any], deadline_s: float = DEADLINE_S) -> Any:
    """Call ``probe`` until it returns something truthy; fail after the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.002)


def drain_finished(adapter: SyncTransferAdapter, wanted: set[str]) -> set[str]:
    """Collect ``get_finished_requests()`` until every id in ``wanted`` was reported."""
    seen: set[str] = set()

    def probe() -> bool:
        seen.update(adapter.get_finished_requests())
        return wanted <= seen

    until(probe)
    return seen


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SyncTransferAdapter, SyncTransferAdapter]]:
    """A sender and a receiver shared by the tests that leave them usable (distinct request ids)."""
    rx = SyncTransferAdapter(service_config("talker", stall_timeout=1.0), stage=STAGE, source="thinker")
    tx = SyncTransferAdapter(service_config("thinker"), stage=STAGE)
    try:
        assert tx.connect(rx.control_address) == "talker"
        yield tx, rx
    finally:
        tx.shutdown()
        rx.shutdown()


def test_save_async_and_load_async_report_finished_on_both_sides(pair):
    tx, rx = pair
    for i in range(3):
        tx.save_async("req-a", chunk(1, i), final=i == 2)
    for _ in range(3):
        rx.load_async("req-a")
    assert "req-a" in drain_finished(tx, {"req-a"})
    drain_finished(rx, {"req-a"})
    got = [until(lambda: rx.get_loaded("req-a")) for _ in range(3)]
    assert [(c.request_id, c.index, c.final) for c in got] == [("req-a", 0, False), ("req-a", 1, False), ("req-a", 2, True)]
    assert all(isinstance(c, Chunk) and (c.data["hidden"] == 100 + c.index).all() for c in got)
    assert rx.get_loaded("req-a") is None
    assert tx.collect_failed_send_request_ids() == {} and rx.collect_failed_receive_request_ids() == {}


def test_get_finished_requests_drains(pair):
    tx, rx = pair
    tx.save_async("req-b", {"x": 1}, final=True)
    rx.load_async("req-b")
    drain_finished(tx, {"req-b"})
    drain_finished(rx, {"req-b"})
    assert "req-b" not in tx.get_finished_requests() | rx.get_finished_requests()


def test_a_request_is_saved_only_when_its_final_chunk_is_acknowledged(pair):
    tx, rx = pair
    tx.save_async("req-c", {"x": 0})
    rx.load("req-c", timeout=DEADLINE_S)  # chunk 0 is acknowledged ...
    assert "req-c" not in tx.get_finished_requests()  # ... but the request is not finished
    tx.save_async("req-c", {"x": 1}, final=True)
    assert rx.load("req-c", timeout=DEADLINE_S).final
    drain_finished(tx, {"req-c"})


def test_blocking_save_and_load(pair):
    tx, rx = pair
    tx.save("req-d", chunk(4, 0), timeout=DEADLINE_S)
    tx.save("req-d", chunk(4, 1), final=True)
    first, second = rx.load("req-d", timeout=DEADLINE_S), rx.load("req-d")
    assert (first.index, second.index, second.final) == (0, 1, True)
    assert (second.data["hidden"] == 401).all()
    time.sleep(0.05)
    assert "req-d" not in tx.get_finished_requests() | rx.get_finished_requests()  # not in the books


def test_load_timeout_raises_and_the_stream_stays_usable(pair):
    tx, rx = pair
    with pytest.raises(DeadlineExceeded):
        rx.load("req-e", timeout=0.2)
    tx.save_async("req-e", {"x": 7}, final=True)
    got = rx.load("req-e", timeout=DEADLINE_S)
    assert (got.index, got.data["x"]) == (0, 7)
    assert rx.collect_failed_receive_request_ids() == {}


def test_stalled_load_is_a_failed_receive(pair):
    _, rx = pair
    rx.load_async("req-ghost")  # nobody sends: stall_timeout (1 s) fails it
    failed = until(rx.collect_failed_receive_request_ids, 3.0)
    assert list(failed) == ["req-ghost"] and failed["req-ghost"].startswith("DeadlineExceeded")
    assert rx.collect_failed_receive_request_ids() == {}  # drained
    assert "req-ghost" not in rx.get_finished_requests()


def test_payload_that_cannot_travel_is_a_failed_send(pair):
    tx, _ = pair
    tx.save_async("req-bad", {"x": object()}, final=True)
    failed = until(tx.collect_failed_send_request_ids)
    assert list(failed) == ["req-bad"] and failed["req-bad"].startswith("TypeError")
    time.sleep(0.05)
    assert "req-bad" not in tx.get_finished_requests()


def test_request_cleaned_up_by_the_receiver_fails_the_send(pair):
    tx, rx = pair
    rx.cleanup("req-f")
    time.sleep(0.05)  # cleanup is handed to the loop without waiting
    tx.save_async("req-f", {"x": 1}, final=True)
    failed = until(tx.collect_failed_send_request_ids)
    assert failed["req-f"].startswith("TransferCancelled")


def test_cancel_by_the_sender_fails_the_receivers_load(pair):
    tx, rx = pair
    tx.save_async("req-g", {"x": 0})
    assert rx.load("req-g", timeout=DEADLINE_S).index == 0
    tx.cancel("req-g")
    with pytest.raises(TransferCancelled):
        rx.load("req-g", timeout=DEADLINE_S)


def test_a_request_cleaned_up_while_a_load_waits_is_not_reported_failed(pair):
    """``cleanup`` empties the request's books, but the load it failed (``TransferCancelled``)
    reported the request as a failed receive afterwards: the caller's own cleanup came back as
    a failure."""
    _, rx = pair
    rx.load_async("req-gone")
    rx.cleanup("req-gone")
    time.sleep(0.1)
    assert "req-gone" not in rx.collect_failed_receive_request_ids()


def test_record_failures_are_drained_like_real_ones(pair):
    tx, rx = pair
    tx.record_send_failure(None, "ignored")
    tx.record_send_failure("req-h", "gave up")
    rx.record_receive_failure("req-h", "invalid chunk")
    assert tx.collect_failed_send_request_ids() == {"req-h": "gave up"}
    assert rx.collect_failed_receive_request_ids() == {"req-h": "invalid chunk"}
    assert tx.collect_failed_send_request_ids() == {} and rx.collect_failed_receive_request_ids() == {}


def test_many_caller_threads(pair):
    tx, rx = pair
    ids = [f"req-t{t}-{r}" for t in range(4) for r in range(4)]

    def produce(thread: int) -> None:
        for r in range(4):
            for i in range(3):
                tx.save_async(f"req-t{thread}-{r}", chunk(r, i), final=i == 2)

    def consume(thread: int) -> None:
        for r in range(4):
            for _ in range(3):
                rx.load_async(f"req-t{thread}-{r}")

    threads = [threading.Thread(target=f, args=(t,)) for t in range(4) for f in (produce, consume)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    drain_finished(tx, set(ids))
    drain_finished(rx, set(ids))
    for request_id in ids:
        got = [until(lambda rid=request_id: rx.get_loaded(rid)) for _ in range(3)]
        assert [c.index for c in got] == [0, 1, 2] and got[-1].final


def test_calls_from_the_loop_thread_are_refused(pair):
    tx, _ = pair
    outcome: list[BaseException] = []

    def on_loop() -> None:
        try:
            tx.save("req-loop", {"x": 1})
        except BaseException as exc:  # recorded for the assertion
            outcome.append(exc)

    tx.loop.call_soon_threadsafe(on_loop)
    until(lambda: outcome)
    assert isinstance(outcome[0], RuntimeError)


def test_argument_errors_are_raised_in_the_callers_thread():
    with SyncTransferAdapter(service_config("lonely"), stage=STAGE) as lonely:
        with pytest.raises(ValueError, match="destination"):
            lonely.save_async("r", {"x": 1})
        with pytest.raises(ValueError, match="destination"):
            lonely.save("r", {"x": 1})
        with pytest.raises(ValueError):
            SyncTransferAdapter(service_config("bad"), stage="a:b")


def test_shutdown_is_idempotent_then_everything_raises_closed():
    adapter = SyncTransferAdapter(service_config("short-lived"), stage=STAGE, destination="nobody")
    loop_thread = f"omni-sync-adapter-{adapter.peer_id}"  # the facade's loop runs in a thread named so
    thread = next(t for t in threading.enumerate() if t.name == loop_thread)
    with pytest.raises(TypeError):
        adapter.save_async("r", [1, 2, 3])  # type: ignore[arg-type]
    adapter.shutdown()
    adapter.shutdown()
    assert not thread.is_alive()
    for call in (lambda: adapter.save_async("r", {}), lambda: adapter.load_async("r"),
                 lambda: adapter.save("r", {}), lambda: adapter.load("r", timeout=1),
                 lambda: adapter.connect("tcp://127.0.0.1:1")):
        with pytest.raises(ClosedError):
            call()
    assert adapter.get_finished_requests() == set()  # the books stay readable


def test_a_scheduler_that_drains_without_sleeping_does_not_starve_the_loops(pair):
    """The seed's scheduler drain with no sleep between calls, on both sides of the pair.

    Each loop thread releases the GIL on every epoll and ctypes call; from a caller that never
    blocks it gets it back only after the switch interval.  Raised to 100 ms here, 20 requests
    with starved loops take seconds; ``get_finished_requests()`` waiting for news keeps them fast.
    """
    tx, rx = pair
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    try:
        start = time.perf_counter()
        for i in range(20):
            request_id = f"req-tight-{i}"
            tx.save_async(request_id, {"x": i}, final=True)
            rx.load_async(request_id)
            for side in (tx, rx):
                while request_id not in side.get_finished_requests():
                    assert time.perf_counter() - start < DEADLINE_S, f"{request_id} never finished"
            loaded = rx.get_loaded(request_id)
            assert loaded is not None and loaded.data == {"x": i} and loaded.final
        elapsed = time.perf_counter() - start
    finally:
        sys.setswitchinterval(previous)
    assert elapsed < 1.0, f"20 requests took {elapsed:.2f}s"
    assert tx.collect_failed_send_request_ids() == {} and rx.collect_failed_receive_request_ids() == {}


def test_a_request_id_reused_after_cleanup_is_not_settled_by_the_old_requests_saves():
    """Saves of a cleaned-up request that were still in flight settled against the book of a
    new request under the same id: the old chunk's acknowledgement finished the new request
    while its own final chunk was still unacknowledged (held back by the receiver)."""
    rx = SyncTransferAdapter({**service_config("talker-reuse"),
                              "connector": {"name": "ucx", "extra": {"max_buffered_bytes": 12 << 20}}},
                             stage=STAGE, source="thinker-reuse")
    tx = SyncTransferAdapter(service_config("thinker-reuse"), stage=STAGE)
    try:
        assert tx.connect(rx.control_address) == "talker-reuse"
        big = 8 << 20  # (its acknowledgement takes a while: the cleanup and the next save come first)
        tx.save_async("req-reuse", {"x": np.zeros(big, np.uint8)})  # acknowledged: fits the buffer
        tx.cleanup("req-reuse")
        tx.save_async("req-reuse", {"x": np.ones(big, np.uint8)}, final=True)  # held: the buffer is full
        time.sleep(0.3)
        assert tx.get_finished_requests() == set()  # its final chunk is not acknowledged yet
        assert tx.collect_failed_send_request_ids() == {}
        first, second = rx.load("req-reuse", timeout=DEADLINE_S), rx.load("req-reuse", timeout=DEADLINE_S)
        assert (int(first.data["x"][0]), int(second.data["x"][0]), second.final) == (0, 1, True)
        drain_finished(tx, {"req-reuse"})
    finally:
        tx.shutdown()
        rx.shutdown()


def test_loaded_chunks_are_handed_out_in_the_order_the_loads_were_made():
    """Loads made ahead settle in arrival order, and a small final chunk overtakes a large
    first one over UCX (every time): the request was reported finished with its final chunk
    first in ``get_loaded``, while chunk 0 was still on its way (a scheduler that took it as the
    stream's end dropped chunk 0).  A chunk is handed out only once every earlier load of its
    request settled."""
    config = {"agent": {"same_host_lane": False}}
    rx = SyncTransferAdapter(_merged(service_config("talker-order", stall_timeout=5.0), config),
                             stage=STAGE, source="thinker-order")
    tx = SyncTransferAdapter(_merged(service_config("thinker-order"), config), stage=STAGE)
    try:
        assert tx.connect(rx.control_address) == "talker-order"
        requests = [f"order-{r}" for r in range(6)]
        for request in requests:
            rx.load_async(request)
            rx.load_async(request)
        for r, request in enumerate(requests):
            tx.save_async(request, {"x": np.full(2 << 20, r, np.uint8)})
            tx.save_async(request, {"i": 1}, final=True)
        drain_finished(tx, set(requests))
        order: dict[str, list[int]] = {request: [] for request in requests}

        def probe() -> bool:
            rx.get_finished_requests()
            for request in requests:
                while (chunk := rx.get_loaded(request)) is not None:
                    order[request].append(chunk.index)
            return all(len(indices) == 2 for indices in order.values())

        until(probe)
        assert order == {request: [0, 1] for request in requests}
    finally:
        tx.shutdown()
        rx.shutdown()


def _merged(config: dict[str, Any], extra: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {**config, **{section: {**config.get(section, {}), **fields} for section, fields in extra.items()}}


def test_a_load_that_cannot_start_is_reported_failed_not_left_waiting():
    """Another adapter of the service already waits for the request's next chunk (the connector
    refuses a second wait on a key, ValueError): the facade's load is reported failed with the
    reason; before, the error escaped the loop's callback and the load stayed outstanding."""
    rx = SyncTransferAdapter(service_config("talker-busy", stall_timeout=5.0), stage=STAGE, source="thinker-busy")
    try:
        async def wait_elsewhere() -> Any:
            assert rx.service is not None
            return rx.service.adapter(STAGE).load_async("busy")

        other = asyncio.run_coroutine_threadsafe(wait_elsewhere(), rx.loop).result(DEADLINE_S)
        rx.load_async("busy")
        failed: dict[str, str] = {}
        until(lambda: failed.update(rx.collect_failed_receive_request_ids()) or failed)
        assert "somebody already waits" in failed["busy"]
        assert rx._engine.outstanding == 0 and not rx._engine.loads
        rx.loop.call_soon_threadsafe(other.cancel)
    finally:
        rx.shutdown()
