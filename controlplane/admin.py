"""``sluice.admin.v1.Admin``: what operators (and tests) read about the running control plane."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from controlplane.core.decide import effective_load
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc

if TYPE_CHECKING:
    from controlplane.app import ControlPlane


def _or_unknown(value: float | None) -> float:
    return -1.0 if value is None else float(value)


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
        plane = self.plane
        now = plane.clock()
        fleet = plane.fleet(now)
        out = []
        for e in fleet.engines:
            s = e.sample
            out.append(admin_pb2.Engine(
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
            ))
        return admin_pb2.ListEnginesResponse(engines=out)
