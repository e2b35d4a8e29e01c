"""LoRA adapters end to end, through Envoy and simulated vLLM engines with one adapter slot each: requests for two
adapters settle on two engines, each adapter where it is loaded, so the engines load each adapter once; the admin API
shows what each engine holds; an adapter no engine serves is a 404."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from rig.waits import wait_for
from tests.harness import Stack, http_json, post, start_stack

LORA_SIM = ["--max-loras", "1", "--lora-modules", "sql=/loras/sql", "chat=/loras/chat", "--lora-swap-s", "1.0"]


def ask(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


def test_adapters_stay_where_they_are_loaded(tmp_path: Path) -> None:
    engines = [{"name": name, "sim": "spark", "max_loras": 1, "sim_args": list(LORA_SIM)} for name in ("e1", "e2")]
    stack = start_stack(engines, tmp_path, speed=20.0, adapters={"swap_seconds": 0.5})
    try:
        served: dict[str, set[str]] = {"sql": set(), "chat": set()}
        # Runs of one adapter: spreading by recent serves alone would move each run's second request to the other
        # engine and swap there.
        for adapter in ("sql", "chat", "sql", "sql", "sql", "chat", "chat", "chat", "sql", "chat"):
            status, headers, body = post(stack, "/chat/completions", ask(adapter))
            assert status == 200, body
            assert json.loads(body)["model"] == adapter
            served[adapter].add(headers["x-sluice-engine"])
            wait_for(lambda: stack.status().open_tickets == 0, timeout=5, what="ticket released")
        # Each adapter kept one engine, and they took different ones: with one slot each, the minimum of loads.
        assert len(served["sql"]) == 1 and len(served["chat"]) == 1 and served["sql"] != served["chat"]
        swaps = sum(http_json(stack.sim_url(name) + "/sim/stats")["lora_swaps"] for name in ("e1", "e2"))
        assert swaps == 2
        listed = stack.engines()
        (sql_engine,) = served["sql"]
        assert listed[sql_engine].adapter_slots == 1 and list(listed[sql_engine].adapters_loaded) == ["sql"]
        status, _, body = post(stack, "/chat/completions", ask("legal"))
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    finally:
        stack.close()


def test_an_adapter_no_engine_lists_is_loaded_on_one_engine_and_served(tmp_path: Path) -> None:
    """Dynamic loading: ``sql`` is configured with its base and path but no engine lists it; its first request waits
    while the control plane loads it on one engine (vLLM's ``/v1/load_lora_adapter``), and is served there; the next
    ones go there too, with no second load. A configured adapter without a path stays a 404."""
    runtime = ["--max-loras", "2", "--allow-runtime-lora-updating", "--lora-swap-s", "0.5"]
    engines = [{"name": name, "sim": "spark", "max_loras": 2, "runtime_lora_updating": True,
                "sim_args": list(runtime)} for name in ("e1", "e2")]
    base = "spark-model"
    engines = [{**e, "sim_model": base} for e in engines]
    stack = start_stack(engines, tmp_path, speed=20.0, adapters={
        "dynamic_loading": True, "models": {"sql": base, "chat": base}, "paths": {"sql": "/loras/sql"}})
    try:
        assert all("sql" not in [m["id"] for m in http_json(stack.sim_url(n) + "/v1/models")["data"]]
                   for n in ("e1", "e2"))
        status, headers, body = post(stack, "/chat/completions", ask("sql"))
        assert status == 200, body
        assert json.loads(body)["model"] == "sql"
        loaded_on = headers["x-sluice-engine"]
        listing = {n: [m["id"] for m in http_json(stack.sim_url(n) + "/v1/models")["data"]] for n in ("e1", "e2")}
        assert [n for n, ids in listing.items() if "sql" in ids] == [loaded_on]
        for _ in range(3):
            wait_for(lambda: stack.status().open_tickets == 0, timeout=5, what="ticket released")
            status, headers, _ = post(stack, "/chat/completions", ask("sql"))
            assert status == 200 and headers["x-sluice-engine"] == loaded_on
        assert sum(http_json(stack.sim_url(n) + "/sim/stats")["lora_swaps"] for n in ("e1", "e2")) == 1
        assert f'sluice_adapter_loads_total{{action="load",engine="{loaded_on}",outcome="ok"}} 1.0' in metrics(stack)
        status, _, body = post(stack, "/chat/completions", ask("chat"))
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    finally:
        stack.close()


def test_a_load_the_engine_refuses_answers_503_and_is_counted(tmp_path: Path) -> None:
    """An engine configured for runtime loading whose server does not allow it (vLLM without
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: the path is a 404): the request is shed 503 with a Retry-After, not left
    waiting and not refused as an unknown model, and the failed load is counted."""
    base = "spark-model"
    engines = [{"name": "e1", "sim": "spark", "sim_model": base, "max_loras": 1, "runtime_lora_updating": True,
                "sim_args": ["--max-loras", "1"]}]
    stack = start_stack(engines, tmp_path, speed=20.0, adapters={
        "dynamic_loading": True, "models": {"sql": base}, "paths": {"sql": "/loras/sql"}})
    try:
        status, headers, body = post(stack, "/chat/completions", ask("sql"))
        assert status == 503, body
        assert json.loads(body)["error"]["code"] == "no_ready_engine" and int(headers["retry-after"]) >= 1
        assert 'sluice_adapter_loads_total{action="load",engine="e1",outcome="failed"} 1.0' in metrics(stack)
    finally:
        stack.close()


def metrics(stack: Stack) -> str:
    """The control plane's Prometheus exposition."""
    assert stack.controlplane is not None
    url = f"http://127.0.0.1:{stack.controlplane.plane.http.port}/metrics"
    text: str = urllib.request.urlopen(url, timeout=5).read().decode()
    return text
