"""The clairvoyant arm of ``sluice bench steady``: its finish times are the simulator's own, and it sends each request
where it finishes first without ever running more than an engine's slots or KV."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from enginesim.batcher import Batcher, SimRequest
from enginesim.profiles import PROFILES
from bench.clairvoyant import Dispatch, EngineRates, Work, assign, finish_time
from bench.clairvoyant_arm import MEASURED, PREDICTED
from bench.steady import Cell, judge, prediction_error, summarise, verdict
from bench.workload import Result

SLOW = EngineRates("slow", max_num_seqs=1, kv_tokens=100_000, prefill_tokens_per_s=1000.0,
                   decode_aggregate_tokens_per_s=(10.0,))
FAST = EngineRates("fast", max_num_seqs=1, kv_tokens=100_000, prefill_tokens_per_s=1000.0,
                   decode_aggregate_tokens_per_s=(20.0,))


def new(key: int, output: int, prompt: int = 100) -> Work:
    return Work(key, prompt, output)


def decoding(key: int, prompt: int, output: int, generated: int) -> Work:
    return Work(key, prompt, output, prefill_left=0.0, generated=generated)


def queued(*works: Work) -> list[list[Work]]:
    """The queue as ``assign`` takes it: each request the same on both engines."""
    return [[w, w] for w in works]


@pytest.mark.parametrize(("fast_left", "expected"), [
    pytest.param(None, [Dispatch(1, 1, 0.1 + 100 / 20)], id="idle-fleet-goes-to-the-fast-engine"),
    pytest.param(10, [], id="fast-busy-briefly-waits-for-it"),
    pytest.param(190, [Dispatch(1, 0, 0.1 + 100 / 10)], id="fast-busy-long-takes-the-slow-one-now"),
])
def test_a_request_goes_where_it_finishes_first(fast_left: int | None, expected: list[Dispatch]) -> None:
    running_fast = [] if fast_left is None else [decoding(9, 100, 200, 200 - fast_left)]
    plan = assign([SLOW, FAST], [[], running_fast], queued(new(1, 100)))
    assert [(d.key, d.engine) for d in plan] == [(d.key, d.engine) for d in expected]
    for got, want in zip(plan, expected):
        assert got.finish_s == pytest.approx(want.finish_s)


def test_a_held_request_does_not_block_a_later_one_that_finishes_first_elsewhere() -> None:
    # The fast engine frees in 0.5 s: request 1 (100 tokens) waits for it (5.6 s there, 10.1 s on the slow one now);
    # request 2 (5 tokens) would finish on the slow engine in 0.6 s, behind request 1 on the fast one in 5.85 s.
    plan = assign([SLOW, FAST], [[], [decoding(9, 100, 200, 190)]], queued(new(1, 100), new(2, 5)))
    assert [(d.key, d.engine) for d in plan] == [(2, 0)]


def test_slots_are_never_oversubscribed() -> None:
    # Both engines full: nothing is dispatched, however long the queue.
    busy = [[decoding(8, 100, 50, 0)], [decoding(9, 100, 50, 0)]]
    assert assign([SLOW, FAST], busy, queued(*(new(k, 10) for k in range(1, 20)))) == []
    two_slots = replace(FAST, max_num_seqs=2, decode_aggregate_tokens_per_s=(20.0, 30.0))
    plan = assign([two_slots], [[]], [[new(k, 10)] for k in range(1, 6)])
    assert [d.key for d in plan] == [1, 2]


def test_kv_is_never_oversubscribed() -> None:
    # A free slot but no KV for the whole prompt and output: the request waits for the running one to finish.
    small = replace(FAST, max_num_seqs=2, kv_tokens=1000, decode_aggregate_tokens_per_s=(20.0, 30.0))
    running = [decoding(9, 500, 400, 0)]
    assert assign([small], [running], [[new(1, 100, prompt=50)]]) == []
    assert [d.key for d in assign([small], [running], [[new(1, 40, prompt=50)]])] == [1]


def simulate(batcher: Batcher, requests: list[SimRequest]) -> dict[str, float]:
    """The simulator's own batcher run to the end (every request submitted at 0): each request's finish time."""
    for r in requests:
        batcher.submit(r)
    now = 0.0
    while not all(r.finished_at is not None for r in requests):
        batcher.schedule(now)
        step = batcher.plan_step()
        assert step > 0
        now += step
        batcher.apply_step(step, now)
    return {r.request_id: float(r.finished_at or 0.0) for r in requests}


@pytest.mark.parametrize("profile", [
    pytest.param(PROFILES["thor"], id="thor"),
    pytest.param(PROFILES["spark"], id="spark"),
    pytest.param(replace(PROFILES["thor"], prefill_chunk_tokens=256), id="thor-chunked-prefill"),
    pytest.param(replace(PROFILES["spark"], decode_slowdown_per_1k_tokens=0.2), id="spark-context-slowdown"),
    pytest.param(PROFILES["v100pp2"], id="v100pp2-four-slots"),
])
def test_finish_times_are_the_simulators_own(profile: object) -> None:
    from enginesim.profiles import Profile

    assert isinstance(profile, Profile)
    lengths = [(3000, 40), (500, 200), (1200, 90), (64, 300), (2000, 15)]
    sims = [SimRequest(str(k), p, max_tokens=10_000, arrived_at=0.0, output_tokens=o)
            for k, (p, o) in enumerate(lengths)]
    truth = simulate(Batcher(profile), sims)
    engine = EngineRates.of("e", profile)
    slots = profile.max_num_seqs
    works = [Work(k, p, o) for k, (p, o) in enumerate(lengths)]
    for k in range(len(works)):
        model = finish_time(engine, works[:slots], works[slots:], k)
        assert model == pytest.approx(truth[str(k)], rel=1e-6), k


def figures(**p90: float) -> dict[str, dict[str, float]]:
    """A cell's figures with only what the verdict reads: each arm's TTFT p90 over every request."""
    return {arm: {"ttft_all_p90": value} for arm, value in p90.items()}


def cell(sluice: float, clairvoyant: float, **envoy: float) -> dict[str, dict[str, float]]:
    arms = {"RR": 9.0, "LR": 9.0, "RR+w+cap": 9.0, "LR+w+cap": 9.0, "LR+scan+cap": 9.0, "LR+w+cap b=0": 9.0,
            "LR+w+cap b=1": 9.0, "LR+w+cap b=2": 9.0}
    arms.update({k.replace("_", "+"): v for k, v in envoy.items()})
    return figures(sluice=sluice, clairvoyant=clairvoyant, **arms)


@pytest.mark.parametrize(("figs", "met", "best"), [
    pytest.param(cell(1.2, 1.0, LR=1.3), True, "LR", id="within-1.25x-and-under-the-best-envoy-arm"),
    pytest.param(cell(1.3, 1.0, LR=1.4), False, "LR", id="over-1.25x-the-clairvoyant-arm"),
    pytest.param(cell(1.2, 1.0, LR=1.3, RR_w_cap=1.1), False, "RR+w+cap", id="judged-against-the-best-envoy-arm"),
    pytest.param({**cell(1.2, 1.0, LR=1.3), **figures(EPP=1.1)}, False, "EPP", id="the-epp-arm-is-a-baseline-too"),
    pytest.param({**cell(1.2, 1.0, LR=1.3), **figures(EPP=1.5)}, True, "LR", id="a-weaker-epp-arm-changes-nothing"),
    pytest.param(cell(math.inf, 1.0, LR=1.3), False, "LR", id="a-shed-tail-is-infinite-and-misses"),
])
def test_the_verdict_uses_the_clairvoyant_arm_and_the_best_baseline_arm(figs: dict[str, dict[str, float]], met: bool,
                                                                      best: str) -> None:
    j = judge(figs, 0.95)
    assert j is not None
    assert (j.met, j.best_baseline) == (met, best)


def test_the_verdict_applies_at_80_and_95_percent_only_and_names_arms_under_the_reference() -> None:
    assert judge(cell(5.0, 1.0), 0.5) is None and judge(cell(5.0, 1.0), 1.1) is None
    j = judge(cell(0.5, 1.0, LR=0.8), 0.8)
    assert j is not None and j.met and set(j.beat_reference) == {"sluice", "LR"}


def test_shed_requests_count_as_infinite_ttft() -> None:
    results = [Result("sluice", 200, 0.0, ttft_s=0.1 * k, total_s=1.0) for k in range(1, 9)]
    results += [Result("sluice", 503, 0.0, total_s=0.01), Result("sluice", 503, 0.0, total_s=0.01)]
    s = summarise(results, [10], [1], 0, window=10.0)
    assert s["ttft_p90"] == pytest.approx(0.7)  # served only: the 7th of 8
    assert math.isinf(s["ttft_all_p90"]) and s["unserved"] == 2


def test_the_report_shows_how_far_the_clairvoyant_arm_mispredicted() -> None:
    served = [Result("clairvoyant", 200, 0.0, ttft_s=0.1, total_s=1.0,
                     headers={PREDICTED: "1.0", MEASURED: f"{m:.2f}"}) for m in (0.9, 1.0, 1.1, 1.3)]
    refused = Result("clairvoyant", 0, 0.0)
    assert prediction_error([*served, refused]) == pytest.approx((0.9, 1.1, 1.3))
    assert prediction_error([refused]) is None


def test_a_short_request_joining_a_decode_under_chunked_prefill_finishes_at_once() -> None:
    """The simulator's own case (tests/unit/test_simulator.py): thor's default chunked prefill leaves a float residue
    of a prompt; the model, like the simulator, counts it as prefilled instead of waiting out the other's answer."""
    thor = EngineRates.of("thor", PROFILES["thor"])
    assert thor.prefill_chunk_tokens > 0
    running = [decoding(1, 10, 150, 18)]
    assert finish_time(thor, running + [new(2, 2, prompt=11)], [], 2) < 0.5



