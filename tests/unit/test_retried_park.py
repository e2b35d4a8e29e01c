"""A parked request whose replica went away, asked again of another replica (Envoy's ext_authz retry, resources.py
``_check_retry``): the survivor parks it at the back of its class, in its lot and in the shared line, the dead replica's
member of it leaves the line at once (it would otherwise head the line, alive to the store until its heartbeat lapses,
and every admission of the model would wait for it), and the request keeps the time it first parked: its
``x-sluice-parked-ms`` and its park deadline count from then.

The dead replica is its member in the line and nothing else (what a SIGKILL leaves: the heartbeat still current)."""

from __future__ import annotations

import asyncio
import time

from controlplane.store.memory import MemoryState, MemoryStore
from rig.waits import wait_until
from tests.unit.storeservice import answer, line, running


async def dead_replicas_member(state: MemoryState, request_id: str, parked_s_ago: float) -> None:
    """Replica ``dead`` parked ``request_id`` ``parked_s_ago`` seconds ago and was killed (its heartbeat is current)."""
    dead = MemoryStore(state, "dead")
    await dead.open()
    await dead.park("m", 1, request_id, time.time() - parked_s_ago)


async def test_a_retried_parked_request_waits_at_the_back_and_keeps_its_first_park_time() -> None:
    state = MemoryState()
    async with running(MemoryStore(state, "survivor"), {"e": 1}, max_park_s=30.0) as svc:
        first = await answer(svc, "first")
        assert first.ticket is not None
        await dead_replicas_member(state, "x", parked_s_ago=2.0)
        y = asyncio.create_task(answer(svc, "y"))  # arrives after x parked: behind it in the shared line
        await wait_until(lambda: line(state) == ["dead|x", "survivor|y"], what="y in line behind the dead replica's x")
        x = asyncio.create_task(answer(svc, "x"))  # x's Check, asked again of the survivor
        await wait_until(lambda: line(state) == ["survivor|y", "survivor|x"], what="x in line once, at the back")
        svc.release_ticket(first.ticket.ticket_id)
        woken = await asyncio.wait_for(y, 1.0)  # the dead member no longer heads the line
        assert woken.ticket is not None, woken.decision
        assert not x.done()
        svc.release_ticket(woken.ticket.ticket_id)
        retried = await asyncio.wait_for(x, 1.0)
        assert retried.ticket is not None, retried.decision
        assert 2.0 <= retried.parked_for < 3.0, "x-sluice-parked-ms counts from x's first park, on the dead replica"
        assert line(state) == [] and state.firsts.get(("m", 1), {}) == {}


async def test_a_retried_parked_request_is_shed_at_its_first_parks_deadline() -> None:
    state = MemoryState()
    async with running(MemoryStore(state, "survivor"), {"e": 1}, max_park_s=1.0) as svc:
        first = await answer(svc, "first")
        assert first.ticket is not None
        await dead_replicas_member(state, "x", parked_s_ago=0.8)
        started = time.monotonic()
        shed = await asyncio.wait_for(answer(svc, "x"), 2.0)
        assert shed.ticket is None and shed.decision.reason.value == "park_timeout", shed.decision
        assert time.monotonic() - started < 0.6, "its max_park_seconds counted from its first park"
        # Counted from its first park too: shed early, inside its decision window, once its expected start is past its
        # max_park_seconds (the slot is expected busy longer), at the latest at that deadline.
        assert 0.8 <= shed.parked_for < 1.3
        await wait_until(lambda: line(state) == [], what="x out of the line")
