"""The fit rules: whether a request can start on an engine now, and the load and KV figures they (and weights) read.
Pure. A candidate **fits** when none of these holds (each a ``Reason``)::

    cap          : load >= cap                    (load: ``effective_load``; cap: max_num_seqs, configured or reported)
    kv_watermark : the probe's KV usage >= kv_high_watermark
    kv_need      : held + need > kv_capacity x kv_high_watermark         (need: ``need_tokens``; held: ``held_tokens``)
    box_pool     : the engines sharing a box would together hold more than its budget (bytes at each model's
                   kv_bytes_per_token, an unknown rate at the largest configured; else tokens)
    quality_cap  : open tickets of the model >= floor(solo decode rate x quality_overcommit / decode floor)
    adapter_slots: a LoRA adapter the engine's open tickets do not use, every adapter slot held by others (adapters.py)

A gauge an engine does not report (``None``) skips the rule that needs it. The fleet index (fleetindex.py) evaluates the
same rules vectorised, from these same functions' figures.
"""

from __future__ import annotations

import math

from controlplane.core import adapters
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.core.model import InferenceRequest, Reason
from controlplane.core.policy import Policy


def effective_load(engine: EngineView, fleet: Fleet) -> float:
    """``max(probe running + waiting + unseen_load, open tickets)``: the probe sees traffic that bypasses sluice, the
    ledger sees what the probe cannot have counted yet."""
    ledger = fleet.of(engine.name)
    probe = engine.sample.queue if engine.sample is not None else None
    return max(0.0, (probe or 0.0) + ledger.unseen_load, float(ledger.open_tickets))


def need_tokens(request: InferenceRequest, policy: Policy) -> int:
    """KV the request may grow to: its prompt estimate plus max_tokens (the policy default when absent)."""
    return request.prompt_tokens + (request.max_tokens or policy.default_max_tokens)


def context_tokens(request: InferenceRequest) -> int:
    """What must fit an engine's context for it to take the request at all: the prompt plus ``max_tokens`` when the
    client set one. Without one the engine caps the answer at its context itself (vLLM: max_model_len - prompt;
    llama.cpp: the slot's n_ctx), so only the prompt (and one token) must fit; the KV rules still reserve the default."""
    return request.prompt_tokens + (request.max_tokens or 1)


def held_tokens(engine: EngineView, fleet: Fleet) -> float:
    """KV the engine holds or has promised: the larger of its open tickets' reservations and what the probe saw, corrected
    for tickets admitted or released since."""
    ledger = fleet.of(engine.name)
    capacity = engine.kv_capacity_tokens
    usage = engine.sample.kv_usage if engine.sample is not None else None
    probe_held = 0.0
    if usage is not None and capacity:
        probe_held = max(0.0, usage * capacity + ledger.unseen_reserved_tokens - ledger.released_since_probe_tokens)
    return max(float(ledger.committed_tokens), probe_held)


def model_len(engine: EngineView, model: str) -> int | None:
    """The engine's ``max_model_len`` for ``model`` (None: unknown, never refuses)."""
    return next((m.max_model_len for m in engine.models if m.model_id == model), None)


def quality_cap(engine: EngineView, model: str, fleet: Fleet, policy: Policy) -> int | None:
    """Requests of ``model`` the engine may run and still decode each at the model's floor (None: no floor or no rate)."""
    floor = policy.model(model).decode_floor_tokens_per_s
    if not floor:
        return None
    solo = fleet.rates.solo_decode.get((model, engine.chip_class)) or policy.model(model).solo_decode_tokens_per_s
    if not solo:
        return None
    return max(1, math.floor(solo * policy.quality_overcommit / floor))


def _box_misfit(engine: EngineView, model: str, need: int, fleet: Fleet, policy: Policy) -> bool:
    box = policy.box_of(engine.name)
    if box is None:
        return False
    members = [e for e in fleet.engines if e.name in box.engines]
    rates = {e.name: policy.model(e.models[0].model_id).kv_bytes_per_token if e.models else None for e in members}
    own_rate = policy.model(model).kv_bytes_per_token
    known = [m.kv_bytes_per_token for m in policy.models.values() if m.kv_bytes_per_token]
    if box.kv_budget_bytes and known:
        worst = max(known)  # an unknown rate is priced at the largest configured: never under-charge the shared pool
        used = sum(held_tokens(e, fleet) * (rates[e.name] or worst) for e in members)
        return used + need * (own_rate or worst) > box.kv_budget_bytes
    if box.kv_budget_tokens:
        return sum(held_tokens(e, fleet) for e in members) + need > box.kv_budget_tokens
    return False


def misfits(engine: EngineView, request: InferenceRequest, fleet: Fleet, policy: Policy) -> tuple[Reason, ...]:
    """Every rule ``engine`` fails for ``request`` (empty: it fits). See the module docstring for the formulas."""
    assert request.model is not None
    need = need_tokens(request, policy)
    out = []
    if engine.cap is not None and effective_load(engine, fleet) >= engine.cap:
        out.append(Reason.CAP)
    usage = engine.sample.kv_usage if engine.sample is not None else None
    if usage is not None and usage >= policy.kv_high_watermark:
        out.append(Reason.KV_WATERMARK)
    capacity = engine.kv_capacity_tokens
    if capacity and held_tokens(engine, fleet) + need > capacity * policy.kv_high_watermark:
        out.append(Reason.KV_NEED)
    if _box_misfit(engine, request.model, need, fleet, policy):
        out.append(Reason.BOX_POOL)
    q_cap = quality_cap(engine, request.model, fleet, policy)
    if q_cap is not None and fleet.of(engine.name).open_for(request.model) >= q_cap:
        out.append(Reason.QUALITY_CAP)
    if engine.adapter_slots is not None:
        known = adapters.known_adapters(fleet, policy.adapters)
        if request.model in known and adapters.blocked(engine, request.model, fleet, known):
            out.append(Reason.ADAPTER_SLOTS)
    return tuple(out)
