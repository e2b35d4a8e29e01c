"""Overload, shed early (core/admission.py): a parked request may be shed for its bound only inside its decision window
(``shed_decision_s``), at arrival or at a park sweep once the estimate of its start (its place in line and the engines'
expected frees, ``expected_start``) is past its bound, with that estimate as its Retry-After. Past the window it is
committed: never shed for its bound again (``max_park_s`` stays the backstop) and served before every request that
parked after it. Under a sustained overload nobody is shed after a long wait, the oldest requests are the ones served,
a burst into an empty line is served whole (``overload_burst_s``; into a standing line, up to its bound), and a request
with its own TTFT deadline keeps that bound."""

from __future__ import annotations

import math
from dataclasses import replace
from collections import Counter

from controlplane.core.admission import AdmissionCore
from controlplane.core.waits import expected_start
from controlplane.core.ledger import Ledger
from controlplane.core.model import Reason, Verdict
from controlplane.core.policy import Policy
from controlplane.core.route import expected_frees
from tests.unit.coreinputs import chat, engine

POLICY = Policy(lifo_after_ms=2000, overload_shed_after_ms=4000, max_park_s=120)
VIEWS = [engine("e", seqs=1)]
SERVICE_S = 10 / 1000 + 111 / 20
"""One ``chat()`` on ``e``: 10 prompt tokens at 1000 tokens/s, 111 expected output tokens at 20 tokens/s."""


def learned(policy: Policy = POLICY) -> AdmissionCore:
    """A core that has seen every answer of ``cortex`` run 111 tokens: a running request frees at its expected finish
    (the learned tail), not one whole answer from now however long it has run (the memoryless tail of a model with no
    recorded lengths)."""
    core = AdmissionCore(policy, Ledger(lease_seconds=600))
    for _ in range(core.output_lengths.min_samples):
        core.record_output("cortex", 111)
    return core


def arrive_every(core: AdmissionCore, gap_s: float, until_s: float, ttft_ms: int | None = None,
                 release_every_s: float = 0.0) -> tuple[Counter[str], list[float], list[str], list[str]]:
    """One engine slot held by a request (for ever, or handed on every ``release_every_s``); a request arrives every
    ``gap_s`` until ``until_s`` while the park sweep runs every 0.1 s. Returns how they were answered by ``until_s``,
    how long each shed request had been parked, the order requests parked in and the order the lot admitted them."""
    answers: Counter[str] = Counter()
    waited: list[float] = []
    parked_order: list[str] = []
    admitted: list[str] = []
    holder = core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0)
    assert holder.ticket is not None
    running = holder.ticket.ticket_id
    now, next_arrival, next_release, n = 0.0, 0.0, release_every_s, 0
    while now <= until_s:
        if release_every_s and now >= next_release:
            core.release(running, now)
            for outcome in core.wake(core.fleet(VIEWS, now), now):
                assert outcome.ticket is not None, outcome.decision
                admitted.append(outcome.request_id)
                running = outcome.ticket.ticket_id
            next_release += release_every_s
        if now >= next_arrival:
            outcome = core.check(f"r{n}", chat(ttft_ms=ttft_ms), core.fleet(VIEWS, now), now)
            answers[outcome.decision.verdict.value] += 1
            if outcome.decision.verdict is Verdict.PARK:
                parked_order.append(outcome.request_id)
            elif outcome.decision.verdict is Verdict.SHED:
                assert outcome.decision.retry_after_s
                answers[outcome.decision.reason.value] += 1
                waited.append(0.0)
            n, next_arrival = n + 1, next_arrival + gap_s
        for outcome in core.expire_parked(core.fleet(VIEWS, now), now):
            assert outcome.decision.verdict is Verdict.SHED and outcome.decision.retry_after_s
            answers[outcome.decision.reason.value] += 1
            waited.append(outcome.parked_for)
        now = round(now + 0.1, 6)
    return answers, waited, parked_order, admitted


