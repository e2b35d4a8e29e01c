"""The simulated engine's batching model: caps, KV blocks, preemption, rates; and its /metrics speak vLLM."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from controlplane.observe.parse import parse_metrics
from enginesim.batcher import Batcher, SimRequest
from enginesim.profiles import ESTIMATOR_WORLD, PROFILES, Profile
from enginesim.server import EngineSimulator

#: ``ESTIMATOR_WORLD`` (a ``dict[str, float]``) as ``Profile`` fields by name, for ``replace``.
IN_ESTIMATOR_WORLD: dict[str, Any] = ESTIMATOR_WORLD


def run_to_completion(batcher: Batcher, limit_s: float = 10_000) -> float:
    now = 0.0
    while not batcher.idle and now < limit_s:
        batcher.schedule(now)
        step = batcher.plan_step()
        now += step
        batcher.apply_step(step, now)
        batcher.finished.clear()
    return now


def test_never_runs_more_than_max_num_seqs() -> None:
    b = Batcher(PROFILES["thor"])
    for i in range(6):
        b.submit(SimRequest(str(i), prompt_tokens=10, max_tokens=20, arrived_at=0))
    run_to_completion(b)
    assert b.max_running_seen == 2
    assert b.generation_tokens_total == 120 and b.prompt_tokens_total == 60


@pytest.mark.parametrize(("profile", "streams", "aggregate"),
                         [("thor", 1, 18.18), ("thor", 2, 50.71), ("spark", 1, 49.24), ("spark", 2, 87.82)])
def test_decode_rates_match_seed_000(profile: str, streams: int, aggregate: float) -> None:
    b = Batcher(PROFILES[profile])
    for i in range(streams):
        b.submit(SimRequest(str(i), prompt_tokens=1, max_tokens=200, arrived_at=0))
    elapsed = run_to_completion(b)
    prefill = 1 / PROFILES[profile].prefill_tokens_per_s
    assert streams * 200 / (elapsed - prefill) == pytest.approx(aggregate, rel=0.02)


def decode_time_with_a_prefill_alongside(profile: Profile) -> float:
    """Seconds one request takes to decode 100 tokens while another's 30,000-token prompt is prefilled beside it."""
    b = Batcher(profile)
    decoding = SimRequest("decoding", prompt_tokens=1, max_tokens=100, arrived_at=0)
    b.submit(decoding)
    b.schedule(0.0)
    now = b.plan_step()
    b.apply_step(now, now)  # its prefill is done: it decodes from here on
    b.submit(SimRequest("prefilling", prompt_tokens=30_000, max_tokens=1, arrived_at=now))
    started = now
    while decoding.finished_at is None:
        b.schedule(now)
        step = b.plan_step()
        now += step
        b.apply_step(step, now)
    return now - started


def test_chunked_prefill_slows_decode_and_a_plain_step_does_not() -> None:
    """Without chunked prefill a decode step runs at the table's rate whatever prefills beside it (thor, one request
    decoding: 18.18 tokens/s); with 512-token chunks each of its steps also prefills 512 of the other's prompt, so its
    100 tokens take their decode steps plus the whole 30,000-token prefill (20 s at 1500 tokens/s)."""
    plain = replace(PROFILES["thor"], **IN_ESTIMATOR_WORLD)
    assert decode_time_with_a_prefill_alongside(plain) == pytest.approx(100 / 18.18, rel=0.02)
    chunked = decode_time_with_a_prefill_alongside(replace(plain, prefill_chunk_tokens=512))
    assert chunked == pytest.approx(100 / 18.18 + 30_000 / 1500, rel=0.03)


def test_decode_slows_as_contexts_grow() -> None:
    profile = replace(PROFILES["spark"], decode_slowdown_per_1k_tokens=0.1)
    short, long = Batcher(profile), Batcher(profile)
    short.submit(SimRequest("s", prompt_tokens=100, max_tokens=100, arrived_at=0))
    long.submit(SimRequest("l", prompt_tokens=20_000, max_tokens=100, arrived_at=0))
    short_s, long_s = run_to_completion(short), run_to_completion(long)
    prefill = 19_900 / profile.prefill_tokens_per_s
    # 150 and 20,050 tokens of context on average while they decode
    assert (long_s - prefill) / short_s == pytest.approx((1 + 0.1 * 20.05) / (1 + 0.1 * 0.15), rel=0.05)


