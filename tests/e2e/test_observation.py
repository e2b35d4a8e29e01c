"""Observation end to end: a mixed fleet (vLLM V1, SGLang, llama.cpp dialects) discovered and served through Envoy; honest
staleness with a metrics endpoint that hangs or fails, under both on_stale policies; the startup self-check."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from rig.waits import wait_for
from sluice.admin.v1 import admin_pb2
from tests.harness import Stack, set_metrics_fault, start_stack


def metrics_text(stack: Stack) -> str:
    assert stack.controlplane is not None
    port = stack.controlplane.plane.http.port
    text: str = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return text


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engines = [
        {"name": "vllm-box", "sim": "thor", "sim_flavor": "vllm-v1"},
        {"name": "sglang-box", "sim": "spark", "sim_flavor": "sglang"},
        {"name": "llama-box", "sim": "thor", "sim_flavor": "llamacpp"},
    ]
    s = start_stack(engines, tmp_path_factory.mktemp("mixed"), speed=20.0)
    yield s
    s.close()


def test_mixed_fleet_is_discovered_per_flavour(mixed: Stack) -> None:
    def detected() -> dict[str, admin_pb2.Engine] | None:
        engines = mixed.engines()
        return engines if all(e.flavor for e in engines.values()) else None

    engines = wait_for(detected, what="flavours detected")
    got = {name: (e.flavor, e.version, e.kv_capacity_tokens, e.discovered_concurrency, list(e.models), e.max_num_seqs,
                  list(e.missing_gauges)) for name, e in engines.items()}
    assert got == {
        # vLLM: capacity from cache_config_info (8253 blocks x 16), no cap of its own: the profile's configured 2.
        "vllm-box": ("vllm", "0.10.1", 8253 * 16, 0, ["cortex"], 2, []),
        # SGLang: capacity and cap from its own metrics and /server_info.
        "sglang-box": ("sglang", "0.5.4", 5939 * 16, 2, ["cortex"], 0, []),
        # llama.cpp: capacity = per-slot n_ctx x total_slots from /props; the cap is total_slots.
        "llama-box": ("llamacpp", "b6500-sim", (8253 * 16 // 2) * 2, 2, ["cortex"], 0, []),
    }


def test_mixed_fleet_serves_through_envoy_and_measures_rates(mixed: Stack) -> None:
    client = openai.OpenAI(base_url=mixed.base_url, api_key="unused", max_retries=0, timeout=60)

    def one(_: int) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="cortex", messages=[{"role": "user", "content": "hello"}], max_tokens=30,
            extra_body={"ignore_eos": True})  # exactly max_tokens: the simulator otherwise stops at a drawn length
        usage = raw.parse().usage
        assert usage is not None and usage.completion_tokens == 30
        return raw.headers["x-sluice-engine"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        served = list(pool.map(one, range(12)))
    assert set(served) == {"vllm-box", "sglang-box", "llama-box"}
    # Each flavour's counters turn into rates: generation tokens/s and a per-request decode rate.
    def measured() -> dict[str, tuple[float, float]]:
        engines = mixed.engines()
        return {n: (e.rates.generation_tokens_per_s, e.rates.decode_tokens_per_s_each) for n, e in engines.items()}

    wait_for(lambda: all(g > 0 for g, _ in measured().values()) or None, what="generation rates")
    text = metrics_text(mixed)
    for name in ("vllm-box", "sglang-box", "llama-box"):
        assert f'sluice_engine_requests_running{{engine="{name}"}}' in text
        assert f'sluice_observer_degraded{{engine="{name}"}} 0.0' in text


def test_llamacpp_kv_usage_comes_from_slots(mixed: Stack) -> None:
    """Mainline llama.cpp exposes no KV gauge; /slots gives it, so the engine's KV usage is known (not the unknown -1)
    and follows the requests running: above 0 while one runs, back to 0 after."""
    # Straight to the engine (what runs there is what its /slots must show, whoever routed it).
    direct = openai.OpenAI(base_url=mixed.sim_url("llama-box") + "/v1", api_key="unused", max_retries=0, timeout=60)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(lambda: direct.chat.completions.create(
            model="cortex", max_tokens=400, messages=[{"role": "user", "content": "x" * 4000}],
            extra_body={"ignore_eos": True}))
        wait_for(lambda: mixed.engines()["llama-box"].kv_usage > 0 or None, timeout=15,
                 what="llama-box's KV usage while it runs a request")
        running.result()
    wait_for(lambda: mixed.engines()["llama-box"].kv_usage == 0 or None, timeout=15, what="llama-box's KV freed")


@pytest.mark.parametrize("fault", ["hang", "error"])
def test_stale_engine_is_shed_when_policy_is_closed(tmp_path: Path, fault: str) -> None:
    stack = start_stack([("thor", "thor")], tmp_path, observe={"on_stale": "closed"})
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        assert client.chat.completions.create(model="cortex", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2).choices[0].message.content == "the quick"
        set_metrics_fault(stack.sim_url("thor"), fault)
        wait_for(lambda: stack.engines()["thor"].stale, timeout=10, what="thor stale")
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="cortex", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert caught.value.status_code == 503
        assert 1 <= int(caught.value.response.headers["retry-after"]) <= 60
        assert caught.value.response.json()["error"]["code"] == "no_ready_engine"
        wait_for(lambda: 'sluice_engine_state_stale_total{engine="thor"} 1.0' in metrics_text(stack), timeout=5,
                 what="the stale transition counted")
        assert stack.engines()["thor"].last_error
        set_metrics_fault(stack.sim_url("thor"), "ok")
        wait_for(lambda: not stack.engines()["thor"].stale, timeout=15, what="thor fresh again")
        assert client.chat.completions.create(model="cortex", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2).choices[0].message.content == "the quick"
    finally:
        stack.close()


def test_stale_engine_is_still_admitted_when_policy_is_open(tmp_path: Path) -> None:
    stack = start_stack([("thor", "thor")], tmp_path)  # on_stale defaults to open
    try:
        set_metrics_fault(stack.sim_url("thor"), "hang")
        wait_for(lambda: stack.engines()["thor"].stale, timeout=10, what="thor stale")
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="cortex", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert raw.headers["x-sluice-engine"] == "thor"
        assert raw.headers["x-sluice-route-reason"] == "stale_fail_open"
        wait_for(lambda: 'sluice_engine_state_stale_total{engine="thor"} 1.0' in metrics_text(stack), timeout=5,
                 what="the stale transition counted")
    finally:
        stack.close()


def test_self_check_flags_a_flavour_mismatch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An engine configured as vLLM that really speaks SGLang: ERROR naming the missing gauges, degraded = 1."""
    caplog.set_level(logging.ERROR, logger="sluice.observe")
    stack = start_stack([{"name": "odd", "sim": "spark", "sim_flavor": "sglang", "flavor": "vllm"}], tmp_path,
                        with_envoy=False)
    try:
        def checked() -> admin_pb2.Engine | None:
            engine = stack.engines()["odd"]
            return engine if engine.missing_gauges else None

        engine = wait_for(checked, what="self-check")
        assert list(engine.missing_gauges) == [
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
        assert engine.running == -1 and engine.kv_usage == -1  # unknown, never 0
        assert 'sluice_observer_degraded{engine="odd"} 1.0' in metrics_text(stack)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("odd" in m and "vllm:num_requests_running" in m and "degraded" in m for m in errors)
    finally:
        stack.close()


def test_admin_engines_table_and_json(mixed: Stack) -> None:
    import subprocess
    import sys

    target = mixed.admin_target
    table = subprocess.run([sys.executable, "-m", "sluice", "admin", "engines", "--target", target],
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["ENGINE", "FLAVOR", "VERSION"]
    assert any(line.startswith("sglang-box") and "sglang" in line and "0.5.4" in line for line in lines)
    as_json = subprocess.run([sys.executable, "-m", "sluice", "admin", "engines", "--json", "--target", target],
                             capture_output=True, text=True, timeout=30)
    engines = {e["name"]: e for e in json.loads(as_json.stdout)["engines"]}
    assert engines["llama-box"]["flavor"] == "llamacpp" and engines["llama-box"]["kvCapacityTokens"] == "132048"