def overload_cell(sluice: float, best: float, rate: float) -> Cell:
    """A 110% cell offered ``rate`` requests/s (its measured capacity ``rate / 1.1``): goodputs of sluice and the best
    baseline arm (EPP)."""
    figs = {"sluice": {"ttft_all_p90": 1.0, "goodput": sluice}, "EPP": {"ttft_all_p90": 1.0, "goodput": best}}
    return Cell("thor+spark", "open", 1.1, "constant", rate, figs)


@pytest.mark.parametrize(("sluice", "rate", "expected"), [
    pytest.param(5.4, 8.8, False, id="room-for-1.3x-and-sluice-short-of-it"),
    pytest.param(6.6, 8.8, True, id="room-for-1.3x-and-sluice-there"),
    pytest.param(5.4, 6.16, None, id="no-room-the-target-does-not-stand"),
])
def test_the_overload_target_stands_only_where_the_best_baseline_leaves_room(sluice: float, rate: float,
                                                                           expected: bool | None) -> None:
    """At 110% sluice must reach 1.3x the best baseline's goodput (5.0 here) only where the fleet's capacity leaves
    room for it: 8.8 requests/s offered is a capacity of 8.0 (1.6x room), 6.16 one of 5.6 (1.12x: no gateway's 1.3x);
    the goodput target (>= the best) stands either way."""
    v = verdict(overload_cell(sluice, 5.0, rate))
    assert v["overload_pass"] is expected
    assert v["good_pass"]
