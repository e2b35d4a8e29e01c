"""LoRA adapters end to end, through Envoy and simulated vLLM engines with one adapter slot each: requests for two
adapters settle on two engines, each adapter where it is loaded, so the engines load each adapter once; the admin API
shows what each engine holds; an adapter no engine serves is a 404."""

from __future__ import annotations

import json
from pathlib import Path

from rig.waits import wait_for
from tests.harness import http_json, post, start_stack

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
