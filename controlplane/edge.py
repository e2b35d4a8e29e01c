"""The HTTP edge: how an outcome reaches a client, in one place.

The decision core speaks verdicts and reasons (``controlplane/core/model.py``); clients speak HTTP and the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}``. ``REPLIES`` is the one table between them: every ``Reason`` and every
``Failure`` (an answer with no decision behind it: the Check's own failures, Envoy's local replies) -> HTTP status, OpenAI
error type and code. Every error code sluice sends is spelled here once, so a Check denial and an Envoy local reply for the
same code cannot drift apart: the Check's denials (``check_deny``, ``check_error``) and the xDS builders' local replies and
direct responses (``controlplane/xds/resources/listener.py``) both render through ``error_json``.

A leaf: protos, ``core.model`` and ``names`` only (no servicer, no xDS module), so the Check, the admin API, the retry
redirector and the xDS builders can all import it without a cycle.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from controlplane.core.engines import ServedModel
from controlplane.core.model import Decision, InferenceRequest, Reason, Verdict
from controlplane.names import (
    CONTENT_TYPE_HEADER, ENGINE_HEADER, PARKED_MS_HEADER, PREEMPTIBLE_HEADER, RETRY_AFTER_HEADER, ROUTE_REASON_HEADER,
    TICKET_HEADER,
)

if TYPE_CHECKING:
    from controlplane.core.model import Outcome

INVALID_REQUEST = "invalid_request_error"
"""OpenAI error type of a request the client must change (4xx)."""
SERVER_ERROR = "server_error"
"""OpenAI error type of a request the client may retry unchanged (5xx)."""
RATE_LIMIT_ERROR = "rate_limit_error"
"""Error type of a 429: the request is fine, its tenant's budget is not (the code, ``rate_limit_exceeded``, is
OpenAI's; clients such as the ``openai`` package key on the status: ``RateLimitError``)."""
JSON_CONTENT_TYPE = "application/json"


