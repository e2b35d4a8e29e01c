"""ext_authz ``Check``: proto -> ``InferenceRequest`` -> ``AdmissionCore`` -> proto. Thin by design; the rules live in core.

A parked request keeps its Check open: the handler awaits a future that the control plane resolves when a wake admits the
request or its park deadline sheds it. When the client goes away Envoy cancels the RPC; the handler then drops the request
from the parking lot (it holds nothing) or, if an admission raced the cancellation, releases the ticket it was given.

A Check always answers (issue 8). Envoy runs ext_authz fail-open and treats *every* failed Check, not only an unreachable
control plane, as "let the request through unpinned", past every cap. So:

- a defect anywhere behind the handler is answered 500 ``internal_error`` (counted, logged with the request id), and a
  ticket or parked entry the failed Check already held is given back;
- a call that waited in gRPC's queue longer than ``controlplane.max_check_queue_ms`` is answered 503
  ``controlplane_overloaded`` + retry-after before any parsing. The wait is read from the deadline Envoy sets
  (``authz_timeout_seconds``): grpc-core fixes the deadline when the call arrives, so ``authz_timeout_seconds -
  context.time_remaining()`` includes the time the call queued before this handler ran (measured, not assumed).

Only a cancelled Check (the client left) ends without an answer, and it leaves no ticket or parked entry behind.
"""

from __future__ import annotations

import logging
import time
import uuid
from urllib.parse import parse_qs
from typing import TYPE_CHECKING

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2

from controlplane.core.admission import Outcome
from controlplane.core.decide import RequestError, error_body, parse_request, refuse
from controlplane.core.model import Verdict
from controlplane.xds.resources import AVOID_PARAM, ENGINE_HEADER, TICKET_HEADER, authz_metadata

if TYPE_CHECKING:
    from controlplane.app import ControlPlane

log = logging.getLogger("sluice.authz")

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
INTERNAL_ERROR = "internal_error"
OVERLOADED = "controlplane_overloaded"
_OVERLOAD_LOG_EVERY_S = 5.0


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # append_action must be explicit: the default APPEND_IF_EXISTS_OR_ADD would add a second value, and cluster_header
    # routes on the first one (envoy-notes, ext_authz HEADER GOTCHA).
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE)


def queued_seconds(context: grpc.aio.ServicerContext, authz_timeout_seconds: float) -> float | None:
    """How long the call waited before its handler ran: Envoy's timeout minus what its deadline leaves. None without a
    deadline (a caller other than Envoy), which is never shed."""
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, authz_timeout_seconds - remaining)


def avoided_engine(path: str) -> str | None:
    """The engine a retried request must not go back to (``?sluice_avoid=<engine>``, added by the retry redirector)."""
    query = path.partition("?")[2]
    return next((values[0] for key, values in parse_qs(query).items() if key == AVOID_PARAM and values), None)


