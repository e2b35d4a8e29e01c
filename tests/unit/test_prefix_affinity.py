"""Capacity-aware prefix affinity (core/affinity.py): engines whose KV holds three 2,000-token system prompts at most. A
group stays on the engines holding it while they have a free slot, spreads once they are full, goes where a prompt
fits rather than over an engine that would evict, and two replicas holding the same index decide alike."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane.core.admission import AdmissionCore
from controlplane.core.affinity import displaced_blocks
from controlplane.core.choose import holders_suffice
from controlplane.core.decide import decide
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Verdict
from controlplane.core.policy import Policy
from controlplane.core.request import parse_request

P = Policy(default_max_tokens=20)
OFF = replace(P, prefix_eviction_charge=0.0)
KV = 6144
"""Tokens: 96 index blocks of 256 characters, three 31-block prompts (and 3 blocks of room left)."""


def view(name: str, *, prefill: float, decode: float, running: int = 0, seqs: int = 2) -> EngineView:
    return EngineView(name=name, url="", max_num_seqs=seqs, models=(ServedModel("cortex", 32_768),), version="0.10.1",
                      sample=EngineSample(0.0, running=running, waiting=0, kv_usage=0.0, kv_capacity_tokens=KV),
                      last_ok_at=0.0, stale=False, chip_class=name, anchor_prefill_tokens_per_s=prefill,
                      anchor_decode_tokens_per_s=decode)


def thor(name: str = "thor", running: int = 0) -> EngineView:
    """Slow: warm, a 20-token answer takes it ~1.33 s."""
    return view(name, prefill=1500.0, decode=16.0, running=running)


def spark(name: str = "spark", running: int = 0) -> EngineView:
    """Fast: cold (2,000 tokens at 4,000 tok/s) it still finishes in ~0.98 s, before a warm thor."""
    return view(name, prefill=4000.0, decode=44.0, running=running)


def system(group: str) -> str:
    return group[0] * 8000  # 2,000 tokens: 31 whole blocks of the rendered prompt


def ask(group: str, question: str = "q") -> InferenceRequest:
    body = ('{"model": "cortex", "max_tokens": 20, "messages": [{"role": "system", "content": "%s"}, '
            '{"role": "user", "content": "%s"}]}' % (system(group), question)).encode()
    return parse_request("POST", "/v1/chat/completions", body, {}, P)


def core_with(views: list[EngineView], policy: Policy = P, held: dict[str, list[str]] | None = None) -> AdmissionCore:
    """A core that knows ``views`` and whose index has each engine holding the named groups' prompts."""
    core = AdmissionCore(policy, Ledger(600))
    for v in views:
        core.note_cache_view(v)
    for engine, groups in (held or {}).items():
        for group in groups:
            core.prefixes.note(engine, ask(group).prefix_blocks)
    return core


def test_displaced_blocks_is_what_does_not_fit_beside_what_is_held() -> None:
    assert displaced_blocks(31, 0, 3) == 28
    assert displaced_blocks(31, 31, 0) == 0  # it holds the whole prompt
    assert displaced_blocks(31, 10, 40) == 0  # room for the rest
    assert displaced_blocks(31, 0, 0) == 31


@pytest.mark.parametrize(("policy", "where"), [(P, "thor"), (OFF, "spark")], ids=["affinity", "off"])
def test_a_group_stays_on_its_engine_while_it_has_a_free_slot(policy: Policy, where: str) -> None:
    """thor holds group a; spark's KV is full of three other groups. Cold, spark would finish first (0.98 s against
    thor's 1.33 s warm), but only by less than the 0.45 s it would take to prefill again the blocks it evicts: the
    request stays on thor. Without the affinity it goes to spark, evicting a group spark serves."""
    views = [thor(), spark()]
    core = core_with(views, policy, {"thor": ["a"], "spark": ["b", "c", "d"]})
    out = core.check("r1", ask("a"), core.fleet(views, 0.0), 0.0)
    assert out.decision.engine == where
    if where == "thor":
        assert set(core.expected_cached(ask("b"))) == {"spark"}  # spark still holds what it held