class Failure(enum.StrEnum):
    """Answers with no decision behind them; each value is the error code the client reads."""

    INTERNAL_ERROR = "internal_error"
    """The control plane failed on this Check (a defect); the request is never forwarded unchecked."""
    CONTROLPLANE_OVERLOADED = "controlplane_overloaded"
    """The Check waited in gRPC's queue longer than ``controlplane.max_check_queue_ms``."""
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    """The chosen engine failed before its first byte and no other could take the request."""
    CONTROLPLANE_UNAVAILABLE = "controlplane_unavailable"
    """Envoy could not reach the control plane (fail-closed, or ``GET /v1/models`` while it is down)."""
    NOT_ADMITTED = "not_admitted"
    """Envoy let an inference request through unanswered (fail-open) and it names no model to route by."""
    ENGINE_OVERLOADED = "engine_overloaded"
    """Fail-open traffic overflowed an engine's circuit breaker."""
    REQUEST_TOO_LARGE = "request_too_large"
    REQUEST_HEADER_FIELDS_TOO_LARGE = "request_header_fields_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    INVALID_HTTP_REQUEST = "invalid_http_request"
    PREEMPTED = "preempted"
    """A running sheddable stream ended for a critical request (``fairness.preempt_sheddable``)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """How one reason or failure reaches the client: the HTTP status and, for an error, its OpenAI type and code."""

    status: int
    code: str = ""
    """The OpenAI error ``code`` ("" when the outcome is not an error)."""
    type: str = ""
    """The OpenAI error ``type`` ("" when the outcome is not an error)."""

    @property
    def is_error(self) -> bool:
        return bool(self.code)


_OK = Reply(200)
"""Admitted, answered, or parked: a park ends in an admission (or a shed, which has its own reason), so it shows 200."""


def _client(status: int, code: str) -> Reply:
    return Reply(status, code, INVALID_REQUEST)


def _server(code: str, status: int = 503) -> Reply:
    return Reply(status, code, SERVER_ERROR)


REPLIES: Mapping[Reason | Failure, Reply] = {
    # admitted, answered
    Reason.FINISH_SOONEST: _OK,
    Reason.SATISFICING_BAND: _OK,
    Reason.SESSION_AFFINITY: _OK,
    Reason.STALE_FAIL_OPEN: _OK,
    Reason.WORK_CONSERVING: _OK,
    Reason.FAIR_SHARE: _OK,
    Reason.PREFIX_CACHE: _OK,
    Reason.MODEL_LIST: _OK,
    # refused: the request itself
    Reason.INVALID_JSON: _client(400, "invalid_json"),
    Reason.JSON_TOO_DEEP: _client(400, "json_too_deep"),
    Reason.MISSING_MODEL: _client(400, "missing_model"),
    Reason.INVALID_MAX_TOKENS: _client(400, "invalid_max_tokens"),
    Reason.INVALID_PRIORITY: _client(400, "invalid_priority"),
    Reason.INVALID_MAX_TTFT_MS: _client(400, "invalid_max_ttft_ms"),
    Reason.INVALID_SESSION: _client(400, "invalid_session"),
    Reason.CONTEXT_LENGTH: _client(400, "context_length_exceeded"),
    Reason.UNKNOWN_MODEL: _client(404, "model_not_found"),
    Reason.UNKNOWN_PATH: _client(404, "unknown_url"),  # also Envoy's answer to a path it never routes
    # refused: who asks (tenants), and their budget
    Reason.INVALID_API_KEY: _client(401, "invalid_api_key"),
    Reason.MODEL_NOT_ALLOWED: _client(403, "model_not_allowed"),
    Reason.RATE_LIMITED: Reply(429, "rate_limit_exceeded", RATE_LIMIT_ERROR),
    # parked (fit rules and waits)
    Reason.CAP: _OK,
    Reason.KV_WATERMARK: _OK,
    Reason.KV_NEED: _OK,
    Reason.BOX_POOL: _OK,
    Reason.QUALITY_CAP: _OK,
    Reason.ADAPTER_SLOTS: _OK,
    Reason.QUEUED_BEHIND: _OK,
    Reason.WAITING_FOR_FASTER: _OK,
    Reason.TTFT_DEADLINE: _OK,
    Reason.RESERVED_SHARE: _OK,
    Reason.PREEMPTING: _OK,
    # shed (always with retry-after)
    Reason.NO_READY_ENGINE: _server("no_ready_engine"),
    Reason.VERSION_FLOOR: _server("version_floor"),
    Reason.SATURATED: _server("saturated"),
    Reason.QUEUE_FULL: _server("queue_full"),
    Reason.PARK_TIMEOUT: _server("park_timeout"),
    Reason.OVERLOADED: _server("overloaded"),
    Reason.TTFT_UNMEETABLE: _server("ttft_unmeetable"),
    Reason.STORE_UNAVAILABLE: _server("store_unavailable"),
    Reason.RATELIMIT_UNAVAILABLE: _server("ratelimit_unavailable"),
    # no decision behind them: the Check's own answers
    Failure.INTERNAL_ERROR: _server("internal_error", 500),
    Failure.CONTROLPLANE_OVERLOADED: _server("controlplane_overloaded"),
    Failure.UPSTREAM_UNAVAILABLE: _server("upstream_unavailable"),
    Failure.PREEMPTED: _server("preempted"),
    # ... and Envoy's local replies (xds/resources/listener.py)
    Failure.CONTROLPLANE_UNAVAILABLE: _server("controlplane_unavailable"),
    Failure.NOT_ADMITTED: _server("not_admitted"),
    Failure.ENGINE_OVERLOADED: _server("engine_overloaded"),
    Failure.REQUEST_TOO_LARGE: _client(413, "request_too_large"),
    Failure.REQUEST_HEADER_FIELDS_TOO_LARGE: _client(431, "request_header_fields_too_large"),
    Failure.REQUEST_TIMEOUT: _client(408, "request_timeout"),
    Failure.INVALID_HTTP_REQUEST: _client(400, "invalid_http_request"),
}


def reply(key: Reason | Failure) -> Reply:
    return REPLIES[key]


def openai_error(message: str, err_type: str, code: str) -> str:
    """The OpenAI error shape every sluice error uses (JSON text)."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}})


def error_json(key: Reason | Failure, message: str) -> str:
    """The error body for ``key``, with its type and code from ``REPLIES``."""
    r = REPLIES[key]
    if not r.is_error:
        raise ValueError(f"{key} is not an error")
    return openai_error(message, r.type, r.code)


def sse_error_event(error: str) -> bytes:
    """An error in a stream that already answered 200: one SSE event carrying the OpenAI error object (``error``, as
    ``error_json`` renders it), which the ``openai`` client raises as ``APIError``."""
    return b"data: " + error.encode() + b"\n\n"


def model_list_json(models: tuple[ServedModel, ...]) -> str:
    """``GET /v1/models`` in the OpenAI list shape (plus each model's ``max_model_len``)."""
    data = [{"id": m.model_id, "object": "model", "created": 0, "owned_by": "sluice", "root": m.model_id,
             "parent": m.parent, "max_model_len": m.max_model_len} for m in models]
    return json.dumps({"object": "list", "data": data})


def http_status(decision: Decision) -> int:
    return REPLIES[decision.reason].status


def response_body(decision: Decision) -> str:
    """What the client reads when the Check answers instead of an engine: the model list, or the error."""
    if decision.verdict is Verdict.ANSWER:
        return model_list_json(decision.models)
    return error_json(decision.reason, decision.detail)


# -- ext_authz CheckResponses ---------------------------------------------------------------------------------------------
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header(key: str, value: str) -> base_pb2.HeaderValueOption:
    """A header that replaces any earlier value. append_action must be explicit: the default APPEND_IF_EXISTS_OR_ADD would
    add a second value, and cluster_header routes on the first one (envoy-notes, ext_authz HEADER GOTCHA)."""
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE)


