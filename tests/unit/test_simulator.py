"""The simulated engine's batching model: caps, KV blocks, preemption, rates; and its /metrics speak vLLM."""

from __future__ import annotations

import math

import pytest

from controlplane.observe.parse import parse_metrics
from enginesim.batcher import Batcher, SimRequest
from enginesim.profiles import PROFILES, Profile


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
    b = Batcher(PROFILES["v100pp2"])
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
    from enginesim.server import EngineSimulator

    sim = EngineSimulator(PROFILES["v100pp2"], name="x")
    text = (await sim.metrics_endpoint(None)).body.decode()  # type: ignore[arg-type, union-attr]
    sample = parse_metrics(text, taken_at=0)
    assert (sample.running, sample.waiting, sample.kv_usage, sample.preemptions_total) == (0, 0, 0, 0)
    assert sample.kv_capacity_tokens == 9527 * 16 == 152_432
    assert math.isclose(PROFILES["v100pp2"].kv_capacity_tokens, 152_432)
