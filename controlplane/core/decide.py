"""The admission decision, pure: ``decide(request, fleet, policy, now, queued_ahead=0, affinity=None, pick=0.5, behind=0,
arriving=False, cached=None) -> Decision``. No I/O, no clock, no HTTP: a verdict, a reason and a detail (the edge,
``controlplane/edge.py``, maps each reason to a status and an OpenAI error). This module orchestrates; the parts live
beside it:

- request.py reads the request (``parse_request``; a malformed one never reaches ``decide``);
- fit.py holds the fit rules (``misfits``: cap, kv_watermark, kv_need, box_pool, quality_cap) and the load figures;
- route.py estimates TTFT and finish time per engine and chooses (finish-soonest, deadlines, the band, affinity);
- fleetindex.py keeps the per-model rows ``_indexed`` decides on without estimating every candidate;
- prefix.py says which engines probably hold the prompt's prefix in their cache (``cached``: engine -> tokens), which
  route.py's estimates subtract from prefill;
- explain.py answers what ``decide`` weighs without deciding (``explain``, ``earliest_fit``).

Refusals come first and cost nothing: unknown model (``unknown_model``), every engine serving it drained or stale
(``no_ready_engine``) or below its version floor (``version_floor``), prompt + max_tokens beyond every candidate's
``max_model_len`` (or KV budget) (``context_length_exceeded``).

Candidates: engines serving the model, at or above its version floor, fresh (or stale when ``on_stale: open`` and no fresh
one exists: ``stale_fail_open``). With a TTFT deadline, a request that even an idle engine cannot prefill in time is shed
(``ttft_unmeetable``); one that could start in time only after a slot frees parks (``ttft_deadline``) for at most as long as
the deadline leaves room for prefill (both with each engine's expected cache hit subtracted). With
``prefix_max_replicas`` R > 0, once R candidates hold the request's prefix (any expected hit), only they remain candidates;
with R = 0 the limit follows the prefix's load (``holders_limit``), and a request left with only busy holders waits for
them without holding the line for other prefixes (``Decision.idle_slot``).
Which fitting engine (or busy but faster one) gets the request is route.py's job.
Nothing fits and nothing is worth waiting for: ``sheddable`` requests are shed (``saturated``), others park (the reason is
the first blocking fit rule, or ``waiting_for_faster``). A request with parked requests ahead of it in its class or a higher
one parks behind them (FIFO, ``queued_behind``), unless they all wait for busy engines although a slot is free
(``Decision.idle_slot``; admission.py decides it as if first then).

Retry-After (shed) is when the ledger expects the ``(queued_ahead + 1)``-th slot among the candidates to free: open tickets'
expected finish times (``expected_done_at = admitted_at + finish`` as route.py estimates it, with the *expected* output length,
not max_tokens) sorted, that entry's distance from now, clamped to ``[retry_after_min_s, retry_after_max_s]``.
``expected_start`` goes further for a request in line, which admission.py sheds early on: after the tickets' expected
frees, each slot is taken again for one service per request ahead; a shed on it carries that wait as its Retry-After.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from controlplane.core import adapters
from controlplane.core.affinity import charged_finish
from controlplane.core.fit import context_tokens, effective_load, misfits, model_len, need_tokens
from controlplane.core.engines import EngineView, ServedModel
from controlplane.core.fleet import EngineLedger, Fleet
from controlplane.core.model import Decision, InferenceRequest, Priority, Reason, Verdict
from controlplane.core.policy import Policy, meets_floor
from controlplane.core.request import RequestError
from controlplane.core.route import (
    Estimate, cached_tokens, capacity_throughput, decode_rate, decode_rate_known, estimate, expected_frees,
    expected_output_tokens, over_share, prefill_rate, waits_too_long, weighted_pick,
)

_NONE_NAMED: Mapping[str, int] = MappingProxyType({})
"""``cached`` / ``waiting`` naming no engine."""
_TINY = 1e-12
"""A floor under a capacity divided by (an engine that measured no decode at all)."""


def refuse(error: RequestError) -> Decision:
    """A request refused before any engine was considered (malformed, or unknown to the fleet)."""
    return Decision(Verdict.REJECT, error.reason, detail=str(error))


def shed(reason: Reason, detail: str, retry_after_s: int) -> Decision:
    """A request the fleet cannot take now; the client may retry after ``retry_after_s``."""
    return Decision(Verdict.SHED, reason, retry_after_s=retry_after_s, detail=detail)


def clamp_retry_after(seconds: float, policy: Policy) -> int:
    """A Retry-After: ``seconds`` rounded up, clamped to ``[retry_after_min_s, retry_after_max_s]``."""
    if not math.isfinite(seconds):
        return policy.retry_after_max_s
    return int(min(policy.retry_after_max_s, max(policy.retry_after_min_s, math.ceil(seconds))))


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
    """When ``request`` is expected to start when ``ahead`` requests take a slot of its model before it (its place in
    line): the ``(ahead + 1)``-th slot to free among the engines that could serve it. A busy slot first frees when
    route.expected_frees says (the ``load - cap + 1``-th soonest of an engine's tickets opens its first slot; load the
    ledger holds no ticket for frees after one service), a free slot now; every slot is then held for one service of
    ``request``'s shape (prefill + expected output at the engine's full-batch rate, as route.slot_wait prices a
    backlog; its prefill only the prompt tokens that engine is expected to hold uncached, ``cached`` as ``decide``'s) by
    the request that takes it, and frees again. Engines: serving the model, not drained, at its version
    floor, fresh (or, failing open, stale ones); with a TTFT deadline, only those that could prefill the prompt within
    it. An engine without a known cap starts it now.

    Only the ``ahead + 1`` soonest first frees can matter, so engines are visited by a lower bound of their first free
    (now with a free slot, else their soonest plain expected finish) and the walk stops at the first that cannot beat
    the best found (as ``_kth_free``). ``typical``: also estimate every candidate's service, for
    ``StartEstimate.service_s`` (0 otherwise). ``StartEstimate.known`` says whether the engines visited have decode
    rates of their own and no open ticket admitted before they had (``EngineLedger.guessed_tickets``: its expected
    finish rests on the policy's default rate)."""
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

    hits = cached or _NONE_NAMED

    def service_of(e: EngineView) -> float:
        computed = request.prompt_tokens - cached_tokens(e.name, request, hits)
        return max(_TINY, computed / prefill_rate(e, model, fleet, policy)
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


def model_list(fleet: Fleet) -> tuple[ServedModel, ...]:
    """``GET /v1/models`` for the whole fleet: every model an admissible engine serves, once (the longest
    ``max_model_len`` any of them reports), sorted by id."""
    seen: dict[str, ServedModel] = {}
    for engine in fleet.engines:
        if engine.stale and not fleet.admit_stale:
            continue
        for m in engine.models:
            known = seen.setdefault(m.model_id, m)
            if m.max_model_len and (known.max_model_len or 0) < m.max_model_len:
                seen[m.model_id] = replace(known, max_model_len=m.max_model_len)
    return tuple(seen[model_id] for model_id in sorted(seen))


# -- the decision ---------------------------------------------------------------------------------------------------------
def decide(
    request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, queued_ahead: int = 0,
    affinity: str | None = None, pick: float = 0.5, behind: int = 0, arriving: bool = False,
    cached: Mapping[str, int] | None = None, waiting: Mapping[str, int] | None = None,
    displaced: Mapping[str, int] | None = None, prefix_share: float = 0.0,
) -> Decision:
    """Choose what happens to ``request`` (see the module docstring and route.py). ``queued_ahead``: parked requests of
    this model in this request's priority class or a higher one; ``affinity``: the engine the request's session used last;
    ``pick``: a uniform draw in [0, 1) for the satisficing band's weighted choice; ``behind``: parked requests of this
    model queued after this one (a woken head's backlog); ``cached``: prompt tokens each engine is expected to hold in
    its prefix cache (engines not named: none); ``waiting``: parked requests ahead of this one, passed over, that wait for
    each named engine (each takes one of its slots first); ``displaced``: prompt tokens of other prefixes each named
    engine would evict to cache this prompt, charged in the choice (affinity.py); ``prefix_share``: the request's
    prefix's share of recent arrivals (prefix.py), which bounds how many engines it may occupy (``holders_limit``)."""
    model = request.model
    if model is None:
        return Decision(Verdict.ANSWER, Reason.MODEL_LIST, models=model_list(fleet))
    cached = cached or _NONE_NAMED
    waiting = waiting or _NONE_NAMED
    displaced = displaced or _NONE_NAMED
    if fleet.index is not None:
        indexed = _indexed(request, fleet, policy, now, queued_ahead, affinity, pick, behind, arriving, cached, waiting,
                           displaced, prefix_share)
        if indexed is not None:
            return indexed
    base = adapters.base_of(model, fleet, policy.adapters.base_models)
    serving = [e for e in fleet.engines if e.serves(model) and not e.drained and (base is None or e.serves(base))]
    if not serving and any(e.serves(model) and (base is None or e.serves(base)) for e in fleet.engines):
        return shed(Reason.NO_READY_ENGINE, f"every engine serving {model} is drained", policy.retry_after_max_s)
    if not serving:
        return refuse(RequestError(Reason.UNKNOWN_MODEL, f"The model `{model}` does not exist."))
    floor = policy.floor_for(model, base)
    eligible = [e for e in serving if meets_floor(e.version, floor)]
    if not eligible:
        versions = ", ".join(f"{e.name}={e.version or 'unknown'}" for e in serving)
        return shed(Reason.VERSION_FLOOR, f"{model} needs engine version >= {floor}; engines serving it: {versions}",
                    policy.retry_after_max_s)
    fresh = [e for e in eligible if not e.stale]
    admitted_reason = Reason.FINISH_SOONEST
    if not fresh and fleet.admit_stale:
        # Fail-open (seed 004): an engine whose metrics went quiet may well be serving; admitting beats refusing.
        fresh, admitted_reason = eligible, Reason.STALE_FAIL_OPEN
    if not fresh:
        detail = f"no ready engine serves {model} ({', '.join(e.name for e in eligible)} stale)"
        return shed(Reason.NO_READY_ENGINE, detail, policy.retry_after_min_s)

    # The context must hold the prompt and any max_tokens the client set (context_tokens); the KV budget must hold the
    # reservation (need_tokens: the default output when none is set), or the request could never fit anywhere.
    need = context_tokens(request)
    candidates = [e for e in fresh if (model_len(e, model) or need) >= need]
    budgets = [e.kv_capacity_tokens * policy.kv_high_watermark for e in candidates if e.kv_capacity_tokens]
    if not candidates or (len(budgets) == len(candidates) and need_tokens(request, policy) > max(budgets)):
        limit = max((model_len(e, model) or 0 for e in fresh), default=0)
        message = (f"This model's maximum context length is {limit} tokens. However, you requested {need} tokens "
                   f"({request.prompt_tokens} in the messages, {need - request.prompt_tokens} in the completion).")
        return refuse(RequestError(Reason.CONTEXT_LENGTH, message))

    def hit(engine: EngineView) -> int:
        return cached_tokens(engine.name, request, cached)

    narrowed = False  # only the prefix's holders remain: waiting for them does not hold the line for other prefixes
    limit = holders_limit(policy, prefix_share, len(candidates))
    if limit and cached:
        holders = [e for e in candidates if hit(e) > 0]
        if len(holders) >= limit:
            narrowed = len(holders) < len(candidates)
            candidates = holders  # the prefix occupies as many engines as it may: it waits for one of them

    deadline_s = request.planned_ttft_s()
    park_limit: float | None = None
    if deadline_s is not None:
        # Prefill alone, on an idle engine: if even that misses the deadline, nothing can meet it. Waits are uncertain
        # (seed 002: a pessimistic estimate over-sheds), so a request that only needs a slot parks, for at most as long
        # as its deadline leaves room for prefill, and real releases decide.
        prefill_floor = min((request.prompt_tokens - hit(e)) / prefill_rate(e, model, fleet, policy)
                            for e in candidates)
        if prefill_floor > deadline_s:
            return shed(Reason.TTFT_UNMEETABLE,
                        f"no engine can prefill {request.prompt_tokens} tokens of {model} within "
                        f"{deadline_text(request)} (best {prefill_floor * 1000:.0f} ms on an idle engine)",
                        retry_after(candidates, fleet, policy, now))
        park_limit = deadline_s - prefill_floor
    if queued_ahead:
        return _wait(request, candidates, fleet, policy, now, queued_ahead, Reason.QUEUED_BEHIND,
                     f"{queued_ahead} parked ahead", park_limit)
    blocked = {e.name: misfits(e, request, fleet, policy) for e in candidates}
    # Engines that fit now, and engines only short of a slot (worth waiting for if they finish sooner).
    pressure = any(blocked.values())
    estimates = [estimate(e, request, not blocked[e.name], fleet, policy, now, pressure, behind, hit(e),
                          waiting.get(e.name, 0), displaced.get(e.name, 0))
                 for e in candidates if not blocked[e.name] or blocked[e.name] == (Reason.CAP,)]
    idle_slot = False  # with a deadline, a slot is free now (a PARK below: none it could start on meets the deadline)
    if deadline_s is not None and estimates:
        meeting = [x for x in estimates if x.ttft_s <= deadline_s]
        idle_slot = any(x.can_start for x in estimates)
        if not meeting:
            soonest_ttft = min(x.ttft_s for x in estimates)
            if idle_slot and all(x.ttft_s - x.slot_wait_s > deadline_s for x in estimates):
                # Even without any wait no engine meets it, and a slot is free now: parking would only idle that slot
                # until the park limit sheds the request anyway.
                return shed(Reason.TTFT_UNMEETABLE,
                            f"no engine can start {request.prompt_tokens} tokens of {model} within "
                            f"{deadline_text(request)} (best {soonest_ttft * 1000:.0f} ms)",
                            retry_after(candidates, fleet, policy, now))
            return _wait(request, candidates, fleet, policy, now, 0, Reason.TTFT_DEADLINE,
                         f"estimated TTFT {soonest_ttft * 1000:.0f} ms after waiting for a slot", park_limit,
                         idle_slot=idle_slot)
        estimates = meeting
        decode_floor = policy.model(model).decode_floor_tokens_per_s or 0.0
        band = [x for x in estimates if x.can_start and x.ttft_s <= deadline_s - policy.band_margin_ms / 1000
                and x.decode_rate >= decode_floor]
        if band:
            sticky = next((x for x in band if x.engine.name == affinity), None)
            if sticky is not None:
                return _admit(request, sticky, Reason.SESSION_AFFINITY, policy, now, fleet)
            longest = max(x.cached_tokens for x in band)
            if longest:  # the prompt where it is cached: good enough anyway, and its prefill costs nothing
                band = [x for x in band if x.cached_tokens == longest]
            least_swap = min(x.swap_s for x in band)
            band = [x for x in band if x.swap_s == least_swap]  # the adapter where it is loaded: no batch stalls
            throughput = {x.engine.name: capacity_throughput(x.engine, fleet, policy) for x in band}
            chosen = weighted_pick(band, fleet.recent_serves, pick, throughput,
                                   policy.band_ttft_grain_fraction * deadline_s)
            return _admit(request, chosen, Reason.SATISFICING_BAND, policy, now, fleet)
    set_aside = math.inf
    if deadline_s is None:
        estimates, set_aside = _spread(estimates, candidates, fleet, policy)
    free = [x for x in estimates if x.can_start]
    if not free:
        # Nothing can start now (or what could start misses the deadline while a busy engine would meet it).
        reasons = [r for name, rs in blocked.items() for r in rs]
        first = reasons[0] if reasons and not any(not rs for rs in blocked.values()) else Reason.WAITING_FOR_FASTER
        detail = "; ".join(f"{name}: {', '.join(r.value for r in rs) or 'misses the deadline'}"
                           for name, rs in blocked.items())
        return _wait(request, candidates, fleet, policy, now, 0, first, detail, park_limit,
                     idle_slot=idle_slot or narrowed,
                     waits_for=min(estimates, key=lambda x: x.finish_s).engine.name if narrowed and estimates else None)

    admitted = _finish_soonest(request, estimates, free, fleet, policy, now, affinity, admitted_reason, arriving,
                               set_aside)
    if admitted is not None:
        return admitted
    best = min(estimates, key=lambda x: _soonest(x, fleet))
    return _wait(request, candidates, fleet, policy, now, 0, Reason.WAITING_FOR_FASTER,
                 f"{best.engine.name} finishes in {best.finish_s:.1f} s after a {best.slot_wait_s:.1f} s wait",
                 park_limit, idle_slot=True, waits_for=best.engine.name)


def holders_limit(policy: Policy, prefix_share: float, candidates: int) -> int:
    """How many of ``candidates`` engines may hold a prefix before only its holders remain candidates (0: no limit):
    ``prefix_max_replicas`` when set, else ``ceil(share x candidates x prefix_load_headroom)``, at least 1, for a prefix
    whose share of recent arrivals is known."""
    if policy.prefix_max_replicas:
        return policy.prefix_max_replicas
    if prefix_share <= 0 or policy.prefix_load_headroom <= 0:
        return 0
    return max(1, math.ceil(prefix_share * candidates * policy.prefix_load_headroom - 1e-9))


def _soonest(x: Estimate, fleet: Fleet) -> tuple[float, float, float, str]:
    # The finish with prefix affinity's eviction charge (affinity.py). Equal estimates (no rates measured yet) fall back
    # to the lighter load, then more headroom, then the name.
    load = effective_load(x.engine, fleet)
    return (round(charged_finish(x), 6), load, load / x.engine.cap if x.engine.cap else load, x.engine.name)


def _spread(estimates: list[Estimate], candidates: list[EngineView], fleet: Fleet,
            policy: Policy) -> tuple[list[Estimate], float]:
    """The fair-share spread (route.py): ``estimates`` without the engines over their share that are not expected to hold
    part of the prompt, when an engine left can start now (else all of them: the spread never makes a request wait);
    and the soonest finish among the free slots set aside (inf: none), which names the reason ``fair_share``."""
    ratio = policy.max_share_over_capacity
    if not ratio or len(candidates) < 2:
        return estimates, math.inf
    serves = fleet.recent_serves
    throughput = {e.name: capacity_throughput(e, fleet, policy) for e in candidates}
    total_serves = sum(serves.get(e.name, 0.0) for e in candidates)
    total_throughput = sum(throughput.values())
    over = [x.cached_tokens == 0 and over_share(serves.get(x.engine.name, 0.0), throughput[x.engine.name],
                                                total_serves, total_throughput, ratio) for x in estimates]
    kept = [x for x, o in zip(estimates, over) if not o]
    if len(kept) == len(estimates) or not any(x.can_start for x in kept):
        return estimates, math.inf
    return kept, min((x.finish_s for x, o in zip(estimates, over) if o and x.can_start), default=math.inf)


def _near_tie(soonest: Estimate, pool: list[Estimate], fleet: Fleet, policy: Policy, now: float) -> Estimate:
    """Near ties (route.py): among ``pool``'s free slots finishing within ``near_tie_fraction`` of ``soonest`` (the
    soonest of them), the ones expected to hold the most of the prompt (a hit also spares the fleet a prefill), then of
    those the ones that need no LoRA adapter swap (a load stalls the engine's batch and evicts another adapter); of more
    than ``near_tie_max_engines`` of them, the warm ones (admitted to within ``near_tie_warm_seconds``), or, none being,
    the first ``near_tie_max_engines`` by name; then the fewest recent admissions per unit of capacity, then
    ``_soonest``'s order."""
    if policy.near_tie_fraction <= 0:
        return soonest
    limit = charged_finish(soonest) * (1 + policy.near_tie_fraction)
    tied = [x for x in pool if x.can_start and charged_finish(x) <= limit]
    if len(tied) < 2:
        return soonest
    longest = max(x.cached_tokens for x in tied)
    tied = [x for x in tied if x.cached_tokens == longest]
    least_swap = min(x.swap_s for x in tied)
    tied = [x for x in tied if x.swap_s == least_swap]
    if policy.near_tie_max_engines and len(tied) > policy.near_tie_max_engines:
        since = now - policy.near_tie_warm_seconds
        warm = [x for x in tied if fleet.last_served.get(x.engine.name, -math.inf) >= since]
        tied = warm or sorted(tied, key=lambda x: x.engine.name)[:policy.near_tie_max_engines]
    serves = fleet.recent_serves
    return min(tied, key=lambda x: (serves.get(x.engine.name, 0.0) / max(capacity_throughput(x.engine, fleet, policy),
                                                                          _TINY), _soonest(x, fleet)))


def _finish_soonest(request: InferenceRequest, estimates: list[Estimate], free: list[Estimate], fleet: Fleet,
                    policy: Policy, now: float, affinity: str | None, admitted_reason: Reason,
                    arriving: bool = False, set_aside: float = math.inf,
                    near_tie: str | None = None) -> Decision | None:
    """Without a deadline: the engine where the request finishes soonest (route.py), or None when that means waiting.

    Waiting for a busy faster engine while a slot is free needs: it finishes sooner (by the margin), the wait is bounded
    (``waits_too_long``), and, for a request just **arriving** (nothing parked ahead of it), that waiting also gives it its
    first token sooner: an arrival that finds a free slot is its own user's latency, and starting now beats finishing
    first, unless the free slot would evict other prompts to cache this one (affinity.py): its first token then counts
    its eviction charge too. A request already parked (a burst's backlog) keeps pure finish-soonest, which is what splits seed 000's bursts
    the way the best assignment does. ``set_aside``: the soonest finish of a free slot the fair-share spread set aside
    (``_spread``); a choice finishing later than that is reported ``fair_share``. ``near_tie``: the engine the fleet
    index chose among every free slot's near ties (``_soonest_indexed``); None: ``_near_tie`` chooses among ``free``."""
    def soonest(x: Estimate) -> tuple[float, float, float, str]:
        return _soonest(x, fleet)

    best = min(estimates, key=soonest)
    acceptable = [x for x in free if charged_finish(x) <= charged_finish(best) * (1 + policy.wait_for_faster_margin)]
    alternative = min(free, key=soonest) if free else None
    # The arrival's first token, with the free slot's eviction charge (affinity.py): a wait for the engine holding the
    # prompt is worth what the free slot would make the fleet prefill again.
    sooner_first_token = alternative is not None and best.ttft_s < alternative.ttft_s + alternative.displaced_s
    if not best.can_start and not acceptable and (waits_too_long(best, policy, alternative)
                                                  or (arriving and not sooner_first_token)):
        # Work conservation (route.py): the faster engine's wait is unbounded enough that a free slot is taken instead.
        acceptable = free
        if admitted_reason is Reason.FINISH_SOONEST:
            admitted_reason = Reason.WORK_CONSERVING
    sticky = next((x for x in acceptable if x.engine.name == affinity), None)
    if sticky is not None:
        return _admit(request, sticky, Reason.SESSION_AFFINITY, policy, now, fleet)
    if request.priority is Priority.SHEDDABLE and not acceptable:
        acceptable = free  # a sheddable request takes any free slot rather than being shed for want of a faster one
    if best.can_start or acceptable:
        # The soonest free slot either way (acceptable holds the free slots soonest first, up to a bound), or a near tie.
        chosen = next((x for x in free if x.engine.name == near_tie), None) if near_tie is not None else None
        if chosen is None:
            chosen = _near_tie(best if best.can_start else min(acceptable, key=soonest), free, fleet, policy, now)
        if admitted_reason is Reason.FINISH_SOONEST and chosen.finish_s > set_aside + 1e-6:
            admitted_reason = Reason.FAIR_SHARE
        return _admit(request, chosen, admitted_reason, policy, now, fleet)
    return None


def _indexed(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, queued_ahead: int,
             affinity: str | None, pick: float, behind: int, arriving: bool = False,
             cached: Mapping[str, int] = _NONE_NAMED,
             waiting: Mapping[str, int] = _NONE_NAMED,
             displaced: Mapping[str, int] = _NONE_NAMED, prefix_share: float = 0.0) -> Decision | None:
    """``decide`` on the fleet's index (fleetindex.py): the fit rules and the no-wait estimate of every candidate at once
    (numpy over the model's rows), then real ``Estimate`` objects only for the engines that can be chosen: the band (its
    weighted pick on a cumulative sum), or the soonest free slot, the busy engines whose no-wait lower bound could beat it,
    and the session's engine. Returns the same decision as the full scan below, or None when the full scan must decide
    (boxes, LoRA adapters, parked requests ahead, nothing fits now, an empty band, any refusal or shed). Expected cache
    hits become a vector over the rows (only the engines the prefix index named are touched), and so do prefix
    affinity's eviction charges (``displaced``)."""
    index = fleet.index
    model = request.model
    if index is None or queued_ahead or policy.boxes or index.policy is not policy or index.admit_stale != fleet.admit_stale:
        return None
    if model in fleet.adapters or model in policy.adapters.base_models:  # adapter slots and swaps: the full scan
        return None
    rows = index.models.get(model)
    if rows is None:
        return None
    # A Check pays per numpy call (a few us each at 1000 rows, mostly dispatch): the rows hold what is compared here in
    # the form it is compared in (fleetindex.ModelArrays), and array methods stand in for numpy's module functions.
    need = need_tokens(request, policy)
    candidate = rows.ok & (rows.model_len >= context_tokens(request))
    if not candidate.any():
        return None
    # Expected prefix-cache hits as a vector over the rows; None (no hit anywhere, the common case) spares every Check the
    # vector's arithmetic.
    hit: Any = None
    if cached:
        hit = np.zeros(len(rows.names))
        for engine in cached:
            at_row = rows.position.get(engine)
            if at_row is not None:
                hit[at_row] = cached_tokens(engine, request, cached)
        limit = holders_limit(policy, prefix_share, int(candidate.sum()))
        if limit:
            held = candidate & (hit > 0)
            if int(held.sum()) >= limit:
                candidate = held
    if need > float(rows.kv_limit.max(where=candidate, initial=-math.inf)):
        return None  # context_length_exceeded (every candidate's KV known and too small): the full scan words the refusal
    deadline_s = request.planned_ttft_s()
    prefill_s = (request.prompt_tokens if hit is None else request.prompt_tokens - hit) / rows.prefill
    if deadline_s is not None and float(prefill_s.min(where=candidate, initial=math.inf)) > deadline_s:
        return None  # ttft_unmeetable
    other = rows.blocked | (rows.held + need > rows.kv_limit)
    not_ready = rows.cap_block | other
    fits = candidate & ~not_ready
    if not fits.any():
        return None
    pressure = bool((candidate & not_ready).any())
    rate, per_token = (rows.d_press, rows.per_token_press) if pressure else (rows.d_free, rows.per_token_free)
    out = expected_output_tokens(request, fleet, policy)
    ttft = (prefill_s + per_token) * rows.ttft_scale  # route.estimate with no wait (0.0 + x is x)

    def exact(i: int, can_start: bool) -> Estimate:
        return estimate(rows.views[i], request, can_start, fleet, policy, now, pressure, behind,
                        0 if hit is None else int(hit[i]), waiting.get(rows.names[i], 0),
                        displaced.get(rows.names[i], 0))

    # Prefix affinity's charge (affinity.py) as a vector over the rows, as route.estimate computes it; None: no charge.
    charge: Any = None
    if displaced and policy.prefix_eviction_charge:
        charge = np.zeros(len(rows.names))
        for engine, tokens in displaced.items():
            at_row = rows.position.get(engine)
            if at_row is not None:
                charge[at_row] = policy.prefix_eviction_charge * tokens / rows.prefill[at_row]

    at = rows.position.get(affinity) if affinity is not None else None
    if deadline_s is not None:
        floor = policy.model(model).decode_floor_tokens_per_s or 0.0
        band = fits & (ttft <= deadline_s - policy.band_margin_ms / 1000)
        if floor:
            band &= rate >= floor
        if at is not None and band[at]:
            return _admit(request, exact(at, True), Reason.SESSION_AFFINITY, policy, now, fleet)
        members = band.nonzero()[0]
        if not len(members):
            # No band: finish-soonest among the engines that meet the deadline (busy ones filtered once estimated).
            busy = candidate & rows.cap_block & ~other
            return _soonest_indexed(request, rows, candidate, fits & (ttft <= deadline_s), busy, ttft + out / rate,
                                    prefill_s, out, exact, at, affinity, deadline_s, fleet, policy, now, hit, arriving,
                                    charge=charge)
        if hit is not None:
            longest = float(hit[members].max())
            if longest > 0:  # as the full scan: the band members expected to hold the longest prefix
                members = members[hit[members] == longest]
        serves = _recent_serves(rows, index, members)
        full = rows.full[members]
        largest = float(full.max())
        capacity = full / largest if largest > 0 else np.ones(len(members))
        quick, grain = ttft[members], policy.band_ttft_grain_fraction * deadline_s
        factor = (float(quick.min()) + grain) / (quick + grain)  # ttft_factor
        cumulative = (capacity / (1.0 + serves / capacity) * factor).cumsum()  # weighted_pick
        chosen = int(cumulative.searchsorted(pick * float(cumulative[-1]), side="right"))
        return _admit(request, exact(int(members[min(chosen, len(members) - 1)]), True), Reason.SATISFICING_BAND,
                      policy, now, fleet)
    finish = ttft + out / rate
    busy = candidate & rows.cap_block & ~other
    set_aside = math.inf
    ratio = policy.max_share_over_capacity
    if ratio and int(candidate.sum()) >= 2:
        # The fair-share spread, as _spread does it on the full scan.
        serves = _recent_serves(rows, index, slice(None))
        total_serves, total_throughput = float(serves[candidate].sum()), float(rows.full[candidate].sum())
        if total_throughput > 0:
            over = candidate & (serves >= 1.0 + ratio * total_serves * rows.full / total_throughput)
            if hit is not None:
                over &= hit == 0
            if over.any() and (fits & ~over).any():
                if (fits & over).any():
                    set_aside = float(finish[fits & over].min())
                fits, busy = fits & ~over, busy & ~over
    return _soonest_indexed(request, rows, candidate, fits, busy, finish, prefill_s, out, exact, at, affinity,
                            None, fleet, policy, now, hit, arriving, set_aside, charge)


def _soonest_indexed(request: InferenceRequest, rows: Any, candidate: Any, free: Any, busy: Any, finish: Any,
                     prefill_s: Any, out: float, exact: Any, at: int | None, affinity: str | None,
                     deadline_s: float | None, fleet: Fleet, policy: Policy, now: float, hit: Any,
                     arriving: bool = False, set_aside: float = math.inf, charge: Any = None) -> Decision | None:
    """Finish-soonest on the index: ``free`` rows can start now (with a deadline, those meeting it), ``busy`` rows are only
    short of a slot; None when no free row is left (the full scan parks or sheds). Waiting for a faster busy engine parks
    here, as the full scan would. ``charge``: prefix affinity's eviction charge per row (None: none), added to
    ``finish`` wherever rows are compared, as ``_soonest`` adds it."""
    if not free.any():
        return None
    if charge is not None:
        finish = finish + charge
    free_rows = free.nonzero()[0]
    best_free = _soonest_row(rows, free_rows, finish)
    estimates = [exact(best_free, True)]
    near_tie = rows.names[best_free] if policy.near_tie_fraction > 0 else None
    if policy.near_tie_fraction > 0 and len(free_rows) > 1:
        # Near ties (as _near_tie): the free rows finishing within the fraction of the soonest, the longest expected hit
        # first, of more than near_tie_max_engines the warm ones (else that many by name), then the fewest serves per
        # unit of capacity, then _soonest's order. Only the winner is estimated, and handed to _finish_soonest as the
        # near tie (its _near_tie would see only the few free slots estimated here, not every one the full scan weighs).
        near = free_rows[finish[free_rows] <= charged_finish(estimates[0]) * (1 + policy.near_tie_fraction)]
        if len(near) > 1:
            if hit is not None:
                near = near[hit[near] == hit[near].max()]
            most = policy.near_tie_max_engines
            if most and len(near) > most:
                warm = near[rows.served_at[near] >= now - policy.near_tie_warm_seconds]
                near = warm if len(warm) else near[np.argpartition(rows.name_rank[near], most - 1)[:most]]
            assert fleet.index is not None
            ratio = _recent_serves(rows, fleet.index, near) / np.maximum(rows.full[near], _TINY)
            tie = _soonest_row(rows, near[ratio == ratio.min()], finish)
            if tie != best_free:
                estimates.append(exact(tie, True))
                near_tie = rows.names[tie]
    if busy.any():
        # A busy engine runs the request at its full batch after its slot wait, which is at least until its soonest
        # ticket's expected finish (or one service when it has none): beyond the bound even so, it cannot win.
        bound = charged_finish(estimates[0]) + 1e-6
        decode_s = out / rows.d_press
        first_done = rows.first_done
        wait = np.where(np.isnan(first_done), prefill_s + decode_s, np.maximum(0.0, np.nan_to_num(first_done) - now))
        lower = wait + (prefill_s + rows.per_token_press) * rows.ttft_scale + decode_s
        if charge is not None:
            lower = lower + charge
        estimates += [x for x in (exact(int(i), False) for i in (busy & (lower <= bound)).nonzero()[0])
                      if deadline_s is None or x.ttft_s <= deadline_s]
    if at is not None and (free[at] or busy[at]) and all(x.engine.name != affinity for x in estimates):
        sticky = exact(at, bool(free[at]))
        if deadline_s is None or sticky.ttft_s <= deadline_s:
            estimates.append(sticky)
    admitted = _finish_soonest(request, estimates, [x for x in estimates if x.can_start], fleet, policy, now, affinity,
                               Reason.FINISH_SOONEST, arriving, set_aside, near_tie)
    if admitted is not None:
        return admitted
    best = min(estimates, key=lambda x: _soonest(x, fleet))
    park_limit = None
    if deadline_s is not None:
        park_limit = deadline_s - float(prefill_s[candidate].min())
    candidates = [rows.views[i] for i in candidate.nonzero()[0]]
    return _wait(request, candidates, fleet, policy, now, 0, Reason.WAITING_FOR_FASTER,
                 f"{best.engine.name} finishes in {best.finish_s:.1f} s after a {best.slot_wait_s:.1f} s wait",
                 park_limit, idle_slot=True, waits_for=best.engine.name)


def deadline_text(request: InferenceRequest) -> str:
    """The deadline as a shed names it: "2000 ms", or "2000 ms less 200 ms of headroom" (for a woken head, what is
    left of it)."""
    if not request.ttft_headroom_ms:
        return f"{request.max_ttft_ms} ms"
    return f"{request.max_ttft_ms} ms less {request.ttft_headroom_ms} ms of headroom"


def _recent_serves(rows: Any, index: Any, among: Any) -> Any:
    """The rows' recent serves decayed to the snapshot's time, as ``DecayedServes`` reads them one at a time
    (``ModelArrays.serve_log2``)."""
    return np.exp2(rows.serve_log2[among] - index.now / index.half_life_s)


def _soonest_row(rows: Any, among: Any, finish: Any) -> int:
    """The row of ``among`` (row numbers) first by _soonest's key: finish rounded to 1 us (Python's round, on the few
    distinct values near the minimum), then the lighter load, the more headroom, the name."""
    values = finish[among]
    near = (values <= float(values.min()) + 1e-6).nonzero()[0]
    if len(near) == 1:
        return int(among[near[0]])  # the common case: one row finishes soonest, no tie to break
    near_values = values[near]
    lowest = round(float(near_values.min()), 6)  # round is monotonic: the lowest rounded value is the minimum's
    if round(float(near_values.max()), 6) != lowest:
        rounded = {float(v): round(float(v), 6) for v in np.unique(near_values)}
        near = near[np.isin(near_values, [v for v, r in rounded.items() if r == lowest])]
    tied = among[near]
    load = rows.load[tied]
    cap = rows.cap[tied]
    headroom = np.where(np.isfinite(cap) & (cap > 0), load / np.where(np.isfinite(cap) & (cap > 0), cap, 1.0), load)
    return int(tied[np.lexsort((rows.name_rank[tied], headroom, load))[0]])


def _admit(request: InferenceRequest, chosen: Estimate, reason: Reason, policy: Policy, now: float,
           fleet: Fleet) -> Decision:
    hit = ""
    if chosen.cached_tokens:
        hit = f", {chosen.cached_tokens} prompt tokens expected cached"
        if reason in (Reason.FINISH_SOONEST, Reason.SATISFICING_BAND):
            reason = Reason.PREFIX_CACHE
    return Decision(
        Verdict.ADMIT, reason, engine=chosen.engine.name, reserved_tokens=need_tokens(request, policy),
        expected_done_at=now + chosen.finish_s, expected_ttft_s=chosen.ttft_s, cached_tokens=chosen.cached_tokens,
        decode_tokens_per_s=chosen.decode_rate, rates_measured=decode_rate_known(chosen.engine, fleet),
        swap_s=chosen.swap_s,
        detail=f"expected TTFT {chosen.ttft_s:.2f} s, finish {chosen.finish_s:.2f} s, load "
               f"{effective_load(chosen.engine, fleet):g}{hit}",
    )


def _wait(request: InferenceRequest, candidates: list[EngineView], fleet: Fleet, policy: Policy, now: float,
          queued_ahead: int, reason: Reason, detail: str, park_limit: float | None = None,
          idle_slot: bool = False, waits_for: str | None = None) -> Decision:
    if request.priority is Priority.SHEDDABLE:
        # Under saturation a sheddable request is shed at once rather than holding a place in the queue.
        return shed(Reason.SATURATED, f"fleet saturated for {request.model}: {detail}",
                    retry_after(candidates, fleet, policy, now, queued_ahead))
    return Decision(Verdict.PARK, reason, detail=detail, park_limit_s=park_limit, idle_slot=idle_slot,
                    waits_for=waits_for, retry_after_s=retry_after(candidates, fleet, policy, now, queued_ahead))
