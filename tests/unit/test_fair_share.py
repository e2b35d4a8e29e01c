"""The fair-share spread (route.py, ``admission.max_share_over_capacity``): at light load, finish-soonest alone sends every
request to the fastest engines; the spread keeps each engine's share of recent admissions within a bound of its part of
the capacity, without ever making a request wait and without moving a prompt away from its cached prefix."""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.core.admission import AdmissionCore
from controlplane.core.decide import decide
from controlplane.core.ledger import Ledger
from controlplane.core.model import EngineLedger, Fleet, Reason, Verdict
from controlplane.core.policy import Policy
from controlplane.core.route import capacity_throughput
from tests.unit.test_route import chat, engine

# Two fast engines and two slow ones, 2 slots each (seed 000's per-request decode rates at one stream).
FLEET = (engine("spark-a", decode=49.0), engine("spark-b", decode=49.0), engine("thor-a", decode=18.0),
         engine("thor-b", decode=18.0))


def light_load(policy: Policy, requests: int = 200) -> Counter[str]:
    """One request every 2 s (a spark answers in about 2.3 s): the fleet is mostly idle, each request is released when
    its estimate says it is done."""
    core = AdmissionCore(policy, Ledger(lease_seconds=600))
    served: Counter[str] = Counter()
    open_tickets: dict[str, float] = {}
    for i in range(requests):
        now = 2.0 * i
        for ticket, done in list(open_tickets.items()):
            if done <= now:
                core.release(ticket, done)
                del open_tickets[ticket]
        outcome = core.check(f"r{i}", chat(), core.fleet(FLEET, now), now)
        assert outcome.ticket is not None  # never parked: a slot is always free
        served[outcome.ticket.engine] += 1
        open_tickets[outcome.ticket.ticket_id] = outcome.ticket.expected_done_at
    return served


def test_light_load_without_the_spread_leaves_the_slow_engines_idle() -> None:
    served = light_load(Policy(max_share_over_capacity=0.0))
    assert served["thor-a"] + served["thor-b"] == 0


@pytest.mark.parametrize("ratio", [1.2, 1.4, 2.0])
def test_the_spread_keeps_every_engine_within_its_bound(ratio: float) -> None:
    served = light_load(Policy(max_share_over_capacity=ratio))
    throughput = {e.name: capacity_throughput(e, Fleet(FLEET), Policy()) for e in FLEET}
    fair = {name: value / sum(throughput.values()) for name, value in throughput.items()}
    total = sum(served.values())
    shares = {name: served[name] / total / fair[name] for name in fair}
    assert max(shares.values()) <= ratio + 0.05, shares
    if ratio * fair["spark-a"] * 2 < 1:  # the two sparks cannot take everything within the bound: the thors take part
        assert served["thor-a"] + served["thor-b"] >= total * (1 - ratio * fair["spark-a"] * 2) - 5


def test_the_spread_never_makes_a_request_wait() -> None:
    """spark-a is far over its share, but the other engines are full: it takes the request (no park)."""
    full = {name: EngineLedger(open_tickets=2, expected_done=(5.0, 6.0)) for name in ("spark-b", "thor-a", "thor-b")}
    fleet = Fleet(FLEET, full, recent_serves={"spark-a": 50.0})
    decision = decide(chat(), fleet, Policy(), now=0.0)
    assert (decision.verdict, decision.engine, decision.reason) == (Verdict.ADMIT, "spark-a", Reason.FINISH_SOONEST)


def test_a_request_goes_elsewhere_when_the_fastest_is_over_its_share() -> None:
    """spark-a has taken 80 of 102 (2.1x its part of the capacity): the next request goes to spark-b, which finishes as
    soon; with both sparks over a tight bound, to a thor, which finishes later (reason ``fair_share``)."""
    fleet = Fleet(FLEET, recent_serves={"spark-a": 80.0, "spark-b": 20.0, "thor-a": 1.0, "thor-b": 1.0})
    decision = decide(chat(), fleet, Policy(), now=0.0)
    assert (decision.verdict, decision.engine, decision.reason) == (Verdict.ADMIT, "spark-b", Reason.FINISH_SOONEST)
    both = Fleet(FLEET, recent_serves={"spark-a": 50.0, "spark-b": 50.0, "thor-a": 1.0, "thor-b": 1.0})
    assert decide(chat(), both, Policy(max_share_over_capacity=1.4), now=0.0).engine == "spark-a"  # 1.34x each
    tight = decide(chat(), both, Policy(max_share_over_capacity=1.2), now=0.0)
    assert (tight.engine, tight.reason) == ("thor-a", Reason.FAIR_SHARE)
    assert decide(chat(), fleet, Policy(max_share_over_capacity=0.0), now=0.0).engine == "spark-a"


def test_a_cached_prefix_stays_on_an_engine_over_its_share() -> None:
    fleet = Fleet(FLEET, recent_serves={"spark-a": 80.0, "spark-b": 20.0, "thor-a": 1.0, "thor-b": 1.0})
    decision = decide(chat(prompt=2000), fleet, Policy(), now=0.0, cached={"spark-a": 1900})
    assert (decision.verdict, decision.engine, decision.reason) == (Verdict.ADMIT, "spark-a", Reason.PREFIX_CACHE)


def test_requests_with_a_deadline_keep_the_band() -> None:
    """The band spreads deadline requests itself (weighted by recent serves); the spread is for finish-soonest."""
    fleet = Fleet(FLEET, recent_serves={"spark-a": 50.0, "spark-b": 50.0})
    decision = decide(chat(ttft_ms=20_000), fleet, Policy(), now=0.0, pick=0.0)
    assert decision.reason is Reason.SATISFICING_BAND
