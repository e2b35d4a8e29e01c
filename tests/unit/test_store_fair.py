"""Fair share in the store (decision 0025), on both backends: an admission's charge lands in its own atomic step, a
tenant parking with nothing parked is lifted, a ``FAIR`` admission passes only as the fair pick among every replica's
parked requests (a refusal carries the store's counters), a settle corrects the counter on any replica and a lapsed
lease's charge is dropped. Then the Lua scripts against the memory store on random operations: the same answers and the
same counters after every step (a real valkey-server, never a fake)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.core.fairshare import FairCounters
from controlplane.store.base import Claim, FairCharge, QueueRule, Refusal, Store
from controlplane.store.memory import MemoryState, MemoryStore
from controlplane.store.valkey import ValkeyStore
from controlplane.store.valkeyserver import ValkeyServer
from tests.unit.sharedstore import BASE, Handles, ticket

STANDARD = 1


def charge(tenant: str, cost: float) -> FairCharge:
    return FairCharge(tenant, cost, prompt_weight=1.0, output_weight=2.0, weight=1.0)


def fair(tid: str, tenant: str, cost: float, rule: QueueRule = QueueRule.FAIR, lease: float = 1000.0) -> Claim:
    return Claim(ticket(tid, lease=lease), cap=None, kv_limit=None, queue=rule, klass=STANDARD,
                 charge=charge(tenant, cost))


async def park(store: Store, rid: str, tenant: str, klass: int = STANDARD) -> None:
    await store.park("m", klass, rid, BASE + 1.0, tenant=tenant)


def standing(held: FairCounters) -> dict[str, tuple[float, float]]:
    return dict(held.counters)


async def test_the_store_charges_lifts_and_picks_by_tenant_across_replicas(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    await park(a, "a1", "x")
    await park(b, "b1", "y")
    assert (await a.reserve(fair("a1", "x", 300.0))).ok, "equal counters: the request parked first"
    assert standing(await b.counters("m")) == {"x": (300.0, 300.0)}, "charged in the admission's step"
    await park(a, "a2", "x")  # x is lifted to y's 0 (the backlogged minimum): never lowered
    refused = await a.reserve(fair("a2", "x", 300.0))
    assert refused.refusal is Refusal.QUEUED, "y's request, on another replica, is the fair pick"
    assert refused.counters == FairCounters("m", {"x": (300.0, 300.0)}, "x"), "the refusal carries the counters"
    assert (await b.reserve(fair("b1", "y", 100.0))).ok
    await park(b, "b2", "z")  # z, never served, parks while x is backlogged: lifted to x's 300, its own service 0
    assert standing(await a.counters("m"))["z"] == (300.0, 0.0)
    assert (await a.reserve(fair("a2", "x", 300.0))).refusal is Refusal.QUEUED, "tie on 300: z has served less"
    assert (await b.reserve(fair("b2", "z", 100.0))).ok
    assert (await a.reserve(fair("a2", "x", 300.0))).ok
    # a1 used 100 prompt + 50 output tokens: 200 priced, not the 300 estimated; settled through the other replica
    assert await b.settle("a1", 100, 50) == -100.0
    assert await a.settle("a1", 100, 50) is None, "settled once"
    assert standing(await a.counters("m")) == {"x": (500.0, 500.0), "y": (100.0, 100.0), "z": (400.0, 100.0)}
    # a lapsed lease's charge goes with it: the estimate stands
    assert (await a.reserve(fair("gone", "y", 50.0, QueueRule.NONE, lease=5.0))).ok
    assert [t.ticket_id for t in await b.expire(BASE + 6.0)] == ["gone"]
    assert await a.settle("gone", 1, 1) is None
    assert (await a.counters("m")).last == "y"


async def test_fair_pick_newest_first_higher_classes_and_leaving(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    for rid, tenant, store in (("y1", "y", a), ("x1", "x", a), ("x2", "x", b)):
        await park(store, rid, tenant)
    assert (await a.reserve(fair("x1", "x", 10.0, QueueRule.FAIR_NEWEST))).refusal is Refusal.QUEUED
    assert (await b.reserve(fair("x2", "x", 10.0, QueueRule.FAIR_NEWEST))).ok, "under LIFO: x's newest"
    await park(b, "c1", "y", klass=0)  # a critical request of y holds the standard class
    assert (await a.reserve(fair("y1", "y", 10.0))).refusal is Refusal.QUEUED
    assert await b.unpark("m", 0, "c1")
    assert await a.unpark("m", STANDARD, "x1")
    assert (await a.reserve(fair("y1", "y", 10.0))).ok
    # y left every line: parking again it is lifted to the counter of the tenant charged last (itself, 10)
    await park(a, "y2", "y")
    await park(a, "w1", "w")  # w, new, is lifted to y's 10 (the backlogged minimum), having served nothing
    assert standing(await b.counters("m")) == {"x": (10.0, 10.0), "y": (10.0, 10.0), "w": (10.0, 0.0)}
    assert (await b.reserve(Claim(ticket("w1"), None, None, queue=QueueRule.FAIR, klass=STANDARD))).refusal \
        is Refusal.QUEUED, "w1 is a's member, not b's: b may not admit it"
    assert (await a.reserve(fair("w1", "w", 10.0))).ok


async def test_a_lift_credit_leaves_a_returning_tenant_below_the_backlogged_minimum(handles: Handles) -> None:
    """x is backlogged at 900; y (served 100) comes back with a credit of 300: lifted to 600, not 900, so its next
    requests go ahead of x's until its counter passes x's; a credit larger than the gap never lowers a counter."""
    a, b = await handles.get("a"), await handles.get("b")
    await park(a, "x1", "x")
    assert (await a.reserve(fair("x1", "x", 900.0))).ok
    await park(a, "x2", "x")
    assert (await b.reserve(fair("y0", "y", 100.0, QueueRule.NONE))).ok  # admitted on arrival, never parked
    await b.park("m", STANDARD, "y1", BASE + 2.0, tenant="y", lift_credit=300.0)
    assert standing(await a.counters("m"))["y"] == (600.0, 100.0)
    assert (await a.reserve(fair("x2", "x", 900.0))).refusal is Refusal.QUEUED, "y, at 600, is the fair pick"
    assert (await b.reserve(fair("y1", "y", 200.0))).ok
    await b.park("m", STANDARD, "y2", BASE + 3.0, tenant="y", lift_credit=10_000.0)
    assert standing(await a.counters("m"))["y"] == (800.0, 300.0), "never lowered"


# -- the Lua scripts against the memory store -----------------------------------------------------------------------

_prefixes = itertools.count()
TENANTS = ["x", "y", "z", ""]
fair_ops = st.lists(st.one_of(
    st.tuples(st.just("park"), st.integers(0, 1), st.sampled_from(TENANTS), st.integers(0, 1),
              st.sampled_from([0.0, 150.0, 1 / 3])),
    st.tuples(st.just("reserve"), st.integers(0, 1), st.integers(0, 30), st.sampled_from([QueueRule.FAIR,
              QueueRule.FAIR_NEWEST, QueueRule.ARRIVAL, QueueRule.NONE]), st.sampled_from([100.0, 250.5, 1 / 3])),
    st.tuples(st.just("unpark"), st.integers(0, 30)),
    st.tuples(st.just("settle"), st.integers(0, 30), st.integers(0, 500), st.integers(0, 500)),
    st.tuples(st.just("release"), st.integers(0, 30)),
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(fair_ops)
@example([("park", 0, "y", 1, 0.0), ("park", 0, "x", 1, 0.0), ("park", 1, "x", 1, 0.0),
          ("reserve", 0, 1, QueueRule.FAIR_NEWEST, 1.0), ("reserve", 0, 2, QueueRule.FAIR_NEWEST, 1.0)])
@example([("park", 0, "x", 1, 0.0), ("reserve", 0, 0, QueueRule.FAIR, 100.0), ("park", 1, "y", 1, 150.0),
          ("park", 0, "x", 1, 0.0), ("park", 1, "", 1, 1 / 3), ("reserve", 1, 1, QueueRule.FAIR_NEWEST, 1 / 3),
          ("settle", 0, 7, 3), ("reserve", 0, 2, QueueRule.FAIR, 250.5), ("park", 0, "z", 0, 150.0),
          ("reserve", 1, 0, QueueRule.FAIR, 100.0)])
def test_valkey_decides_the_fair_line_as_the_memory_store_does(valkey: ValkeyServer, ops: list[tuple[Any, ...]]) -> None:
    async def run() -> None:
        prefix = f"fair{next(_prefixes)}"
        state = MemoryState()
        backends: list[list[Store]] = [[MemoryStore(state, r) for r in "ab"],
                                       [ValkeyStore(valkey.url, r, prefix=prefix) for r in "ab"]]
        for stores in backends:
            for store in stores:
                await store.open()
        parked: list[tuple[int, str, str, int]] = []  # (replica, request id, tenant, class), parking order
        admitted: list[str] = []
        try:
            for n, (kind, *args) in enumerate(ops):
                answers = [await _apply(stores, kind, args, n, parked, admitted) for stores in backends]
                assert answers[0] == answers[1], f"step {n} {kind} {args}"
                if kind == "park":
                    replica, tenant, klass, _ = args
                    parked.append((replica, f"r{n}", tenant, klass))
                elif kind == "reserve" and answers[0] and answers[0][0] is None:
                    admitted.append(answers[0][1])
                    parked[:] = [p for p in parked if p[1] != answers[0][1]]
                elif kind == "unpark" and parked and answers[0]:
                    del parked[args[0] % len(parked)]
                counters = [await stores[0].counters("m") for stores in backends]
                assert counters[0] == counters[1], f"after step {n} {kind} {args}"
        finally:
            for store in backends[1]:
                await store.close()
    asyncio.run(run())


async def _apply(stores: list[Store], kind: str, args: list[Any], n: int, parked: list[tuple[int, str, str, int]],
                 admitted: list[str]) -> Any:
    """One step on one backend; its answer, to compare."""
    if kind == "park":
        replica, tenant, klass, credit = args
        await stores[replica].park("m", klass, f"r{n}", BASE + n, tenant=tenant, lift_credit=credit)
        return None
    if kind == "reserve":
        replica, pick, rule, cost = args
        if not parked:
            return None
        owner, rid, tenant, klass = parked[pick % len(parked)]
        claim = Claim(ticket(rid), cap=None, kv_limit=None, queue=rule, klass=klass, charge=charge(tenant, cost))
        answer = await stores[owner if rule in (QueueRule.FAIR, QueueRule.FAIR_NEWEST) else replica].reserve(claim)
        return answer.refusal, rid, answer.counters
    if kind == "unpark":
        if not parked:
            return None
        owner, rid, _, klass = parked[args[0] % len(parked)]
        return await stores[owner].unpark("m", klass, rid)
    if not admitted:
        return None
    tid = admitted[args[0] % len(admitted)]
    if kind == "settle":
        return await stores[0].settle(tid, args[1], args[2])
    closed = await stores[1].release(tid)
    return None if closed is None else closed.ticket_id
