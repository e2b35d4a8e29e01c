"""Spreading without a deadline (route.py). Near ties (``admission.near_tie_fraction``, on by default): free slots that
finish within a few percent of the soonest are equally good, and the least served per unit of capacity takes the
request, so engines of one kind share light load instead of the one that measured a percent faster taking it all. The
fair-share spread (``admission.max_share_over_capacity``, off by default): each engine's share of recent admissions is
kept within a bound of its part of the capacity, without ever making a request wait and without moving a prompt away
from its cached prefix."""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.core.admission import AdmissionCore
from controlplane.core.decide import decide
from controlplane.core.ledger import Ledger
from controlplane.core.fleet import EngineLedger, Fleet
from controlplane.core.engines import EngineView
from controlplane.core.model import Reason, Verdict
from controlplane.core.policy import Policy
from tests.unit.coreinputs import chat, engine

# Two fast engines and two slow ones, 2 slots each (seed 000's per-request decode rates at one stream); the two sparks
# measured a percent apart, as two boxes of one kind do.
FLEET = (engine("spark-a", decode=49.5), engine("spark-b", decode=49.0), engine("thor-a", decode=18.0),
         engine("thor-b", decode=18.0))
SPREAD = Policy(max_share_over_capacity=1.3, near_tie_fraction=0.0)
"""The fair-share spread alone."""


def light_load(policy: Policy, requests: int = 200, fleet: tuple[EngineView, ...] = FLEET,
               every_s: float = 2.0) -> Counter[str]:
    """One request every ``every_s`` (a spark answers in about 2.3 s): the fleet is mostly idle, each request is released
    when its estimate says it is done."""
    core = AdmissionCore(policy, Ledger(lease_seconds=600))
    served: Counter[str] = Counter()
    open_tickets: dict[str, float] = {}
    for i in range(requests):
        now = every_s * i
        for ticket, done in list(open_tickets.items()):
            if done <= now:
                core.release(ticket, done)
                del open_tickets[ticket]
        outcome = core.check(f"r{i}", chat(), core.fleet(fleet, now), now)
        assert outcome.ticket is not None  # never parked: a slot is always free
        served[outcome.ticket.engine] += 1
        open_tickets[outcome.ticket.ticket_id] = outcome.ticket.expected_done_at
    return served


def test_near_ties_share_light_load_between_engines_of_one_kind() -> None:
    """Without near ties spark-a, a percent faster, takes every request it is free for; with them the two sparks take
    turns. The thors, 2.7x slower, are no tie: they stay idle, as finish-soonest wants."""
    alone = light_load(Policy(near_tie_fraction=0.0), every_s=5.0)
    assert alone["spark-a"] == 200
    shared = light_load(Policy(), every_s=5.0)
    assert abs(shared["spark-a"] - shared["spark-b"]) <= 2, shared
    assert shared["thor-a"] + shared["thor-b"] == 0


def test_light_load_on_a_large_fleet_stays_on_the_warm_engines() -> None:
    """Twenty idle engines of one kind are all near ties. A request a second (each runs about 2.3 s): the engines
    admitted to within the last 4 s take them (their connections and prompt caches stay warm), so a few engines serve
    all and share it; without the limit the load goes round all twenty. One every 5 s: nothing is warm when a request
    comes, and the first eight by name share it."""
    sparks = tuple(engine(f"spark-{i:02d}", decode=49.0 + i / 100) for i in range(20))
    warm = light_load(Policy(), fleet=sparks, every_s=1.0)
    assert 2 <= len(warm) <= 4, warm
    assert max(warm.values()) - min(warm.values()) <= 2, warm
    assert len(light_load(Policy(near_tie_max_engines=0), fleet=sparks, every_s=1.0)) == 20
    cold = light_load(Policy(), fleet=sparks, every_s=5.0)
    assert set(cold) == {f"spark-{i:02d}" for i in range(8)}, cold
    assert max(cold.values()) - min(cold.values()) <= 2, cold
    # The full scan (no fleet index) decides the same: the warm engine however served, else the first eight by name.
    served = {f"spark-{i:02d}": 5.0 for i in range(8)}
    fleet = Fleet(sparks, recent_serves=served, last_served={"spark-03": 7.0, "spark-12": -1.0})
    assert decide(chat(), fleet, Policy(), now=10.0).engine == "spark-03"
    assert decide(chat(), fleet, Policy(), now=12.0).engine in {f"spark-{i:02d}" for i in range(8)}
    assert decide(chat(), fleet, Policy(near_tie_max_engines=0), now=10.0).engine not in served


def test_a_fleet_refreshed_after_an_admission_knows_the_engine_is_warm() -> None:
    """Parked heads are admitted one after another on a fleet refreshed after each admission: without an index too, the
    next one must see the engine just admitted to as warm, as a fresh fleet would."""
    sparks = tuple(engine(f"spark-{i:02d}", decode=49.0) for i in range(20))
    core = AdmissionCore(Policy(), Ledger(lease_seconds=600))
    fleet = core.fleet(sparks, 0.0)
    outcome = core.check("r1", chat(), fleet, 3.0)
    assert outcome.ticket is not None
    assert core.refreshed(fleet, 3.0).last_served[outcome.ticket.engine] == 3.0
    assert core.fleet(sparks, 3.0).last_served[outcome.ticket.engine] == 3.0


