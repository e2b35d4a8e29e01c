"""The ``Store`` contract's claims, liveness, shared serve counts and own admissions heard (controlplane/store/base.py),
run unchanged against both backends: the in-process memory store and a real valkey-server (never a fake).

Claims: an admission the store refused for the line alone stays with the request's member and is admitted by the
store itself, in line order, in the step that brings the member to the head (and only then, only while fresh, only if
it fits).
Liveness: a replica whose heartbeat lapsed is removed at once by ``reap``, its members and their claims with it."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.store.base import Claim, EventKind, QueueRule, Refusal, Store, StoreEvent
from tests.unit.sharedstore import BASE, Handles, ticket


def claim(tid: str, queue: QueueRule = QueueRule.ARRIVAL, cap: int | None = None, fresh_s: float = 5.0,
          klass: int = 1, engine: str = "thor", half_life_s: float = 0.0) -> Claim:
    return Claim(ticket(tid, engine=engine), cap=cap, kv_limit=None, queue=queue, klass=klass,
                 serve_half_life_s=half_life_s, fresh_s=fresh_s)


async def open_tickets(store: Store) -> list[str]:
    return sorted(t.ticket_id for t, _ in (await store.load()).tickets)


class Heard:
    """What one handle's ``listen`` hands on."""

    def __init__(self, store: Store) -> None:
        self.events: list[StoreEvent] = []
        self.connected = asyncio.Event()
        self.task = asyncio.create_task(store.listen(self.events.append, self.connected.set))

    async def __aenter__(self) -> Heard:
        await asyncio.wait_for(self.connected.wait(), 5)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def until(self, count: int) -> list[StoreEvent]:
        for _ in range(300):
            if len(self.events) >= count:
                break
            await asyncio.sleep(0.01)
        return self.events


async def test_an_arrival_refused_for_the_line_is_admitted_on_its_claim_when_it_heads_the_line(
        handles: Handles) -> None:
    a, b, c = await handles.get("a"), await handles.get("b"), await handles.get("c")
    async with Heard(b) as heard_b, Heard(c) as heard_c:
        await a.park("m", 1, "first", BASE + 1.0)
        refused = await b.reserve(claim("second"))
        assert refused.refusal is Refusal.QUEUED
        await b.park("m", 1, "second", BASE + 2.0, claim("second"))
        assert await open_tickets(c) == [], "its claim waits for the head"
        assert (await a.reserve(claim("first", QueueRule.OLDEST))).ok
        assert await open_tickets(c) == ["first", "second"], "admitted in the same step that made it the head"
        assert await b.members("m", 1) == []
        assert dict((t.ticket_id, owner) for t, owner in (await c.load()).tickets) == {"first": "a", "second": "b"}
        seen = [(e.kind, e.replica, e.ticket_id) for e in await heard_c.until(2)]
        assert seen == [(EventKind.ADMITTED, "a", "first"), (EventKind.CLAIMED, "b", "second")]
        mine = [(e.kind, e.replica, e.ticket_id) for e in await heard_b.until(2)]
        assert (EventKind.CLAIMED, "b", "second") in mine, "the replica holding the Check hears its own claim admitted"
        assert heard_c.events[1].ticket == ticket("second")


async def test_claims_go_in_line_order_critical_first_and_stop_at_a_head_without_one(handles: Handles) -> None:
    a, b, c = await handles.get("a"), await handles.get("b"), await handles.get("c")
    await a.park("m", 1, "p1", BASE)
    await b.park("m", 1, "p2", BASE, claim("p2"))
    await a.park("m", 1, "p3", BASE, claim("p3"))
    await c.park("m", 1, "p4", BASE)
    await b.park("m", 1, "p5", BASE, claim("p5"))
    await a.park("m", 0, "vip", BASE)  # a critical request parked: no standard claim goes before it
    assert (await a.reserve(claim("p1", QueueRule.NONE))).ok
    assert await open_tickets(c) == ["p1"], "a critical head without a claim holds the standard line"
    assert (await a.reserve(claim("vip", QueueRule.OLDEST, klass=0))).ok
    assert await open_tickets(c) == ["p1", "p2", "p3", "vip"], "then the claims at the head, in order, up to p4"
    assert await c.members("m", 1) == ["p4"] and await b.members("m", 1) == ["p5"]
    assert (await c.reserve(claim("p4", QueueRule.OLDEST))).ok
    assert await open_tickets(c) == ["p1", "p2", "p3", "p4", "p5", "vip"]


