"""Overload shedding (core/admission.py): under a sustained overload the requests adaptive LIFO leaves behind are told
``overloaded`` (with a Retry-After) once they have waited ``overload_shed_after_ms``; a burst that stops arriving is drained
in full, and a request with its own TTFT deadline keeps that bound."""

from __future__ import annotations

from collections import Counter

from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.model import Reason, Verdict
from controlplane.core.policy import Policy
from tests.unit.test_route import chat, engine

POLICY = Policy(lifo_after_ms=2000, overload_shed_after_ms=4000, max_park_s=120)
VIEWS = [engine("e", seqs=1)]


def arrive_every(core: AdmissionCore, gap_s: float, until_s: float, ttft_ms: int | None = None) -> Counter[str]:
    """One engine slot held by a request that never ends; a request arrives every ``gap_s`` until ``until_s`` while the
    park sweep runs every 0.1 s: how were they answered by ``until_s``?"""
    answers: Counter[str] = Counter()
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    now, next_arrival, n = 0.0, 0.0, 0
    while now <= until_s:
        if now >= next_arrival:
            outcome = core.check(f"r{n}", chat(ttft_ms=ttft_ms), core.fleet(VIEWS, now), now)
            answers[outcome.decision.verdict.value] += 1
            n, next_arrival = n + 1, next_arrival + gap_s
        for outcome in core.expire_parked(core.fleet(VIEWS, now), now):
            assert outcome.decision.verdict is Verdict.SHED and outcome.decision.retry_after_s
            answers[outcome.decision.reason.value] += 1
        now = round(now + 0.1, 6)
    return answers


def test_a_sustained_overload_sheds_the_requests_left_behind() -> None:
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    answers = arrive_every(core, 0.5, 20.0)
    # Arrivals from 0 to 20 s: everyone who has waited over 4 s by 20 s was shed (those that arrived before 16 s).
    assert answers[Reason.OVERLOADED.value] == 32, answers
    assert all(20.0 - p.parked_at <= 4.0 for p in core.parked())
    assert core.depth() == 41 - 32


def test_a_burst_that_stops_arriving_is_not_overload() -> None:
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    for n in range(11):  # eleven requests at once, then nothing
        assert core.check(f"r{n}", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.PARK
    for tick in range(1, 600):  # a minute later they are all still waiting their turn
        assert not core.expire_parked(core.fleet(VIEWS, tick / 10), tick / 10)
    assert core.depth() == 11


def test_a_burst_spread_over_seconds_is_not_overload_either() -> None:
    """``bench cag4``: two requests at once, then eight 0.3 s apart; the slot frees late. Nobody is shed."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    assert core.check("holder", chat(), core.fleet(VIEWS, 0.0), 0.0).decision.verdict is Verdict.ADMIT
    arrivals = [0.0, 0.0] + [0.3 * (i + 1) for i in range(8)]
    for n, at in enumerate(arrivals):
        assert core.check(f"r{n}", chat(), core.fleet(VIEWS, at), at).decision.verdict is Verdict.PARK
    for tick in range(25, 300):
        assert not core.expire_parked(core.fleet(VIEWS, tick / 10), tick / 10), tick
    assert core.depth() == 10


def test_a_request_with_a_deadline_keeps_its_own_bound() -> None:
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    answers = arrive_every(core, 0.5, 20.0, ttft_ms=60_000)
    assert Reason.OVERLOADED.value not in answers and core.depth() == 41


def test_off_when_zero() -> None:
    core = AdmissionCore(Policy(lifo_after_ms=2000, overload_shed_after_ms=0), Ledger(lease_seconds=600))
    assert Reason.OVERLOADED.value not in arrive_every(core, 0.5, 20.0)


def test_where_one_answer_takes_seconds_the_bound_is_several_of_them() -> None:
    """``bench prefix`` at speed x1: answers take seconds, so 4 s is a normal wait at 90% load, not an overload. The
    bound is ``overload_shed_services`` (4) of the model's recent service times: 12 s when each request held its slot
    3 s. Tickets closed late (a lapsed lease) say nothing of service and are not counted."""
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    for i in range(20):
        start = -100.0 + 4 * i
        assert core.check(f"w{i}", chat(), core.fleet(VIEWS, start), start).decision.verdict is Verdict.ADMIT
        assert core.release(f"w{i}", start + 3.0) is not None
    assert core.check("lost", chat(), core.fleet(VIEWS, -20.0), -20.0).decision.verdict is Verdict.ADMIT
    assert core.release("lost", -1.0, completed=False) is not None  # held 19 s: not a service time
    assert abs(core.overload_bound_s("cortex") - 12.0) < 1e-6
    answers = arrive_every(core, 0.5, 20.0)
    # Everyone who had waited over 12 s by 20 s was shed (those that arrived before 8 s); nobody else.
    assert answers[Reason.OVERLOADED.value] == 16, answers
    assert all(20.0 - p.parked_at <= 12.0 for p in core.parked())
    # Without the scaling the fixed 4 s bound applies, as before.
    fixed = AdmissionCore(Policy(lifo_after_ms=2000, overload_shed_after_ms=4000, overload_shed_services=0),
                          Ledger(lease_seconds=600))
    for i in range(20):
        start = -100.0 + 4 * i
        fixed.check(f"w{i}", chat(), fixed.fleet(VIEWS, start), start)
        fixed.release(f"w{i}", start + 3.0)
    assert arrive_every(fixed, 0.5, 20.0)[Reason.OVERLOADED.value] == 32

