"""Reserved shares: slots of a model's fleet held for a tenant while it has work, lent out while it has none (decision
0020). Pure. Per model, over its engines not drained, with a known cap, fresh (or stale under ``on_stale: open``)::

    slots        = sum of cap                 free = sum of max(0, floor(cap - effective load))
    reserved(U)  = floor(reserved_share(U) x slots)
    owed(U)      = min(parked(U), max(0, reserved(U) - running(U)))   while U's next parked request fits some engine
                   now and did not last decline a free slot; else 0 (its slots are lent out)
    T may take a slot  <=>  free - 1 >= sum of owed(U) over every U != T                          (``may_take``)

``running(U)``: U's open tickets of the model admitted by this replica. Every admission (arrival, wake, backfill) obeys
``may_take`` (refused: it parks ``reserved_share``), and a wake serves the owed tenants first. Invariants: a reservation
holds against every class; it is work-conserving (a tenant with nothing that fits holds nothing); lending is never
revoked (lent slots come back as borrowers finish); shares add up to at most 1 (a config over 1 is refused), so the
reserved slots fit any fleet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from controlplane.core.fit import effective_load
from controlplane.core.fleet import Fleet


def slots(fleet: Fleet, model: str) -> tuple[int, int]:
    """``(slots, free)`` of ``model``'s fleet: engines that serve it, are not drained, have a known cap and are not
    stale (unless the fleet admits stale engines)."""
    total = free = 0
    for engine in fleet.engines:
        cap = engine.cap
        if cap is None or engine.drained or not engine.serves(model) or (engine.stale and not fleet.admit_stale):
            continue
        total += cap
        free += max(0, math.floor(cap - effective_load(engine, fleet)))
    return total, free


def reserved_slots(share: float, total: int) -> int:
    """``floor(share x total)``: the slots a share guarantees on a fleet of ``total`` slots."""
    return math.floor(share * total + 1e-9)


def owed(shares: Mapping[str, float], total: int, running: Mapping[str, int],
         holding: Mapping[str, int]) -> dict[str, int]:
    """Slots held back for each tenant in ``holding`` (those with a fitting request parked -> how many they have
    parked): its reserved slots less those it runs, no more than it has parked, when positive. Tenants without a
    share, or not holding, are left out."""
    out = {}
    for tenant, parked in holding.items():
        share = shares.get(tenant, 0.0)
        if share <= 0:
            continue
        n = min(parked, reserved_slots(share, total) - running.get(tenant, 0))
        if n > 0:
            out[tenant] = n
    return out


def may_take(tenant: str, free: int, held: Mapping[str, int]) -> bool:
    """Whether a request of ``tenant`` may take one of ``free`` slots: what is left covers what is held for the others
    (``free - 1 >= sum of held[U] for U != tenant``)."""
    return free - 1 >= sum(n for t, n in held.items() if t != tenant)


def oversubscribed(shares: Mapping[str, float]) -> str | None:
    """Why a config's shares cannot all be honoured (they add up to more than the fleet), or None."""
    total = sum(shares.values())
    if total <= 1 + 1e-9:
        return None
    listed = ", ".join(f"{t} {s:g}" for t, s in sorted(shares.items()) if s > 0)
    return f"tenants' reserved_share add up to {total:g}, more than the whole fleet (1): {listed}"
