"""``sluice.admin.v1.Admin``: what operators (and tests) read about the running control plane."""

from __future__ import annotations

import grpc

from controlplane.admin_views import engine_proto, explain_proto, explain_request, status_proto
from controlplane.core.decide import explain
from controlplane.core.model import EngineView, Fleet
from controlplane.core.policy import PRIORITIES
from controlplane.ports import AdminPort
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, plane: AdminPort) -> None:
        self.plane = plane

    async def GetStatus(  # noqa: N802
        self, request: admin_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStatusResponse:
        now = self.plane.now()
        return status_proto(self.plane.status(now), self.plane.fleet(now))

    async def ListEngines(  # noqa: N802
        self, request: admin_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListEnginesResponse:
        now = self.plane.now()
        fleet = self.plane.fleet(now)
        return admin_pb2.ListEnginesResponse(engines=[self._engine(e, fleet, now) for e in fleet.engines])

    async def DrainEngine(  # noqa: N802
        self, request: admin_pb2.DrainEngineRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Engine:
        if not await self.plane.set_drained(request.name, request.drained):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no engine named {request.name!r}")
        now = self.plane.now()
        fleet = self.plane.fleet(now)
        return self._engine(next(e for e in fleet.engines if e.name == request.name), fleet, now)

    async def ExplainDecision(  # noqa: N802
        self, request: admin_pb2.ExplainDecisionRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ExplainDecisionResponse:
        priority = request.priority or "standard"
        if priority not in PRIORITIES or not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"need a model and a priority in {PRIORITIES}")
        now = self.plane.now()
        inference = explain_request(request, priority, self.plane.policy)
        decision, ahead = self.plane.decide_for(inference, now)
        fleet = self.plane.fleet(now)
        return explain_proto(decision, ahead, explain(inference, fleet, self.plane.policy, now))

    async def ReloadConfig(  # noqa: N802
        self, request: admin_pb2.ReloadConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ReloadConfigResponse:
        result = await self.plane.reload(request.path or None)
        return admin_pb2.ReloadConfigResponse(applied=result.applied, problems=list(result.problems),
                                              changed=list(result.changed), source=result.source)

    def _engine(self, e: EngineView, fleet: Fleet, now: float) -> admin_pb2.Engine:
        model = e.models[0].model_id if e.models else None
        medians = self.plane.medians(model, e.chip_class) if model else (None, None)
        return engine_proto(e, fleet, now, self.plane.open_tickets(e.name), medians)
