"""The admission decision, pure: ``decide(request, fleet, now) -> Decision``.

This is the first cut of DESIGN.md's decision model: bad requests are refused before they cost anything, and an admitted
request goes to the fresh engine serving its model with the least effective load (when every such engine is stale and policy
``observe.on_stale`` is ``open``, to the least loaded stale one, reason ``stale_fail_open``), where::

    effective_load(e) = max(0, probe_running(e) + probe_waiting(e) + unseen_load(e))

Ties go to the engine with the lower ``effective_load / max_num_seqs`` (more headroom), then to the name, so the choice is
deterministic. Caps, parking and shedding with a computed Retry-After build on this (issue 4).
"""

from __future__ import annotations

import json
from typing import Any

from controlplane.core.model import Decision, EngineView, Fleet, InferenceRequest, Reason, Verdict

#: Paths whose body names a model and is routed to an engine.
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

NO_ENGINE_RETRY_AFTER_S = 1


class RequestError(Exception):
    """A request refused before any decision; carries its HTTP status, reason and OpenAI error code."""

    def __init__(self, status: int, reason: Reason, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.code = code


def error_body(message: str, err_type: str, code: str) -> bytes:
    """The OpenAI error shape every sluice error uses."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}}).encode()


_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error"}


def refuse(error: RequestError) -> Decision:
    err_type = _ERROR_TYPES.get(error.status, "server_error")
    return Decision(
        Verdict.REJECT, error.reason, status=error.status, detail=str(error),
        body=error_body(str(error), err_type, error.code),
    )


def parse_request(method: str, path: str, raw_body: bytes) -> InferenceRequest:
    """Read what the decision needs from an HTTP request; raise ``RequestError`` for anything malformed."""
    route = path.split("?", 1)[0]
    if method == "GET" and route == "/v1/models":
        return InferenceRequest(method, route, model=None)
    if method != "POST" or route not in INFERENCE_PATHS:
        raise RequestError(404, Reason.UNKNOWN_PATH, f"Unknown request URL: {method} {route}", "unknown_url")
    try:
        body: Any = json.loads(raw_body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, Reason.MALFORMED_JSON, f"Request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, Reason.MALFORMED_JSON, "Request body must be a JSON object", "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, Reason.MISSING_MODEL, "You must provide a model parameter", "missing_model")
    return InferenceRequest(method, route, model=model, stream=bool(body.get("stream")))


def effective_load(engine: EngineView, fleet: Fleet) -> float:
    probe = engine.sample.queue if engine.sample is not None else None
    return max(0.0, (probe or 0.0) + fleet.unseen_load.get(engine.name, 0))


def model_list(fleet: Fleet) -> bytes:
    """``GET /v1/models`` for the whole fleet: every model an admissible engine serves, once."""
    seen: dict[str, dict[str, Any]] = {}
    for engine in fleet.engines:
        if engine.stale and not fleet.admit_stale:
            continue
        for m in engine.models:
            entry = seen.setdefault(
                m.model_id,
                {"id": m.model_id, "object": "model", "created": 0, "owned_by": "sluice", "root": m.model_id,
                 "parent": m.parent, "max_model_len": m.max_model_len},
            )
            if m.max_model_len and (entry["max_model_len"] or 0) < m.max_model_len:
                entry["max_model_len"] = m.max_model_len
    return json.dumps({"object": "list", "data": sorted(seen.values(), key=lambda e: e["id"])}).encode()


def decide(request: InferenceRequest, fleet: Fleet, now: float) -> Decision:
    """Choose what happens to ``request`` given ``fleet`` at ``now`` (see the module docstring for the rule)."""
    del now  # the first cut needs no time; the signature is the one later rules keep
    if request.model is None:
        return Decision(Verdict.ANSWER, Reason.MODEL_LIST, status=200, body=model_list(fleet))
    serving = [e for e in fleet.engines if e.serves(request.model)]
    if not serving:
        return refuse(
            RequestError(404, Reason.UNKNOWN_MODEL, f"The model `{request.model}` does not exist.", "model_not_found")
        )
    ready = [e for e in serving if not e.stale]
    reason = Reason.LEAST_LOADED
    if not ready and fleet.admit_stale:
        # Fail-open (seed 004): an engine whose metrics went quiet may well be serving; admitting beats refusing.
        ready, reason = serving, Reason.STALE_FAIL_OPEN
    if not ready:
        detail = f"no ready engine serves {request.model} ({', '.join(e.name for e in serving)} stale)"
        return Decision(
            Verdict.SHED, Reason.NO_READY_ENGINE, status=503, retry_after_s=NO_ENGINE_RETRY_AFTER_S, detail=detail,
            body=error_body(detail, "server_error", Reason.NO_READY_ENGINE.value),
        )

    def key(e: EngineView) -> tuple[float, float, str]:
        load = effective_load(e, fleet)
        return (load, load / e.cap if e.cap else load, e.name)

    chosen = min(ready, key=key)
    return Decision(
        Verdict.ADMIT, reason, engine=chosen.name,
        detail=f"effective load {effective_load(chosen, fleet):g} of {len(ready)} ready",
    )
