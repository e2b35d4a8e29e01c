"""How long a request is expected to wait, and the verdicts that send it away or make it wait. Pure.

Retry-After (a shed) is when the ledger expects the ``(queued_ahead + 1)``-th slot among the candidates to free: the
open tickets' expected frees (route.expected_frees) sorted, that entry's distance from now, clamped to
``[retry_after_min_s, retry_after_max_s]``; deeper than every open ticket, each extra round of slots costs a typical
request. ``expected_start`` goes further for a request in line (shed early, admission.py): after the tickets' expected
frees, each slot is taken again for one service per request ahead; a shed on it carries that wait as its Retry-After.
A ``sheddable`` request that would wait is shed ``saturated`` instead (``park_or_shed``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.core import adapters
from controlplane.core.engines import EngineView
from controlplane.core.fit import effective_load
from controlplane.core.fleet import EngineLedger, Fleet
from controlplane.core.model import Decision, InferenceRequest, Priority, Reason, Verdict
from controlplane.core.policy import Policy, meets_floor
from controlplane.core.request import RequestError
from controlplane.core.route import (
    NONE_NAMED, TINY, cached_tokens, decode_rate, decode_rate_known, expected_frees, expected_output_tokens,
    prefill_rate,
)


def refuse(error: RequestError) -> Decision:
    """A request refused before any engine was considered (malformed, or unknown to the fleet)."""
    return Decision(Verdict.REJECT, error.reason, detail=str(error))


def shed(reason: Reason, detail: str, retry_after_s: int) -> Decision:
    """A request the fleet cannot take now; the client may retry after ``retry_after_s``."""
    return Decision(Verdict.SHED, reason, retry_after_s=retry_after_s, detail=detail)


def park_or_shed(request: InferenceRequest, candidates: list[EngineView], fleet: Fleet, policy: Policy, now: float,
                 queued_ahead: int, reason: Reason, detail: str, park_limit: float | None = None,
                 idle_slot: bool = False, waits_for: str | None = None) -> Decision:
    """A request that must wait for a slot: parked, with a Retry-After for its client should it be shed later; a
    ``sheddable`` request is shed (``saturated``) instead of holding a place in the lot."""
    if request.priority is Priority.SHEDDABLE:
        return shed(Reason.SATURATED, f"fleet saturated for {request.model}: {detail}",
                    retry_after(candidates, fleet, policy, now, queued_ahead))
    return Decision(Verdict.PARK, reason, detail=detail, park_limit_s=park_limit, idle_slot=idle_slot,
                    waits_for=waits_for, retry_after_s=retry_after(candidates, fleet, policy, now, queued_ahead))


def deadline_text(request: InferenceRequest) -> str:
    """The deadline as a shed names it: "2000 ms", or "2000 ms less 200 ms of headroom" (for a woken head, what is
    left of it)."""
    if not request.ttft_headroom_ms:
        return f"{request.max_ttft_ms} ms"
    return f"{request.max_ttft_ms} ms less {request.ttft_headroom_ms} ms of headroom"


def clamp_retry_after(seconds: float, policy: Policy) -> int:
    """A Retry-After: ``seconds`` rounded up, clamped to ``[retry_after_min_s, retry_after_max_s]``."""
    if not math.isfinite(seconds):
        return policy.retry_after_max_s
    return int(min(policy.retry_after_max_s, max(policy.retry_after_min_s, math.ceil(seconds))))


def retry_after(candidates: list[EngineView], fleet: Fleet, policy: Policy, now: float, queued_ahead: int = 0) -> int:
    """Seconds until the ledger expects the ``(queued_ahead + 1)``-th slot among ``candidates`` to free, clamped."""
    ledgers = [(e.name, fleet.of(e.name)) for e in candidates]
    tickets = sum(len(ledger.expected_done) for _, ledger in ledgers)
    wait = 0.0
    if queued_ahead < tickets:
        wait = _kth_free(ledgers, fleet, now, queued_ahead + 1) - now
    elif tickets:  # deeper than every open ticket: each extra slot-round costs a typical request
        done = sorted(t for name, _ in ledgers for t in expected_frees(name, fleet, now))
        wait = done[-1] - now
        typical = (done[-1] - now) / len(done) if done[-1] > now else 0.0
        wait += (queued_ahead - len(done) + 1) * typical
    return clamp_retry_after(wait, policy)


def _kth_free(ledgers: list[tuple[str, EngineLedger]], fleet: Fleet, now: float, k: int) -> float:
    """The ``k``-th soonest expected free time among the engines' open tickets (``k`` <= their number). No ticket frees
    before its plain expected finish (``expected_frees`` only stretches it), so engines are visited by their soonest one
    and the walk stops at the first engine that cannot beat the ``k`` best found: a shed among 1000 engines estimates a
    few of them, not every ticket of every one."""
    order = sorted((max(now, ledger.expected_done[0]), name) for name, ledger in ledgers if ledger.expected_done)
    best: list[float] = []  # the k soonest so far, negated (a max-heap)
    for bound, name in order:
        if len(best) == k and bound >= -best[0]:
            break
        for t in expected_frees(name, fleet, now):
            if len(best) < k:
                heapq.heappush(best, -t)
            elif t < -best[0]:
                heapq.heapreplace(best, -t)
            else:
                break  # this engine's frees come soonest first
    return -best[0]


@dataclass(frozen=True, slots=True)
class StartEstimate:
    """When a parked (or parking) request is expected to start (``expected_start``)."""

    wait_s: float
    """Seconds from now until it starts; ``inf`` when no engine could serve it."""
    service_s: float
    """The candidates' service time for a request of its shape, as their slots free: total slots over slots freed per
    second (each engine's cap over its service); 0 when not asked for (``typical``) or unknown."""
    known: bool = True
    """Every engine the estimate looked at has a decode rate of its own (measured, or its configured anchor), not the
    policy's default: an estimate that rests on the default may be off by any factor."""


def expected_start(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, ahead: int,
                   typical: bool = False, cached: Mapping[str, int] | None = None) -> StartEstimate:
    """When ``request`` is expected to start if ``ahead`` requests take a slot of its model before it: the
    ``(ahead + 1)``-th slot to free among the engines that could serve it (serving the model, not drained, at its
    floor, fresh or failing open; with a TTFT deadline, able to prefill it in time; one without a known cap starts it
    now). A free slot frees now, a busy one when route.expected_frees says (load without a ticket: after one service);
    each slot is then held for one service of ``request``'s shape (its uncached prefill and expected output at the
    full-batch rate, as route.slot_wait prices a backlog) and frees again. Engines are visited by a lower bound of their
    first free and the walk stops at the first that cannot beat the best found. ``typical``: also estimate
    ``StartEstimate.service_s`` (else 0). ``StartEstimate.known``: the engines visited have decode rates of their own
    and no open ticket admitted before they had (``EngineLedger.guessed_tickets``)."""
    model = request.model
    assert model is not None
    floor = policy.floor_for(model, adapters.base_of(model, fleet, policy.adapters.base_models))
    engines = [e for e in fleet.engines if e.serves(model) and not e.drained and meets_floor(e.version, floor)]
    fresh = [e for e in engines if not e.stale]
    engines = fresh or (engines if fleet.admit_stale else [])
    deadline_s = request.planned_ttft_s()
    if deadline_s is not None:
        engines = [e for e in engines if request.prompt_tokens / prefill_rate(e, model, fleet, policy) <= deadline_s]
    if not engines:
        return StartEstimate(math.inf, 0.0, False)
    out = expected_output_tokens(request, fleet, policy)

    hits = cached or NONE_NAMED

    def service_of(e: EngineView) -> float:
        computed = request.prompt_tokens - cached_tokens(e.name, request, hits)
        return max(TINY, computed / prefill_rate(e, model, fleet, policy)
                   + out / decode_rate(e, e.cap or 1, fleet, policy))

    slots_total, per_s = 0, 0.0
    if typical:
        for e in engines:
            if e.cap is not None:
                slots_total, per_s = slots_total + e.cap, per_s + e.cap / service_of(e)
    service_s = slots_total / per_s if per_s > 0 else 0.0
    k = max(0, ahead) + 1
    order = []
    for e in engines:
        cap = e.cap
        if cap is None:
            return StartEstimate(0.0, service_s)
        load = math.ceil(effective_load(e, fleet))
        done = fleet.of(e.name).expected_done
        lower = max(now, done[0]) if load >= cap and done and load <= len(done) else now
        order.append((lower, e.name, e, cap, load))
    order.sort(key=lambda x: (x[0], x[1]))
    firsts: list[tuple[float, float]] = []  # (first free, service) of every slot visited
    best: list[float] = []  # the k soonest first frees so far, negated (a max-heap)
    known = True
    for lower, name, e, cap, load in order:
        if len(best) == k and lower >= -best[0]:
            break
        known = known and decode_rate_known(e, fleet) and not fleet.of(name).guessed_tickets
        service = service_of(e)
        frees = list(expected_frees(name, fleet, now))
        frees += [now + service] * max(0, load - len(frees))
        frees.sort()
        for t in [now] * max(0, cap - len(frees)) + frees[max(0, len(frees) - cap):]:
            firsts.append((t, service))
            if len(best) < k:
                heapq.heappush(best, -t)
            elif t < -best[0]:
                heapq.heapreplace(best, -t)
    waves = heapq.nsmallest(k, firsts)
    heapq.heapify(waves)
    for _ in range(k - 1):
        t, service = heapq.heappop(waves)
        heapq.heappush(waves, (t + service, service))
    return StartEstimate(max(0.0, waves[0][0] - now), service_s, known)
