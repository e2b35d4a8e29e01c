"""Admin API messages built from data: pure functions from the control plane's facts to ``sluice.admin.v1`` protos."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from controlplane.core import adapters
from controlplane.core.adapters import AdapterPolicy
from controlplane.core.explain import EngineExplanation
from controlplane.core.fairshare import FairShare, FairStanding, TenantShare
from controlplane.core.feedback import TtftSummary
from controlplane.core.prompt_tokens import PromptTokenRules, PromptTokenSummary
from controlplane.core.fit import effective_load
from controlplane.core.engines import EngineRates, EngineView
from controlplane.core.fleet import Fleet
from controlplane.core.model import Decision, InferenceRequest, Priority, Reason
from controlplane.core.policy import Policy
from controlplane.core.request import RequestError, parse_request, ttft_deadline
from controlplane.edge import http_status
from controlplane.ports import StatusFacts
from controlplane.admission.quota import TenantUsage
from sluice.admin.v1 import admin_pb2


def _or_unknown(value: float | None) -> float:
    return -1.0 if value is None else float(value)


def rates_proto(r: EngineRates | None) -> admin_pb2.Rates | None:
    if r is None:
        return None
    return admin_pb2.Rates(
        interval_seconds=r.interval_s,
        prompt_tokens_per_s=_or_unknown(r.prompt_tokens_per_s),
        generation_tokens_per_s=_or_unknown(r.generation_tokens_per_s),
        prefill_tokens_per_s=_or_unknown(r.prefill_tokens_per_s),
        decode_tokens_per_s_each=_or_unknown(r.decode_tokens_per_s_each),
        solo=r.solo,
    )


def status_proto(facts: StatusFacts, fleet: Fleet) -> admin_pb2.GetStatusResponse:
    return admin_pb2.GetStatusResponse(
        version=facts.version,
        uptime_seconds=facts.uptime_s,
        engines_total=len(fleet.engines),
        engines_ready=sum(1 for e in fleet.engines if e.ready),
        open_tickets=facts.open_tickets,
        tickets_admitted_total=facts.tickets_admitted_total,
        tickets_released_total=facts.tickets_released_total,
        tickets_expired_total=facts.tickets_expired_total,
        xds_nacks_total=facts.xds_nacks_total,
        xds=[admin_pb2.XdsTypeStatus(type_url=x.type_url, current_version=x.current_version,
                                     acked_versions=x.acked_versions) for x in facts.xds],
        envoy_streams=facts.envoy_streams,
    )


def engine_proto(e: EngineView, fleet: Fleet, now: float, open_tickets: int,
                 medians: tuple[float | None, float | None], ttfts: TtftSummary,
                 prompts: PromptTokenSummary | None, adapter_policy: AdapterPolicy | None = None,
                 swap_samples: int = 0) -> admin_pb2.Engine:
    s = e.sample
    known = adapters.known_adapters(fleet, adapter_policy or AdapterPolicy())
    return admin_pb2.Engine(
        name=e.name,
        url=e.url,
        cluster=e.name,
        models=[m.model_id for m in e.models],
        ready=e.ready,
        stale=e.stale,
        running=_or_unknown(s.running if s else None),
        waiting=_or_unknown(s.waiting if s else None),
        kv_usage=_or_unknown(s.kv_usage if s else None),
        open_tickets=open_tickets,
        max_num_seqs=e.max_num_seqs or 0,
        last_probe_age_seconds=-1.0 if e.last_ok_at is None else now - e.last_ok_at,
        last_error=e.last_error,
        version=e.version or "",
        effective_load=int(effective_load(e, fleet)),
        flavor=e.flavor.value if e.flavor else "",
        chip_class=e.chip_class,
        kv_capacity_tokens=e.kv_capacity_tokens or 0,
        discovered_concurrency=e.discovered_concurrency or 0,
        missing_gauges=list(e.degraded),
        rates=rates_proto(e.rates),
        prefill_median_tokens_per_s=_or_unknown(medians[0]),
        solo_decode_median_tokens_per_s=_or_unknown(medians[1]),
        kv_used_tokens=int(_or_unknown(s.kv_used_tokens if s else None)),
        preemptions_total=_or_unknown(s.preemptions_total if s else None),
        drained=e.drained,
        ttft_p50_seconds=_or_unknown(ttfts.p50_s),
        ttft_p90_seconds=_or_unknown(ttfts.p90_s),
        ttft_samples=ttfts.samples,
        ttft_estimate_error_median=_or_unknown(ttfts.error_median),
        end_to_end_estimate_error_median=_or_unknown(ttfts.end_to_end_error_median),
        ttft_correction=ttfts.correction,
        prompt_chars_per_token=prompts.rule.chars_per_token if prompts else -1.0,
        prompt_template_tokens_per_message=prompts.rule.per_message if prompts else -1.0,
        prompt_token_samples=prompts.samples if prompts else 0,
        prompt_tokens_error_median=_or_unknown(prompts.error_median if prompts else None),
        adapter_slots=e.adapter_slots or 0,
        adapters_running=list(s.lora_running or ()) if s else [],
        adapters_waiting=list(s.lora_waiting or ()) if s else [],
        adapters_loaded=list(dict.fromkeys((*adapters.resident(e, fleet, known), *e.lora_adapters))),
        adapter_swap_seconds=fleet.adapter_swap_s.get(e.name, (adapter_policy or AdapterPolicy()).swap_s),
        adapter_swap_samples=swap_samples,
    )


def explain_request(request: admin_pb2.ExplainDecisionRequest, priority: Priority, policy: Policy,
                    tokens: PromptTokenRules | None = None) -> InferenceRequest:
    """The request to explain. With ``body_json`` its prompt is read as a Check reads it (``parse_request``: its blocks
    for the prefix index, and its prompt tokens unless ``prompt_tokens`` is set); a malformed body raises
    ``RequestError``."""
    prompt_tokens = max(0, request.prompt_tokens)
    blocks: tuple[int, ...] = ()
    if request.body_json:
        try:
            body = json.loads(request.body_json)
        except ValueError as exc:
            raise RequestError(Reason.INVALID_JSON, f"not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(Reason.INVALID_JSON, "must be a JSON object")
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        body.setdefault("model", request.model)  # the model is the request's own field; the body may leave it out
        parsed = parse_request("POST", route, json.dumps(body).encode(), {}, policy, tokens)
        prompt_tokens, blocks = prompt_tokens or parsed.prompt_tokens, parsed.prefix_blocks
    max_ttft_ms, headroom_ms = ttft_deadline(request.max_ttft_ms or None, request.model, policy)
    return InferenceRequest(
        "POST", "/v1/chat/completions", request.model, prompt_tokens=prompt_tokens,
        max_tokens=request.max_tokens or None, priority=priority, max_ttft_ms=max_ttft_ms,
        ttft_headroom_ms=headroom_ms, session=request.session or None, prefix_blocks=blocks,
        tenant=request.tenant or None,
    )


def fair_standing_proto(standing: FairStanding, enabled: bool) -> admin_pb2.FairStanding:
    return admin_pb2.FairStanding(
        enabled=enabled, tenant=standing.tenant, counter=round(standing.counter, 1), lifted=standing.lifted,
        ahead_in_class=standing.ahead_in_class, ahead_in_higher_classes=standing.ahead_in_higher_classes,
        tenants_ahead=[admin_pb2.TenantAhead(tenant=a.tenant, counter=round(a.counter, 1), requests=a.requests)
                       for a in standing.tenants_ahead],
        held_slots=dict(standing.held_slots))


def explain_proto(decision: Decision, ahead: int, explanations: Sequence[EngineExplanation],
                  fairness: admin_pb2.FairStanding | None = None) -> admin_pb2.ExplainDecisionResponse:
    engines = [
        admin_pb2.EngineExplanation(
            name=x.name, serves_model=x.serves_model, meets_version_floor=x.meets_floor, stale=x.stale,
            drained=x.drained, misfits=[r.value for r in x.misfits], ttft_estimate_s=_or_unknown(x.ttft_s),
            finish_estimate_s=_or_unknown(x.finish_s), effective_load=x.load, expected_cached_tokens=x.cached_tokens,
        )
        for x in explanations
    ]
    return admin_pb2.ExplainDecisionResponse(
        verdict=decision.verdict.value, reason=decision.reason.value, engine=decision.engine or "",
        status=http_status(decision), retry_after_s=decision.retry_after_s or 0, detail=decision.detail,
        queued_ahead=ahead, engines=engines, fairness=fairness,
    )


def tenant_proto(usage: TenantUsage, share: FairShare = FairShare()) -> admin_pb2.Tenant:
    """A tenant and its limits as they stand; its key digests stay in the config (only their number is shown)."""
    t = usage.tenant
    return admin_pb2.Tenant(
        name=t.name, keys=len(t.key_digests), weight=share.weight(t.name), reserved_share=t.reserved_share,
        default_priority=t.default_priority.value,
        max_priority=t.max_priority.value, models_allowed=sorted(t.models_allowed or ()), error=usage.error,
        limits=[admin_pb2.TenantLimit(scope=s.key, kind=s.kind.value, limit=s.limit, remaining=s.remaining,
                                      used=s.limit - s.remaining, reset_seconds=round(s.reset_s, 3))
                for s in usage.states])


def fair_share_proto(share: FairShare, standings: Iterable[TenantShare]) -> admin_pb2.FairShare:
    """Fair share's settings and every (model, tenant)'s standing on this replica (core/fairshare.py)."""
    return admin_pb2.FairShare(
        enabled=share.enabled, mode=share.mode.value, prompt_weight=share.prompt_weight,
        output_weight=share.output_weight,
        shares=[admin_pb2.TenantShare(model=t.model, tenant=t.tenant, weight=share.weight(t.tenant),
                                      reserved_share=share.reserved.get(t.tenant, 0.0),
                                      counter=round(t.counter, 1), served_tokens=round(t.served_tokens),
                                      waiting=t.waiting) for t in standings])
