"""ext_authz ``Check``: proto -> ``InferenceRequest`` -> ``decide`` -> proto. Thin by design; the rules live in core."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2

from controlplane.core.decide import RequestError, decide, parse_request, refuse
from controlplane.core.model import Decision, Verdict
from controlplane.xds.resources import ENGINE_HEADER, authz_metadata

if TYPE_CHECKING:
    from controlplane.app import ControlPlane

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # append_action must be explicit: the default APPEND_IF_EXISTS_OR_ADD would add a second value, and cluster_header
    # routes on the first one (envoy-notes, ext_authz HEADER GOTCHA).
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE)


class AuthorizationServicer(external_auth_pb2_grpc.AuthorizationServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> external_auth_pb2.CheckResponse:
        started = time.perf_counter()
        plane = self.plane
        http = request.attributes.request.http
        now = plane.clock()
        try:
            parsed = parse_request(http.method, http.path, http.raw_body)
        except RequestError as error:
            decision = refuse(error)
            model = "-"
        else:
            decision = decide(parsed, plane.fleet(now), now)
            model = parsed.model or "-"
        if decision.verdict is Verdict.ADMIT:
            assert decision.engine is not None
            ticket = plane.ledger.admit(uuid.uuid4().hex, decision.engine, model, now)
            plane.metrics.tickets_open.labels(decision.engine).inc()
            response = _admit(decision, ticket.ticket_id)
        else:
            response = _deny(decision)
        plane.metrics.authz_decisions.labels(
            model if decision.reason.value != "unknown_model" else "-", decision.verdict.value, decision.reason.value
        ).inc()
        plane.metrics.authz_seconds.observe(time.perf_counter() - started)
        return response


def _admit(decision: Decision, ticket_id: str) -> external_auth_pb2.CheckResponse:
    assert decision.engine is not None
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[_header(ENGINE_HEADER, decision.engine)],
            response_headers_to_add=[
                _header(ENGINE_HEADER, decision.engine),
                _header("x-sluice-route-reason", decision.reason.value),
            ],
        ),
        dynamic_metadata=authz_metadata(ticket_id, decision.engine),
    )


def _deny(decision: Decision) -> external_auth_pb2.CheckResponse:
    headers = [_header("content-type", "application/json"), _header("x-sluice-route-reason", decision.reason.value)]
    if decision.retry_after_s is not None:
        headers.append(_header("retry-after", str(decision.retry_after_s)))
    # The model list (ANSWER) is a "denial" with status 200: Envoy replies locally and no engine is involved.
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=decision.status),  # type: ignore[arg-type]
            headers=headers,
            body=decision.body.decode(),
        ),
    )
