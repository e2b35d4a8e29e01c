"""The interleaved rounds of ``sluice bench steady`` and ``sluice bench prefix``: every arm once a round in an order
rotated each round, one seeded set of arrivals per round, and figures pooled over the rounds with each round's own
beside them (the runs themselves need minutes of simulators and Envoys)."""

from __future__ import annotations

import math

import pytest

from bench import prefix, steady
from bench.common import by_round, interleaved
from bench.workload import Result


def test_every_arm_runs_once_a_round_and_no_arm_keeps_its_place() -> None:
    plan = interleaved(["sluice", "LR", "EPP"], 3)
    assert plan == [(0, "sluice"), (0, "LR"), (0, "EPP"), (1, "LR"), (1, "EPP"), (1, "sluice"),
                    (2, "EPP"), (2, "sluice"), (2, "LR")]
    for arm in ("sluice", "LR", "EPP"):
        places = [[a for n, a in plan if n == r].index(arm) for r in range(3)]
        assert sorted(places) == [0, 1, 2]  # first, middle and last once each
    assert interleaved(["sluice", "LR"], 1) == [(0, "sluice"), (0, "LR")]


def test_each_round_has_its_own_arrivals_and_every_arm_of_a_round_the_same() -> None:
    seed = steady.SEED + 95
    one, two = (steady.draw_jobs(4.0, 10.0, "poisson", seed + steady.ROUND_SEED_STRIDE * r) for r in range(2))
    assert one == steady.draw_jobs(4.0, 10.0, "poisson", seed) and one != two and len(one) == len(two) == 40
    first, second = (prefix.draw_jobs("system", 2.0, 10.0, prefix.SEED + prefix.ROUND_SEED_STRIDE * r) for r in (0, 1))
    assert first == prefix.draw_jobs("system", 2.0, 10.0, prefix.SEED) and first != second


def served(ttft: float, started: float = 0.0, tokens: int = 100, total: float = 2.0) -> Result:
    return Result("sluice", 200, started, ttft_s=ttft, total_s=total, completion_tokens=tokens)


def test_steady_pools_the_rounds_requests_and_keeps_each_rounds_figures() -> None:
    quick = [served(0.1 * k, started=k) for k in range(1, 10)]  # nine good answers, the last ends at 11 s
    slow = [served(3.0, started=1.0), Result("sluice", 503, 2.0, total_s=0.01)]  # one past the SLO, one shed
    rounds = [steady.Segment(quick, [5, 4], [2, 1], 0, [0.01, 0.02], 1.0),
              steady.Segment(slow, [1, 0], [1, 3], 2, [0.03], 2.5)]
    pooled = steady.pool(rounds, window=10.0)
    assert pooled["n"] == 11 and pooled["shed"] == 1 and pooled["unserved"] == 1
    assert pooled["served"] == [6, 4] and pooled["peaks"] == [2, 3] and pooled["preemptions"] == 2
    assert pooled["goodput"] == pytest.approx(9 / 20)  # good answers over both rounds' windows
    assert pooled["throughput"] == pytest.approx(1000 / (11.0 + 3.0) / steady.SPEED)  # each round to its last answer
    assert pooled["ttft_p90"] == pytest.approx(0.9) and math.isinf(pooled["ttft_all_p99"])
    assert by_round(pooled, "goodput") == pytest.approx([0.9, 0.0])
    assert by_round(pooled, "ttft_all_p90")[0] == pytest.approx(0.8) and math.isinf(by_round(pooled, "ttft_all_p90")[1])
    assert pooled["loadavg"] == 2.5 and pooled["refill_ms"] == pytest.approx((20.0, 30.0))
    assert steady.round_ratios(pooled, pooled, "goodput") == "1.00x / inf"  # nothing good in round 2: no ratio


def test_the_ratio_a_target_reads_is_given_round_by_round() -> None:
    mine = {"ttft_all_p90": 1.0, "rounds": [{"ttft_all_p90": 0.8}, {"ttft_all_p90": 1.2}]}
    theirs = {"ttft_all_p90": 2.0, "rounds": [{"ttft_all_p90": 1.6}, {"ttft_all_p90": 1.0}]}
    assert steady.round_ratios(mine, theirs, "ttft_all_p90") == "0.50x / 1.20x"
    assert steady.round_ratios({"ttft_all_p90": 1.0}, {"ttft_all_p90": 2.0}, "ttft_all_p90") == "0.50x"


def outcome(arrived: float, ttft: float, done: float, cached: int = 0) -> prefix.Outcome:
    return prefix.Outcome(200, arrived, arrived, ttft, done, 1000, cached, 10)


def test_prefix_pools_the_measured_windows_of_every_round() -> None:
    rounds = [prefix.Segment([outcome(1.0, 9.0, 5.0), outcome(12.0, 1.0, 14.0, cached=1000)], {"a": 2, "b": 0}, 9, 10,
                             30.0),
              prefix.Segment([outcome(11.0, 3.0, 20.0), outcome(13.0, 5.0, 18.0)], {"a": 1, "b": 1}, 1, 10, 40.0)]
    pooled = prefix.pool(rounds, warm=10.0)
    assert pooled["n"] == 3 and pooled["hit"] == pytest.approx(1 / 3)  # the warm-up's request is left out
    assert pooled["served"] == {"a": 3, "b": 1} and pooled["wall_s"] == 70.0 and pooled["engine_hit"] == 0.5
    assert pooled["throughput"] == pytest.approx(30 / ((14.0 - 10.0) + (20.0 - 10.0)) / prefix.SPEED)
    assert by_round(pooled, "hit") == pytest.approx([1.0, 0.0])
    assert prefix.spread(pooled, "hit", ".0%") == " (rounds 100% / 0%)"
    assert prefix.spread({"hit": 0.5}, "hit", ".0%") == ""  # one round: no spread to show
