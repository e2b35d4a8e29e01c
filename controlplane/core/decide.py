"""The admission decision, pure: ``decide(request, fleet, policy, now, ...) -> Decision``. No I/O, no clock, no HTTP: a
verdict, a reason and a detail (the edge, ``controlplane/edge.py``, maps each reason to a status and an OpenAI error).

``decide`` refuses first, at no cost: an unknown model (``unknown_model``; ``no_ready_engine`` for an adapter dynamic
loading could load but has not, core/adapterloads.py), every engine serving it drained or stale (``no_ready_engine``)
or below its version floor (``version_floor``), prompt + max_tokens beyond every candidate's ``max_model_len`` or KV
budget (``context_length_exceeded``). The candidates are then the engines serving the model, at
or above its floor, fresh (or stale when ``on_stale: open`` and no fresh one exists: ``stale_fail_open``); with
``prefix_max_replicas`` R > 0, once R candidates hold the request's prefix only they remain (R = 0:
``holders_suffice``: once the holders' capacity covers the prefix's load, with headroom only while a candidate has room
to cache it without evicting). With a TTFT deadline, a request that even an idle candidate cannot prefill in time is shed
(``ttft_unmeetable``); a request with parked requests ahead of it in its class or a higher one parks behind them
(``queued_behind``). Which candidate gets it is choose.py's job (indexed.py on the fleet index); how long a wait or a
Retry-After is, waits.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from controlplane.core import adapters
from controlplane.core.choose import Candidates, choose, holders_suffice
from controlplane.core.engines import EngineView, ServedModel
from controlplane.core.fit import context_tokens, model_len, need_tokens
from controlplane.core.fleet import Fleet
from controlplane.core.indexed import decide_indexed
from controlplane.core.model import Decision, InferenceRequest, Reason, Verdict
from controlplane.core.policy import Policy, meets_floor
from controlplane.core.request import RequestError
from controlplane.core.route import NONE_NAMED, cached_tokens, capacity_throughput, prefill_rate
from controlplane.core.waits import deadline_text, park_or_shed, refuse, retry_after, shed


def decide(
    request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, queued_ahead: int = 0,
    affinity: str | None = None, pick: float = 0.5, behind: int = 0, arriving: bool = False,
    cached: Mapping[str, int] | None = None, waiting: Mapping[str, int] | None = None,
    displaced: Mapping[str, int] | None = None, prefix_share: float = 0.0,
    prefix_demand: Mapping[str, float] | None = None,
) -> Decision:
    """Choose what happens to ``request`` (see the module docstring and route.py). ``queued_ahead``: parked requests of
    this model in this request's priority class or a higher one; ``affinity``: the engine the request's session used last;
    ``pick``: a uniform draw in [0, 1) for the satisficing band's weighted choice; ``behind``: parked requests of this
    model queued after this one (a woken head's backlog); ``cached``: prompt tokens each engine is expected to hold in
    its prefix cache (engines not named: none); ``waiting``: parked requests ahead of this one, passed over, that wait for
    each named engine (each takes one of its slots first); ``displaced``: prompt tokens of other prefixes each named
    engine would evict to cache this prompt, charged in the choice (affinity.py); ``prefix_share``: the request's
    prefix's share of recent arrivals (prefix.py), which bounds how many engines it may occupy (``holders_suffice``);
    ``prefix_demand``: per engine, what the prefixes it holds ask of it (``PrefixIndex.demand``)."""
    model = request.model
    if model is None:
        return Decision(Verdict.ANSWER, Reason.MODEL_LIST, models=model_list(fleet))
    cached = cached or NONE_NAMED
    waiting = waiting or NONE_NAMED
    displaced = displaced or NONE_NAMED
    if fleet.index is not None:
        indexed = decide_indexed(request, fleet, policy, now, queued_ahead, affinity, pick, behind, arriving, cached,
                                 waiting, displaced, prefix_share, prefix_demand or NONE_NAMED)
        if indexed is not None:
            return replace(indexed, on_index=True)
    found = candidates_for(request, fleet, policy, now, cached, prefix_share, displaced, prefix_demand or NONE_NAMED)
    if isinstance(found, Decision):
        return found
    if queued_ahead:
        return park_or_shed(request, found.engines, fleet, policy, now, queued_ahead, Reason.QUEUED_BEHIND,
                            f"{queued_ahead} parked ahead", found.park_limit)
    return choose(request, found, fleet, policy, now, affinity, pick, behind, arriving, cached, waiting, displaced)


def candidates_for(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, cached: Mapping[str, int],
                   prefix_share: float, displaced: Mapping[str, int] = NONE_NAMED,
                   prefix_demand: Mapping[str, float] = NONE_NAMED) -> Candidates | Decision:
    """The engines ``request`` may run on, or the refusal or shed that leaves it none (the module docstring);
    ``displaced``, ``prefix_demand``: as ``decide``'s (an engine not named evicts nothing to cache the prompt; is asked
    for nothing)."""
    model = request.model
    assert model is not None
    base = adapters.base_of(model, fleet, policy.adapters.base_models)
    serving = [e for e in fleet.engines if e.serves(model) and not e.drained and (base is None or e.serves(base))]
    if not serving and any(e.serves(model) and (base is None or e.serves(base)) for e in fleet.engines):
        return shed(Reason.NO_READY_ENGINE, f"every engine serving {model} is drained", policy.retry_after_max_s)
    if not serving and policy.adapters.dynamic_loading and model in policy.adapters.paths:
        return shed(Reason.NO_READY_ENGINE, f"no engine has the adapter {model} loaded, and none could load it now "
                    "(adapters.loads_per_minute, or the load failed)", policy.retry_after_min_s)
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
        # Fail open: an engine whose metrics went quiet may well be serving; admitting beats refusing.
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
    if cached:
        holders = [e for e in candidates if hit(e) > 0]
        room = any(e.name not in displaced for e in candidates if hit(e) <= 0)
        capacity = {e.name: capacity_throughput(e, fleet, policy) for e in candidates}
        held_capacity = sum(capacity[e.name] for e in holders)
        held_demand = sum(prefix_demand.get(e.name, 0.0) for e in holders)
        if holders_suffice(policy, prefix_share, len(holders), held_capacity, sum(capacity.values()), room,
                           held_demand):
            narrowed = len(holders) < len(candidates)
            candidates = holders  # the prefix occupies as many engines as it may: it waits for one of them

    deadline_s = request.planned_ttft_s()
    park_limit: float | None = None
    if deadline_s is not None:
        # Prefill alone, on an idle engine: if even that misses the deadline, nothing can meet it. A request that only
        # needs a slot parks for as long as its deadline leaves room for prefill: waits are estimates, releases decide.
        prefill_floor = min((request.prompt_tokens - hit(e)) / prefill_rate(e, model, fleet, policy)
                            for e in candidates)
        if prefill_floor > deadline_s:
            return shed(Reason.TTFT_UNMEETABLE,
                        f"no engine can prefill {request.prompt_tokens} tokens of {model} within "
                        f"{deadline_text(request)} (best {prefill_floor * 1000:.0f} ms on an idle engine)",
                        retry_after(candidates, fleet, policy, now))
        park_limit = deadline_s - prefill_floor
    return Candidates(candidates, park_limit, narrowed, admitted_reason)


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
