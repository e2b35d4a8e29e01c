"""Two control-plane replicas' admission services on one store: the shared line moves without a round trip between
replicas (claims), a dead replica stops holding the line within a fraction of a second (liveness), a replica found dead
while alive comes back in line, and a replica that starts agrees with the others on which engines are warm.

Claims and the warm engines run on the memory store and on a real valkey-server; liveness on the real server (the
heartbeat thread and key expiry are the point); never a fake."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import redis

from controlplane.admission.service import AdmissionService
from controlplane.core.model import Ticket
from controlplane.store.base import Claim, QueueRule, Store
from controlplane.store.memory import MemoryState, MemoryStore
from controlplane.store.valkey import ValkeyStore
from controlplane.store.valkeyserver import ValkeyServer
from rig.waits import wait_until
from tests.unit.storeservice import REQUEST, answer, running

_prefixes = itertools.count()


@asynccontextmanager
async def backend(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Callable[[str], Store]]:
    """Handles on one shared store, one per replica id, of the ``kind`` named."""
    made: list[Store] = []
    if kind == "memory":
        state = MemoryState()

        def make(replica: str) -> Store:
            made.append(MemoryStore(state, replica))
            return made[-1]
    else:
        server: ValkeyServer = request.getfixturevalue("valkey")
        prefix = f"f{next(_prefixes)}"

        def make(replica: str) -> Store:
            made.append(ValkeyStore(server.url, replica, prefix=prefix))
            return made[-1]
    try:
        yield make
    finally:
        for store in made:
            await store.close()


def shared_ticket(tid: str, engine: str = "e") -> Ticket:
    now = time.time()
    return Ticket(tid, engine, "m", now, now + 600, 10, now + 1, 0.1)


async def tickets(store: Store) -> list[str]:
    return sorted(t.ticket_id for t, _ in (await store.load()).tickets)


async def in_line(svc: AdmissionService, request_id: str) -> bool:
    """Whether the service's member of ``request_id`` is in the store's line (its park landed)."""
    return request_id in await svc.replication.store.members("m", 1)


def store_calls(svc: AdmissionService, op: str) -> float:
    return svc.metrics.registry.get_sample_value("sluice_store_seconds_count", {"op": op}) or 0.0


@pytest.mark.parametrize("kind", ["memory", "valkey"])
async def test_requests_parked_for_the_line_on_both_replicas_go_in_the_step_that_frees_it(
        kind: str, request: pytest.FixtureRequest) -> None:
    async with backend(kind, request) as make:
        holder = make("r2")  # another replica holding the line's head
        await holder.open()
        await holder.park("m", 1, "head", time.time())
        async with running(make("r0"), {"e": 8}) as r0, running(make("r1"), {"e": 8}) as r1:
            checks = []
            for i in range(4):  # a slot is free for each: refused only for the line, each parks with a claim
                replica = (r0, r1)[i % 2]
                checks.append(asyncio.create_task(answer(replica, f"q{i}")))
                await wait_until(lambda: in_line(replica, f"q{i}"), what=f"q{i} in line")
            assert not any(c.done() for c in checks)
            assert await r0.replication.store.members("m", 1) == ["q0", "q2"]
            assert await r1.replication.store.members("m", 1) == ["q1", "q3"]
            r0.wake()  # any event wakes a replica: its wake leaves claims for every head it would admit
            r1.wake()
            await wait_until(lambda: store_calls(r0, "claim") == store_calls(r1, "claim") == 1,
                             what="both wakes' claims written")
            admitted = await holder.reserve(Claim(shared_ticket("head"), cap=8, kv_limit=None, queue=QueueRule.OLDEST))
            assert admitted.ok
            # The same store step admitted every claim behind the head, before either replica heard of it.
            assert await tickets(holder) == ["head", "q0", "q1", "q2", "q3"]
            answers = await asyncio.wait_for(asyncio.gather(*checks), 2.0)
            assert all(a.ticket is not None and a.decision.engine == "e" and a.parked_for > 0 for a in answers)
            for a in answers:
                assert a.ticket is not None
                (r0 if a.request_id in ("q0", "q2") else r1).release_ticket(a.ticket.ticket_id)
            await holder.release("head")

            async def none_open() -> bool:
                return await tickets(holder) == []

            await wait_until(none_open, what="every ticket released")


async def test_an_arrival_behind_its_replicas_requests_gone_on_their_claims_is_admitted_at_once() -> None:
    """The requests ahead of it in its replica's lot went on their claims in the store, their answers one event hop
    away: an arrival that the lot would park behind them is offered to the line as it is, and admitted, without a
    park (before, every arrival parked behind the lot as long as it was not empty, and the line stood)."""
    state = MemoryState()
    holder = MemoryStore(state, "r2")
    await holder.open()
    await holder.park("m", 1, "head", time.time())
    async with running(MemoryStore(state, "r0"), {"e": 8}) as svc:
        first = asyncio.create_task(answer(svc, "q0"))  # refused for the line: parks with its claim
        await wait_until(lambda: in_line(svc, "q0"), what="q0 in line")
        assert await svc.replication.store.members("m", 1) == ["q0"]
        assert (await holder.reserve(Claim(shared_ticket("head"), cap=8, kv_limit=None, queue=QueueRule.OLDEST))).ok
        assert svc.core.where("q0") is not None, "q0's answer is on its way (the CLAIMED event)"
        arrival = await svc.check("q1", REQUEST)  # in the same turn of the loop
        assert arrival.ticket is not None and arrival.parked_for == 0, arrival.decision
        assert sorted(state.tickets) == ["head", "q0", "q1"] and svc.core.where("q1") is None
        claimed = await asyncio.wait_for(first, 1.0)
        assert claimed.ticket is not None and claimed.parked_for > 0
        for outcome in (arrival, claimed):
            assert outcome.ticket is not None
            svc.release_ticket(outcome.ticket.ticket_id)
        await holder.release("head")
        await wait_until(lambda: not state.tickets and not any(state.lines.values()), what="nothing left in the store")


class SlowUnparks(MemoryStore):
    async def unpark(self, model: str, klass: int, request_id: str) -> bool:
        await asyncio.sleep(0.1)
        return await super().unpark(model, klass, request_id)


async def test_a_request_admitted_on_its_claim_after_its_client_left_gives_its_ticket_back() -> None:
    state = MemoryState()
    holder = MemoryStore(state, "r2")
    await holder.open()
    await holder.park("m", 1, "head", time.time())
    async with running(SlowUnparks(state, "r0"), {"e": 8}) as svc:
        check = asyncio.create_task(answer(svc, "x"))
        await wait_until(lambda: in_line(svc, "x"), what="x in line")
        assert await svc.replication.store.members("m", 1) == ["x"]
        check.cancel()  # the client leaves; its unpark is on its way
        await asyncio.gather(check, return_exceptions=True)
        assert (await holder.reserve(Claim(shared_ticket("head"), cap=8, kv_limit=None, queue=QueueRule.OLDEST))).ok
        assert sorted(state.tickets) == ["head", "x"], "the store admitted x on its claim before the unpark landed"
        await wait_until(lambda: sorted(state.tickets) == ["head"],
                         what="x's ticket released (nobody would ever use it)")
        assert not svc.core.tickets() or [t.ticket_id for t in svc.core.tickets()] == ["head"]


async def test_the_survivor_admits_within_half_a_second_of_a_replica_dying(valkey: ValkeyServer) -> None:
    prefix = f"f{next(_prefixes)}"
    victim = ValkeyStore(valkey.url, "victim", prefix=prefix)
    await victim.open()
    victim.start_liveness(0.05, 0.25, lambda: None)
    try:
        async with running(ValkeyStore(valkey.url, "survivor", prefix=prefix), {"e": 1}, max_park_s=30.0) as svc:
            first = await answer(svc, "a")
            assert first.ticket is not None
            for k in range(3):  # the victim's parked requests head the line; nobody will ask for them again
                await victim.park("m", 1, f"v{k}", time.time())
            parked = asyncio.create_task(answer(svc, "b"))
            await wait_until(lambda: in_line(svc, "b"), what="b in line behind the victim's requests")
            assert not parked.done()
            assert victim._liveness is not None
            victim._liveness.stopping.set()  # SIGKILL: the heartbeat stops, its key is left to lapse
            await asyncio.to_thread(victim._liveness.join)
            killed = time.monotonic()
            svc.release_ticket(first.ticket.ticket_id)  # the slot is free: only the dead members hold b
            woken = await asyncio.wait_for(parked, 3.0)
            took = time.monotonic() - killed
            assert woken.ticket is not None, woken.decision
            assert took < 0.8, f"admitted {took:.2f} s after the victim's death (target 0.5 s; before: up to 3 s)"
            assert await victim.members("m", 1) == []
    finally:
        await victim.close()


async def test_a_replica_found_dead_while_alive_puts_its_lot_back_in_line(valkey: ValkeyServer) -> None:
    prefix = f"f{next(_prefixes)}"
    other = ValkeyStore(valkey.url, "other", prefix=prefix)
    await other.open()
    store = ValkeyStore(valkey.url, "r0", prefix=prefix)
    try:
        async with running(store, {"e": 1}, max_park_s=30.0) as svc:
            first = await answer(svc, "a")
            assert first.ticket is not None
            x = asyncio.create_task(answer(svc, "x"))
            await wait_until(lambda: in_line(svc, "x"), what="x in line")
            y = asyncio.create_task(answer(svc, "y"))
            await wait_until(lambda: in_line(svc, "y"), what="y in line")
            assert await store.members("m", 1) == ["x", "y"]
            liveness = store._liveness
            assert liveness is not None
            liveness.stopping.set()  # its beats held up past the lapse ...
            await asyncio.to_thread(liveness.join)
            client = redis.Redis.from_url(valkey.url)
            client.delete(f"{prefix}:r:r0")
            client.close()
            assert await other.reap() == ["r0"]  # ... so the store takes its members out of the line
            assert await store.members("m", 1) == []
            store._liveness = None
            store.start_liveness(0.05, 0.25, liveness.on_lapsed)  # ... and its beats resume
            for _ in range(100):
                if await store.members("m", 1) == ["x", "y"]:
                    break
                await asyncio.sleep(0.02)
            assert await store.members("m", 1) == ["x", "y"], "its lot went back in line, in order"
            svc.release_ticket(first.ticket.ticket_id)
            admitted_x = await asyncio.wait_for(x, 2.0)
            assert admitted_x.ticket is not None and not y.done()
            svc.release_ticket(admitted_x.ticket.ticket_id)
            admitted_y = await asyncio.wait_for(y, 2.0)
            assert admitted_y.ticket is not None
            svc.release_ticket(admitted_y.ticket.ticket_id)
    finally:
        await other.close()


@pytest.mark.parametrize("kind", ["memory", "valkey"])
async def test_a_replica_that_starts_takes_the_engines_the_others_keep_warm(
        kind: str, request: pytest.FixtureRequest) -> None:
    """More than ``near_tie_max_engines`` (8) idle engines tie: the ones admitted to within ``near_tie_warm_seconds``
    take the request. A replica that starts (or restarts after a failover) learns them from the store, though their
    requests are over; without that it would take the first 8 by name (e0, e1, e10 ... e15), cold ones."""
    engines = {f"e{i}": 4 for i in range(20)}
    async with backend(kind, request) as make:
        other = make("r1")
        await other.open()
        for engine in ("e17", "e18", "e19"):
            t = shared_ticket(f"t-{engine}", engine)
            assert (await other.reserve(Claim(t, cap=4, kv_limit=None, serve_half_life_s=300.0))).ok
            await other.release(t.ticket_id)
        async with running(make("r0"), engines) as svc:
            chosen = set()
            for k in range(3):
                outcome = await answer(svc, f"q{k}")
                assert outcome.ticket is not None
                chosen.add(outcome.decision.engine)
                svc.release_ticket(outcome.ticket.ticket_id)
            assert chosen <= {"e17", "e18", "e19"}, chosen
