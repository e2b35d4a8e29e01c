"""``sluice bench prefix``'s own arithmetic (the run itself needs minutes of simulators and Envoys): prompts of the stated
size, arrivals identical across arms, the measured window, and the targets as the report words them."""

from __future__ import annotations

import random

from bench.prefix import (
    GROUPS, KV_WORKLOAD, TURNS, Cell, Outcome, Texts, draw_jobs, first_messages, summarise, text, verdicts,
)


def test_prompts_have_the_stated_size_and_each_arm_its_own_text() -> None:
    assert len(text(random.Random(1), 8000)) == 32_000
    job = draw_jobs("system", 2.0, 10.0, 7)[0]
    one, other = first_messages("system", job, Texts("a")), first_messages("system", job, Texts("b"))
    assert one[0]["content"] != other[0]["content"] and len(one[0]["content"]) == len(other[0]["content"])
    assert first_messages("system", job, Texts("a")) == one  # the same arm, the same group: the same system prompt


def test_arrivals_are_reproducible_and_chat_arrives_per_conversation() -> None:
    assert draw_jobs("system", 2.0, 10.0, 7) == draw_jobs("system", 2.0, 10.0, 7)
    assert len(draw_jobs("system", 2.0, 10.0, 7)) == 20
    assert all(0 <= j.key < GROUPS for j in draw_jobs("system", 2.0, 10.0, 7))
    chats = draw_jobs("chat", 2.0, 10.0, 7)
    assert len(chats) == 20 // TURNS and all(len(j.naturals) == TURNS for j in chats)


def outcome(arrived: float, ttft: float, prompt: int = 1000, cached: int = 0, done: float = 20.0) -> Outcome:
    return Outcome(200, arrived, arrived, ttft, done, prompt, cached, 10)


def test_only_the_measured_window_counts() -> None:
    results = [outcome(1.0, 99.0), outcome(12.0, 1.0, cached=900), outcome(13.0, 3.0, cached=0)]
    s = summarise(results, {"a": 3, "b": 1}, warm=10.0)
    assert s["n"] == 2 and s["hit"] == 0.45 and s["ttft_p50"] in (1.0, 3.0)
    assert s["max_share"] == s["max_even"] == 3 / 4 / 0.25
    # Unequal engines: a's fair share is its part of the capacity, so 3 of 4 requests is 1.25x of it, not 3x.
    s = summarise(results, {"a": 3, "b": 1}, warm=10.0, fair={"a": 0.6, "b": 0.4})
    assert abs(s["max_share"] - 0.75 / 0.6) < 1e-9 and s["max_even"] == 3.0


def test_targets_as_the_issue_states_them() -> None:
    def figures(hit: float, p50: float, tokens: float, served: tuple[int, ...] = (1, 1, 1, 1)) -> dict[str, object]:
        return {"hit": hit, "ttft_p50": p50, "ttft_p90": p50, "ttft_p50_all": p50, "ttft_p90_all": p50,
                "throughput": tokens, "served": dict(zip("abcd", served)),
                "max_share": max(served) / sum(served) / 0.25, "max_even": max(served) / sum(served) / 0.25}

    cell = Cell("system", 0.9, 1.0, figures={"sluice": figures(0.9, 1.0, 150), "LR": figures(0.4, 3.5, 100),
                                             "oracle": figures(0.95, 1.0, 150)})
    met = {what: ok for what, ok, _ in verdicts(cell)}
    assert met == {"hit rate >= 0.9 x oracle's": True, "TTFT p50 >= 3x lower than LR": True,
                   "throughput >= 1.5x LR": True, "no engine above 1.5x its fair share (its part of the capacity)": True,
                   "TTFT p50 <= the best baseline arm's (LR)": True, "hit rate >= the best baseline arm's (LR)": True}
    cell.figures["sluice"] = figures(0.8, 1.5, 140, (4, 1, 1, 1))
    met = {what: ok for what, ok, _ in verdicts(cell)}
    assert met["TTFT p50 <= the best baseline arm's (LR)"] and met["hit rate >= the best baseline arm's (LR)"]
    assert not any(ok for what, ok in met.items() if "best baseline" not in what)
    # Ring and EPP, measured in the same cell, are baselines too: beating LR by 3x is not enough if they do better.
    cell.figures["sluice"] = figures(0.9, 1.0, 150)
    cell.figures["ring"] = figures(0.97, 2.0, 120)
    cell.figures["EPP"] = figures(0.9, 0.5, 160)
    missed = [what for what, ok, _ in verdicts(cell) if not ok]
    assert missed == ["TTFT p50 <= the best baseline arm's (EPP)", "hit rate >= the best baseline arm's (ring)"]
    control = Cell("control", 0.5, 1.0, figures={"sluice": figures(0, 1.05, 100),
                                                 "sluice-noindex": figures(0, 1.0, 101)})
    assert all(ok for _, ok, _ in verdicts(control))


def test_kv_pressure_targets_judge_sluice_against_the_oracle_its_old_self_and_the_best_baseline_arm() -> None:
    def figures(hit: float, p50: float) -> dict[str, object]:
        return {"hit": hit, "ttft_p50_all": p50, "ttft_p90_all": 2 * p50}

    cell = Cell(KV_WORKLOAD, 0.7, 1.0, figures={
        "sluice": figures(0.9, 0.05), "sluice-before": figures(0.4, 2.0), "pin": figures(0.95, 5.0),
        "LR+w+cap": figures(0.3, 3.0), "ring": figures(0.7, 0.5)})
    verdict = {what.split(" (")[0]: ok for what, ok, _ in verdicts(cell)}
    assert verdict == {"hit rate >= 0.9 x the pinning oracle's": True,
                       "TTFT p50 no worse than sluice without the affinity": True,
                       "TTFT p50 <= the best baseline arm's": True, "hit rate >= the best baseline arm's": True}
    # Ring beating sluice on TTFT is a miss, named; so is a hit rate under 0.9x the oracle's.
    cell.figures["ring"] = figures(0.7, 0.01)
    cell.figures["sluice"] = figures(0.8, 0.05)
    missed = [what for what, ok, _ in verdicts(cell) if not ok]
    assert missed == ["hit rate >= 0.9 x the pinning oracle's", "TTFT p50 <= the best baseline arm's (ring)"]
    # The EPP arm is a baseline too: a higher hit rate than sluice's is a miss, named.
    cell.figures["ring"] = figures(0.7, 0.5)
    cell.figures["EPP"] = figures(0.85, 0.3)
    missed = [what for what, ok, _ in verdicts(cell) if not ok]
    assert missed == ["hit rate >= 0.9 x the pinning oracle's", "hit rate >= the best baseline arm's (EPP)"]


def test_a_failed_request_counts_as_never_answered_and_groups_are_followed() -> None:
    ok = [Outcome(200, t, 12.0, 0.1, 20.0, 1000, 900, 10, engine=e, key=k)
          for t, e, k in ((1.0, "a", 0), (2.0, "a", 0), (3.0, "b", 0), (4.0, "c", 1))]
    failed = [Outcome(503, 5.0, 12.0, key=1), Outcome(503, 6.0, 12.0, key=1)]
    s = summarise(ok + failed, {"a": 2, "b": 1, "c": 1}, warm=10.0)
    assert s["ttft_p50"] == 0.1 and s["ttft_p50_all"] == 0.1 and s["ttft_p90_all"] == float("inf")
    assert s["same"] == 0.5 and s["spread"] == 1.5  # group 0: a -> a (same), a -> b; engines {a, b} and {c}