def test_a_sustained_overload_never_sheds_after_the_window() -> None:
    """The slot never frees and a request arrives every 0.5 s for 20 s: the overload is refused (``overloaded``), each
    refusal within its decision window, and the requests left parked are the oldest ones, never shed, still waiting
    their turn."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    answers, waited, parked_order, _ = arrive_every(core, 0.5, 20.0)
    assert answers[Reason.OVERLOADED.value] >= 30, answers
    assert max(waited) < POLICY.shed_decision_s, waited
    committed = [p.request_id for p in core.parked() if 20.0 - p.parked_at >= POLICY.shed_decision_s]
    assert committed and committed == [f"r{i}" for i in range(len(committed))], committed  # the first, in order
    assert set(committed) <= set(parked_order)


def test_an_arrival_expected_past_its_bound_is_shed_at_once_with_the_estimate() -> None:
    """One slot, held. r0 parks (expected to start when the holder's slot frees). Once r0 is committed the line stands
    and a newcomer may be expected to wait ``STANDING_SERVICES`` (2) of the model's service times: r1, one service
    behind r0, parks; r2, two behind, is expected past that and is refused at once, its Retry-After the expected wait:
    the holder's expected free, then one service for each request ahead."""
    core = learned()
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).ticket is not None
    assert core.check("r0", chat(), core.fleet(VIEWS, 0.1), 0.1).decision.verdict is Verdict.PARK
    assert core.check("r1", chat(), core.fleet(VIEWS, 1.2), 1.2).decision.verdict is Verdict.PARK
    fleet = core.fleet(VIEWS, 1.3)
    shed = core.check("r2", chat(), fleet, 1.3)
    expected = expected_frees("e", fleet, 1.3)[0] + 2 * SERVICE_S - 1.3
    assert (shed.decision.verdict, shed.decision.reason, shed.parked_for) == (Verdict.SHED, Reason.OVERLOADED, 0.0)
    assert shed.decision.retry_after_s == math.ceil(expected), (shed.decision, expected)
    assert f"expected to start in {expected:.1f} s (2 ahead in line)" in shed.decision.detail
    assert [p.request_id for p in core.parked()] == ["r0", "r1"]


