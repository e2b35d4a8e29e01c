"""``sluice.admin.v1.Admin``: what operators (and tests) read about the running control plane."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from controlplane.core.decide import decide, explain
from controlplane.core.route import effective_load
from controlplane.core.model import EngineRates, EngineView, Fleet, InferenceRequest
from controlplane.core.policy import PRIORITIES
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc

if TYPE_CHECKING:
    from controlplane.app import ControlPlane


def _or_unknown(value: float | None) -> float:
    return -1.0 if value is None else float(value)


def _rates(r: EngineRates | None) -> admin_pb2.Rates | None:
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


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    async def GetStatus(  # noqa: N802
        self, request: admin_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStatusResponse:
        plane = self.plane
        now = plane.clock()
        fleet = plane.fleet(now)
        snapshot = plane.cache.snapshot
        xds = []
        if snapshot is not None:
            for type_url in sorted(snapshot.types):
                acked = {s.node_id or "?": s.acked_version(type_url) or "" for s in plane.ads.streams}
                xds.append(admin_pb2.XdsTypeStatus(
                    type_url=type_url, current_version=snapshot.version(type_url), acked_versions=acked
                ))
        ledger = plane.ledger
        return admin_pb2.GetStatusResponse(
            version=plane.version,
            uptime_seconds=now - plane.started_at,
            engines_total=len(fleet.engines),
            engines_ready=sum(1 for e in fleet.engines if e.ready),
            open_tickets=ledger.open_tickets(),
            tickets_admitted_total=ledger.admitted_total,
            tickets_released_total=ledger.released_total,
            tickets_expired_total=ledger.expired_total,
            xds_nacks_total=plane.ads.nacks_total,
            xds=xds,
            envoy_streams=len(plane.ads.streams),
        )

    async def ListEngines(  # noqa: N802
        self, request: admin_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListEnginesResponse:
        fleet = self.plane.fleet(self.plane.clock())
        return admin_pb2.ListEnginesResponse(engines=[self._engine(e, fleet) for e in fleet.engines])

    async def DrainEngine(  # noqa: N802
        self, request: admin_pb2.DrainEngineRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Engine:
        if not await self.plane.set_drained(request.name, request.drained):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no engine named {request.name!r}")
        fleet = self.plane.fleet(self.plane.clock())
        return self._engine(next(e for e in fleet.engines if e.name == request.name), fleet)

    async def ExplainDecision(  # noqa: N802
        self, request: admin_pb2.ExplainDecisionRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ExplainDecisionResponse:
        plane = self.plane
        policy = plane.config.policy
        priority = request.priority or "standard"
        if priority not in PRIORITIES or not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"need a model and a priority in {PRIORITIES}")
        now = plane.clock()
        fleet = plane.fleet(now)
        inference = InferenceRequest(
            "POST", "/v1/chat/completions", request.model, prompt_tokens=max(0, request.prompt_tokens),
            max_tokens=request.max_tokens or None, priority=priority,
            max_ttft_ms=request.max_ttft_ms or policy.model(request.model).max_ttft_ms, session=request.session or None,
        )
        ahead = plane.admission.queued_ahead(request.model, priority)
        decision = decide(inference, fleet, policy, now, ahead, plane.admission.sessions.get(inference.session))
        engines = [
            admin_pb2.EngineExplanation(
                name=x.name, serves_model=x.serves_model, meets_version_floor=x.meets_floor, stale=x.stale,
                drained=x.drained, misfits=[r.value for r in x.misfits], ttft_estimate_s=_or_unknown(x.ttft_s),
                finish_estimate_s=_or_unknown(x.finish_s), effective_load=x.load,
            )
            for x in explain(inference, fleet, policy, now)
        ]
        return admin_pb2.ExplainDecisionResponse(
            verdict=decision.verdict.value, reason=decision.reason.value, engine=decision.engine or "",
            status=decision.status, retry_after_s=decision.retry_after_s or 0, detail=decision.detail,
            queued_ahead=ahead, engines=engines,
        )

    async def ReloadConfig(  # noqa: N802
        self, request: admin_pb2.ReloadConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ReloadConfigResponse:
        applied, problems, changed, source = await self.plane.reload(request.path or None)
        return admin_pb2.ReloadConfigResponse(applied=applied, problems=problems, changed=changed, source=str(source))

    def _engine(self, e: EngineView, fleet: Fleet) -> admin_pb2.Engine:
        plane = self.plane
        now = plane.clock()
        s = e.sample
        model = e.models[0].model_id if e.models else None
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
            open_tickets=plane.ledger.open_tickets(e.name),
            max_num_seqs=e.max_num_seqs or 0,
            last_probe_age_seconds=-1.0 if e.last_ok_at is None else now - e.last_ok_at,
            last_error=e.last_error,
            version=e.version or "",
            effective_load=int(effective_load(e, fleet)),
            flavor=e.flavor or "",
            chip_class=e.chip_class,
            kv_capacity_tokens=e.kv_capacity_tokens or 0,
            discovered_concurrency=e.discovered_concurrency or 0,
            missing_gauges=list(e.degraded),
            rates=_rates(e.rates),
            prefill_median_tokens_per_s=_or_unknown(plane.rates.prefill_median(model, e.chip_class) if model else None),
            solo_decode_median_tokens_per_s=_or_unknown(
                plane.rates.solo_decode_median(model, e.chip_class) if model else None
            ),
            kv_used_tokens=int(_or_unknown(s.kv_used_tokens if s else None)),
            preemptions_total=_or_unknown(s.preemptions_total if s else None),
            drained=e.drained,
        )