def test_kv_exhaustion_preempts_and_recomputes() -> None:
    """Three 60k prompts with long answers outgrow 152,432 KV tokens while all three run: the youngest is preempted."""
    b = Batcher(PROFILES["v100pp2"])
    for i in range(3):
        b.submit(SimRequest(str(i), prompt_tokens=60_000, max_tokens=4_000, arrived_at=0))
    run_to_completion(b, limit_s=100_000)
    assert b.preemptions >= 1
    assert b.generation_tokens_total == 12_000  # every request still finished
    assert b.free_blocks == PROFILES["v100pp2"].num_gpu_blocks  # and gave its KV back


def test_two_65k_prompts_fit_without_preemption() -> None:
    b = Batcher(replace(PROFILES["v100pp2"], **IN_ESTIMATOR_WORLD))
    for i in range(2):
        b.submit(SimRequest(str(i), prompt_tokens=65_000, max_tokens=100, arrived_at=0))
    elapsed = run_to_completion(b, limit_s=100_000)
    assert b.preemptions == 0
    # Prefill is shared FIFO at 262 tok/s; the first request decodes while the second prefills, then the second decodes alone.
    assert elapsed == pytest.approx(130_000 / 262 + 100 / 12.0, rel=0.01)


def test_abort_frees_kv() -> None:
    profile = Profile("tiny", "m", 2, 10, 16, 100.0, (10.0,), 1000, "0")
    b = Batcher(profile)
    r = SimRequest("a", prompt_tokens=64, max_tokens=10, arrived_at=0)
    b.submit(r)
    b.schedule(0)
    b.apply_step(b.plan_step(), 1)
    assert b.free_blocks < 10
    b.abort(r)
    assert b.free_blocks == 10 and b.idle


async def test_sim_metrics_parse_as_vllm_v1() -> None:
    sim = EngineSimulator(PROFILES["v100pp2"], name="x")
    answer = await sim.metrics_endpoint(make_mocked_request("GET", "/metrics"))
    assert isinstance(answer.body, bytes)
    text = answer.body.decode()
    sample = parse_metrics(text, taken_at=0)
    assert (sample.running, sample.waiting, sample.kv_usage, sample.preemptions_total) == (0, 0, 0, 0)
    assert sample.kv_capacity_tokens == 9527 * 16 == 152_432
    assert math.isclose(PROFILES["v100pp2"].kv_capacity_tokens, 152_432)


