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
  (``authz_timeout_s``): grpc-core fixes the deadline when the call arrives, so ``authz_timeout_s -
  context.time_remaining()`` includes the time the call queued before this handler ran (measured, not assumed).

Only a cancelled Check (the client left) ends without an answer, and it leaves no ticket or parked entry behind.

With ``tracing.enabled`` the wiring registers ``tracing.TracedAuthorizationServicer`` instead, which runs this Check as it is
inside an OpenTelemetry span; tracing off, nothing here changes.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any
from urllib.parse import parse_qs
import grpc
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc

from controlplane.core.admission import Outcome
from controlplane.core.decide import refuse
from controlplane.core.model import InferenceRequest, Verdict
from controlplane.ports import CheckPort, CheckSettings
from controlplane.core.request import RequestError, parse_request
# The CheckResponse builders live at the edge, with every status and error code (edge.py).
from controlplane.edge import Failure, check_admit as _admit, check_deny as _deny, check_error as _error
from controlplane.names import AVOID_PARAM

log = logging.getLogger("sluice.authz")

INTERNAL_ERROR = Failure.INTERNAL_ERROR
OVERLOADED = Failure.CONTROLPLANE_OVERLOADED
_OVERLOAD_LOG_EVERY_S = 5.0


def queued_s(context: grpc.aio.ServicerContext[Any, Any], authz_timeout_s: float) -> float | None:
    """How long the call waited before its handler ran: Envoy's timeout minus what its deadline leaves. None without a
    deadline (a caller other than Envoy), which is never shed."""
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, authz_timeout_s - remaining)


def avoided_engine(path: str) -> str | None:
    """The engine a retried request must not go back to (``?sluice_avoid=<engine>``, added by the retry redirector)."""
    _, sep, query = path.partition("?")
    if not sep:  # almost every Check: no query string, nothing to parse
        return None
    values = parse_qs(query).get(AVOID_PARAM)
    return values[0] if values else None


class AuthorizationServicer(external_auth_pb2_grpc.AuthorizationServicer):
    def __init__(self, admission: CheckPort) -> None:
        self.admission = admission
        self._overload_logged_at = float("-inf")
        self._in_flight: set[str] = set()
        """Request ids of the Checks being answered (parked ones included): the parking lot's keys."""

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> external_auth_pb2.CheckResponse:
        started = time.perf_counter()
        port, settings = self.admission, self.admission.settings
        queued = queued_s(context, settings.authz_timeout_s)
        if queued is not None and queued * 1000 > settings.max_check_queue_ms:
            response = self._overloaded(queued, settings)
        else:
            http = request.attributes.request.http
            # Envoy's own x-request-id (its HCM makes one per request and forwards it to the engine), so the control
            # plane's log, the watch stream and the engine's log name a request the same way. It keys the parking lot,
            # so it must be unique among Checks in flight: a client can send its own (Envoy keeps an internal caller's),
            # and a duplicate gets a suffix rather than the other request's place.
            request_id = self._unique(http.headers.get("x-request-id") or uuid.uuid4().hex)
            outcome: Outcome | None = None  # the latest answer from admission: a failure after it must give its hold back
            try:
                model: str | None = None
                parsed: InferenceRequest | None = None
                try:
                    parsed = parse_request(http.method, http.path, http.raw_body, http.headers, settings.policy)
                except RequestError as error:
                    outcome = Outcome(request_id, refuse(error))
                else:
                    model = parsed.model
                    outcome = await port.check(request_id, parsed)
                if outcome.decision.verdict is Verdict.PARK:
                    outcome = await port.wait_parked(request_id)
                port.record_outcome(model, outcome, parsed)
                response = self._answer(outcome, avoided_engine(http.path))
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("Check %s: %s %s on %s", request_id, outcome.decision.verdict.value, model or "?",
                              outcome.decision.engine or "-", extra={"request_id": request_id})
            except Exception:  # not BaseException: a cancelled Check (CancelledError) must still end the RPC
                log.exception("Check %s failed inside the control plane; answered 500 %s", request_id, INTERNAL_ERROR,
                              extra={"request_id": request_id})
                port.metrics.authz_internal_errors.inc()
                port.give_back(request_id, outcome)
                response = _error(INTERNAL_ERROR, f"The admission control plane failed on this request (id "
                                  f"{request_id}); it was not forwarded", None)
            finally:
                self._in_flight.discard(request_id)
        port.metrics.authz_seconds.observe(time.perf_counter() - started)
        return response

    def _unique(self, request_id: str) -> str:
        while request_id in self._in_flight:
            request_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
        self._in_flight.add(request_id)
        return request_id

    def _answer(self, outcome: Outcome, avoided: str | None) -> external_auth_pb2.CheckResponse:
        if outcome.ticket is None:
            return _deny(outcome)
        if outcome.decision.engine == avoided:  # a retry of a request this engine just failed: never the same twice
            self.admission.release_ticket(outcome.ticket.ticket_id)
            return _error(Failure.UPSTREAM_UNAVAILABLE, f"Engine {avoided} failed this request and no other engine "
                          "could take it; retry later", 1)
        return _admit(outcome)

    def _overloaded(self, queued: float, settings: CheckSettings) -> external_auth_pb2.CheckResponse:
        """Shed before any work: under overload the cheapest answer is the one that lets the backlog drain."""
        self.admission.metrics.authz_overloaded.inc()
        if time.monotonic() - self._overload_logged_at >= _OVERLOAD_LOG_EVERY_S:  # one line per burst, not per Check
            self._overload_logged_at = time.monotonic()
            log.warning("control plane overloaded: a Check waited %.2fs (> max_check_queue_ms %s) before it ran; "
                        "answering 503 %s (count: sluice_authz_overloaded_total)", queued,
                        settings.max_check_queue_ms, OVERLOADED)
        return _error(OVERLOADED, f"The admission control plane is overloaded (this request waited {queued:.1f}s "
                      "for it); retry later", settings.overload_retry_after_s)
