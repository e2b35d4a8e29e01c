"""Admission end to end through the real Envoy: a burst beyond the fleet's slots is served without any engine running more
than its max_num_seqs; parked requests say how long they waited; a client that leaves while parked leaves nothing behind;
queue overflow and sheddable requests get a 503 with a sane Retry-After; context and floors refuse before any engine."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rig.waits import wait_for
from tests.harness import Stack, chat_body, http_json, post, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Two identical engines: these tests are about admission (caps, parking, shedding), so routing must not prefer one.
    s = start_stack([("a", "spark"), ("b", "spark")], tmp_path_factory.mktemp("admission"), speed=10.0,
                    admission={"max_queue_depth": 6, "max_park_seconds": 20})
    yield s
    s.close()


def fill_slots(stack: Stack, pool: concurrent.futures.ThreadPoolExecutor,
               max_tokens: int) -> list[concurrent.futures.Future[tuple[int, dict[str, str], bytes]]]:
    """Take all four slots of the fleet with requests of ``max_tokens``; their futures."""
    holders = [pool.submit(post, stack, "/chat/completions", chat_body(max_tokens=max_tokens)) for _ in range(4)]
    wait_for(lambda: stack.status().open_tickets == 4, what="all four slots taken")
    return holders


def drained(stack: Stack) -> None:
    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    wait_for(lambda: stack.status().open_tickets == 0 and plane.admission.depth() == 0, timeout=30,
             what="fleet drained")


def test_burst_beyond_slots_is_all_served_within_caps(stack: Stack) -> None:
    drained(stack)
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda _: post(stack, "/chat/completions", chat_body(max_tokens=30)), range(6)))
    assert [status for status, _, _ in results] == [200] * 6
    parked = [h for _, h, _ in results if "x-sluice-parked-ms" in h]
    assert len(parked) >= 2, "4 slots for 6 requests: at least two had to wait"
    assert all(int(h["x-sluice-parked-ms"]) > 0 for h in parked)
    for name in ("a", "b"):
        stats = http_json(stack.sim_url(name) + "/sim/stats")
        assert stats["max_running_seen"] <= 2, f"{name} ran more than max_num_seqs"
        assert stats["preemptions"] == 0
    drained(stack)


def test_client_that_leaves_while_parked_leaves_nothing(stack: Stack) -> None:
    drained(stack)
    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        # Holders that outlast a slow machine's wait for the fifth request to park (60 tokens at speed 10 took 0.14 s).
        holders = fill_slots(stack, pool, max_tokens=1500)
        served_before = sum(len(stack.sim_log(n)) for n in stack.sims)
        raw = chat_body(max_tokens=5)
        sock = socket.create_connection(("127.0.0.1", stack.config.envoy.listen_port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        wait_for(lambda: plane.admission.depth() == 1, what="the fifth request parked")
        sock.close()
        wait_for(lambda: plane.admission.depth() == 0, what="the parked request gone")
        assert 'sluice_admission_park_cancelled_total 1.0' in _metrics(stack)
        assert [f.result()[0] for f in holders] == [200] * 4
    drained(stack)
    assert sum(len(stack.sim_log(n)) for n in stack.sims) == served_before, "the abandoned request reached an engine"
    assert stack.status().tickets_expired_total == 0


def test_queue_overflow_and_sheddable_get_503_with_retry_after(stack: Stack) -> None:
    drained(stack)
    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        long = fill_slots(stack, pool, max_tokens=200)
        parked = [pool.submit(post, stack, "/chat/completions", chat_body(max_tokens=5)) for _ in range(6)]
        wait_for(lambda: plane.admission.depth() == 6, what="queue full")
        status, headers, payload = post(stack, "/chat/completions", chat_body(max_tokens=5))
        assert status == 503
        error = json.loads(payload)["error"]
        assert error["code"] == "queue_full" and error["type"] == "server_error"
        # The ledger knows the four running requests finish in roughly 200 tokens' time (~4-10 s emulated /10 speed).
        assert 1 <= int(headers["retry-after"]) <= 60
        status, headers, payload = post(stack, "/chat/completions", chat_body(max_tokens=5),
                                         {"x-sluice-priority": "sheddable"})
        assert status == 503 and json.loads(payload)["error"]["code"] == "saturated"
        assert 1 <= int(headers["retry-after"]) <= 60
        assert [f.result()[0] for f in long + parked] == [200] * 10
    drained(stack)


def test_critical_jumps_the_standard_queue(stack: Stack) -> None:
    drained(stack)
    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    admitted_at: dict[str, float] = {}

    def timed(tag: str, headers: dict[str, str]) -> None:
        sent = time.monotonic()
        status, response_headers, _ = post(stack, "/chat/completions", chat_body(max_tokens=5), headers)
        assert status == 200
        admitted_at[tag] = sent + int(response_headers["x-sluice-parked-ms"]) / 1000

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        # One holder much shorter than the others: its release frees exactly one slot, long before the next, so the two
        # parked requests are admitted at clearly different moments and the order cannot blur into one wake.
        # Wide enough apart (about 2 s and 7 s at speed 10) that a loaded machine parks both before the first frees.
        holders = [pool.submit(post, stack, "/chat/completions", chat_body(max_tokens=n))
                   for n in (900, 3000, 3000, 3000)]
        wait_for(lambda: stack.status().open_tickets == 4, what="all four slots taken")
        standard = pool.submit(timed, "standard", {})
        wait_for(lambda: plane.admission.depth() == 1, what="standard parked")
        critical = pool.submit(timed, "critical", {"x-sluice-priority": "critical"})
        wait_for(lambda: plane.admission.depth() == 2, what="critical parked")
        futures: list[concurrent.futures.Future[Any]] = [*holders, standard, critical]
        for f in futures:
            f.result()
    # The critical request parked last but left the lot first.
    assert admitted_at["critical"] < admitted_at["standard"]
    drained(stack)


def test_context_length_is_refused_before_any_engine(stack: Stack) -> None:
    before = sum(len(stack.sim_log(n)) for n in stack.sims)
    status, _, payload = post(stack, "/chat/completions", chat_body(max_tokens=32_000, content="x" * 4_000))
    assert status == 400
    assert json.loads(payload)["error"]["code"] == "context_length_exceeded"
    assert sum(len(stack.sim_log(n)) for n in stack.sims) == before


def test_park_timeout_sheds_with_retry_after(tmp_path: Path) -> None:
    """The two slots are held by answers that run about 2 s (100 tokens at speed 2), so a request that may wait only
    ``max_park_seconds`` (1 s) is refused ``park_timeout`` with a Retry-After: as soon as its estimate says it would
    start too late, or at its second."""
    stack = start_stack([("thor", "thor")], tmp_path, speed=2.0, admission={"max_park_seconds": 1})
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            holders = [pool.submit(post, stack, "/chat/completions", chat_body(max_tokens=100)) for _ in range(2)]
            wait_for(lambda: stack.status().open_tickets == 2, what="slots full")
            started = time.monotonic()
            status, headers, payload = post(stack, "/chat/completions", chat_body(max_tokens=5))
            waited = time.monotonic() - started
            assert status == 503 and json.loads(payload)["error"]["code"] == "park_timeout"
            # The server's own measure, immune to this client's scheduling: answered at arrival or by a park sweep once
            # its estimate rests on measured rates (a fresh engine's first requests are estimated at the policy's
            # default rate, which refuses nobody), at the latest at its 1 s (the sweep runs every 0.1 s).
            assert int(headers.get("x-sluice-parked-ms", 0)) < 1500 and waited < 5.0
            assert 1 <= int(headers["retry-after"]) <= 60
            assert [f.result()[0] for f in holders] == [200, 200]
    finally:
        stack.close()


def test_version_floor_sheds_and_names_the_versions(tmp_path: Path) -> None:
    stack = start_stack([("thor", "thor")], tmp_path, version_floors={"cortex": "0.11"})
    try:
        status, headers, payload = post(stack, "/chat/completions", chat_body())
        assert status == 503
        error = json.loads(payload)["error"]
        assert error["code"] == "version_floor" and "thor=0.10.1" in error["message"]
        assert int(headers["retry-after"]) == 60
        from sluice.admin.v1 import admin_pb2

        why = stack.admin().ExplainDecision(admin_pb2.ExplainDecisionRequest(model="cortex", prompt_tokens=10),
                                            timeout=5)
        assert (why.verdict, why.reason) == ("shed", "version_floor")
        assert [(e.name, e.serves_model, e.meets_version_floor) for e in why.engines] == [("thor", True, False)]
    finally:
        stack.close()


def _metrics(stack: Stack) -> str:
    import urllib.request

    assert stack.controlplane is not None
    port = stack.controlplane.plane.http.port
    text: str = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return text


SOLO_SPEED = 10.0


def _refill_gaps(stack: Stack, rounds: int) -> list[float]:
    """Wall seconds the one-slot engine ``solo`` sat empty between a stream's end and the parked request's arrival, once
    per round (each round: a holder takes the slot, a second request parks behind it). Measured on the simulator's own
    clock (``/sim/log``), so the client's scheduling does not enter."""
    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    gaps = []
    for _ in range(rounds):
        before = len(stack.sim_log("solo"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            holder = pool.submit(post, stack, "/chat/completions", chat_body(max_tokens=600))
            wait_for(lambda: stack.status().open_tickets == 1, what="the slot taken")
            parked = pool.submit(post, stack, "/chat/completions", chat_body(max_tokens=5))
            wait_for(lambda: plane.admission.depth() == 1, what="the second request parked")
            assert holder.result()[0] == 200 and parked.result()[0] == 200
        first, second = stack.sim_log("solo")[before:before + 2]
        gaps.append((second["arrived_at"] - first["finished_at"]) / SOLO_SPEED)
        wait_for(lambda: stack.status().open_tickets == 0, what="both released")
    return gaps


def test_a_freed_slot_is_refilled_without_waiting_for_the_log_flush(tmp_path: Path) -> None:
    # The access log flushes every 5 s and probes come every 5 s: only sending each entry as its stream ends
    # (envoy.access_log_buffer_bytes, default 1) wakes the parked request at once. Batched, the slot would sit empty
    # for up to 5 s (a probe's idle reaping or the flush timer): under 0.5 s three rounds running by chance is ~0.1%.
    stack = start_stack([{"name": "solo", "sim": "spark", "max_num_seqs": 1}], tmp_path, speed=SOLO_SPEED,
                        envoy={"access_log_flush_seconds": 5.0},
                        observe={"poll_interval_seconds": 5.0, "poll_timeout_seconds": 1.0})
    try:
        gaps = _refill_gaps(stack, rounds=3)
        assert max(gaps) < 0.5, gaps
    finally:
        stack.close()