def test_a_near_tie_goes_to_the_least_served_per_unit_of_capacity() -> None:
    """Equal per-request speed, but big has 4 slots (twice the capacity): at 30 serves against small's 20 it has served
    less per unit of capacity and takes the request; at 50 it has not."""
    big, small = engine("big", seqs=4, decode=49.0), engine("small", seqs=2, decode=49.2)
    fleet = Fleet((big, small), recent_serves={"big": 30.0, "small": 20.0})
    assert decide(chat(), fleet, Policy(), now=0.0).engine == "big"
    fleet = Fleet((big, small), recent_serves={"big": 50.0, "small": 20.0})
    assert decide(chat(), fleet, Policy(), now=0.0).engine == "small"
    assert decide(chat(), fleet, Policy(near_tie_fraction=0.0), now=0.0).engine == "small"  # the soonest anyway


def test_a_slot_past_the_fraction_is_no_tie() -> None:
    """spark-b finishes 2% later than spark-a: a tie at 5%, not at 1%."""
    fleet = Fleet(FLEET[:2], recent_serves={"spark-a": 10.0})
    assert decide(chat(), fleet, Policy(), now=0.0).engine == "spark-b"
    assert decide(chat(), fleet, Policy(near_tie_fraction=0.005), now=0.0).engine == "spark-a"


def test_a_near_tie_never_takes_a_prefix_hit_away() -> None:
    """A short answer: the hit makes spark-a's finish far sooner than spark-b's cold prefill (no tie). A long one: spark-b
    would finish cold under 5% later, a near tie, and the engine holding the prompt keeps it though it served more (the
    hit spares the fleet a prefill as well)."""
    fleet = Fleet(FLEET[:2], recent_serves={"spark-a": 10.0})
    decision = decide(chat(prompt=4000), fleet, Policy(), now=0.0, cached={"spark-a": 3900})
    assert (decision.engine, decision.reason) == ("spark-a", Reason.PREFIX_CACHE)
    long_answer = chat(prompt=4000, max_tokens=5000)
    decision = decide(long_answer, fleet, Policy(default_expected_output_tokens=5000), now=0.0, cached={"spark-a": 3900})
    assert (decision.engine, decision.reason) == ("spark-a", Reason.PREFIX_CACHE)


def test_light_load_without_the_spread_leaves_the_slow_engines_idle() -> None:
    served = light_load(Policy(max_share_over_capacity=0.0))
    assert served["thor-a"] + served["thor-b"] == 0


@pytest.mark.parametrize("ratio", [1.2, 1.4, 2.0])
def test_the_spread_keeps_every_engine_within_its_bound(ratio: float) -> None:
    served = light_load(Policy(max_share_over_capacity=ratio, near_tie_fraction=0.0))
    # Each engine's part of the capacity: its 2 slots at its per-request decode rate (the anchors; no batch table).
    throughput = {"spark-a": 2 * 49.5, "spark-b": 2 * 49.0, "thor-a": 2 * 18.0, "thor-b": 2 * 18.0}
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
    decision = decide(chat(), fleet, SPREAD, now=0.0)
    assert (decision.verdict, decision.engine, decision.reason) == (Verdict.ADMIT, "spark-a", Reason.FINISH_SOONEST)


def test_a_request_goes_elsewhere_when_the_fastest_is_over_its_share() -> None:
    """spark-a has taken 80 of 102 (2.1x its part of the capacity): the next request goes to spark-b, which finishes a
    little later than spark-a would (reason ``fair_share``); with both sparks over a tight bound, to a thor."""
    fleet = Fleet(FLEET, recent_serves={"spark-a": 80.0, "spark-b": 20.0, "thor-a": 1.0, "thor-b": 1.0})
    decision = decide(chat(), fleet, SPREAD, now=0.0)
    assert (decision.verdict, decision.engine, decision.reason) == (Verdict.ADMIT, "spark-b", Reason.FAIR_SHARE)
    both = Fleet(FLEET, recent_serves={"spark-a": 50.0, "spark-b": 50.0, "thor-a": 1.0, "thor-b": 1.0})
    loose = Policy(max_share_over_capacity=1.4, near_tie_fraction=0.0)
    assert decide(chat(), both, loose, now=0.0).engine == "spark-a"  # 1.34x each
    tight = decide(chat(), both, Policy(max_share_over_capacity=1.2, near_tie_fraction=0.0), now=0.0)
    assert (tight.engine, tight.reason) == ("thor-a", Reason.FAIR_SHARE)
    assert decide(chat(), fleet, Policy(near_tie_fraction=0.0), now=0.0).engine == "spark-a"  # off by default


def test_a_cached_prefix_stays_on_an_engine_over_its_share() -> None:
    fleet = Fleet(FLEET, recent_serves={"spark-a": 80.0, "spark-b": 20.0, "thor-a": 1.0, "thor-b": 1.0})
    decision = decide(chat(prompt=2000), fleet, SPREAD, now=0.0, cached={"spark-a": 1900})
    assert (decision.verdict, decision.engine, decision.reason) == (Verdict.ADMIT, "spark-a", Reason.PREFIX_CACHE)


def test_requests_with_a_deadline_keep_the_band() -> None:
    """The band spreads deadline requests itself (weighted by recent serves); the spread is for finish-soonest."""
    fleet = Fleet(FLEET, recent_serves={"spark-a": 50.0, "spark-b": 50.0})
    decision = decide(chat(ttft_ms=20_000), fleet, SPREAD, now=0.0, pick=0.0)
    assert decision.reason is Reason.SATISFICING_BAND
