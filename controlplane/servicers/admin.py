"""``sluice.admin.v1.Admin``: what operators (and tests) read about the running control plane, and the changes they make.

Every call passes the ``AdminGuard`` first (``controlplane/servicers/adminauth.py``): a change (reload, drain, undrain, floor) needs a
valid bearer token, a read one only with ``admin.require_token_for_reads``. Every accepted or refused change is one line of
the audit log."""

from __future__ import annotations

from typing import Any

from collections.abc import AsyncIterator

import grpc

from controlplane.servicers.adminauth import AdminGuard, audit
from controlplane.servicers.admin_views import (
    engine_proto, explain_proto, explain_request, fair_share_proto, fair_standing_proto, status_proto, tenant_proto,
)
from controlplane.policytext import policy_yaml
from controlplane.core.explain import explain
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.core.model import Priority
from controlplane.core.request import RequestError
from controlplane.ports import AdminPort
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, plane: AdminPort, guard: AdminGuard) -> None:
        self.plane = plane
        self.guard = guard

    async def GetStatus(  # noqa: N802
        self, request: admin_pb2.GetStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.GetStatusResponse:
        await self.guard.require(context, "GetStatus", mutating=False)
        now = self.plane.now()
        return status_proto(self.plane.status(now), self.plane.fleet(now))

    async def ListEngines(  # noqa: N802
        self, request: admin_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.ListEnginesResponse:
        await self.guard.require(context, "ListEngines", mutating=False)
        now = self.plane.now()
        fleet = self.plane.fleet(now)
        return admin_pb2.ListEnginesResponse(engines=[self._engine(e, fleet, now) for e in fleet.engines])

    async def DrainEngine(  # noqa: N802
        self, request: admin_pb2.DrainEngineRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.Engine:
        what = {"method": "DrainEngine", "engine": request.name, "drained": request.drained}
        who = await self.guard.require(context, "DrainEngine", mutating=True, what=what)
        before = next((e.drained for e in self.plane.fleet(self.plane.now()).engines if e.name == request.name), None)
        if not await self.plane.set_drained(request.name, request.drained):
            audit(who=who, what=what, before=None, after=None, result="refused: no such engine", peer=context.peer())
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no engine named {request.name!r}")
        audit(who=who, what=what, before={"drained": before}, after={"drained": request.drained}, result="applied",
              peer=context.peer())
        now = self.plane.now()
        fleet = self.plane.fleet(now)
        return self._engine(next(e for e in fleet.engines if e.name == request.name), fleet, now)

    async def ExplainDecision(  # noqa: N802
        self, request: admin_pb2.ExplainDecisionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.ExplainDecisionResponse:
        await self.guard.require(context, "ExplainDecision", mutating=False)
        names = tuple(p.value for p in Priority)
        if (request.priority or Priority.STANDARD) not in names or not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"need a model and a priority in {names}")
        now = self.plane.now()
        try:
            inference = explain_request(request, Priority(request.priority or Priority.STANDARD), self.plane.policy,
                                        self.plane.prompt_rules)
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"body_json: {error}")
        decision, ahead = self.plane.decide_for(inference, now)
        fleet = self.plane.fleet(now)
        cached = self.plane.expected_cached(inference)
        standing = fair_standing_proto(self.plane.fair_standing(inference, now), self.plane.policy.fairness.enabled)
        return explain_proto(decision, ahead, explain(inference, fleet, self.plane.policy, now, cached), standing)

    async def ReloadConfig(  # noqa: N802
        self, request: admin_pb2.ReloadConfigRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.ReloadConfigResponse:
        what = {"method": "ReloadConfig", "path": request.path or None}
        who = await self.guard.require(context, "ReloadConfig", mutating=True, what=what)
        before = policy_yaml(self.plane.policy)
        result = await self.plane.reload(request.path or None)
        after = policy_yaml(self.plane.policy)
        audit(who=who, what=what, before=before if result.applied else None, after=after if result.applied else None,
              result=f"applied; changed: {', '.join(result.changed) or 'nothing'}" if result.applied
              else "refused: " + "; ".join(result.problems), peer=context.peer())
        return admin_pb2.ReloadConfigResponse(applied=result.applied, problems=list(result.problems),
                                              changed=list(result.changed), source=result.source)

    async def SetVersionFloor(  # noqa: N802
        self, request: admin_pb2.SetVersionFloorRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.SetVersionFloorResponse:
        what = {"method": "SetVersionFloor", "model_pattern": request.model_pattern, "version": request.version}
        who = await self.guard.require(context, "SetVersionFloor", mutating=True, what=what)
        result = await self.plane.set_version_floor(request.model_pattern, request.version)
        audit(who=who, what=what, before=result.before or None, after=result.after or None,
              result="applied" if result.applied else "refused: " + "; ".join(result.problems), peer=context.peer())
        return admin_pb2.SetVersionFloorResponse(applied=result.applied, problems=list(result.problems),
                                                 before=result.before, after=result.after)

    async def GetPolicy(  # noqa: N802
        self, request: admin_pb2.GetPolicyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.GetPolicyResponse:
        await self.guard.require(context, "GetPolicy", mutating=False)
        return admin_pb2.GetPolicyResponse(yaml=policy_yaml(self.plane.policy), source=self.plane.config_source)

    async def WatchDecisions(  # noqa: N802
        self, request: admin_pb2.WatchDecisionsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[admin_pb2.DecisionEvent]:
        await self.guard.require(context, "WatchDecisions", mutating=False)
        watcher = self.plane.watch(request.model or None)
        try:
            while True:
                event, dropped = await watcher.next()
                yield admin_pb2.DecisionEvent(
                    at_unix=event.at_unix, request_id=event.request_id, verdict=event.verdict, reason=event.reason,
                    engine=event.engine, model=event.model, tenant=event.tenant, parked_ms=event.parked_ms,
                    expected_ttft_s=event.expected_ttft_s, retry_after_s=event.retry_after_s, priority=event.priority,
                    dropped_since_last=dropped)
        finally:
            self.plane.unwatch(watcher)

    async def ListTenants(  # noqa: N802
        self, request: admin_pb2.ListTenantsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.ListTenantsResponse:
        await self.guard.require(context, "ListTenants", mutating=False)
        share = self.plane.policy.fairness
        return admin_pb2.ListTenantsResponse(tenants=[tenant_proto(u, share) for u in await self.plane.tenant_usage()],
                                             fairness=fair_share_proto(share, self.plane.tenant_shares()))

    def _engine(self, e: EngineView, fleet: Fleet, now: float) -> admin_pb2.Engine:
        model = e.models[0].model_id if e.models else None
        medians = self.plane.medians(model, e.chip_class) if model else (None, None)
        return engine_proto(e, fleet, now, self.plane.open_tickets(e.name), medians, self.plane.ttft_summary(e.name),
                            self.plane.prompt_summary(model, e.name) if model else None, self.plane.policy.adapters,
                            self.plane.swap_samples(e.name))