def test_a_faster_engine_that_wins_by_more_than_the_refill_takes_the_request() -> None:
    """A much slower holder (decode 5 tok/s: 4.2 s warm) loses to a cold spark even with the charge (1.43 s)."""
    views = [view("thor", prefill=1500.0, decode=5.0), spark()]
    core = core_with(views, P, {"thor": ["a"], "spark": ["b", "c", "d"]})
    assert core.check("r1", ask("a"), core.fleet(views, 0.0), 0.0).decision.engine == "spark"


def test_a_group_spreads_only_when_its_engines_are_full() -> None:
    """Requests of group a keep going to thor while thor has a free slot; the third, with thor's two slots taken, spills
    to spark (waiting for thor would exceed the work-conserving bound), and spark holds the group from then on."""
    views = [thor(), spark()]
    core = core_with(views, P, {"thor": ["a"], "spark": ["b", "c", "d"]})
    engines = []
    for i in range(3):
        out = core.check(f"r{i}", ask("a", f"q{i}"), core.fleet(views, 0.1 * i), 0.1 * i)
        assert out.decision.verdict is Verdict.ADMIT
        engines.append(out.decision.engine)
    assert engines == ["thor", "thor", "spark"]
    assert set(core.expected_cached(ask("a"))) == {"thor", "spark"}


@pytest.mark.parametrize(("policy", "where"), [(P, "spark-c"), (OFF, "spark-b")], ids=["affinity", "off"])
def test_a_spilled_group_goes_where_it_fits_not_over_an_engine_that_would_evict(policy: Policy, where: str) -> None:
    """thor holds group a and is full (waiting for it would take longer than a cold start elsewhere). spark-b's KV holds
    three other groups; spark-c holds one and has room for a. Equal engines, equal estimates: the affinity sends a to
    spark-c, where it fits, and spark-b keeps its groups. Without it the tie goes by name, to spark-b, which evicts one
    of them."""
    views = [thor(running=2), spark("spark-b"), spark("spark-c")]
    core = core_with(views, policy, {"thor": ["a"], "spark-b": ["b", "c", "d"], "spark-c": ["e"]})
    out = core.check("r1", ask("a"), core.fleet(views, 0.0), 0.0)
    assert out.decision.engine == where
    if where == "spark-c":
        assert all(core.expected_cached(ask(g)) == {"spark-b": 1984} for g in "bcd")


def test_a_prompt_nobody_holds_is_placed_as_without_the_affinity() -> None:
    """The charge is for recurring prefixes only: a new group goes where it finishes soonest, full engines or not."""
    views = [thor(), spark()]
    for policy in (P, OFF):
        core = core_with(views, policy, {"thor": ["b"], "spark": ["c", "d", "e"]})
        assert core.expected_displaced(ask("z")) == {}
        assert core.check("r", ask("z"), core.fleet(views, 0.0), 0.0).decision.engine == "spark"


def test_the_charge_never_admits_past_a_cap() -> None:
    """thor holds the group and both its slots are taken: however large the charge on spark, the request never goes to
    thor's full slots; it parks for thor or takes spark's free slot."""
    views = [thor(running=2), spark()]
    for charge in (1.0, 100.0):
        policy = replace(P, prefix_eviction_charge=charge)
        core = core_with(views, policy, {"thor": ["a"], "spark": ["b", "c", "d"]})
        decision = decide(ask("a"), core.fleet(views, 0.0), policy, 0.0, cached=core.expected_cached(ask("a")),
                          displaced=core.expected_displaced(ask("a")))
        assert decision.verdict is Verdict.PARK or decision.engine == "spark"