# -- output lengths: an engine stops at end of sequence ----------------------------------------------------------------
def draws(profile: str, seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [PROFILES[profile].draw_output_tokens(rng) for _ in range(n)]


def test_output_lengths_are_seeded() -> None:
    assert draws("thor", 7, 50) == draws("thor", 7, 50)
    assert draws("thor", 7, 50) != draws("thor", 8, 50)


@pytest.mark.parametrize("profile", ["thor", "spark", "v100pp2"])
def test_output_length_median_and_long_tail(profile: str) -> None:
    lengths = sorted(draws(profile, 1, 4_000))
    median = PROFILES[profile].output_median_tokens
    assert 150 <= median <= 300
    assert lengths[len(lengths) // 2] == pytest.approx(median, rel=0.08)
    assert min(lengths) >= 1
    assert lengths[int(len(lengths) * 0.99)] > 5 * median  # a long tail, as chat traffic has
    assert sum(lengths) / len(lengths) > median  # so the mean sits above the median


def plan(body: dict[str, object], prompt: int = 10, **kwargs: Any) -> tuple[int, int | None]:
    sim = EngineSimulator(PROFILES["thor"], name="t", seed=3, **kwargs)
    out = sim.plan_output({"model": "cortex", **body}, prompt)
    assert isinstance(out, tuple), out
    return out


def test_output_plan_caps_forces_and_ignores_eos() -> None:
    limit, natural = plan({})
    assert limit == 32_768 - 10 and natural is not None  # no max_tokens: the engine's own limit applies
    assert plan({"max_tokens": 5}) == (5, natural)  # the same draw, cut at max_tokens by the request
    assert plan({"max_tokens": 50, "sim_output_tokens": 12}) == (50, 12)
    assert plan({"max_tokens": 50, "ignore_eos": True}) == (50, None)  # exactly max_tokens
    assert plan({"max_tokens": 50}, output_model="max_tokens") == (50, None)
    assert plan({}, output_model="max_tokens") == (64, None)  # the old default


def test_output_plan_refuses_what_does_not_fit() -> None:
    sim = EngineSimulator(PROFILES["thor"], name="t")
    for body, prompt in (({"max_tokens": 0.5}, 10), ({"max_tokens": 100}, 32_700), ({}, 32_768)):
        refused = sim.plan_output(body, prompt)
        assert isinstance(refused, web.Response) and refused.status == 400, refused
    with pytest.raises(ValueError):
        EngineSimulator(PROFILES["thor"], name="t", output_model="sometimes")


def test_a_request_stops_at_its_natural_length() -> None:
    b = Batcher(PROFILES["spark"])
    stops = SimRequest("stop", prompt_tokens=5, max_tokens=100, arrived_at=0, output_tokens=7)
    cut = SimRequest("cut", prompt_tokens=5, max_tokens=20, arrived_at=0, output_tokens=70)
    for r in (stops, cut):
        b.submit(r)
    run_to_completion(b)
    assert (stops.generated, stops.finish_reason) == (7, "stop")
    assert (cut.generated, cut.finish_reason) == (20, "length")
    assert b.generation_tokens_total == 27


async def _post(sim: EngineSimulator, path: str,
                body: dict[str, object]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    client = TestClient(TestServer(sim.app()))
    await client.start_server()
    try:
        response = await client.post(path, json=body)
        assert response.status == 200, await response.text()
        if not body.get("stream"):
            return await response.json(), []
        chunks = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                  if line.startswith("data: {")]
        return None, chunks
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("extra", "tokens", "reason"), [
    ({"sim_output_tokens": 3}, 3, "stop"),
    ({"sim_output_tokens": 30}, 6, "length"),
    ({"ignore_eos": True}, 6, "length"),
])
async def test_finish_reason_over_http(stream: bool, path: str, extra: dict[str, object], tokens: int,
                                       reason: str) -> None:
    sim = EngineSimulator(PROFILES["spark"], name="s", speed=1000)
    content = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    body = {"model": "cortex", "max_tokens": 6, "stream": stream, "stream_options": {"include_usage": True},
            **content, **extra}
    full, chunks = await _post(sim, path, body)
    if full is not None:
        assert full["choices"][0]["finish_reason"] == reason
        assert full["usage"]["completion_tokens"] == tokens
    else:
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == reason and reasons.count(reason) == 1
        assert chunks[-1]["usage"]["completion_tokens"] == tokens
    assert sim.served[-1]["completion_tokens"] == tokens and sim.served[-1]["finish_reason"] == reason


def test_a_short_request_joining_a_decode_under_chunked_prefill_starts_at_once() -> None:
    """thor with its default chunked prefill: a 2-token request arriving while another decodes prefills in the next
    step and is done within a few decode steps, not after the other's whole answer (a chunked step's budget left a
    float residue of its prompt that never finished)."""
    b = Batcher(PROFILES["thor"])
    assert PROFILES["thor"].prefill_chunk_tokens > 0
    b.submit(SimRequest("long", prompt_tokens=10, max_tokens=150, arrived_at=0))
    now, short = 0.0, None
    while short is None or not short.done:
        if short is None and now >= 1.0:
            short = SimRequest("short", prompt_tokens=11, max_tokens=2, arrived_at=now)
            b.submit(short)
        b.schedule(now)
        step = b.plan_step()
        assert step > 0
        now += step
        b.apply_step(step, now)
    assert now - short.arrived_at < 0.5
