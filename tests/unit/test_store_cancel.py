"""A store call that swallows the cancellation of its task (redis-py can, when the cancellation arrives inside a call:
found by a service whose stop never returned) still ends the task: the admission service's store loops stop."""

from __future__ import annotations

import asyncio

from controlplane.core.model import Ticket
from controlplane.store.memory import MemoryState, MemoryStore
from tests.unit.storeservice import service


class SwallowsCancel(MemoryStore):
    """A store whose lease sweep takes long and, cancelled, returns as if nothing happened."""

    async def expire(self, now: float, limit: int = 256) -> list[Ticket]:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass
        return []


async def test_a_store_call_that_swallows_a_cancellation_still_ends_its_task() -> None:
    svc = service(SwallowsCancel(MemoryState(), "r0"), {"e": 1})
    await svc.open_store()
    svc.start()
    await asyncio.sleep(0.1)  # the store loop is inside the lease sweep
    await asyncio.wait_for(svc.stop(), 2.0)
