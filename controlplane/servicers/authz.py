"""ext_authz ``Check``: proto -> ``InferenceRequest`` -> ``AdmissionCore`` -> proto. Thin by design; the rules live in core.

A parked request keeps its Check open: the handler awaits a future that the control plane resolves when a wake admits the
request or its park deadline sheds it. When the client goes away Envoy cancels the RPC; the handler then drops the request
from the parking lot or, if an admission raced the cancellation, releases the ticket it was given.

A Check always answers (issue 8): Envoy runs ext_authz fail-open and lets *every* failed Check through unpinned, past
every cap. A defect behind the handler is answered 500 ``internal_error`` (counted, logged with the request id), giving
back the ticket, parked entry or pre-charge the Check held; a call that queued in gRPC longer than
``controlplane.max_check_queue_ms`` is answered 503 ``controlplane_overloaded`` + retry-after before any parsing
(``queued_s``). Only a cancelled Check (the client left) ends without an answer, and it leaves nothing behind.
With ``tenants:`` configured a request is authenticated, its model and class checked and it is pre-charged before
admission (``_tenant_gate``); any answer other than an admission gives the charge back. A long prompt may be counted
by an engine's tokenizer first (``admission.tokenize_above_chars``: ``CheckPort.counted_prompt``). With
``tracing.enabled`` the wiring registers ``tracing.TracedAuthorizationServicer``, which runs this Check as it is inside a span.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qs
import grpc
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc

from controlplane.core.model import Decision, InferenceRequest, Outcome, Priority, Reason, Verdict
from controlplane.core.waits import refuse
from controlplane.core.tenants import Tenant, tenant_priority
from controlplane.ports import CheckPort, CheckSettings, QuotaPort
from controlplane.core.request import RequestError, parse_request
# The CheckResponse builders live at the edge, with every status and error code (edge.py).
from controlplane.edge import Failure, TenantCharge, check_admit as _admit, check_deny as _deny, check_error as _error
from controlplane.names import AVOID_PARAM, PRIORITY_HEADER
from controlplane.admission.quota import Refused
from ratelimit import ChargeIdInUse

log = logging.getLogger("sluice.authz")

INTERNAL_ERROR = Failure.INTERNAL_ERROR
OVERLOADED = Failure.CONTROLPLANE_OVERLOADED
_OVERLOAD_LOG_EVERY_S = 5.0
MAX_CHARGED_REQUEST_ID = 200
"""A tenant's request is charged under its request id (the limiter takes up to 256 characters, and a duplicate gets a
9-character suffix); a longer client-sent x-request-id is replaced by a fresh one."""


def queued_s(context: grpc.aio.ServicerContext[Any, Any], authz_timeout_s: float) -> float | None:
    """How long the call waited before its handler ran: Envoy's timeout minus what its deadline leaves. grpc-core fixes
    the deadline when the call arrives, so this includes the time it queued before the handler ran (measured, not
    assumed: docs/architecture.md, Failure modes). None without a deadline (a caller other than Envoy), which is never
    shed."""
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, authz_timeout_s - remaining)


def _models_for(tenant: Tenant, outcome: Outcome) -> Outcome:
    """``GET /v1/models`` lists only the models a tenant may use."""
    if tenant.models_allowed is None:
        return outcome
    d = outcome.decision
    return replace(outcome, decision=replace(d, models=tuple(m for m in d.models if tenant.allows(m.model_id))))


def avoided_engine(path: str) -> str | None:
    """The engine a retried request must not go back to (``?sluice_avoid=<engine>``, added by the retry redirector)."""
    _, sep, query = path.partition("?")
    if not sep:  # almost every Check: no query string, nothing to parse
        return None
    values = parse_qs(query).get(AVOID_PARAM)
    return values[0] if values else None


@dataclass(slots=True)
class _Gate:
    """What a tenant's request brings from the tenant gate to the answer."""

    request_id: str
    request: InferenceRequest
    outcome: Outcome | None = None
    """A refusal (model not allowed, over the budget, limiter unavailable): no admission is asked for."""
    charge: TenantCharge | None = None
    """Its pre-charge (``charge.charged``: an open charge under ``request_id``, to settle or give back)."""
    headers: tuple[tuple[str, str], ...] = ()
    """A refusal's ``x-ratelimit-*``."""


