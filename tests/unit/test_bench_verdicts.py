"""The benches' verdicts come from what a run measured: a ``Target`` is met or missed by its figure (NaN misses), the
exit status is 1 when one misses, and t10, cag4 and overhead build their targets and their Envoy arms from the run."""

from __future__ import annotations

import math

import pytest

from bench import cag4, overhead, t10
from bench.common import Target, exit_code, sim_world, verdicts
from bench.plain import render
from bench.workload import Result


@pytest.mark.parametrize(("target", "met"), [
    (Target("at least, above", 2.0, 1.0), True),
    (Target("at least, equal", 1.0, 1.0), True),
    (Target("at least, below", 0.99, 1.0), False),
    (Target("at most, below", 0.5, 1.0, at_least=False), True),
    (Target("at most, above", 1.5, 1.0, at_least=False), False),
    (Target("nothing measured", math.nan, 1.0, at_least=False), False),
], ids=lambda v: v.name if isinstance(v, Target) else str(v))
def test_a_target_is_met_by_its_measured_figure(target: Target, met: bool) -> None:
    assert target.met is met
    assert target.line().endswith(": met" if met else ": **missed**")


def test_one_missed_target_makes_the_exit_status_1_and_none_is_not_a_pass() -> None:
    good, bad = Target("a", 1, 0), Target("b", 0, 1)
    assert exit_code([good]) == 0
    assert exit_code([good, bad]) == 1
    assert exit_code([]) == 1
    text = verdicts([good, bad])
    assert "- a: measured 1 (target >= 0): met" in text and "1 of 2 targets met." in text


def test_the_simulated_world_is_stated_from_the_profiles() -> None:
    text = sim_world(["thor", "spark", "thor"], "fixed.")
    assert text.count("`thor`") == 1 and "`spark` 3.3 characters a token, 5 template tokens" in text
    assert "chunked prefill of 2048 tokens" in text and "1.5% slower per 1,000 tokens" in text


def test_t10_best_split_on_the_seed_rates_is_the_even_one_at_4_and_six_on_spark_at_8() -> None:
    spark, thor = t10.profile_box("spark"), t10.profile_box("thor")
    best4, on_spark4 = t10.best_assignment(4, spark, thor)
    assert on_spark4 == 2 and best4 == pytest.approx(t10.even_split(4, spark, thor)) == pytest.approx(101.4, abs=0.1)
    best8, on_spark8 = t10.best_assignment(8, spark, thor)
    assert on_spark8 == 6 and best8 == pytest.approx(117.1, abs=0.1)
    assert t10.makespan_s(thor, 3) == pytest.approx(2 * 111 / 50.71 + 111 / 18.18)


def test_t10_envoy_arms_are_weighted_by_measured_capacity_and_capped_at_the_slots() -> None:
    weights = t10.capacity_weights([50.4, 87.6, 0.2])
    assert weights == [50, 88, 1]
    specs = t10.envoy_arm_specs(weights[:2], [2, 2])
    assert set(specs) == set(t10.ENVOY_ARMS)
    assert specs["RR"] == {"lb_policy": "ROUND_ROBIN"}
    for arm in ("RR+w+cap", "LR+w+cap"):
        spec = specs[arm]
        assert spec["concurrency"] == 1 and spec["max_per_host"] == [2, 2] and spec["weights"] == [50, 88]
        yaml_text = render(1, 2, [11, 12], spec["lb_policy"], spec["weights"], spec["max_per_host"])
        assert "max_connections: 2" in yaml_text
        assert "load_balancing_weight: 50" in yaml_text and "load_balancing_weight: 88" in yaml_text


def _t10_runs(sluice4: list[float], sluice8: list[float]) -> dict[str, dict[int, list[float]]]:
    return {"sluice": {4: sluice4, 8: sluice8}, "RR": {4: [101.0, 101.2, 100.8], 8: [101.0] * 3},
            "RR+w+cap": {4: [90.0] * 3, 8: [85.0] * 3}, "LR+w+cap": {4: [95.0] * 3, 8: [84.0] * 3},
            t10.DIRECT: {8: [50.6] * 3}}


