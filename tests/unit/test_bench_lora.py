"""``sluice bench lora``'s pure parts: the EPP-like LoRA-affinity scorer as llm-d's, the Zipf popularity, the arrivals."""

from __future__ import annotations

import pytest

from bench.epp import EndpointMetrics, Weights, lora_affinity_scores, parse_metrics, weighted_scores
from bench.lora import ADAPTERS, draw_jobs, zipf_weights


def test_lora_affinity_scores_as_the_scorer_does() -> None:
    text = """# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 1.765e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.766e+09
vllm:num_requests_waiting{model_name="m"} 3.0
"""
    full = parse_metrics(text)
    assert (full.active_adapters, full.waiting_adapters, full.max_adapters) == (
        frozenset({"a", "b"}), frozenset({"c"}), 2)
    room = EndpointMetrics(0, 1, 0.0, active_adapters=frozenset({"a"}), max_adapters=2)
    scores = {m: lora_affinity_scores(m, {"full": full, "room": room}) for m in ("a", "b", "c", "z")}
    assert scores["a"] == {"full": 1.0, "room": 1.0}
    assert scores["b"] == {"full": 1.0, "room": 0.8}
    assert scores["c"] == {"full": 0.6, "room": 0.8}
    assert scores["z"] == {"full": 0.0, "room": 0.8}
    # Weighted far above the others, affinity decides; the default profile does not weigh it at all.
    heavy = weighted_scores({"full": full, "room": room}, {}, 0, Weights(lora=100.0), "z")
    assert heavy["room"] > heavy["full"]
    assert weighted_scores({"full": full}, {}, 0, Weights(), "z") == weighted_scores({"full": full}, {}, 0, Weights())


def test_popularity_is_zipf_and_arrivals_replay() -> None:
    weights = zipf_weights()
    assert len(weights) == ADAPTERS and sum(weights) == pytest.approx(1.0)
    assert weights[0] / weights[1] == pytest.approx(2.0) and weights == sorted(weights, reverse=True)
    jobs = draw_jobs(rate=4.0, warm=5.0, window=20.0, seed=7)
    assert jobs == draw_jobs(rate=4.0, warm=5.0, window=20.0, seed=7)
    assert len(jobs) == 100 and all(a.at <= b.at for a, b in zip(jobs, jobs[1:]))
    assert {j.measured for j in jobs if j.at < 5.0} == {False} and all(j.measured for j in jobs if j.at >= 5.0)