@dataclass(slots=True)
class _Flight:
    """One Check while it is answered: what a failure or its end must give back."""

    request_id: str
    """Unique among Checks in flight (``_unique``); the tenant gate may replace it (a charge id already in use)."""
    outcome: Outcome | None = None
    """The latest answer from admission: a failure after it gives its hold back."""
    charge: TenantCharge | None = None
    """A tenant's pre-charge: given back unless the request is admitted."""
    admitted: bool = False


class AuthorizationServicer(external_auth_pb2_grpc.AuthorizationServicer):
    def __init__(self, admission: CheckPort, quota: QuotaPort | None = None) -> None:
        self.admission = admission
        self.quota = quota
        """Tenants' budgets; None: nothing is charged (tenants still authenticate)."""
        self._overload_logged_at = float("-inf")
        self._in_flight: set[str] = set()
        """Request ids of the Checks being answered (parked ones included): the parking lot's keys."""

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> external_auth_pb2.CheckResponse:
        """One Check: refused at once when it queued past ``max_check_queue_ms``; else decided (``_decide``: tenant,
        parse, quota, admission, park) and answered. Never raises: a failure is a 500 that gives back what the Check
        held (its parked entry or ticket, its pre-charge)."""
        started = time.perf_counter()
        settings = self.admission.settings
        queued = queued_s(context, settings.authz_timeout_s)
        if queued is not None and queued * 1000 > settings.max_check_queue_ms:
            response = self._overloaded(queued, settings)
        else:
            http = request.attributes.request.http
            # Envoy's own x-request-id (its HCM makes one per request and forwards it to the engine), so the control
            # plane's log, the watch stream and the engine's log name a request the same way (``_unique``).
            flight = _Flight(self._unique(http.headers.get("x-request-id") or uuid.uuid4().hex))
            try:
                response = await self._decide(http, flight)
            except Exception:  # not BaseException: a cancelled Check (CancelledError) must still end the RPC
                response = self._failed(flight)
            finally:
                self._land(flight)
        self.admission.metrics.authz_seconds.observe(time.perf_counter() - started)
        return response

    async def _decide(self, http: Any, flight: _Flight) -> external_auth_pb2.CheckResponse:
        """Tenant, parse, the tenant's gate, admission, the park: the answer, with ``flight`` kept current (the latest
        outcome, the pre-charge) so that a failure can give back what is held."""
        port, settings = self.admission, self.admission.settings
        model: str | None = None
        parsed: InferenceRequest | None = None
        tenant: Tenant | None = None
        extra: tuple[tuple[str, str], ...] = ()
        if settings.tenants.enabled:
            # The key is hashed and dropped here: only its digest is looked up, nothing logs it.
            tenant = settings.tenants.identify(http.headers.get("authorization"))
        if settings.tenants.enabled and tenant is None:
            port.metrics.auth_refusals.labels(Reason.INVALID_API_KEY.value).inc()
            flight.outcome = Outcome(flight.request_id, Decision(
                Verdict.REJECT, Reason.INVALID_API_KEY,
                detail="Incorrect API key provided (send it as Authorization: Bearer <key>)"))
        else:
            try:
                parsed = await port.counted_prompt(parse_request(
                    http.method, http.path, http.raw_body, http.headers, settings.policy, port.prompt_rules),
                    http.raw_body)
            except RequestError as error:
                flight.outcome = Outcome(flight.request_id, refuse(error))
            else:
                model = parsed.model
                if tenant is not None:
                    gate = await self._tenant_gate(tenant, parsed, flight.request_id, http.headers.get(PRIORITY_HEADER))
                    flight.request_id, parsed, flight.charge, extra = gate.request_id, gate.request, gate.charge, \
                        gate.headers
                    flight.outcome = gate.outcome
                if flight.outcome is None:
                    flight.outcome = await port.check(flight.request_id, parsed)
        outcome = flight.outcome
        if outcome.decision.verdict is Verdict.PARK:
            outcome = flight.outcome = await port.wait_parked(flight.request_id)
        if tenant is not None and outcome.decision.verdict is Verdict.ANSWER:
            outcome = flight.outcome = _models_for(tenant, outcome)
        port.record_outcome(model, outcome, parsed, tenant.name if tenant is not None else "")
        response = self._answer(outcome, avoided_engine(http.path), flight.charge, extra, parsed)
        flight.admitted = response.HasField("ok_response")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("Check %s: %s %s on %s", flight.request_id, outcome.decision.verdict.value, model or "?",
                      outcome.decision.engine or "-", extra={"request_id": flight.request_id})
        return response

    def _failed(self, flight: _Flight) -> external_auth_pb2.CheckResponse:
        """A Check that raised inside the control plane: logged, counted, its hold given back, answered 500."""
        log.exception("Check %s failed inside the control plane; answered 500 %s", flight.request_id, INTERNAL_ERROR,
                      extra={"request_id": flight.request_id})
        self.admission.metrics.authz_internal_errors.inc()
        self.admission.give_back(flight.request_id, flight.outcome)
        return _error(INTERNAL_ERROR, f"The admission control plane failed on this request (id "
                      f"{flight.request_id}); it was not forwarded", None)

    def _land(self, flight: _Flight) -> None:
        """However a Check ended: it is no longer in flight, and a pre-charge of a request no engine will see (refused,
        shed, timed out in the lot, cancelled, failed) is given back."""
        self._in_flight.discard(flight.request_id)
        charge = flight.charge
        if charge is not None and charge.charged and not flight.admitted and self.quota is not None:
            self.quota.refund(flight.request_id)

    async def _tenant_gate(self, tenant: Tenant, parsed: InferenceRequest, request_id: str,
                           asked_priority: str | None) -> _Gate:
        """A tenant's request before admission (its key was hashed and found before the body was read: else 401
        ``invalid_api_key``): its model allowed (else 403 ``model_not_allowed``), ``x-sluice-priority`` capped at the
        tenant's highest class (absent: the tenant's default), its pre-charge taken under the request id (over a
        budget: 429 ``rate_limit_exceeded``)."""
        port = self.admission
        if parsed.model is None:  # GET /v1/models: answered, never charged
            return _Gate(request_id, parsed)
        if not tenant.allows(parsed.model):
            port.metrics.auth_refusals.labels(Reason.MODEL_NOT_ALLOWED.value).inc()
            return _Gate(request_id, parsed, Outcome(request_id, Decision(
                Verdict.REJECT, Reason.MODEL_NOT_ALLOWED,
                detail=f"This API key may not use the model {parsed.model!r}")))
        parsed = replace(parsed, priority=tenant_priority(tenant, asked_priority, parsed.priority), tenant=tenant.name)
        if len(request_id) > MAX_CHARGED_REQUEST_ID:  # a client's own x-request-id, too long to name a charge
            self._in_flight.discard(request_id)
            request_id = self._unique(uuid.uuid4().hex)
        if self.quota is None:
            return _Gate(request_id, parsed, charge=TenantCharge(tenant.name, parsed.prompt_tokens, False))
        try:
            charged = await self.quota.charge(tenant, parsed, request_id)
        except ChargeIdInUse:  # a client's own x-request-id, still open from an earlier request: this one gets another
            request_id = self._renamed(request_id)
            charged = await self.quota.charge(tenant, parsed, request_id)
        if isinstance(charged, Refused):
            return _Gate(request_id, parsed, Outcome(request_id, charged.decision), headers=charged.headers)
        return _Gate(request_id, parsed, charge=TenantCharge(tenant.name, parsed.prompt_tokens,
                                                             charged.charge_id is not None, charged.headers))

    def _renamed(self, request_id: str) -> str:
        self._in_flight.discard(request_id)
        return self._unique(f"{request_id}.{uuid.uuid4().hex[:8]}")

    def _unique(self, request_id: str) -> str:
        """``request_id``, or it with a suffix when a Check in flight or an open ticket already has it: a client's own
        id reused while its first request streams, or a Check Envoy asks again after the replica that admitted it died
        before answering (that admission's ticket is left to the reaper)."""
        while request_id in self._in_flight or self.admission.ticket_open(request_id):
            request_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
        self._in_flight.add(request_id)
        return request_id

    def _answer(self, outcome: Outcome, avoided: str | None, charge: TenantCharge | None,
                extra: tuple[tuple[str, str], ...], request: InferenceRequest | None) -> external_auth_pb2.CheckResponse:
        if outcome.ticket is None:
            return _deny(outcome, extra)
        if outcome.decision.engine == avoided:  # a retry of a request this engine just failed: never the same twice
            self.admission.release_ticket(outcome.ticket.ticket_id)
            return _error(Failure.UPSTREAM_UNAVAILABLE, f"Engine {avoided} failed this request and no other engine "
                          "could take it; retry later", 1)
        preemptible = request is not None and request.priority is Priority.SHEDDABLE and \
            self.admission.settings.policy.fairness.preempt_sheddable
        return _admit(outcome, charge, request, preemptible)

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