def test_two_replicas_sharing_the_index_decide_alike() -> None:
    """Replica one admits, replica two learns each admission from its store event (ticket and prompt blocks), and the
    other way round: their indexes hold the same prompts, so both expect the same hits and evictions and choose the
    same engine for every group."""
    views = [thor("thor-a"), thor("thor-b"), spark("spark-a"), spark("spark-b")]
    one, two = core_with(views), core_with(views)
    now = 0.0
    for i, group in enumerate("abcdefghabcdefgh"):
        now += 0.1
        deciding, learning = (one, two) if i % 2 == 0 else (two, one)
        request = ask(group, f"q{i}")
        out = deciding.check(f"r{i}", request, deciding.fleet(views, now), now)
        assert out.ticket is not None
        learning.learn(out.ticket, None, now, request.prefix_blocks)
        for core in (one, two):  # it ended before the next arrival, seen by both (the access log, a release event)
            core.release(out.ticket.ticket_id, now + 0.01)
        probe = ask(group, "next")
        assert one.expected_cached(probe) == two.expected_cached(probe)
        assert one.expected_displaced(probe) == two.expected_displaced(probe)
        first = decide(probe, one.fleet(views, now), P, now, cached=one.expected_cached(probe),
                       displaced=one.expected_displaced(probe))
        second = decide(probe, two.fleet(views, now), P, now, cached=two.expected_cached(probe),
                        displaced=two.expected_displaced(probe))
        assert (first.verdict, first.engine) == (second.verdict, second.engine)


@pytest.mark.parametrize(("policy", "parks"), [(P, True), (OFF, False)], ids=["affinity", "off"])
def test_an_arrival_waits_a_little_for_its_busy_engine_rather_than_evicting_a_group_elsewhere(policy: Policy,
                                                                                            parks: bool) -> None:
    """spark-a holds group a and is full, one short service (~0.4 s) from a free slot; spark-b is free, faster at
    prefill, and full of three other groups. Cold on spark-b the first token comes in ~0.27 s, but spark-b would evict
    a group worth ~0.22 s of prefill: the request waits for spark-a (its first token in ~0.41 s, within half a service
    plus the prefill and the charge it spares). Without the affinity it starts cold on spark-b."""
    views = [view("spark-a", prefill=4000.0, decode=50.0, running=2), view("spark-b", prefill=8000.0, decode=44.0)]
    core = core_with(views, policy, {"spark-a": ["a"], "spark-b": ["b", "c", "d"]})
    out = core.check("r1", ask("a"), core.fleet(views, 0.0), 0.0)
    if parks:
        assert out.decision.verdict is Verdict.PARK and out.decision.waits_for == "spark-a"
    else:
        assert out.decision.engine == "spark-b"


def test_holders_suffice_once_their_capacity_covers_the_prefix_share() -> None:
    """On four equal engines (capacity 1 each) a prefix may occupy ``ceil(share x 4 x headroom)`` of them; on unequal
    ones the holders' capacity must cover ``share x headroom`` of the total."""
    def enough(share: float, holders: int, room: bool = True, policy: Policy = P) -> bool:
        return holders_suffice(policy, share, holders, float(holders), 4.0, room)

    assert not enough(0.0, 1)  # share unknown: no limit
    assert not enough(1 / 8, 0)  # nobody holds it
    assert enough(1 / 32, 1) and enough(1 / 8, 1)  # an eighth of the traffic x headroom 2: one engine of four
    assert not enough(0.3, 2) and enough(0.3, 3)
    assert not enough(1.0, 4)  # every request carries it: never narrowed
    assert enough(1.0, 2, policy=replace(P, prefix_max_replicas=2))  # a fixed limit wins
    assert not enough(1 / 32, 1, policy=replace(P, prefix_load_headroom=0.0))
    # No candidate could cache it without evicting another prompt: its load alone, no headroom.
    assert enough(0.2, 1, room=False) and not enough(0.2, 1) and enough(0.2, 2)
    assert not enough(0.3, 1, room=False) and enough(0.3, 2, room=False) and enough(1.0, 4, room=False)
    # Unequal engines, 16 + 16 + 44 + 44 tokens/s: a slow holder carries an eighth of the traffic, not a sixth.
    assert holders_suffice(P, 1 / 8, 1, 16.0, 120.0, room=False)
    assert not holders_suffice(P, 1 / 6, 1, 16.0, 120.0, room=False)
    assert holders_suffice(P, 1 / 6, 1, 44.0, 120.0, room=False)
    # What every prefix the holders hold asks of them: a slow holder asked for a quarter of the arrivals is over its
    # 0.13 of the capacity x 1.25; a fast one (0.37) is not.
    demand = replace(P, prefix_demand_slack=1.25)
    assert not holders_suffice(demand, 1 / 8, 1, 16.0, 120.0, room=False, held_demand=0.25)
    assert holders_suffice(demand, 1 / 8, 1, 44.0, 120.0, room=False, held_demand=0.25)
    assert holders_suffice(P, 1 / 8, 1, 16.0, 120.0, room=False, held_demand=0.25)  # off by default


