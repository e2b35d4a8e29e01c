"""Fallback weights for Envoy's per-model ``weighted_clusters`` route, used only when no Check pinned the request (the
control plane unreachable under ``on_controlplane_failure: open``). Pure.

For each model, every engine that serves it, is not drained, meets the model's version floor and is admissible (fresh, or
stale under ``on_stale: open``) gets::

    free_throughput(e) = max(0, cap - load) x decode_rate(e, at batch cap)     (tokens/s it could still add)

and the weights are those numbers scaled to integers summing to about 1000. When every engine is saturated (all zero), the
weights fall back to each engine's full throughput (cap x decode rate) so the route always has somewhere to go. An engine
below the floor or drained gets no weight at all. Weights are pushed only on a real change (``should_push``): an engine or
model appearing or leaving at once; a drift of the traffic split past the threshold at most every ``MIN_PUSH_INTERVAL_S``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from controlplane.core.fit import effective_load
from controlplane.core import adapters
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.core.policy import Policy, meets_floor
from controlplane.core.route import capacity_throughput, decode_rate

Weights = dict[str, dict[str, int]]
SCALE = 1000


def _eligible(engine: EngineView, model: str, fleet: Fleet, policy: Policy) -> bool:
    return (engine.serves(model) and not engine.drained and meets_floor(engine.version, policy.floor_for(
        model, adapters.base_of(model, fleet, policy.adapters.base_models)))
            and (not engine.stale or fleet.admit_stale))


def compute_weights(fleet: Fleet, policy: Policy) -> Weights:
    *_, weights = weight_steps(fleet, policy, len(fleet.engines) or 1)
    assert weights is not None  # the last step is the weights
    return weights


def weight_steps(fleet: Fleet, policy: Policy, slice_size: int) -> Iterator[Weights | None]:
    """``compute_weights`` in steps: None after each ``slice_size`` engines of each model, then the weights. The publisher
    takes a step per turn of the event loop (at 1000 engines the whole pass held it 5 ms); ``compute_weights`` takes
    them all at once."""
    out: Weights = {}
    for model in served_models(fleet):
        rows: list[tuple[str, float, float]] = []
        for start in range(0, len(fleet.engines), slice_size):
            rows += _throughputs(fleet.engines[start:start + slice_size], model, fleet, policy)
            yield None
        if rows:
            out[model] = _model_weights(rows)
    yield out


def served_models(fleet: Fleet) -> list[str]:
    return sorted({m.model_id for e in fleet.engines for m in e.models})


def _throughputs(engines: Iterable[EngineView], model: str, fleet: Fleet,
                policy: Policy) -> list[tuple[str, float, float]]:
    """(name, full throughput, free throughput) of each of ``engines`` the model's route may use."""
    return [(e.name, capacity_throughput(e, fleet, policy),
             max(0.0, (e.cap or 1) - effective_load(e, fleet)) * decode_rate(e, e.cap or 1, fleet, policy))
            for e in engines if _eligible(e, model, fleet, policy)]


def _model_weights(rows: list[tuple[str, float, float]]) -> dict[str, int]:
    """One model's weights from its engines' ``_throughputs`` (at least one)."""
    full = {name: value for name, value, _ in rows}
    free = {name: value for name, _, value in rows}
    raw = free if sum(free.values()) > 0 else full
    total = sum(raw.values())
    if total <= 0:
        raw, total = {name: 1.0 for name in raw}, float(len(raw))
    weights = {name: max(1, round(SCALE * value / total)) for name, value in raw.items() if value > 0}
    return dict(sorted(weights.items()))


MIN_PUSH_INTERVAL_S = 10.0
"""Weights that only drift are pushed at most this often (a new or vanished engine or model is pushed at once): every push
rebuilds and resends the whole snapshot, and fallback weights matter only while the control plane is unreachable."""


def moved(published: Weights, fresh: Weights, threshold: float) -> bool:
    """True when the set of models or engines changed, or some model's traffic split moved by at least ``threshold``: the
    share of its fallback traffic that would go to a different engine (half the summed absolute change of each engine's
    share): on a large fleet one unit of rounding is a large relative move of a small weight, not a change of split."""
    if published.keys() != fresh.keys():
        return True
    for model, weights in fresh.items():
        old = published[model]
        if old.keys() != weights.keys():
            return True
        old_total, new_total = sum(old.values()) or 1, sum(weights.values()) or 1
        shifted = sum(abs(w / new_total - old[e] / old_total) for e, w in weights.items()) / 2
        if shifted >= threshold - 1e-12:
            return True
    return False


def eligible_engines(fleet: Fleet, policy: Policy) -> dict[str, frozenset[str]]:
    """Per model, the engines the route may use at all (serving, not drained, at the floor, admissible): a change here is
    an engine appearing or leaving, unlike an engine whose free throughput touched zero (its weight only drifted)."""
    return {model: frozenset(e.name for e in fleet.engines if _eligible(e, model, fleet, policy))
            for model in served_models(fleet)}


def membership_changed(published: Weights, fresh: Weights) -> bool:
    """A model or an engine appeared in or left the weights."""
    return published.keys() != fresh.keys() or any(published[m].keys() != w.keys() for m, w in fresh.items())


def _shifted(old: dict[str, int], new: dict[str, int]) -> float:
    """Share of the traffic that would go to a different engine (an engine missing on one side has share 0)."""
    old_total, new_total = sum(old.values()) or 1, sum(new.values()) or 1
    return sum(abs(new.get(e, 0) / new_total - old.get(e, 0) / old_total) for e in old.keys() | new.keys()) / 2


def should_push(published: Weights, fresh: Weights, threshold: float, now: float, last_push_at: float | None,
                min_interval_s: float = MIN_PUSH_INTERVAL_S, eligible_before: dict[str, frozenset[str]] | None = None,
                eligible_now: dict[str, frozenset[str]] | None = None) -> bool:
    """Push at once when a model or an eligible engine appeared or left (``eligible_*``; without them, any change of the
    weights' keys counts); a drift of some model's split by at least ``threshold`` at most once per ``min_interval_s``
    (a saturated engine's weight falling to nothing is drift: it comes back when a request finishes)."""
    if published.keys() != fresh.keys():
        return True
    if eligible_before is not None or eligible_now is not None:
        if eligible_before != eligible_now:
            return True
    elif membership_changed(published, fresh):
        return True
    if last_push_at is not None and now - last_push_at < min_interval_s:
        return False
    return any(_shifted(published[m], w) >= threshold - 1e-12 for m, w in fresh.items())
