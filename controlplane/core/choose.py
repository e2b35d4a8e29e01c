"""Which engine among the candidates: finish-soonest, the satisficing band, near ties, session affinity. Pure.

``choose`` takes the candidates ``decide`` found (decide.py: serving, at the floor, fresh, the context fits, narrowed
to the prefix's holders) and applies the fit rules (fit.py) and the estimates (route.py, whose docstring holds the
formulas). With a TTFT deadline: the band's weighted pick, else park (``ttft_deadline``) or shed (``ttft_unmeetable``)
when no engine meets it. Without: the soonest charged finish (affinity.charged_finish), a near tie, or a park for a
busy faster engine within work conservation's bound (``waiting_for_faster``). A LoRA adapter's estimates are first
charged its evictions and kept to its homes (adapterhomes.py). Nothing fits: park on the first blocking fit rule (a
``sheddable`` request is shed ``saturated``). The fleet index (indexed.py) reuses ``finish_soonest`` and ``admit`` so
that both paths decide alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.core import adapters
from controlplane.core.adapterhomes import placed
from controlplane.core.affinity import charged_finish
from controlplane.core.engines import EngineView
from controlplane.core.fit import effective_load, misfits, need_tokens
from controlplane.core.fleet import Fleet
from controlplane.core.model import Decision, InferenceRequest, Priority, Reason, Verdict
from controlplane.core.policy import Policy
from controlplane.core.route import (
    TINY, Estimate, cached_tokens, capacity_throughput, decode_rate_known, estimate, over_share, waits_too_long,
    weighted_pick,
)
from controlplane.core.waits import deadline_text, park_or_shed, retry_after, shed


@dataclass(frozen=True, slots=True)
class Candidates:
    """The engines a request may run on (``decide``'s filtering) and what the filtering found."""

    engines: list[EngineView]
    park_limit: float | None
    """With a TTFT deadline: the longest the request may wait and still prefill in time on the fastest candidate."""
    narrowed: bool
    """Only the prefix's holders remain (``holders_suffice``): waiting for them does not hold the line for others."""
    reason: Reason
    """An admission's reason: ``finish_soonest``, or ``stale_fail_open`` when only stale engines serve the model."""


def holders_suffice(policy: Policy, prefix_share: float, holders: int, held_capacity: float, total_capacity: float,
                    room: bool = True, held_demand: float = 0.0) -> bool:
    """Whether the ``holders`` candidates holding a prefix are as many as it may occupy, so that only they remain
    candidates: ``prefix_max_replicas`` of them when set; else, for a prefix whose share of recent arrivals is known,
    holders whose capacity (``held_capacity``, their ``route.capacity_throughput``) covers ``share x headroom`` of the
    candidates' (``total_capacity``), at least one holder. ``headroom`` is ``prefix_load_headroom`` while ``room`` (some
    candidate that does not hold the prefix could cache it without evicting another prompt), else at most 1: under KV
    pressure a prefix spreads only as far as its load needs, since each copy beyond that evicts another prefix; and a
    prefix held by a slow engine whose capacity falls short of its load gets another one (decision 0016). On equal
    engines this is ``holders >= ceil(share x candidates x headroom)``. And with ``prefix_demand_slack`` > 0, only
    while the holders are not asked for more than that many times their part of the capacity: ``held_demand``, their
    ``PrefixIndex.demand`` summed (every prefix they hold, not only this one), at most ``slack x held_capacity /
    total_capacity``."""
    if holders <= 0:
        return False
    if policy.prefix_max_replicas:
        return holders >= policy.prefix_max_replicas
    if prefix_share <= 0 or policy.prefix_load_headroom <= 0 or total_capacity <= 0:
        return False
    headroom = policy.prefix_load_headroom if room else min(1.0, policy.prefix_load_headroom)
    if policy.prefix_demand_slack > 0 and held_demand > policy.prefix_demand_slack * held_capacity / total_capacity:
        return False
    return held_capacity >= total_capacity * (prefix_share * headroom - 1e-9)


def choose(request: InferenceRequest, found: Candidates, fleet: Fleet, policy: Policy, now: float,
           affinity: str | None, pick: float, behind: int, arriving: bool, cached: Mapping[str, int],
           waiting: Mapping[str, int], displaced: Mapping[str, int]) -> Decision:
    """What happens to ``request`` among ``found`` (the module docstring; ``decide`` names the arguments)."""
    model = request.model
    assert model is not None
    candidates, park_limit, narrowed, admitted_reason = found.engines, found.park_limit, found.narrowed, found.reason
    deadline_s = request.planned_ttft_s()

    def hit(engine: EngineView) -> int:
        return cached_tokens(engine.name, request, cached)

    blocked = {e.name: misfits(e, request, fleet, policy) for e in candidates}
    # Engines that fit now, and engines only short of a slot (worth waiting for if they finish sooner).
    pressure = any(blocked.values())
    estimates = [estimate(e, request, not blocked[e.name], fleet, policy, now, pressure, behind, hit(e),
                          waiting.get(e.name, 0), displaced.get(e.name, 0))
                 for e in candidates if not blocked[e.name] or blocked[e.name] == (Reason.CAP,)]
    known = adapters.known_adapters(fleet, policy.adapters)
    if model in known:
        estimates = placed(model, estimates, candidates, fleet, policy.adapters.load_headroom,
                           policy.adapters.home_margin, known,
                           {e.name: capacity_throughput(e, fleet, policy) for e in candidates})
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
            return park_or_shed(request, candidates, fleet, policy, now, 0, Reason.TTFT_DEADLINE,
                                f"estimated TTFT {soonest_ttft * 1000:.0f} ms after waiting for a slot", park_limit,
                                idle_slot=idle_slot)
        estimates = meeting
        decode_floor = policy.model(model).decode_floor_tokens_per_s or 0.0
        band = [x for x in estimates if x.can_start and x.ttft_s <= deadline_s - policy.band_margin_ms / 1000
                and x.decode_rate >= decode_floor]
        if band:
            sticky = next((x for x in band if x.engine.name == affinity), None)
            if sticky is not None:
                return admit(request, sticky, Reason.SESSION_AFFINITY, policy, now, fleet)
            longest = max(x.cached_tokens for x in band)
            if longest:  # the prompt where it is cached: good enough anyway, and its prefill costs nothing
                band = [x for x in band if x.cached_tokens == longest]
            least_swap = min(x.swap_s for x in band)
            band = [x for x in band if x.swap_s == least_swap]  # the adapter where it is loaded: no batch stalls
            throughput = {x.engine.name: capacity_throughput(x.engine, fleet, policy) for x in band}
            chosen = weighted_pick(band, fleet.recent_serves, pick, throughput,
                                   policy.band_ttft_grain_fraction * deadline_s)
            return admit(request, chosen, Reason.SATISFICING_BAND, policy, now, fleet)
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
        return park_or_shed(request, candidates, fleet, policy, now, 0, first, detail, park_limit,
                            idle_slot=idle_slot or narrowed,
                            waits_for=min(estimates, key=lambda x: x.finish_s).engine.name if narrowed and estimates
                            else None)

    soonest = finish_soonest(request, estimates, free, fleet, policy, now, affinity, admitted_reason, arriving,
                             set_aside)
    if soonest is not None:
        return soonest
    best = min(estimates, key=lambda x: soonest_key(x, fleet))
    return park_or_shed(request, candidates, fleet, policy, now, 0, Reason.WAITING_FOR_FASTER,
                        f"{best.engine.name} finishes in {best.finish_s:.1f} s after a {best.slot_wait_s:.1f} s wait",
                        park_limit, idle_slot=True, waits_for=best.engine.name)


def soonest_key(x: Estimate, fleet: Fleet) -> tuple[float, float, float, str]:
    """Finish-soonest's order: the charged finish (affinity.charged_finish) rounded to 1 us, then the lighter load,
    the more headroom, the name (equal estimates: no rates measured yet)."""
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
    ``soonest_key``'s order (decisions 0004, 0005, 0017)."""
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
                                                                          TINY), soonest_key(x, fleet)))