def test_demand_is_each_engines_share_of_the_arrivals_whose_prompt_it_holds() -> None:
    """Prompts a, b held by thor, c by thor and spark (split between them), d by nobody: of 44 arrivals, 11 each.
    Unknown below 32 arrivals; computed again after 16 more (it may lag the index by that many), and at once when an
    engine is forgotten. With ``prefix_demand_slack`` off (the default) it is not computed at all."""
    views = [thor(), spark()]
    held = {"thor": ["a", "b", "c"], "spark": ["c"]}
    core = core_with(views, replace(P, prefix_demand_slack=1.25), held)
    traffic(core, "abcd" * 7)
    assert core.prefix_demand() == {}
    traffic(core, "abcd" * 3)
    assert core.prefix_demand() == {}  # 12 arrivals since it was computed
    traffic(core, "abcd")
    demand = core.prefix_demand()
    assert demand["thor"] == pytest.approx(0.25 + 0.25 + 0.125) and demand["spark"] == pytest.approx(0.125)
    core.prefixes.forget("thor")
    assert set(core.prefix_demand()) == {"spark"} and core.prefix_demand()["spark"] == pytest.approx(0.25)
    off = core_with(views, P, held)
    traffic(off, "abcd" * 11)
    assert off.prefix_demand() == {}


def traffic(core: AdmissionCore, groups: str) -> None:
    """One arrival per group named: what the recent requests carried."""
    for group in groups:
        core.prefixes.arrived(ask(group).prefix_blocks)


def test_a_prefix_with_a_small_share_waits_for_its_busy_holder_without_holding_the_line() -> None:
    """thor holds group a and both its slots are taken; spark is free. Group a is one arrival in 37 of the recent
    traffic, so it stays on one engine: it parks for thor instead of prefilling on spark, and the park lets the line
    pass (a free slot it will not take): an arrival of another group takes spark at once."""
    views = [thor(running=2), spark()]
    core = core_with(views, P, {"thor": ["a"], "spark": ["b"]})
    traffic(core, "cdefghijklmnopqrst" * 2)
    assert core.prefix_share(ask("a")) == pytest.approx(0)  # only arrivals count; the index's notes do not
    out = core.check("r1", ask("a"), core.fleet(views, 0.0), 0.0)
    assert out.decision.verdict is Verdict.PARK and out.decision.idle_slot and out.decision.waits_for == "thor"
    other = core.check("r2", ask("z"), core.fleet(views, 0.01), 0.01)
    assert other.decision.verdict is Verdict.ADMIT and other.decision.engine == "spark"


def test_a_prefix_every_request_carries_spreads_over_the_free_engines() -> None:
    """The same fleet, but every recent admission carried group a's prompt (one system prompt for the whole traffic):
    its load needs every engine, so with thor full it takes spark's free slot."""
    views = [thor(running=2), spark()]
    core = core_with(views, P, {"thor": ["a"]})
    traffic(core, "a" * 40)
    out = core.check("r1", ask("a", "another"), core.fleet(views, 0.0), 0.0)
    assert out.decision.verdict is Verdict.ADMIT and out.decision.engine == "spark"


