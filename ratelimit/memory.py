"""The in-process backend: the core's functions over dicts. For one control plane; replicas share a budget only
through the Valkey backend.

No method awaits anything, so on one event loop every charge and settle runs whole: 200 concurrent charges are 200
sequential ones. Expired state is dropped as time passes (each call sweeps what ``now`` has made stale: a heap of when
each meter, slot set and open charge may expire, re-checked when that time comes), so idle keys vanish here as they do in
Valkey by TTL. ``now`` must not go backwards: what a sweep dropped is gone for earlier times too.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ratelimit.core import (
    ChargeRequest, LimiterSettings, LimitKind, LimitState, MeterState, OpenCharge, Scope, SettleOutcome, Settlement,
    Verdict, check_actual_tokens, decide_charge, live, open_charge, peek_states, plan_charge, plan_scopes, settle_meter,
    verdict,
)
from ratelimit.port import ChargeIdInUse

_Item = tuple[str, str, str]
"""``("meter", key, kind)``, ``("slots", key, "")`` or ``("charge", id, "")``."""


class MemoryRateLimiter:
    def __init__(self, settings: LimiterSettings | None = None) -> None:
        self.settings = settings or LimiterSettings()
        self._meters: dict[tuple[str, str], MeterState] = {}
        self._slots: dict[str, dict[str, float]] = {}
        """key -> charge id -> lease deadline."""
        self._charges: dict[str, OpenCharge] = {}
        self._heap: list[tuple[float, _Item]] = []
        self._scheduled: dict[_Item, float] = {}
        """The earliest pending heap entry of each item."""

    # ---- the port ---------------------------------------------------------------------------------------------------

    async def charge(self, request: ChargeRequest, now: float) -> Verdict:
        self._sweep(now)
        if request.charge_id is not None and request.charge_id in self._charges:
            raise ChargeIdInUse(f"charge {request.charge_id!r} is still open")
        plan = plan_charge(request)
        states = [self._meter(m.key, m.kind, now) for m in plan.meters]
        held = [self._held(s.key, now) for s in plan.slot_sets]
        decision = decide_charge(plan, states, held, now)
        if decision.allowed:
            for meter, state in zip(plan.meters, decision.states, strict=True):
                self._set_meter(meter.key, meter.kind, state, now)
            record = open_charge(request, plan, decision, now, self.settings)
            if record is not None:
                self._charges[record.charge_id] = record
                self._schedule(("charge", record.charge_id, ""), record.lease_deadline)
                for key in record.slot_keys:
                    self._slots.setdefault(key, {})[record.charge_id] = record.lease_deadline
                    self._schedule(("slots", key, ""), record.lease_deadline)
        return verdict(request, plan, decision, now, self.settings)

    async def settle(self, charge_id: str, actual_tokens: int, now: float, *,
                     refund_request: bool = False) -> Settlement:
        check_actual_tokens(actual_tokens)
        self._sweep(now)
        record = self._charges.pop(charge_id, None)
        if record is None or record.lease_deadline <= now:
            return Settlement(SettleOutcome.NOT_OPEN)
        for meter in record.meters:
            after = settle_meter(meter, self._meter(meter.key, meter.kind, now), now, actual_tokens, refund_request)
            self._set_meter(meter.key, meter.kind, after, now)
        for key in record.slot_keys:
            slots = self._slots.get(key, {})
            slots.pop(charge_id, None)
            if not slots:
                self._slots.pop(key, None)
        return Settlement(SettleOutcome.SETTLED, record.tokens, actual_tokens)

    async def peek(self, scopes: Sequence[Scope], now: float) -> tuple[LimitState, ...]:
        self._sweep(now)
        plan = plan_scopes(scopes)
        return peek_states(scopes, [self._meter(m.key, m.kind, now) for m in plan.meters],
                           [self._held(s.key, now) for s in plan.slot_sets], now)

    async def close(self) -> None:
        pass

    # ---- what the tests look at -------------------------------------------------------------------------------------

    def stored_items(self, now: float) -> int:
        """Meters, slot sets and open charges still held after dropping what ``now`` made stale."""
        self._sweep(now)
        return len(self._meters) + len(self._slots) + len(self._charges)

    # ---- state ------------------------------------------------------------------------------------------------------

    def _meter(self, key: str, kind: LimitKind, now: float) -> MeterState | None:
        return live(self._meters.get((key, kind)), now)

    def _set_meter(self, key: str, kind: LimitKind, state: MeterState | None, now: float) -> None:
        if live(state, now) is None:
            self._meters.pop((key, kind), None)
            return
        assert state is not None
        self._meters[(key, kind)] = state
        self._schedule(("meter", key, kind), state.full_at)

    def _held(self, key: str, now: float) -> int:
        slots = self._slots.get(key)
        if not slots:
            return 0
        for charge_id in [c for c, deadline in slots.items() if deadline <= now]:
            del slots[charge_id]
        return len(slots)

    def _schedule(self, item: _Item, when: float) -> None:
        if when < self._scheduled.get(item, float("inf")):
            self._scheduled[item] = when
            heapq.heappush(self._heap, (when, item))

    def _expiry(self, item: _Item, now: float) -> float | None:
        """Drop ``item`` if ``now`` made it stale; else when it will be (``None``: gone already)."""
        what, name, kind = item
        if what == "meter":
            state = self._meters.get((name, kind))
            if state is not None and live(state, now) is None:
                del self._meters[(name, kind)]
                return None
            return state.full_at if state is not None else None
        if what == "slots":
            if name not in self._slots:
                return None
            if not self._held(name, now):
                del self._slots[name]
                return None
            return max(self._slots[name].values())
        record = self._charges.get(name)
        if record is not None and record.lease_deadline <= now:
            del self._charges[name]
            return None
        return record.lease_deadline if record is not None else None

    def _sweep(self, now: float) -> None:
        due: list[_Item] = []
        while self._heap and self._heap[0][0] <= now:
            when, item = heapq.heappop(self._heap)
            if self._scheduled.get(item) == when:
                del self._scheduled[item]
            due.append(item)
        # Scheduled after the loop: a meter whose rounded ``full_at`` is past but whose exact debt is not yet 0 would
        # otherwise be popped again and again.
        for item in due:
            later = self._expiry(item, now)
            if later is not None:
                self._schedule(item, later)