def test_t10_targets_judge_sluice_against_the_best_envoy_arm_of_the_run() -> None:
    best = {4: 101.4, 8: 117.1}
    targets = t10.t10_targets(_t10_runs([100.5, 100.0, 100.9], [116.0] * 3), best, failures=0)
    assert [t.met for t in targets] == [True, True, True, True, True]
    assert "best Envoy arm's (RR, 101.0)" in targets[0].name and targets[0].bound == pytest.approx(0.99 * 101.0)
    assert targets[1].bound == pytest.approx(0.97 * 101.4)
    missed = t10.t10_targets(_t10_runs([98.5, 99.0, 99.5], [116.0, 110.0, 116.0]), best, failures=1)
    assert [t.met for t in missed] == [False, True, True, False, False]


def _result(tag: str, ttft: float | None, total: float, tokens: int = cag4.MAX_TOKENS, status: int = 200) -> Result:
    return Result(tag, status, 0.0, ttft_s=ttft, total_s=total, completion_tokens=tokens)


def test_cag4_targets_check_preemptions_full_service_and_the_fast_413() -> None:
    full = [_result("65k", 5.0, 20.0), _result("8k", 2.0, 10.0)]
    short = [_result("65k", 5.0, 20.0), _result("8k", None, 1.0, tokens=0, status=503)]
    arms = {cag4.SLUICE_ARMS[0]: (full, {"preemptions": 0}), cag4.SLUICE_ARMS[1]: (short, {"preemptions": 3})}
    targets = cag4.cag4_targets(arms, [1.0, 2.5])
    assert [t.met for t in targets] == [True, True, False, False, True]
    assert not cag4.cag4_targets(arms, [1.0, 250.0])[-1].met
    assert cag4.ttft_p50(short, "8k") == math.inf and cag4.makespan_s(full) == 20.0
    assert cag4.not_served(full) == "-" and cag4.not_served([*short, _result("8k", 1.0, 2.0, tokens=9)]) == "200: 1, 503: 1"


def test_cag4_safety_cost_says_where_sluice_loses() -> None:
    fast = [_result("65k", 3.7, 30.0), _result("8k", 9.0, 40.0)]
    slow = [_result("65k", 9.4, 25.0), _result("8k", 7.0, 35.0)]
    arms = {cag4.SLUICE_ARMS[0]: (slow, {"preemptions": 0}), cag4.SLUICE_ARMS[1]: (slow, {"preemptions": 0}),
            cag4.BYPASSED: (fast, {"preemptions": 361})}
    text = cag4.safety_cost(arms)
    assert f"- 65k TTFT p50: {cag4.SLUICE_ARMS[0]} 9.40 s loses to the best other arm, {cag4.BYPASSED}, 3.70 s" in text
    assert f"- 8k TTFT p50: {cag4.SLUICE_ARMS[0]} 7.00 s beats or ties" in text


def test_cag4_envoy_arm_caps_the_engine_at_its_slots() -> None:
    spec = cag4.envoy_arm_spec(4)
    yaml_text = render(1, 2, [11], spec["lb_policy"], spec["weights"], spec["max_per_host"])
    assert "lb_policy: LEAST_REQUEST" in yaml_text and "max_connections: 4" in yaml_text and spec["concurrency"] == 1


def _rate_run() -> overhead.RateRun:
    run = overhead.RateRun(200)
    plain, mine = overhead.PATHS
    run.latencies[plain] = [[1.0, 1.0, 2.0], [1.0, 1.5, 3.0]]
    run.latencies[mine] = [[2.5, 2.5, 4.0], [2.0, 3.0, 9.0]]
    run.failures = {plain: [0, 0], mine: [0, 0]}
    run.checks.update({0.0005: 50.0, 0.001: 99.0, 0.005: 100.0, math.inf: 100.0})
    return run


def test_overhead_reports_the_added_p50_and_p99_pooled_and_by_round() -> None:
    run = _rate_run()
    assert run.added_by_round(50) == [1.5, 1.5]
    assert run.added_by_round(99) == [2.0, 6.0]
    assert run.added(50) == pytest.approx(2.75 - 1.25)
    assert run.added(99) == pytest.approx(9.0 - 3.0)


def test_overhead_targets_at_200_requests_per_second() -> None:
    run = _rate_run()
    targets = overhead.overhead_targets(run, one_token=True)
    assert [t.met for t in targets] == [True, True, True, True]
    assert len(overhead.overhead_targets(run, one_token=False)) == 3
    run.failures[overhead.PATHS[1]] = [0, 2]
    run.latencies[overhead.PATHS[1]] = [[4.0, 4.0], [4.0]]
    assert [t.met for t in overhead.overhead_targets(run, one_token=True)] == [True, True, False, False]
