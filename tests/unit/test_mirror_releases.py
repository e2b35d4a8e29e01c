"""A replica's mirror against replies and events that arrive late and out of order. A ticket this replica has released
must not come back into its mirror (where it would hold a slot until the idle probe or its lease reaps it), whether a
refusal decided before the release lists it, or the admission's event arrives after the access log released it here."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from controlplane.core.model import Verdict
from controlplane.store.base import Claim, Reserved
from controlplane.store.memory import MemoryState, MemoryStore
from rig.waits import wait_until
from tests.unit.storeservice import REQUEST, answer, service


class HeldRefusals(MemoryStore):
    """A memory store whose ``reserve`` decides at once but answers a refusal only once ``answer_refusals`` is set (a
    reply held up on a busy connection); ``refused`` and ``answered`` count the refusals decided and answered."""

    def __init__(self, state: MemoryState, replica: str) -> None:
        super().__init__(state, replica)
        self.answer_refusals = asyncio.Event()
        self.refused = 0
        self.answered = 0

    async def reserve(self, claim: Claim) -> Reserved:
        reserved = await super().reserve(claim)
        if not reserved.ok:
            self.refused += 1
            await self.answer_refusals.wait()
            self.answered += 1
        return reserved


async def test_a_refusal_answered_after_this_replicas_own_release_does_not_bring_the_ticket_back() -> None:
    # Found by `sluice bench replicas` (a ticket reaped by the idle probe on one replica after a burst through 3): the
    # refusal lists the engine's tickets as the store held them when it decided; this replica's own release of one of
    # them is confirmed before that refusal is read. The mirror must not learn the released ticket again.
    state = MemoryState()
    store = HeldRefusals(state, "a")
    a = service(store, {"e": 2})
    other = MemoryStore(state, "b")
    await a.open_store()
    await other.open()
    a.start()
    try:
        first = await answer(a, "t1")
        assert first.ticket is not None
        pending = asyncio.create_task(a.check("x", REQUEST))  # decides on the mirror (one ticket: a slot is free)
        claim = Claim(a.mirror.shared.to_shared(replace(first.ticket, ticket_id="t2")), cap=2, kv_limit=None)
        assert (await other.reserve(claim)).ok  # another replica takes the last slot; a hears of it a turn later
        # x's reserve is refused (cap, listing t1 and t2); the answer is on its way
        await wait_until(lambda: store.refused == 1, what="x's reserve refused")
        a.release_ticket("t1")  # the access log: released here, and in the store at once
        await wait_until(lambda: "t1" not in state.tickets, what="t1 released in the store")
        store.answer_refusals.set()  # the refusal arrives; x is decided again
        await wait_until(lambda: store.answered == 1, what="the refusal answered")
        assert "t1" not in {t.ticket_id for t in a.core.tickets()}, "the mirror learned a ticket it had released"
        await other.release("t2")
        outcome = await asyncio.wait_for(pending, 1.0)
        if outcome.decision.verdict is Verdict.PARK:
            outcome = await asyncio.wait_for(a.wait_parked("x"), 1.0)
        assert outcome.ticket is not None
    finally:
        await a.stop()


async def test_an_access_log_entry_that_outruns_the_admission_event_leaves_no_ticket_behind() -> None:
    # Found by `sluice bench replicas` (after a closed loop through 2 replicas, each mirror held as many tickets as it had
    # counted `unknown_ticket` access-log entries, until the idle probe reaped them): the access log releases a ticket
    # of another replica on this one before this one has heard that the ticket was admitted.
    state = MemoryState()
    a, b = service(MemoryStore(state, "a"), {"e": 2}), service(MemoryStore(state, "b"), {"e": 2})
    for svc in (a, b):
        await svc.open_store()
        svc.start()
    try:
        admitted = await answer(b, "t")  # the memory store answers at once: a hears of it on the next turn
        assert admitted.ticket is not None
        a.release_ticket("t")  # the access log reached a first
        # Events reach every replica in the order they happened: once b heard of the release, a heard of the admission.
        await wait_until(lambda: "t" not in {t.ticket_id for t in b.core.tickets()}, what="b heard of the release")
        assert "t" not in state.tickets
        assert "t" not in {t.ticket_id for t in a.core.tickets()}, "a learned a ticket it had released"
        assert "t" not in {t.ticket_id for t in b.core.tickets()}
    finally:
        for svc in (a, b):
            await svc.stop()