async def test_a_claim_that_does_not_fit_waits_at_the_head_and_a_stale_one_is_dropped(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    assert (await a.reserve(claim("holder", cap=1))).ok
    await b.park("m", 1, "x", BASE, claim("x", cap=1))
    assert await open_tickets(a) == ["holder"] and await b.members("m", 1) == ["x"], "the engine is full"
    await a.release("holder")
    assert await open_tickets(a) == ["x"], "the release that freed the slot admitted the head's claim"
    await b.park("m", 1, "y", BASE, claim("y", cap=1, fresh_s=0.1))
    await asyncio.sleep(0.3)
    await a.release("x")
    assert await open_tickets(a) == [] and await b.members("m", 1) == ["y"], "a stale claim waits for its replica"
    assert (await b.reserve(claim("y", QueueRule.OLDEST, cap=1))).ok


async def test_a_woken_head_refused_for_the_line_leaves_its_claim(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    await a.park("m", 1, "first", BASE)
    await b.park("m", 1, "second", BASE)
    await b.park("m", 1, "third", BASE)
    await a.park("m", 1, "last", BASE)
    assert (await b.reserve(claim("second", QueueRule.OLDEST))).refusal is Refusal.QUEUED
    assert (await b.reserve(claim("third", QueueRule.NEWEST))).refusal is Refusal.QUEUED
    assert (await a.reserve(claim("first", QueueRule.OLDEST))).ok
    assert await open_tickets(a) == ["first", "second"], "oldest-first refusals leave a claim, newest-first ones not"
    assert await b.members("m", 1) == ["third"]
    assert await b.unpark("m", 1, "third") is True and await a.unpark("m", 1, "last") is True


async def test_a_dead_replica_is_reaped_at_once_and_the_line_moves_on_behind_it(handles: Handles) -> None:
    a, b, c = await handles.get("a"), await handles.get("b"), await handles.get("c")
    await a.heartbeat(0.2)
    await a.park("m", 1, "orphan", BASE + 1.0)
    await a.park("m", 0, "orphan-vip", BASE + 1.0)
    await b.park("m", 1, "waiting", BASE + 2.0, claim("waiting"))
    async with Heard(c) as heard:
        assert await b.reap() == []
        assert await open_tickets(c) == []
        await asyncio.sleep(0.4)  # a's heartbeat lapses: a is dead
        assert await c.reap() == ["a"]
        assert await open_tickets(c) == ["waiting"], "the claim behind the dead replica's members went in the same step"
        assert await a.members("m", 1) == [] and await a.members("m", 0) == []
        seen = [(e.kind, e.replica) for e in await heard.until(2)]
        assert seen == [(EventKind.DEAD, "a"), (EventKind.CLAIMED, "b")]
        assert await c.reap() == [], "once"
    assert await b.park("m", 1, "orphan", BASE + 9.0) == BASE + 1.0, "asked again elsewhere: its first park time"
    assert await b.park("m", 1, "other", BASE + 9.0) == BASE + 9.0


async def test_a_line_meets_a_dead_replicas_member_and_removes_that_replica(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    await a.heartbeat(0.2)
    await a.park("m", 1, "orphan", BASE)
    await a.park("n", 1, "other-model", BASE)
    await asyncio.sleep(0.4)
    assert (await b.reserve(claim("new"))).ok, "the arrival finds no live member ahead"
    assert await a.members("n", 1) == [], "the whole replica went, not only the member met"


async def test_open_removes_members_a_former_process_of_the_same_id_left(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    await a.park("m", 1, "left-behind", BASE)
    await b.park("m", 1, "behind", BASE)
    await handles.new("a")  # the same replica id, restarted
    assert await b.members("m", 1) == ["behind"] and await a.members("m", 1) == []


async def test_load_returns_each_engines_shared_recent_serve_count(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    assert (await a.reserve(claim("x", half_life_s=100.0))).ok
    assert (await b.reserve(claim("y", half_life_s=100.0))).ok
    assert (await b.reserve(claim("z", engine="spark", half_life_s=100.0))).ok
    assert (await b.reserve(claim("uncounted", engine="gpu"))).ok
    await b.park("m", 1, "claimed", BASE)
    assert (await a.reserve(Claim(ticket("w"), cap=None, kv_limit=None, queue=QueueRule.OLDEST, klass=1,
                                  serve_half_life_s=100.0))).refusal is Refusal.QUEUED
    await b.release("x")  # a closed ticket's admission still counts
    serves = (await a.load()).serves
    assert set(serves) == {"thor", "spark"}
    count, at = serves["thor"]
    assert count == pytest.approx(2.0) and at == pytest.approx(BASE + 10.0)
    assert serves["spark"] == pytest.approx((1.0, BASE + 10.0))


async def test_an_expected_admission_is_answered_at_its_own_event_in_the_streams_order(handles: Handles) -> None:
    a, b = await handles.get("a"), await handles.get("b")
    order: list[str] = []
    await a.park("m", 1, "head", BASE)
    await b.park("m", 1, "woken", BASE)
    await a.park("m", 1, "claimed", BASE, claim("claimed"))
    connected = asyncio.Event()
    listener = asyncio.create_task(b.listen(lambda e: order.append(f"{e.kind.value} {e.ticket_id}"), connected.set))
    await asyncio.wait_for(connected.wait(), 5)
    b.expect_admission("refused", lambda: order.append("answered refused"))
    assert (await b.reserve(claim("refused", QueueRule.OLDEST, fresh_s=0))).refusal is Refusal.QUEUED
    b.admission_settled("refused", False)
    assert (await a.reserve(claim("head", QueueRule.OLDEST))).ok
    b.expect_admission("woken", lambda: order.append("answered woken"))
    assert (await b.reserve(claim("woken", QueueRule.OLDEST))).ok  # a's claim behind it goes in the same step
    b.admission_settled("woken", True)
    for _ in range(300):
        if "claimed claimed" in order:
            break
        await asyncio.sleep(0.01)
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    assert order == ["admitted head", "answered woken", "claimed claimed"], \
        "answered once, at its own event (which goes to no handler), before the next event"
    b.expect_admission("offline", lambda: order.append("answered offline"))
    b.admission_settled("offline", True)
    assert order[-1] == "answered offline", "not listening: answered when the reserve returns"
