"""The simulated engine's LoRA adapters: slots, swaps, vLLM's /v1/models cards, lora_requests_info, runtime loading."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from enginesim.batcher import Batcher, SimRequest
from enginesim.profiles import ESTIMATOR_WORLD, PROFILES
from enginesim.server import EngineSimulator, parse_lora_modules
from rig.waits import wait_until

#: ``ESTIMATOR_WORLD`` (a ``dict[str, float]``) as ``Profile`` fields by name, for ``replace``.
IN_ESTIMATOR_WORLD: dict[str, Any] = ESTIMATOR_WORLD
PROFILE = replace(PROFILES["spark"], max_num_seqs=4, **IN_ESTIMATOR_WORLD)


def step(b: Batcher, now: float) -> float:
    b.schedule(now)
    planned = b.plan_step()
    b.apply_step(planned, now + planned)
    b.finished.clear()
    return now + planned


def request(rid: str, adapter: str | None, tokens: int = 20) -> SimRequest:
    return SimRequest(rid, prompt_tokens=10, max_tokens=tokens, arrived_at=0, output_tokens=tokens, adapter=adapter)


def test_a_swap_stalls_the_batch_once_and_a_resident_adapter_costs_nothing() -> None:
    b = Batcher(PROFILE, max_loras=2, lora_swap_s=0.5)
    b.submit(request("1", "acme"))
    b.schedule(0.0)
    assert b.swaps == 1 and list(b.resident) == ["acme"]
    cold = b.plan_step()
    assert cold == pytest.approx(0.5 + 10 / PROFILE.prefill_tokens_per_s)
    b.apply_step(cold, cold)
    assert b.running[0].prefill_left == 0  # the prefill still happened inside the step, after the load
    now = cold
    while not b.idle:
        now = step(b, now)
    b.submit(request("2", "acme"))
    b.schedule(now)
    assert b.swaps == 1 and b.plan_step() == pytest.approx(10 / PROFILE.prefill_tokens_per_s)


def test_adapters_beyond_the_slots_wait_and_later_requests_pass_them() -> None:
    b = Batcher(PROFILE, max_loras=1, lora_swap_s=0.1)
    first, blocked, same = request("1", "a", 50), request("2", "b"), request("3", "a")
    base = request("4", None)
    for r in (first, blocked, same, base):
        b.submit(r)
    b.schedule(0.0)
    # "b" finds its only slot held by a running request of "a": it waits; "a" and the base model run past it.
    assert b.running == [first, same, base] and list(b.waiting) == [blocked]
    assert b.running_adapters() == ["a"] and b.waiting_adapters() == ["b"]
    now = 0.0
    while blocked.prefill_started_at is None:
        now = step(b, now)
    assert first.finished_at is not None and same.finished_at is not None  # it ran only once "a" was idle
    assert b.swaps == 2 and list(b.resident) == ["b"] and blocked.swapped and not same.swapped


def test_the_least_recently_used_idle_adapter_is_evicted() -> None:
    b = Batcher(PROFILE, max_loras=2, lora_swap_s=0.0)
    now = 0.0
    for rid, adapter in (("1", "a"), ("2", "b"), ("3", "a"), ("4", "c")):
        b.submit(request(rid, adapter, 1))
        while not b.idle:
            now = step(b, now)
    assert list(b.resident) == ["a", "c"] and b.swaps == 3


def test_distinct_running_adapters_never_exceed_the_slots() -> None:
    b = Batcher(PROFILE, max_loras=2, lora_swap_s=0.01)
    for i in range(40):
        b.submit(request(str(i), f"ad{i % 5}", 5 + i % 7))
    now = 0.0
    while not b.idle:
        now = step(b, now)
        assert len(b.running_adapters()) <= 2 and len(b.resident) <= 2
    assert b.generation_tokens_total == sum(5 + i % 7 for i in range(40))


def test_lora_modules_parse_as_vllm_takes_them() -> None:
    assert parse_lora_modules(["sql=/a/sql", "chat=/a/chat"]) == {"sql": "/a/sql", "chat": "/a/chat"}
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["sql"])
    with pytest.raises(ValueError, match="max_loras"):
        EngineSimulator(PROFILE, name="x", lora_modules={"sql": "/a"})


async def _client(sim: EngineSimulator) -> TestClient[web.Request, web.Application]:
    client = TestClient(TestServer(sim.app()))
    await client.start_server()
    return client


def lora_series(text: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
            for s in f.samples]


async def test_models_metrics_and_requests_speak_vllm_lora() -> None:
    sim = EngineSimulator(PROFILE, name="e1", speed=1000, max_loras=2, lora_swap_s=0.2,
                          lora_modules={"acme-sql": "/loras/acme-sql", "acme-chat": "/loras/acme-chat"})
    client = await _client(sim)
    try:
        models = await (await client.get("/v1/models")).json()
        cards = {c["id"]: c for c in models["data"]}
        assert list(cards) == ["cortex", "acme-sql", "acme-chat"]
        assert cards["acme-sql"]["parent"] == "cortex" and cards["acme-sql"]["root"] == "/loras/acme-sql"
        assert cards["acme-sql"]["max_model_len"] is None and cards["cortex"]["parent"] is None
        response = await client.post("/v1/completions", json={"model": "acme-sql", "prompt": "x", "max_tokens": 3})
        body: dict[str, Any] = await response.json()
        assert response.status == 200 and body["model"] == "acme-sql"
        missing = await client.post("/v1/completions", json={"model": "other-sql", "prompt": "x", "max_tokens": 3})
        assert missing.status == 404
        assert (await missing.json())["error"]["code"] == "model_not_found"
        stats = await (await client.get("/sim/stats")).json()
        assert stats["lora_swaps"] == 1 and stats["resident_adapters"] == ["acme-sql"]
        assert sim.served[0]["adapter"] == "acme-sql" and sim.served[0]["adapter_swapped"] is True
        metrics = await (await client.get("/metrics")).text()
        series = lora_series(metrics)
        labels = {k for s in series for k in s[0]}
        assert labels == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
        newest = max(series, key=lambda s: s[1])[0]
        assert newest == {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}
        assert {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": "acme-sql"} in [
            s[0] for s in series]  # the step that ran it stays as its own series, older
        assert all(s[1] > 1.7e9 for s in series)  # set_to_current_time: Unix seconds
        # vLLM's runtime updating is off unless allowed: its paths do not exist.
        assert (await client.post("/v1/load_lora_adapter", json={"lora_name": "n", "lora_path": "/p"})).status == 404
    finally:
        await client.close()


async def test_runtime_loading_registers_and_fills_a_slot() -> None:
    sim = EngineSimulator(PROFILE, name="e1", speed=1000, max_loras=1, lora_swap_s=0.2, runtime_lora_updating=True)
    client = await _client(sim)
    try:
        loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/loras/sql"})
        assert loaded.status == 200 and "added successfully" in await loaded.text()
        again = await client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/loras/sql"})
        assert again.status == 400 and "already been loaded" in (await again.json())["error"]["message"]
        assert (await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})).status == 400
        cards = (await (await client.get("/v1/models")).json())["data"]
        assert [c["id"] for c in cards] == ["cortex", "sql"]
        response = await client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
        assert response.status == 200
        assert sim.batcher.swaps == 1 and sim.served[0]["adapter_swapped"] is False  # the load paid the swap
        second = await client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/loras/chat"})
        assert second.status == 200 and list(sim.batcher.resident) == ["chat"] and sim.batcher.swaps == 2
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert gone.status == 200
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status == 404
        after = await client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
        assert after.status == 404
    finally:
        await client.close()


async def test_a_request_waits_inside_the_engine_for_a_slot() -> None:
    """Two adapters, one slot: the second request's time to first token includes the first request's whole run."""
    sim = EngineSimulator(PROFILE, name="e1", speed=10, max_loras=1, lora_swap_s=0.5,
                          lora_modules={"a": "/a", "b": "/b"})
    client = await _client(sim)
    try:
        long = client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 60,
                                                    "sim_output_tokens": 60})
        first = asyncio.ensure_future(long)
        await wait_until(lambda: sim.batcher.running or sim.batcher.waiting, what="the first request in the engine")
        second = await client.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 1})
        assert second.status == 200 and (await first).status == 200
        a, b = sim.served
        assert a["finished_at"] - b["arrived_at"] > 0.5  # it arrived well before "a" was done
        assert b["ttft_s"] >= a["finished_at"] - b["arrived_at"] + 0.5 * 0.9
        assert sim.batcher.swaps == 2
    finally:
        await client.close()
