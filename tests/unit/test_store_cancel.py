"""A store call that swallows the cancellation of its task (redis-py can, when the cancellation arrives inside a call:
found by a service whose stop never returned) still ends the task: the admission service's store loops stop."""

from __future__ import annotations

import asyncio

from controlplane.core.model import Ticket
from controlplane.store.memory import MemoryState, MemoryStore
from tests.unit.storeservice import service


class SwallowsCancel(MemoryStore):
    """A store whose lease sweep takes long and, cancelled, returns as if nothing happened; ``sweeping`` is set once a
    sweep has begun."""

    def __init__(self, state: MemoryState, replica: str) -> None:
        super().__init__(state, replica)
        self.sweeping = asyncio.Event()

    async def expire(self, now: float, limit: int = 256) -> list[Ticket]:
        self.sweeping.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass
        return []


async def test_a_store_call_that_swallows_a_cancellation_still_ends_its_task() -> None:
    store = SwallowsCancel(MemoryState(), "r0")
    svc = service(store, {"e": 1})
    await svc.open_store()
    svc.start()
    await asyncio.wait_for(store.sweeping.wait(), 5.0)  # the store loop is inside the lease sweep
    await asyncio.wait_for(svc.stop(), 2.0)