@dataclass(frozen=True, slots=True)
class TenantCharge:
    """What an admitted tenant's request carries to its access-log entry and its client (controlplane/admission/quota.py)."""

    tenant: str
    prompt_tokens: int
    """The Check's prompt estimate: the settle's fallback when the engine reports no usage."""
    charged: bool
    """An open charge under the ticket id awaits its settle (False: the tenant has no limits, or the limiter failed
    open)."""
    headers: tuple[tuple[str, str], ...] = ()
    """``x-ratelimit-*`` for the client's response."""


def authz_metadata(ticket_id: str, engine: str, charge: TenantCharge | None = None,
                   request: InferenceRequest | None = None) -> struct_pb2.Struct:
    """The admission's dynamic metadata: the access log reads the ticket back from it to release it, the prompt the
    Check counted (``prompt_chars``, ``prompt_messages``) and estimated (``prompt_tokens``) to learn from the engine's
    count, and a tenant's name and whether it was charged to settle it (Envoy's Lua usage filter counts deltas only when
    ``tenant`` is there)."""
    s = struct_pb2.Struct()
    s.update({"ticket": ticket_id, "engine": engine})
    if request is not None:
        s.update({"prompt_chars": request.prompt_chars, "prompt_messages": request.prompt_messages,
                  "prompt_tokens": request.prompt_tokens})
    if charge is not None:
        s.update({"tenant": charge.tenant, "prompt_tokens": charge.prompt_tokens, "charged": charge.charged})
    return s


def _parked(outcome: Outcome) -> list[base_pb2.HeaderValueOption]:
    return [header(PARKED_MS_HEADER, str(round(outcome.parked_for * 1000)))] if outcome.parked_for > 0 else []


def check_admit(outcome: Outcome, charge: TenantCharge | None = None,
                request: InferenceRequest | None = None, preemptible: bool = False) -> external_auth_pb2.CheckResponse:
    """An admission: the engine pinned for the route, the ticket for the retry redirector, the reason (and a tenant's
    ``x-ratelimit-*``) for the client. ``preemptible``: the stream goes through ext_proc, which can end it."""
    decision, ticket = outcome.decision, outcome.ticket
    assert decision.engine is not None and ticket is not None
    limits = [header(k, v) for k, v in charge.headers] if charge is not None else []
    pin = [header(ENGINE_HEADER, decision.engine), header(TICKET_HEADER, ticket.ticket_id)]
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        ok_response=external_auth_pb2.OkHttpResponse(
            # The ticket rides to the engine (never back to the client) so the retry redirector can release it.
            headers=[*pin, header(PREEMPTIBLE_HEADER, "1")] if preemptible else pin,
            response_headers_to_add=[header(ENGINE_HEADER, decision.engine),
                                     header(ROUTE_REASON_HEADER, decision.reason.value), *_parked(outcome), *limits],
            # A tenant's API key is sluice's secret, not the engine's: it never reaches an engine (or its logs). Without
            # tenants the client's Authorization passes through untouched (an engine's own --api-key keeps working).
            headers_to_remove=["authorization"] if charge is not None else [],
        ),
        dynamic_metadata=authz_metadata(ticket.ticket_id, decision.engine, charge, request),
    )


def check_deny(outcome: Outcome, extra: tuple[tuple[str, str], ...] = ()) -> external_auth_pb2.CheckResponse:
    """Any outcome without a ticket: a refusal, a shed, or the model list (ANSWER, a "denial" with status 200: Envoy
    replies locally and no engine is involved). ``extra``: more headers (a rate-limit refusal's ``x-ratelimit-*``)."""
    decision = outcome.decision
    headers = [header(ROUTE_REASON_HEADER, decision.reason.value)]
    if decision.retry_after_s is not None:
        headers.append(header(RETRY_AFTER_HEADER, str(decision.retry_after_s)))
    headers += _parked(outcome)
    headers += [header(k, v) for k, v in extra]
    return _denied(http_status(decision), headers, response_body(decision))


def check_error(failure: Failure, message: str, retry_after_s: int | None) -> external_auth_pb2.CheckResponse:
    """A denial the Check makes itself (no decision behind it), in the same OpenAI shape as every other sluice error."""
    headers = [header(ROUTE_REASON_HEADER, failure.value)]
    if retry_after_s is not None:
        headers.append(header(RETRY_AFTER_HEADER, str(retry_after_s)))
    return _denied(REPLIES[failure].status, headers, error_json(failure, message))


def _denied(status: int, headers: list[base_pb2.HeaderValueOption], body: str) -> external_auth_pb2.CheckResponse:
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=[header(CONTENT_TYPE_HEADER, JSON_CONTENT_TYPE), *headers],
            body=body,
        ),
    )