def test_a_burst_of_one_prefix_raises_its_share_and_spreads_it() -> None:
    """Shares count arrivals, not admissions: 20 requests of group a arriving after 36 of other groups make it a third
    of the traffic, which needs more than one engine of two, so with thor full it takes spark's free slot."""
    views = [thor(running=2), spark()]
    core = core_with(views, P, {"thor": ["a"], "spark": ["b"]})
    traffic(core, "cdefghijklmnopqrst" * 2 + "a" * 20)
    out = core.check("r1", ask("a"), core.fleet(views, 0.0), 0.0)
    assert out.decision.verdict is Verdict.ADMIT and out.decision.engine == "spark"


@pytest.mark.parametrize("slack", [1.25, 0.0], ids=["demand", "off"])
def test_a_slow_engine_holding_more_prefixes_than_it_serves_lets_one_spread(slack: float) -> None:
    """thor-a (0.13 of the capacity) holds groups a and b, 6 of 64 recent arrivals each, and both its slots are taken;
    every other engine would evict a group to cache a. Each group alone is within thor-a's capacity, so by its own
    share a waits for thor-a; by what thor-a is asked in all (0.19 > 1.25 x 0.13) it takes a free slot elsewhere. With
    ``prefix_demand_slack`` 0 (the default) it waits."""
    policy = replace(P, prefix_demand_slack=slack)
    views = [thor("thor-a", running=2), thor("thor-b"), spark("spark-a"), spark("spark-b")]
    core = core_with(views, policy, {"thor-a": ["a", "b"], "thor-b": ["d", "e", "f"], "spark-a": ["g", "h", "i"],
                                     "spark-b": ["j", "k", "l"]})
    traffic(core, "a" * 6 + "b" * 6 + ("defghijklmnopq" * 4)[:52])
    out = core.check("r1", ask("a", "another"), core.fleet(views, 0.0), 0.0)
    if slack:
        assert out.decision.verdict is Verdict.ADMIT and out.decision.engine != "thor-a"
    else:
        assert out.decision.verdict is Verdict.PARK and out.decision.waits_for == "thor-a"


@pytest.mark.parametrize(("spark_b", "arrivals", "spreads"), [("jkl", 6, False), ("j", 6, True), ("jkl", 10, True)],
                         ids=["kv-full", "room", "kv-full-beyond-thor"])
def test_under_kv_pressure_a_prefix_spreads_only_as_far_as_its_load_needs(spark_b: str, arrivals: int,
                                                                           spreads: bool) -> None:
    """Four engines whose KV holds three groups each; thor-a holds group a and both its slots are taken; a thor is
    about 0.13 of the fleet's capacity. Group a is about 0.12 of the recent arrivals (6 of 64, and this one): a second
    engine's worth with the headroom (0.12 x 2 > 0.13), within thor-a's capacity by load alone. Where every other engine would
    evict a group to cache it, it keeps to thor-a and waits (a copy beyond its load would cost another group its
    cache); where spark-b has room, it takes spark-b's free slot. At about 0.18 (10 of 64) its load alone is more than a
    thor carries: it takes a free slot elsewhere even at the cost of another group's cache."""
    views = [thor("thor-a", running=2), thor("thor-b"), spark("spark-a"), spark("spark-b")]
    core = core_with(views, P, {"thor-a": ["a", "b", "c"], "thor-b": ["d", "e", "f"], "spark-a": ["g", "h", "i"],
                                "spark-b": list(spark_b)})
    traffic(core, "a" * arrivals + ("defghijklmnopqrstuvwxyz" * 3)[:64 - arrivals])  # b and c not asked lately
    out = core.check("r1", ask("a", "another"), core.fleet(views, 0.0), 0.0)
    if spreads:
        assert out.decision.verdict is Verdict.ADMIT and out.decision.engine != "thor-a"
    else:
        assert out.decision.verdict is Verdict.PARK and out.decision.waits_for == "thor-a"
