"""Placement of LoRA adapters by their share of the traffic (core/adapterhomes.py): an adapter's requests keep to the
engines holding it once it has as many as its share needs, unless those are clearly worse; a load is charged the
adapter it evicts by that adapter's share; and, over random traffic, no engine holds open tickets of more adapters than
it has slots and every adapter that has traffic is served somewhere."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.adapterhomes import AdapterShares, homes, placed, plan, victim
from controlplane.core.adapters import AdapterPolicy
from controlplane.core.admission import AdmissionCore
from controlplane.core.decide import decide
from controlplane.core.engines import EngineSample
from controlplane.core.fleet import Fleet
from controlplane.core.ledger import Ledger
from controlplane.core.model import Verdict
from controlplane.core.policy import Policy
from controlplane.core.route import estimate
from tests.unit.test_adapters import ADAPTERS, BASE, ask, engine, fleet

P = Policy(default_max_tokens=100, adapters=AdapterPolicy(swap_s=0.5, load_headroom=1.5, home_margin=0.25))


def equal(*engines: Any) -> dict[str, float]:
    """Equal capacities."""
    return {e.name: 1.0 for e in engines}


def shared(f: Fleet, **shares: float) -> Fleet:
    return replace(f, adapter_shares=shares)


def loaded(name: str, running: int = 0, slots: int = 1) -> Any:
    """An engine of ``slots`` adapter slots with ``running`` base-model requests in flight."""
    return replace(engine(name, slots=slots), sample=EngineSample(0.0, running=running, waiting=0, kv_usage=0.0,
                                                                  kv_capacity_tokens=100_000))


def test_shares_are_unknown_until_enough_admissions_then_follow_the_window() -> None:
    book = AdapterShares(window=4, min_admissions=2)
    book.note("sql", BASE)
    assert book.shares() == {}
    book.note("chat", BASE)
    assert book.shares() == {"sql": 0.5, "chat": 0.5}
    for _ in range(3):
        book.note("chat", BASE)
    assert book.shares() == {"chat": 1.0}  # sql slid out of the last four
    book.note("other", "mistral")
    assert "other" not in book.shares()  # its base has one admission: unknown


@pytest.mark.parametrize(("share", "candidates", "headroom", "expected"), [
    (0.0, 4, 1.5, 1),     # no recent traffic: still one home
    (0.03, 4, 1.5, 1),    # a rare adapter
    (0.25, 4, 1.5, 2),    # a quarter of the traffic on four engines, with headroom: two
    (0.25, 4, 1.0, 1),
    (1.0, 4, 1.5, 6),     # more than the candidates: the narrowing never applies
    (0.5, 2, 1.0, 1),
], ids=["idle", "rare", "popular", "popular-no-headroom", "everything", "exact"])
def test_homes_follow_the_share(share: float, candidates: int, headroom: float, expected: int) -> None:
    assert homes(share, candidates, headroom) == expected


def test_a_rare_adapters_requests_keep_to_its_holder_unless_it_is_clearly_worse() -> None:
    """``sql`` has a tenth of the traffic (one home on two engines) and is loaded on ``warm``: its requests go there
    although ``cold`` is idle, until ``warm`` finishes later than 1.25 x ``cold`` with the load included."""
    warm, cold = loaded("warm", running=1), loaded("cold")
    f = shared(fleet(cold, warm, recent={"warm": ("sql",)}), sql=0.1, chat=0.9)
    xs = [estimate(e, ask("sql"), True, f, P, 0.0) for e in (cold, warm)]
    kept = placed("sql", xs, [cold, warm], f, 1.5, 0.25, f.adapters, equal(cold, warm))
    assert [x.engine.name for x in kept] == ["warm"]
    assert decide(ask("sql"), f, P, now=0.0).engine == "warm"
    swamped = shared(fleet(cold, replace(warm, sample=replace(warm.sample, running=4)), recent={"warm": ("sql",)}),
                     sql=0.1, chat=0.9)
    assert decide(ask("sql"), swamped, P, now=0.0).engine == "cold"  # every sequence slot taken: clearly worse


def test_a_popular_adapter_may_load_on_another_engine() -> None:
    """Half the traffic needs 1.5 engines of two: with one holder, the other engine may load it."""
    warm, cold = loaded("warm", running=1), loaded("cold")
    f = shared(fleet(cold, warm, recent={"warm": ("sql",)}), sql=0.5, chat=0.5)
    xs = [estimate(e, ask("sql"), True, f, P, 0.0) for e in (cold, warm)]
    kept = placed("sql", xs, [cold, warm], f, 1.5, 0.25, f.adapters, equal(cold, warm))
    assert sorted(x.engine.name for x in kept) == ["cold", "warm"]


@pytest.mark.parametrize(("victim_share", "held_elsewhere", "swaps"), [
    (0.01, False, 0.01 * 2 * 1.5),  # rare: share x candidates x headroom of a swap
    (0.4, False, 1.0),              # popular: a whole reload
    (0.3, True, 0.0),               # held on as many other engines as its share needs: nothing
], ids=["rare-victim", "popular-victim", "victim-held-elsewhere"])
def test_a_load_is_charged_the_adapter_it_evicts_by_that_adapters_share(victim_share: float, held_elsewhere: bool,
                                                                         swaps: float) -> None:
    """``full`` would evict ``chat``, charged by ``chat``'s share; ``sql`` carries enough traffic for both engines, so
    neither is narrowed away."""
    full = loaded("full")
    other = loaded("other")
    recent: dict[str, tuple[str, ...]] = {"full": ("chat",), "other": ("chat",) if held_elsewhere else ("legal",)}
    f = shared(fleet(full, other, recent=recent), chat=victim_share, legal=0.4 - victim_share, sql=0.6)
    assert victim(full, f, f.adapters) == "chat"
    x = estimate(full, ask("sql"), True, f, P, 0.0)
    xs = [x, estimate(other, ask("sql"), True, f, P, 0.0)]
    out = placed("sql", xs, [full, other], f, 1.5, 0.25, f.adapters, equal(full, other))
    assert out[0].engine.name == "full" and out[0].stall_s == pytest.approx(x.stall_s + 0.5 * swaps)


def test_without_shares_every_eviction_is_a_whole_swap_and_nothing_is_narrowed() -> None:
    full, free = loaded("full"), loaded("free")
    f = fleet(full, free, recent={"full": ("chat",), "free": ("sql",)})
    xs = [estimate(e, ask("chat"), True, f, P, 0.0) for e in (full, free)]
    out = placed("chat", xs, [full, free], f, 1.5, 0.25, f.adapters, {})
    assert len(out) == 2 and out[1].stall_s == xs[1].stall_s + 0.5
    off = placed("chat", xs, [full, free], shared(f, chat=0.1, sql=0.9), 0.0, 0.25, f.adapters, {})
    assert off[1].stall_s == xs[1].stall_s + 0.5


def test_the_plan_pins_popular_adapters_by_capacity_and_keeps_a_slot_per_engine_for_the_rest() -> None:
    """Six adapters, two engines of two slots (one twice the other's capacity): one slot each stays for the others.
    ``p`` (half the traffic) needs both engines and takes their pinned slots; each next one goes where the most capacity
    is left for its traffic; an adapter already held keeps its engine while that has room."""
    fast, slow = loaded("fast", slots=2), loaded("slow", slots=2)
    f = shared(fleet(fast, slow), p=0.5, q=0.3, r=0.1, s=0.05, t=0.03, u=0.02)
    capacity = {"fast": 2.0, "slow": 1.0}
    homes_of = {a: plan(a, [fast, slow], f, 1.5, capacity, f.adapters) for a in "pqrstu"}
    # Room left (fast, slow): 2/3, 1/3; p: 5/12, 1/12; q: 7/60, 1/12; r: 1/60, 1/12; s: 1/60, 1/30; t: 1/60, 1/300
    assert homes_of == {"p": ("fast", "slow"), "q": ("fast",), "r": ("fast",), "s": ("slow",), "t": ("slow",),
                        "u": ("fast",)}
    held = shared(fleet(fast, slow, recent={"slow": ("s",)}), p=0.5, q=0.3, r=0.1, s=0.05, t=0.03, u=0.02)
    assert plan("s", [fast, slow], held, 1.5, capacity, held.adapters) == ("slow",)


# -- properties --------------------------------------------------------------------------------------------------------
engines_st = st.lists(st.tuples(st.integers(1, 4), st.lists(st.sampled_from(ADAPTERS), max_size=4, unique=True),
                                st.integers(0, 3)), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(engines_st, st.dictionaries(st.sampled_from(ADAPTERS), st.floats(0.0, 1.0), min_size=1),
       st.sampled_from(ADAPTERS), st.floats(0.0, 3.0), st.floats(0.0, 1.0))
def test_placement_keeps_a_home_and_only_adds_eviction_charges(specs: list[tuple[int, list[str], int]],
                                                               shares: dict[str, float], adapter: str,
                                                               headroom: float, margin: float) -> None:
    views = [loaded(f"e{i}", running=running, slots=slots) for i, (slots, _, running) in enumerate(specs)]
    f = shared(fleet(*views, recent={f"e{i}": tuple(held) for i, (_, held, _) in enumerate(specs)}), **shares)
    xs = [estimate(e, ask(adapter), True, f, P, 0.0) for e in views]
    out = placed(adapter, xs, views, f, headroom, margin, f.adapters, equal(*views))
    assert out, "an adapter with candidates always keeps one"
    before = {x.engine.name: x for x in xs}
    for x in out:
        assert before[x.engine.name].stall_s <= x.stall_s <= before[x.engine.name].stall_s + x.swap_s + 1e-9
    if len(out) < len(xs):  # narrowed: to its planned homes, not clearly worse than the rest
        kept = {x.engine.name for x in out}
        planned = plan(adapter, views, f, headroom, equal(*views), f.adapters)
        assert kept == set(planned) and len(planned) == min(len(xs), homes(shares.get(adapter, 0.0), len(xs),
                                                                                headroom))
        dropped = [x.finish_s for x in xs if x.engine.name not in kept]
        assert min(x.finish_s for x in out) <= min(dropped) * (1 + margin) + 1e-9


ZIPF = [1.0 / k for k in range(1, len(ADAPTERS) + 1)]
op = st.one_of(st.tuples(st.just("submit"), st.integers(0, 1000)), st.tuples(st.just("release"), st.integers(0, 99)),
               st.tuples(st.just("tick"), st.floats(0.1, 5.0)))


@settings(max_examples=60, deadline=None)
@given(st.lists(op, min_size=40, max_size=120))
def test_with_shares_known_no_engine_outgrows_its_slots_and_every_adapter_is_served(ops: list[tuple[Any, ...]]) -> None:
    """Zipf-like traffic of four adapters on engines of 1 and 2 slots, shares known after four admissions: after every
    event each engine's open tickets use at most its slots' worth of adapters, and once every ticket is released every
    parked request is admitted (each adapter with traffic has a home)."""
    core = AdmissionCore(Policy(default_max_tokens=100, max_queue_depth=200, max_park_s=10_000,
                                adapters=AdapterPolicy(swap_s=0.5)), Ledger(lease_seconds=100_000))
    core.adapter_shares = AdapterShares(window=32, min_admissions=4)
    slots = {"a": 1, "b": 2, "c": 1}
    views = [engine(name, slots=n) for name, n in slots.items()]
    now, seq, open_tickets = 0.0, 0, []

    def invariant() -> None:
        for name, n in slots.items():
            assert len({t.model for t in core.tickets() if t.engine == name and t.model != BASE}) <= n

    def took(outcomes: Any) -> None:
        for o in outcomes:
            if o.ticket is not None:
                open_tickets.append(o.ticket.ticket_id)
            invariant()

    total = sum(ZIPF)
    for kind, arg in ops:
        if kind == "submit":
            seq += 1
            u, pick = (arg / 1000) * total, 0
            while pick < len(ZIPF) - 1 and u > ZIPF[pick]:
                u -= ZIPF[pick]
                pick += 1
            took([core.check(f"r{seq}", ask(ADAPTERS[pick]), core.fleet(views, now), now)])
        elif kind == "release" and open_tickets:
            core.release(open_tickets.pop(int(arg) % len(open_tickets)), now)
            took(core.wake(core.fleet(views, now), now))
        elif kind == "tick":
            now += float(arg)
        invariant()
    while open_tickets:
        core.release(open_tickets.pop(), now)
        took(core.wake(core.fleet(views, now), now))
    assert core.lot.depth() == 0
