"""A replica's mirror and the store's replies, which arrive late and out of order: a refusal lists the engine's tickets as
the store held them when it decided, so a ticket released since must not come back into the mirror (where it would hold
a slot until the idle probe or its lease reaps it)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from controlplane.core.model import Verdict
from controlplane.store.base import Claim, Reserved
from controlplane.store.memory import MemoryState, MemoryStore
from tests.unit.test_store_line_order import REQUEST, answer, service


class SlowRefusals(MemoryStore):
    """A memory store whose ``reserve`` decides at once but answers ``delay`` s later (as a reply on a busy connection)."""

    def __init__(self, state: MemoryState, replica: str, delay: float) -> None:
        super().__init__(state, replica)
        self.delay = delay

    async def reserve(self, claim: Claim) -> Reserved:
        reserved = await super().reserve(claim)
        await asyncio.sleep(self.delay)
        return reserved


async def test_a_refusal_answered_after_this_replicas_own_release_does_not_bring_the_ticket_back() -> None:
    # Found by `sluice bench replicas` (a ticket reaped by the idle probe on one replica after a burst through 3): the
    # refusal lists the engine's tickets as the store held them when it decided; this replica's own release of one of
    # them is confirmed before that refusal is read. The mirror must not learn the released ticket again.
    state = MemoryState()
    a = service(SlowRefusals(state, "a", 0.05), {"e": 2})
    other = MemoryStore(state, "b")
    await a.open_store()
    await other.open()
    a.start()
    try:
        first = await answer(a, "t1")
        assert first.ticket is not None
        pending = asyncio.create_task(a.check("x", REQUEST))  # decides on the mirror (one ticket: a slot is free)
        claim = Claim(a.shared.to_shared(replace(first.ticket, ticket_id="t2")), cap=2, kv_limit=None)
        assert (await other.reserve(claim)).ok  # another replica takes the last slot; a hears of it a turn later
        await asyncio.sleep(0.01)  # x's reserve was refused (cap, listing t1 and t2); the answer is on its way
        a.release_ticket("t1")  # the access log: released here, and in the store at once
        await asyncio.sleep(0.01)
        assert "t1" not in state.tickets
        await asyncio.sleep(0.1)  # the refusal arrives; x is decided again
        assert "t1" not in {t.ticket_id for t in a.core.tickets()}, "the mirror learned a ticket it had released"
        await other.release("t2")
        outcome = await asyncio.wait_for(pending, 1.0)
        if outcome.decision.verdict is Verdict.PARK:
            outcome = await asyncio.wait_for(a.wait_parked("x"), 1.0)
        assert outcome.ticket is not None
    finally:
        await a.stop()