def finish_soonest(request: InferenceRequest, estimates: list[Estimate], free: list[Estimate], fleet: Fleet,
                   policy: Policy, now: float, affinity: str | None, admitted_reason: Reason,
                   arriving: bool = False, set_aside: float = math.inf,
                   near_tie: str | None = None) -> Decision | None:
    """Without a deadline: the engine where the request finishes soonest, or None when that means waiting.

    Waiting for a busy faster engine while a slot is free needs: it finishes sooner (by ``wait_for_faster_margin``),
    the wait is bounded (``waits_too_long``), and, for a request just **arriving** (nothing parked ahead of it), waiting
    also gives it its first token sooner than the free slot, whose first token counts its eviction charge (affinity.py).
    A request already parked keeps pure finish-soonest. ``set_aside``: the soonest finish of a free slot the fair-share
    spread set aside (``_spread``); a choice finishing later is reported ``fair_share``. ``near_tie``: the engine the
    fleet index chose among every free slot's near ties (indexed.py); None: ``_near_tie`` chooses among ``free``."""
    def soonest(x: Estimate) -> tuple[float, float, float, str]:
        return soonest_key(x, fleet)

    best = min(estimates, key=soonest)
    acceptable = [x for x in free if charged_finish(x) <= charged_finish(best) * (1 + policy.wait_for_faster_margin)]
    alternative = min(free, key=soonest) if free else None
    # The arrival's first token, with the free slot's eviction charge (affinity.py): a wait for the engine holding the
    # prompt is worth what the free slot would make the fleet prefill again.
    sooner_first_token = alternative is not None and best.ttft_s < alternative.ttft_s + alternative.displaced_s
    if not best.can_start and not acceptable and (waits_too_long(best, policy, alternative)
                                                  or (arriving and not sooner_first_token)):
        # Work conservation (route.waits_too_long, decision 0009): a free slot is taken instead.
        acceptable = free
        if admitted_reason is Reason.FINISH_SOONEST:
            admitted_reason = Reason.WORK_CONSERVING
    sticky = next((x for x in acceptable if x.engine.name == affinity), None)
    if sticky is not None:
        return admit(request, sticky, Reason.SESSION_AFFINITY, policy, now, fleet)
    if request.priority is Priority.SHEDDABLE and not acceptable:
        acceptable = free  # a sheddable request takes any free slot rather than being shed for want of a faster one
    if best.can_start or acceptable:
        # The soonest free slot either way (acceptable holds the free slots soonest first, up to a bound), or a near tie.
        chosen = next((x for x in free if x.engine.name == near_tie), None) if near_tie is not None else None
        if chosen is None:
            chosen = _near_tie(best if best.can_start else min(acceptable, key=soonest), free, fleet, policy, now)
        if admitted_reason is Reason.FINISH_SOONEST and chosen.finish_s > set_aside + 1e-6:
            admitted_reason = Reason.FAIR_SHARE
        return admit(request, chosen, admitted_reason, policy, now, fleet)
    return None


def admit(request: InferenceRequest, chosen: Estimate, reason: Reason, policy: Policy, now: float,
          fleet: Fleet) -> Decision:
    """The admission to ``chosen``'s engine, with its estimates (an expected cache hit reports ``prefix_cache``)."""
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