class AuthorizationServicer(external_auth_pb2_grpc.AuthorizationServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._overload_logged_at = float("-inf")

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> external_auth_pb2.CheckResponse:
        started = time.perf_counter()
        plane = self.plane
        request_id = uuid.uuid4().hex
        queued = queued_seconds(context, plane.config.authz_timeout_seconds)
        if queued is not None and queued * 1000 > plane.config.controlplane.max_check_queue_ms:
            response = self._overloaded(queued)
        else:
            outcome: Outcome | None = None  # the latest answer from admission: a failure after it must give its hold back
            try:
                http = request.attributes.request.http
                now = plane.clock()
                model: str | None = None
                try:
                    parsed = parse_request(http.method, http.path, http.raw_body, http.headers, plane.config.policy)
                except RequestError as error:
                    outcome = Outcome(request_id, refuse(error))
                else:
                    model = parsed.model
                    outcome = plane.admission.check(request_id, parsed, plane.fleet(now), now)
                if outcome.decision.verdict is Verdict.PARK:
                    plane.metrics.admission_parked.labels(plane.model_label(model)).inc()
                    outcome = await plane.wait_parked(request_id)
                plane.record_outcome(model, outcome)
                avoided = avoided_engine(http.path)
                if outcome.ticket is not None and outcome.decision.engine == avoided:
                    # A retry of a request this engine just failed: never the same engine twice.
                    plane.release_ticket(outcome.ticket.ticket_id)
                    response = _error(503, "upstream_unavailable", f"Engine {avoided} failed this request and no other "
                                      "engine could take it; retry later", 1)
                else:
                    response = _admit(outcome) if outcome.ticket is not None else _deny(outcome)
            except Exception:  # not BaseException: a cancelled Check (CancelledError) must still end the RPC
                response = self._internal_error(request_id, outcome)
        plane.metrics.authz_seconds.observe(time.perf_counter() - started)
        return response

    def _overloaded(self, queued: float) -> external_auth_pb2.CheckResponse:
        """Shed before any work: under overload the cheapest answer is the one that lets the backlog drain."""
        cp = self.plane.config.controlplane
        self.plane.metrics.authz_overloaded.inc()
        if time.monotonic() - self._overload_logged_at >= _OVERLOAD_LOG_EVERY_S:  # one line per burst, not per Check
            self._overload_logged_at = time.monotonic()
            log.warning("control plane overloaded: a Check waited %.2fs (> max_check_queue_ms %s) before it ran; "
                        "answering 503 %s (count: sluice_authz_overloaded_total)", queued, cp.max_check_queue_ms,
                        OVERLOADED)
        return _error(503, OVERLOADED, f"The admission control plane is overloaded (this request waited {queued:.1f}s "
                      "for it); retry later", cp.overload_retry_after_seconds)

    def _internal_error(self, request_id: str, outcome: Outcome | None) -> external_auth_pb2.CheckResponse:
        """A Check that failed is refused 500, never left to Envoy's fail-open. Whatever it held is given back: it may
        still be parked (the failure came before its wait), or hold a ticket no access-log entry will ever release."""
        plane = self.plane
        plane.metrics.authz_internal_errors.inc()
        log.exception("Check %s failed inside the control plane; answered 500 %s", request_id, INTERNAL_ERROR)
        try:
            if plane.admission.cancel(request_id):
                plane.metrics.parked_now.set(plane.admission.depth())
            if outcome is not None and outcome.ticket is not None:
                plane.release_ticket(outcome.ticket.ticket_id)
        except Exception:
            log.exception("Check %s: giving back what it held failed too (its lease will reap any ticket)", request_id)
        return _error(500, INTERNAL_ERROR, f"The admission control plane failed on this request (id {request_id}); "
                      "it was not forwarded", None)


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
            # The ticket rides to the engine (never back to the client) so the retry redirector can release it.
            headers=[_header(ENGINE_HEADER, decision.engine), _header(TICKET_HEADER, ticket.ticket_id)],
            response_headers_to_add=response_headers,
        ),
        dynamic_metadata=authz_metadata(ticket.ticket_id, decision.engine),
    )


def _deny(outcome: Outcome) -> external_auth_pb2.CheckResponse:
    decision = outcome.decision
    headers = [_header("x-sluice-route-reason", decision.reason.value)]
    if decision.retry_after_s is not None:
        headers.append(_header("retry-after", str(decision.retry_after_s)))
    if outcome.parked_for > 0:
        headers.append(_header("x-sluice-parked-ms", str(round(outcome.parked_for * 1000))))
    # The model list (ANSWER) is a "denial" with status 200: Envoy replies locally and no engine is involved.
    return _denied(decision.status, headers, decision.body.decode())


def _error(status: int, code: str, message: str, retry_after_s: int | None) -> external_auth_pb2.CheckResponse:
    """A denial the Check makes itself (no decision behind it), in the same OpenAI shape as every other sluice error."""
    headers = [_header("x-sluice-route-reason", code)]
    if retry_after_s is not None:
        headers.append(_header("retry-after", str(retry_after_s)))
    return _denied(status, headers, error_body(message, "server_error", code).decode())


def _denied(status: int, headers: list[base_pb2.HeaderValueOption], body: str) -> external_auth_pb2.CheckResponse:
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
            headers=[_header("content-type", "application/json"), *headers],
            body=body,
        ),
    )
