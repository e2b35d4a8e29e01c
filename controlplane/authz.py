"""ext_authz ``Check``: proto -> ``InferenceRequest`` -> ``AdmissionCore`` -> proto. Thin by design; the rules live in core.

A parked request keeps its Check open: the handler awaits a future that the control plane resolves when a wake admits the
request or its park deadline sheds it. When the client goes away Envoy cancels the RPC; the handler then drops the request
from the parking lot (it holds nothing) or, if an admission raced the cancellation, releases the ticket it was given.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2

from controlplane.core.admission import Outcome
from controlplane.core.decide import RequestError, parse_request, refuse
from controlplane.core.model import Verdict
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
        request_id = uuid.uuid4().hex
        now = plane.clock()
        try:
            parsed = parse_request(http.method, http.path, http.raw_body, http.headers, plane.config.policy)
        except RequestError as error:
            outcome, model = Outcome(request_id, refuse(error)), None
        else:
            outcome, model = plane.admission.check(request_id, parsed, plane.fleet(now), now), parsed.model
        if outcome.decision.verdict is Verdict.PARK:
            plane.metrics.admission_parked.labels(plane.model_label(model)).inc()
            outcome = await plane.wait_parked(request_id)
        plane.record_outcome(model, outcome)
        plane.metrics.authz_seconds.observe(time.perf_counter() - started)
        return _admit(outcome) if outcome.ticket is not None else _deny(outcome)


def _admit(outcome: Outcome) -> external_auth_pb2.CheckResponse:
    decision, ticket = outcome.decision, outcome.ticket
    assert decision.engine is not None and ticket is not None
    response_headers = [
        _header(ENGINE_HEADER, decision.engine),
        _header("x-sluice-route-reason", decision.reason.value),
    ]
    if outcome.parked_for > 0:
        response_headers.append(_header("x-sluice-parked-ms", str(round(outcome.parked_for * 1000))))
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[_header(ENGINE_HEADER, decision.engine)],
            response_headers_to_add=response_headers,
        ),
        dynamic_metadata=authz_metadata(ticket.ticket_id, decision.engine),
    )


def _deny(outcome: Outcome) -> external_auth_pb2.CheckResponse:
    decision = outcome.decision
    headers = [_header("content-type", "application/json"), _header("x-sluice-route-reason", decision.reason.value)]
    if decision.retry_after_s is not None:
        headers.append(_header("retry-after", str(decision.retry_after_s)))
    if outcome.parked_for > 0:
        headers.append(_header("x-sluice-parked-ms", str(round(outcome.parked_for * 1000))))
    # The model list (ANSWER) is a "denial" with status 200: Envoy replies locally and no engine is involved.
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=decision.status),  # type: ignore[arg-type]
            headers=headers,
            body=decision.body.decode(),
        ),
    )
