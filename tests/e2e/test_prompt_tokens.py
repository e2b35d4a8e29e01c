"""Prompt tokens learned from the engines, through the real Envoy: an engine whose tokenizer counts 1.3 characters a token
and 5 template tokens a chat message (where sluice's prior is 4 characters a token and none), after a warm-up, keeps a
tenant's tokens-per-minute burst within one request of its budget, and a mix of long prompts that would fill its KV by
the prior's estimate causes no preemption."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from controlplane.core.tenants import key_digest
from rig.waits import wait_for
from tests.harness import Stack, http_json, start_stack

BUDGET = 3000
MAX_TOKENS = 40
PROMPT = "y" * 136
TENANTS: dict[str, Any] = {
    "warm": {"keys": [key_digest("sk-warm")]},
    "burst": {"keys": [key_digest("sk-burst")], "limits": {"tokens_per_minute": BUDGET}},
}


def post(stack: Stack, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(stack.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def chat(content: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": "cortex", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True}


def test_learned_prompt_tokens_hold_a_token_budget_and_the_kv(tmp_path: Path) -> None:
    tokenizer = ["--chars-per-token", "1.3", "--template-tokens", "5"]
    engines = [{"name": "thor", "sim": "thor", "max_num_seqs": 24, "sim_args": tokenizer},
               {"name": "small", "sim": "spark", "sim_model": "small", "max_num_seqs": 8,
                "sim_args": [*tokenizer, "--num-gpu-blocks", "2500"]}]
    stack = start_stack(engines, tmp_path, speed=40.0, api_key="sk-warm", tenants=TENANTS,
                        admission={"prompt_tokens_min_samples": 10})
    try:
        # Warm-up: prompts of varied length, one and two messages, as a tenant without limits, on each model.
        for model in ("cortex", "small"):
            for i in range(16):
                messages = [{"role": "user", "content": "w" * (50 + 97 * i)}]
                if i % 2:
                    messages.insert(0, {"role": "system", "content": "s" * (30 + 11 * i)})
                status, _ = post(stack, {"model": model, "messages": messages, "max_tokens": 2}, "sk-warm")
                assert status == 200
        wait_for(lambda: all(e.prompt_token_samples >= 16 for e in stack.engines().values()), timeout=10,
                 what="16 prompts counted on each engine")
        thor = stack.engines()["thor"]
        assert abs(thor.prompt_chars_per_token - 1.3) < 0.05 and abs(thor.prompt_template_tokens_per_message - 5) < 1

        # The burst: each request really uses ceil(136 / 1.3) + 5 + 40 = 150 tokens; the prior would pre-charge 74.
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=80) as pool:
            answers = list(pool.map(lambda _: post(stack, chat(PROMPT), "sk-burst"), range(80)))
        refilled = (time.monotonic() - started) * BUDGET / 60
        used = sum(body["usage"]["total_tokens"] for status, body in answers if status == 200)
        assert {status for status, _ in answers} <= {200, 429}, answers
        assert used <= BUDGET + refilled + 150, (used, refilled)
        assert used >= 0.9 * BUDGET, used

        # Long prompts with long answers on "small" (40,000 tokens of KV): 8 of 12,000 characters and 1,000 tokens
        # (10,241 tokens each). By the prior (4,000 each) all 8 would fit at once; as learned, 3 do, and the rest wait in
        # the control plane until one finishes.
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            long = list(pool.map(lambda i: post(stack, {**chat(f"{i:02d}" + "z" * 11_998, max_tokens=1000),
                                                        "model": "small"}, "sk-warm"), range(8)))
        # Each is served, or refused with a Retry-After (a wait the control plane expects past its bound), never lost.
        assert all(status == 200 or (status == 503 and body["error"]["code"]) for status, body in long), long
        assert sum(status == 200 for status, _ in long) >= 3, long
        stats = http_json(stack.sim_url("small") + "/sim/stats")
        assert stats["preemptions"] == 0, stats
    finally:
        stack.close()


def test_streams_without_a_tenant_teach_the_prompt_rule(tmp_path: Path) -> None:
    """A client without a tenant that streams with ``stream_options.include_usage`` (as the openai client does when
    asked) teaches the Check its engine's tokenizer: the Lua filter reads every admitted stream to its usage chunk."""
    engines = [{"name": "thor", "sim": "thor", "max_num_seqs": 8, "sim_args": ["--chars-per-token", "1.3"]}]
    stack = start_stack(engines, tmp_path, speed=40.0, admission={"prompt_tokens_min_samples": 10})
    try:
        for i in range(12):
            body = {**chat("q" * (40 + 61 * i), max_tokens=3), "stream": True,
                    "stream_options": {"include_usage": True}}
            request = urllib.request.Request(stack.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                assert b'"prompt_tokens"' in response.read()
        wait_for(lambda: stack.engines()["thor"].prompt_token_samples >= 12, timeout=10, what="12 streams counted")
        assert abs(stack.engines()["thor"].prompt_chars_per_token - 1.3) < 0.05, stack.engines()["thor"]
    finally:
        stack.close()


def test_streams_without_usage_teach_the_prompt_rule_through_the_engines_counter(tmp_path: Path) -> None:
    """A client that streams without ``include_usage`` (the openai client's default) tells the gateway nothing of its
    prompt's tokens; the engine's ``vllm:prompt_tokens_total`` between its idle probes does (core/prompt_counters.py)."""
    engines = [{"name": "thor", "sim": "thor", "max_num_seqs": 8,
                "sim_args": ["--chars-per-token", "1.3", "--template-tokens", "5"]}]
    stack = start_stack(engines, tmp_path, speed=40.0, admission={"prompt_tokens_min_samples": 6})
    try:
        for i in range(12):
            messages = [{"role": "user", "content": "q" * (60 + 83 * i)}]
            if i % 2:
                messages.insert(0, {"role": "system", "content": "s" * (25 + 9 * i)})
            body = {"model": "cortex", "messages": messages, "max_tokens": 3, "stream": True}
            request = urllib.request.Request(stack.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                assert b'"prompt_tokens"' not in response.read()
            time.sleep(0.5)  # a probe (every 0.2 s) finds the engine idle between two requests
        wait_for(lambda: stack.engines()["thor"].prompt_token_samples >= 6, timeout=10, what="6 counter windows")
        thor = stack.engines()["thor"]
        assert abs(thor.prompt_chars_per_token - 1.3) < 0.05 and abs(thor.prompt_template_tokens_per_message - 5) < 1, \
            thor
    finally:
        stack.close()


def test_long_prompts_counted_by_the_engine_fill_its_kv_without_a_warm_up(tmp_path: Path) -> None:
    """With ``tokenize_above_chars``, a long prompt is counted by the engine's ``/tokenize`` before the Check decides:
    with nothing learned yet, 8 prompts of 12,000 characters at 1.3 a token (9,232 tokens, 10,232 with their answers)
    are reserved as what they are, not as the prior's 3,000, so the 40,000 tokens of KV take 3 at a time and the
    engine never preempts. Answers that did not fit are refused with a reason, never lost."""
    engines = [{"name": "small", "sim": "spark", "sim_model": "small", "max_num_seqs": 8,
                "sim_args": ["--chars-per-token", "1.3", "--template-tokens", "5", "--num-gpu-blocks", "2500"]}]
    stack = start_stack(engines, tmp_path, speed=40.0, admission={"tokenize_above_chars": 4000})
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            long = list(pool.map(lambda i: post(stack, {**chat(f"{i:02d}" + "z" * 11_998, max_tokens=1000),
                                                        "model": "small"}, "none"), range(8)))
        assert all(status == 200 or (status == 503 and body["error"]["code"]) for status, body in long), long
        assert sum(status == 200 for status, _ in long) >= 3, long
        assert {body["usage"]["prompt_tokens"] for status, body in long if status == 200} == {9236}
        stats = http_json(stack.sim_url("small") + "/sim/stats")
        assert stats["preemptions"] == 0, stats
        assert stack.controlplane is not None
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{stack.controlplane.plane.http.port}/metrics").read().decode()
        assert 'sluice_tokenize_requests_total{outcome="ok"} 8.0' in metrics
    finally:
        stack.close()
