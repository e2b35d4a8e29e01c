"""What ``decide`` weighs, without deciding: every engine's standing for a request (operators' ``ExplainDecision``) and
the earliest time a request could start if open tickets finish when expected (backfill's bound). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from controlplane.core import adapters
from controlplane.core.fit import effective_load, misfits
from controlplane.core.fleet import Fleet
from controlplane.core.model import InferenceRequest, Reason
from controlplane.core.policy import Policy, meets_floor
from controlplane.core.route import cached_tokens, estimate


@dataclass(frozen=True, slots=True)
class EngineExplanation:
    name: str
    serves_model: bool
    meets_floor: bool
    stale: bool
    drained: bool
    misfits: tuple[Reason, ...]
    ttft_s: float | None
    finish_s: float | None
    load: float
    cached_tokens: int = 0
    """Prompt tokens the engine is expected to hold in its prefix cache (the estimates left them out of prefill)."""


def explain(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float,
            cached: Mapping[str, int] | None = None) -> tuple[EngineExplanation, ...]:
    """Every engine's standing for ``request``: the facts ``decide`` weighs, without deciding (for operators).
    ``cached``: the prefix index's expected hits for this request, as ``decide`` gets them."""
    cached = cached or {}
    assert request.model is not None
    floor = policy.floor_for(request.model, adapters.base_of(request.model, fleet, policy.adapters.base_models))
    blocked = {e.name: misfits(e, request, fleet, policy) for e in fleet.engines if e.serves(request.model)}
    pressure = any(blocked.values())
    out = []
    for e in fleet.engines:
        serves = e.serves(request.model)
        reasons = blocked.get(e.name, ())
        hit = cached_tokens(e.name, request, cached)
        x = estimate(e, request, not reasons, fleet, policy, now, pressure, cached_tokens=hit) if serves else None
        out.append(EngineExplanation(e.name, serves, meets_floor(e.version, floor), e.stale, e.drained, reasons,
                                     x.ttft_s if x else None, x.finish_s if x else None, effective_load(e, fleet), hit))
    return tuple(out)


def earliest_fit(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float) -> float | None:
    """When ``request`` could start at the earliest if open tickets finish when the ledger expects: per engine, release
    its tickets soonest first until no fit rule blocks; the soonest engine's time (``now`` if one fits already). None when
    no candidate frees up within its open tickets (backfill then has no bound to respect)."""
    assert request.model is not None
    floor = policy.floor_for(request.model, adapters.base_of(request.model, fleet, policy.adapters.base_models))
    best: float | None = None
    for engine in fleet.engines:
        if not engine.serves(request.model) or engine.drained or not meets_floor(engine.version, floor):
            continue
        if engine.stale and not fleet.admit_stale:
            continue
        if not misfits(engine, request, fleet, policy):
            return now
        ledger = fleet.of(engine.name)
        tokens = 0
        for freed, (done_at, reserved) in enumerate(ledger.finishing, start=1):
            tokens += reserved
            what_if = replace(ledger, open_tickets=ledger.open_tickets - freed, unseen_load=ledger.unseen_load - freed,
                              committed_tokens=ledger.committed_tokens - tokens,
                              released_since_probe_tokens=ledger.released_since_probe_tokens + tokens)
            if not misfits(engine, request, replace(fleet, ledger={**fleet.ledger, engine.name: what_if}), policy):
                at = max(now, done_at)
                best = at if best is None else min(best, at)
                break
    return best