def test_a_parked_request_is_shed_inside_its_window_once_its_estimate_passes_its_bound_and_never_after() -> None:
    """r0 and r1 park in a standing line (held by ``old``, committed), each expected in time. A critical request then
    parks ahead of them both: r1, still inside its window, is now expected past its bound and the next sweep sheds it;
    r0, committed, is not shed however late it now expects to start."""
    core = learned()
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).ticket is not None
    assert core.check("r0", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.PARK
    assert core.check("r1", chat(), core.fleet(VIEWS, 1.0), 1.0).decision.verdict is Verdict.PARK
    assert not core.expire_parked(core.fleet(VIEWS, 1.1), 1.1)
    critical = chat(priority="critical")
    assert core.check("crit", critical, core.fleet(VIEWS, 1.2), 1.2).decision.verdict is Verdict.PARK
    shed = core.expire_parked(core.fleet(VIEWS, 1.3), 1.3)
    assert [(o.request_id, o.decision.reason) for o in shed] == [("r1", Reason.OVERLOADED)]
    assert shed[0].parked_for < POLICY.shed_decision_s and shed[0].parked is not None
    for tick in range(14, 600):
        assert not core.expire_parked(core.fleet(VIEWS, tick / 10), tick / 10), tick
    assert [p.request_id for p in core.parked()] == ["crit", "r0"]


def test_committed_requests_are_admitted_in_arrival_order() -> None:
    """An overload that lasts (the slot is handed on every 2 s, a request arrives every 0.5 s, for 40 s): the lot admits
    the requests it kept in the order they parked (no newest-first past ``lifo_after_ms``), and sheds nobody after their
    window."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    answers, waited, parked_order, admitted = arrive_every(core, 0.5, 40.0, release_every_s=2.0)
    assert len(admitted) >= 15 and answers[Reason.OVERLOADED.value] > 0, (admitted, answers)
    assert max(waited) < POLICY.shed_decision_s
    # Every request kept (parked and not shed inside its window) was admitted before any that parked after it.
    still = {p.request_id for p in core.parked()}
    kept = [r for r in parked_order if r in admitted or r in still]
    assert admitted == kept[:len(admitted)], (admitted, kept)


def test_a_burst_into_an_empty_line_is_served_whole_and_never_shed_later() -> None:
    """Eleven requests at once into an empty line, then nothing (an agent's fan-out): a burst is not an overload
    (``overload_burst_s``), so every one parks, and a minute later all are still waiting their turn. Only a request
    expected to start past ``max_park_s`` is refused, and at once (``park_timeout``): with 30 s, the five expected to
    start within it (the slot frees every 5.6 s) park."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    verdicts = [core.check(f"r{n}", chat(), core.fleet(VIEWS, 0.0), 0.0).decision for n in range(11)]
    assert all(d.verdict is Verdict.PARK for d in verdicts), verdicts
    for tick in range(1, 600):
        assert not core.expire_parked(core.fleet(VIEWS, tick / 10), tick / 10)
    assert core.depth() == 11
    bounded = AdmissionCore(replace(POLICY, max_park_s=30.0), Ledger(lease_seconds=600))
    assert bounded.check("holder", chat(), bounded.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    verdicts = [bounded.check(f"r{n}", chat(), bounded.fleet(VIEWS, 0.0), 0.0).decision for n in range(11)]
    assert [d.verdict for d in verdicts] == [Verdict.PARK] * 5 + [Verdict.SHED] * 6, verdicts
    assert all(d.reason is Reason.PARK_TIMEOUT and d.retry_after_s for d in verdicts[5:])


def test_a_burst_into_a_line_that_stood_past_the_burst_grace_is_refused_past_its_bound() -> None:
    """One request has been parked for 1.5 s (the line stands) when ten more arrive at once: whoever is expected past
    the bound (a standing line's two service times, 11 s) is refused at once ``overloaded``; with
    ``overload_burst_s`` 0 the same holds for a burst into an empty line."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    assert core.check("first", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.PARK
    for tick in range(1, 15):
        assert not core.expire_parked(core.fleet(VIEWS, tick / 10), tick / 10)
    verdicts = [core.check(f"r{n}", chat(), core.fleet(VIEWS, 1.5), 1.5).decision for n in range(10)]
    assert verdicts[0].verdict is Verdict.PARK
    assert all(d.verdict is Verdict.SHED and d.reason is Reason.OVERLOADED for d in verdicts[1:]), verdicts
    off = AdmissionCore(replace(POLICY, overload_burst_s=0.0), Ledger(lease_seconds=600))
    assert off.check("holder", chat(), off.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    verdicts = [off.check(f"r{n}", chat(), off.fleet(VIEWS, 0.0), 0.0).decision for n in range(11)]
    assert Verdict.PARK in [d.verdict for d in verdicts[:3]]
    assert all(d.verdict is Verdict.SHED and d.reason is Reason.OVERLOADED for d in verdicts[3:]), verdicts


def test_a_burst_spread_over_seconds_is_refused_early_if_at_all() -> None:
    """``bench cag4``'s shape: two requests at once, then eight 0.3 s apart; the slot frees late. Whoever is refused is
    refused at arrival or inside its window (the line stands from 1 s on, and a request expected past two service times
    is told then); nobody after."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    arrivals = [0.0, 0.0] + [0.3 * (i + 1) for i in range(8)]
    parked, swept = 0, []
    tick = 0
    for n, at in enumerate(arrivals):
        while tick / 10 < at:
            swept += core.expire_parked(core.fleet(VIEWS, tick / 10), tick / 10)
            tick += 1
        parked += core.check(f"r{n}", chat(), core.fleet(VIEWS, at), at).decision.verdict is Verdict.PARK
    for tick in range(tick, 300):
        swept += core.expire_parked(core.fleet(VIEWS, tick / 10), tick / 10)
    assert all(o.parked_for < POLICY.shed_decision_s for o in swept), swept
    assert core.depth() == parked - len(swept) >= 2


def test_a_request_with_a_deadline_keeps_its_own_bound() -> None:
    """With a 60 s deadline, a request is refused only when it is expected to start past it (``ttft_unmeetable``, at
    arrival or in its window), never as ``overloaded``."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    answers, waited, parked_order, _ = arrive_every(core, 0.5, 20.0, ttft_ms=60_000)
    assert Reason.OVERLOADED.value not in answers
    assert answers[Reason.TTFT_UNMEETABLE.value] > 0 and len(parked_order) > 5, answers
    assert max(waited) < POLICY.shed_decision_s
    assert core.depth() == len(parked_order)


def test_off_when_zero() -> None:
    core = AdmissionCore(Policy(lifo_after_ms=2000, overload_shed_after_ms=0), Ledger(lease_seconds=600))
    answers, waited, _, _ = arrive_every(core, 0.5, 20.0)
    assert Reason.OVERLOADED.value not in answers
    assert max(waited, default=0.0) < 1.0  # beyond max_park_s (not expected within 120 s): refused at arrival


def test_where_one_answer_takes_seconds_the_bound_is_several_of_them() -> None:
    """``bench prefix`` at speed x1: answers take seconds, so 4 s is a normal wait at 90% load, not an overload. The
    bound is ``overload_shed_services`` (4) of the model's recent service times: 12 s when each request held its slot
    3 s (and a standing line's two of them, 6 s, rather than ``lifo_after_ms``). Tickets closed late (a lapsed lease)
    say nothing of service and are not counted. Either way every refusal comes inside the window. (The line's first
    second is judged like the rest: ``overload_burst_s`` 0.)"""
    def measured(policy: Policy) -> AdmissionCore:
        core = AdmissionCore(policy, Ledger(lease_seconds=600))
        for i in range(20):
            start = -100.0 + 4 * i
            assert core.check(f"w{i}", chat(), core.fleet(VIEWS, start), start).decision.verdict is Verdict.ADMIT
            assert core.release(f"w{i}", start + 3.0) is not None
        return core

    core = measured(replace(POLICY, overload_burst_s=0.0))
    assert core.check("lost", chat(), core.fleet(VIEWS, -20.0), -20.0).decision.verdict is Verdict.ADMIT
    assert core.release("lost", -1.0, completed=False) is not None  # held 19 s: not a service time
    assert abs(core.overload_bound_s("cortex") - 12.0) < 1e-6
    scaled, waited, scaled_parked, _ = arrive_every(core, 0.5, 20.0)
    assert max(waited) < POLICY.shed_decision_s
    # Without the scaling the fixed 4 s bound and lifo_after_ms (2 s) apply, as before: fewer requests are kept.
    fixed = measured(Policy(lifo_after_ms=2000, overload_shed_after_ms=4000, overload_shed_services=0,
                            overload_burst_s=0.0))
    assert abs(fixed.overload_bound_s("cortex") - 4.0) < 1e-6
    _, waited, fixed_parked, _ = arrive_every(fixed, 0.5, 20.0)
    assert max(waited) < POLICY.shed_decision_s
    assert len(fixed_parked) < len(scaled_parked), (fixed_parked, scaled_parked)


def test_the_config_key() -> None:
    from controlplane.config import DEFAULTS, ConfigError, parse_config

    assert DEFAULTS["admission"]["shed_decision_seconds"] == Policy().shed_decision_s == 1.0
    raw = {"engines": [{"name": "a", "url": "http://127.0.0.1:1"}], "admission": {"shed_decision_seconds": 0}}
    assert parse_config(raw).policy.shed_decision_s == 0.0
    raw["admission"] = {"shed_decision_seconds": -0.5}
    try:
        parse_config(raw)
    except ConfigError as caught:
        assert [p.split(":")[0] for p in caught.problems] == ["admission.shed_decision_seconds"]
    else:
        raise AssertionError("a negative window was accepted")


def test_an_estimate_from_the_default_rates_refuses_nobody() -> None:
    """An engine neither measured nor anchored is estimated at the policy's default decode rate, which may be off by any
    factor (a simulator at speed x10 runs 25 times faster): nobody is refused on such an estimate; the same burst on an
    anchored engine is refused past its bound (``overload_burst_s`` 0: a burst is judged like a standing line)."""
    unknown = [replace(engine("e", seqs=1), anchor_decode_tokens_per_s=None)]
    policy = replace(POLICY, overload_burst_s=0.0)
    core = AdmissionCore(policy, Ledger(lease_seconds=600))
    assert core.check("holder", chat(), core.fleet(unknown, 0.0), 0.0).ticket is not None
    verdicts = [core.check(f"r{n}", chat(), core.fleet(unknown, 0.0), 0.0).decision.verdict for n in range(11)]
    assert verdicts == [Verdict.PARK] * 11
    assert not core.expire_parked(core.fleet(unknown, 0.5), 0.5)
    anchored = AdmissionCore(policy, Ledger(lease_seconds=600))
    assert anchored.check("holder", chat(), anchored.fleet(VIEWS, 0.0), 0.0).ticket is not None
    verdicts = [anchored.check(f"r{n}", chat(), anchored.fleet(VIEWS, 0.0), 0.0).decision.verdict for n in range(11)]
    assert Verdict.SHED in verdicts


def test_tickets_admitted_on_the_default_rate_refuse_nobody_after_the_engine_is_measured() -> None:
    """A burst on a fresh engine: the first request is admitted while the engine's decode rate is the policy's default
    (20 tokens/s, its expected finish 5.6 s away), then a probe measures the engine 25 times faster. Requests that
    park behind that ticket are not refused on its stale expected finish (a real llama.cpp burst was refused 0.6 s in,
    "expected to start in 8.0 s", and its slot freed 0.4 s later); once it closes, estimates count again."""
    unknown = [replace(engine("e", seqs=1), anchor_decode_tokens_per_s=None)]
    measured = [replace(engine("e", seqs=1), anchor_decode_tokens_per_s=500.0)]
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    holder = core.check("holder", chat(), core.fleet(unknown, 0.0), 0.0)
    assert holder.ticket is not None and not holder.decision.rates_measured
    assert core.fleet(measured, 0.1).of("e").guessed_tickets == 1
    verdicts = [core.check(f"r{n}", chat(), core.fleet(measured, 0.1), 0.1).decision.verdict for n in range(11)]
    assert verdicts == [Verdict.PARK] * 11
    assert not core.expire_parked(core.fleet(measured, 0.5), 0.5)
    core.release(holder.ticket.ticket_id, 0.6)
    woken = core.wake(core.fleet(measured, 0.6), 0.6)
    assert [o.decision.verdict for o in woken] == [Verdict.ADMIT]
    assert woken[0].decision.rates_measured and core.fleet(measured, 0.6).of("e").guessed_tickets == 0


def test_a_line_behind_an_engine_that_holds_the_prompt_is_expected_to_move_at_the_cached_pace() -> None:
    """The expected start of a request 3 places back in line on one busy slot: each request ahead holds the slot for one
    service of the request's shape. When the engine holds the prompt's 8000-token prefix, that service is its decode
    and the few tokens left to prefill, not 8 s of prefill: an estimate of a cold line would shed, at arrival, requests
    the engine serves in time."""
    core = learned()
    views = [engine("e", seqs=1)]
    request = chat(prompt=8040)
    holder = core.check("holder", chat(), core.fleet(views, 0.0), 0.0)
    assert holder.ticket is not None
    fleet = core.fleet(views, 0.0)
    cold = expected_start(request, fleet, POLICY, 0.0, 3)
    warm = expected_start(request, fleet, POLICY, 0.0, 3, cached={"e": 8000})
    first_free = expected_frees("e", fleet, 0.0)[0]
    assert math.isclose(cold.wait_s, first_free + 3 * (8040 / 1000 + 111 / 20))
    assert math.isclose(warm.wait_s, first_free + 3 * (40 / 1000 + 111 / 20))
