"""Reserved shares: slots of a model's fleet held back for a tenant while it has work, lent out while it has none. Pure.

A tenant's ``reserved_share`` (``tenants.NAME.reserved_share``, a fraction in [0, 1]) guarantees it that part of each
model's sequence slots. Per model, over the engines that serve it, are not drained, have a known cap (``max_num_seqs``,
configured or reported) and are not stale unless ``observe.on_stale: open``::

    slots          = sum of cap
    free           = sum of max(0, floor(cap - effective load))               (fit.effective_load)
    reserved(U)    = floor(reserved_share(U) x slots)
    owed(U)        = min(parked(U), max(0, reserved(U) - running(U)))
                                          if U holds work: its next request of the model parked (class order, then
                                          the class's order) fits some engine now and was not last decided to wait
                                          for a busy engine while a slot was free; parked(U): its requests parked
                   = 0                    otherwise: its slots are lent out
    T may take a slot  <=>  free - 1 >= sum of owed(U) over every U != T                       (``may_take``)

``running(U)`` is U's open tickets of the model admitted here. The rule is applied at every admission (an arrival, a
wake's head, a backfill): a request refused by it parks (``Reason.RESERVED_SHARE``), and no other rule changes. A wake
first serves owed tenants (``AdmissionCore._wake_reserved``): while a slot is free and some tenant is owed, the next
request of the owed tenants (highest class first, then the class's order) is decided, and admitted if ``decide`` admits
it (it passes the line: ``QueueRule.NONE``, as a backfill does); a tenant whose request ``decide`` does not admit holds
nothing for the rest of that wake. The rest of the wake then runs as without reservations.

Invariants. **Held**: while the owed tenants are owed ``H`` slots in all, any other tenant takes a free slot only if
more than ``H`` are free (``may_take``), and a wake gives the free slots to the owed tenants first (among themselves:
class order, then the class's order). **Work-conserving**: a tenant without parked work holds
nothing, and neither does one whose next request fits no engine (KV, a drained fleet): a free slot that the held
tenant could not use goes to whoever can. Lending is not revoked: a tenant coming back from idle gets its reserved
slots as the borrowers' requests finish (each release goes to it first), never by stopping a running request.

**Oversubscription.** The shares of all tenants must add up to at most 1: a config whose shares add up to more is
refused at load (and at reload) with the sum and each tenant's share. Scaling them down would silently turn every
guarantee into a smaller one that no operator wrote; with a sum of at most 1, ``floor`` keeps the reserved slots within
the fleet whatever its size (sum of floor(share x slots) <= floor(sum of shares x slots) <= slots). A share that rounds
to no slot on a small fleet reserves nothing there.

Classes: a reservation holds against every class (a guarantee that another tenant's critical request could take would
not be one); within the owed tenants' requests, critical before standard. With several replicas each replica applies
the rule to its own admissions (``running`` counts the tickets it admitted, ``free`` is the shared ledger's).
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
