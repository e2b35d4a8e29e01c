"""``bench shapes`` draws the field's workload shapes with their published statistics, seeded, and judges sluice against
the best other arm of the same cell."""

from __future__ import annotations

import math
import random
import statistics

from bench import shapes
from bench.prefix import Texts


def test_sharegpt_sessions_have_the_published_turns_and_lengths() -> None:
    rng = random.Random(1)
    sessions = [shapes.draw_session("sharegpt", rng, i) for i in range(4000)]
    turns = [len(s.steps) for s in sessions]
    assert abs(statistics.mean(turns) - shapes.mean_requests("sharegpt")) < 0.1
    assert 3.0 < statistics.mean(turns) < shapes.TURNS_MEAN  # the cap at TURNS_MAX trims the geometric tail
    assert max(turns) == shapes.TURNS_MAX and min(turns) == 1
    users = [step.message_tokens for s in sessions for step in s.steps]
    answers = [step.output for s in sessions for step in s.steps]
    assert abs(statistics.mean(users) - shapes.USER_MEAN) < 0.08 * shapes.USER_MEAN
    assert abs(statistics.mean(answers) - shapes.ANSWER_MEAN * shapes.ANSWER_SCALE) < 0.1 * shapes.ANSWER_MEAN
    assert all(not s.together and s.steps[0].context_tokens == 0 for s in sessions)


def test_tenants_repeat_each_users_question_under_its_groups_prompt() -> None:
    rng = random.Random(2)
    sessions = [shapes.draw_session("tenants", rng, i) for i in range(2000)]
    steps = [s.steps[0] for s in sessions]
    assert {step.context for step in steps} == {f"g{g}" for g in range(shapes.GROUPS)}
    assert len({step.message for step in steps}) == shapes.GROUPS * shapes.USERS
    assert all(step.message.startswith(step.context + "-u") for step in steps)
    texts = Texts("salt")
    first, again = (shapes.messages_of(step, texts) for step in (steps[0], next(
        s for s in steps[1:] if s.message == steps[0].message)))
    assert first == again and first[0]["role"] == "system"
    only = shapes.draw_session("tenants", random.Random(3), 0, groups=range(1, shapes.GROUPS, 4))
    assert int(only.steps[0].context[1:]) % 4 == 1


def test_a_fanout_episode_sends_its_sub_tasks_together_over_one_context() -> None:
    episode = shapes.draw_session("fanout", random.Random(4), 7)
    assert episode.together and len(episode.steps) == shapes.FANOUT_WIDTH
    assert {step.context for step in episode.steps} == {"e7"}
    assert len({step.message for step in episode.steps}) == shapes.FANOUT_WIDTH
    outputs = [s.output for e in range(300) for s in shapes.draw_session("fanout", random.Random(e), e).steps]
    assert abs(statistics.median(outputs) - shapes.FANOUT_OUTPUT) < 0.15 * shapes.FANOUT_OUTPUT


def test_sessions_carry_the_rate_asked_for_and_are_seeded() -> None:
    sessions = shapes.draw_sessions("sharegpt", 2.0, 100.0, seed=5)
    assert abs(len(sessions) * shapes.mean_requests("sharegpt") - 200) < shapes.mean_requests("sharegpt")
    assert sessions == shapes.draw_sessions("sharegpt", 2.0, 100.0, seed=5)
    assert [s.at for s in sessions] == sorted(s.at for s in sessions)


def _figures(**kw: float) -> dict[str, float]:
    base = {"ttft_p90": 1.0, "hit": 0.5, "makespan_p90": 10.0}
    return {**base, **kw}


def test_targets_take_the_best_other_arm_of_the_cell() -> None:
    cell = shapes.Cell("fanout", 0.9, 1.0, {
        "sluice": _figures(ttft_p90=0.8, makespan_p90=12.0),
        "LR+w+cap": _figures(ttft_p90=0.7, makespan_p90=15.0),
        "ring": _figures(ttft_p90=2.0, makespan_p90=11.0),
        "EPP": _figures(ttft_p90=math.inf, makespan_p90=math.inf),
    }, list(shapes.ARMS))
    ttft, makespan = shapes.targets(cell)
    assert "LR+w+cap" in ttft.name and ttft.bound == 0.7 and not ttft.met
    assert "ring" in makespan.name and makespan.bound == 11.0 and not makespan.met
    cell.figures["sluice"] = _figures(ttft_p90=0.6, makespan_p90=9.0)
    assert all(t.met for t in shapes.targets(cell))
    tenants = shapes.Cell("tenants", 0.8, 1.0, {"sluice": _figures(hit=0.9), "ring": _figures(hit=0.95)}, [])
    assert [t.met for t in shapes.targets(tenants)] == [True, False]
