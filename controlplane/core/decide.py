"""The admission decision, pure: ``decide(request, fleet, policy, now, queued_ahead) -> Decision``. No I/O, no clock.

Refusals come first and cost nothing: unknown path 404, malformed body 400, unknown model 404, every engine below the model's
version floor 503 (``version_floor``), prompt + max_tokens beyond every candidate's ``max_model_len`` (or KV budget) 400
``context_length_exceeded``. Reading a request is total and bounded (a Check that raises would be failed open by Envoy):
``MAX_JSON_DEPTH`` (64 levels, checked before parsing, 400 ``json_too_deep``), ``MAX_TOKENS_LIMIT`` (10,000,000, 400
``invalid_max_tokens``), ``MAX_TTFT_DIGITS`` (9 ASCII digits, 400 ``invalid_max_ttft_ms``).

Candidates: engines serving the model, at or above its version floor, fresh (or stale when ``on_stale: open`` and no fresh
one exists). A candidate **fits** when none of these holds (each is a named ``Reason``)::

    load        = max(probe running + waiting + unseen_load, open tickets)
    cap         : load >= cap                                  (cap = max_num_seqs, configured or reported; N, not N-1)
    kv_watermark: probe KV usage >= kv_high_watermark          (0.90)
    kv_need     : held + need > kv_capacity x kv_high_watermark
                  where need = prompt estimate + max_tokens (policy default when absent)
                  and   held = max(sum of reserved tokens of open tickets,          (every admitted request may grow fully)
                               KV usage x capacity + reserved tokens of unseen tickets
                               - reserved tokens of tickets released since the probe)  (what the engine holds now)
    box_pool    : the engines sharing one box would together hold more than the box budget: in bytes (held tokens x
                  the model's kv_bytes_per_token, an unknown rate priced at the largest configured one) when the box
                  has a byte budget, else in tokens
    quality_cap : open tickets of this model on the engine >= floor(solo decode rate x quality_overcommit / decode floor)

A gauge an engine does not report (``None``) skips the rule that needs it. Which fitting engine (or busy but faster one) gets
the request is route.py's job: finish-soonest, TTFT deadlines, the satisficing band and session affinity. Nothing fits and
nothing is worth waiting for: ``sheddable`` requests are shed (503 ``saturated``), others park (the reason is the first
blocking rule). A request with parked requests ahead of it in its class or a higher one parks behind them (FIFO).

Retry-After (shed) is when the ledger expects the ``(queued_ahead + 1)``-th slot among the candidates to free: open tickets'
expected finish times (``expected_done_at = admitted_at + finish`` as route.py estimates it, with the *expected* output length,
not max_tokens) sorted, that entry's distance from now, clamped to ``[retry_after_min_s, retry_after_max_s]``.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import numpy as np

from controlplane.core.model import Decision, EngineView, Fleet, InferenceRequest, Reason, Verdict
from controlplane.core.policy import PRIORITIES, Policy, meets_floor
from controlplane.core.route import (
    Estimate, effective_load, estimate, expected_output_tokens, prefill_rate, waits_too_long, weighted_pick,
)

#: Paths whose body names a model and is routed to an engine.
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
PRIORITY_HEADER = "x-sluice-priority"
TTFT_HEADER = "x-sluice-max-ttft-ms"
SESSION_HEADER = "x-sluice-session"
MAX_SESSION_KEY = 256
#: Parsing is total (issue 8): Envoy fails a Check error open, so every header and body either parses within these bounds
#: or is refused 400 before any decision; none may make parse_request raise anything but ``RequestError``.
MAX_TTFT_DIGITS = 9
"""``x-sluice-max-ttft-ms`` is 1 to 9 ASCII digits (up to 999,999,999 ms); more -> 400 ``invalid_max_ttft_ms``."""
MAX_TOKENS_LIMIT = 10_000_000
"""``max_tokens`` / ``max_completion_tokens`` above this (no engine has such a context) -> 400 ``invalid_max_tokens``."""
MAX_JSON_DEPTH = 64
"""Arrays/objects nested deeper than this -> 400 ``json_too_deep``, found by a scan that runs before ``json.loads`` (whose
decoder recurses once per level and raises ``RecursionError`` near 1000)."""


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


def _error_type(status: int) -> str:
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def refuse(error: RequestError) -> Decision:
    return Decision(
        Verdict.REJECT, error.reason, status=error.status, detail=str(error),
        body=error_body(str(error), _error_type(error.status), error.code),
    )


def shed(reason: Reason, detail: str, retry_after_s: int) -> Decision:
    return Decision(Verdict.SHED, reason, status=503, retry_after_s=retry_after_s, detail=detail,
                    body=error_body(detail, "server_error", reason.value))


# -- reading the request ------------------------------------------------------------------------------------------------
def _text_length(value: Any) -> int:
    """Characters of prompt text in a message content, a prompt, or a list of either (OpenAI content parts included).
    Iterative: a body's nesting is bounded by ``MAX_JSON_DEPTH`` already, but this must not depend on it."""
    total = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.append(item.get("text", ""))
            pending.append(item.get("content", ""))
    return total


# Bytes of a JSON text that matter for nesting: brackets become +1/-1 depth steps (0xff reads as -1 in a signed array) and
# quotes stay to mark strings; every other byte is deleted.
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'[]{}"')))


def _check_nesting(text: str) -> None:
    """Refuse ``text`` when its arrays/objects nest deeper than ``MAX_JSON_DEPTH`` (400 ``json_too_deep``), without parsing
    it, so ``json.loads`` (whose decoder recurses once per level) never sees such a body. Linear, in C, never recursive:
    escaped backslashes and quotes are cut, then every byte but brackets and quotes; adjacent quote pairs (strings without
    brackets) go; brackets still inside a string are dropped; a running sum (``accumulate``) of the steps is the depth.
    An odd number of quotes is an unterminated string: 400 ``invalid_json``."""
    raw = text.encode("utf-8", "surrogatepass")
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # too few brackets to nest past the limit: most bodies
        return
    if b'\\"' in raw:  # an escaped quote (possibly after escaped backslashes) does not end a string
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Removing two adjacent quotes never moves a bracket in or out of a string: nothing lies between them.
    structure = raw.translate(_DEPTH_STEP, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in structure:
        pieces = structure.split(b'"')
        if len(pieces) % 2 == 0:
            raise _malformed("unterminated string")
        structure = b"".join(pieces[::2])  # the even pieces lie outside strings
    if max(accumulate(array("b", structure)), default=0) > MAX_JSON_DEPTH:
        raise RequestError(400, Reason.MALFORMED_JSON, f"Request body nests deeper than {MAX_JSON_DEPTH} levels",
                           "json_too_deep")


def _token_limit(body: dict[str, Any], key: str) -> int | None:
    """A token-count field: absent or null is None; anything else must be an integer in 1..``MAX_TOKENS_LIMIT``."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise RequestError(400, Reason.INVALID_FIELD, f"{key} must be an integer from 1 to {MAX_TOKENS_LIMIT}",
                           "invalid_max_tokens")
    return value


def _malformed(detail: str) -> RequestError:
    return RequestError(400, Reason.MALFORMED_JSON, f"Request body is not valid JSON: {detail}", "invalid_json")


def parse_request(
    method: str, path: str, raw_body: bytes, headers: Mapping[str, str] | None = None, policy: Policy | None = None
) -> InferenceRequest:
    """Read what the decision needs from an HTTP request; raise ``RequestError`` for anything malformed.

    Total: for any method, path, headers and body this returns or raises ``RequestError`` (400/404), never anything else
    (a Check that raises is an ext_authz error, which Envoy fails open). Bounds: ``x-sluice-max-ttft-ms`` is 1 to
    ``MAX_TTFT_DIGITS`` ASCII digits; token counts are at most ``MAX_TOKENS_LIMIT``; the body nests at most
    ``MAX_JSON_DEPTH`` levels (400 ``json_too_deep``), checked before it is parsed."""
    policy = policy or Policy()
    headers = headers or {}
    route = path.split("?", 1)[0]
    if method == "GET" and route == "/v1/models":
        return InferenceRequest(method, route, model=None)
    if method != "POST" or route not in INFERENCE_PATHS:
        raise RequestError(404, Reason.UNKNOWN_PATH, f"Unknown request URL: {method} {route}", "unknown_url")
    priority = headers.get(PRIORITY_HEADER, "standard").strip().lower() or "standard"
    if priority not in PRIORITIES:
        raise RequestError(400, Reason.INVALID_FIELD, f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}",
                           "invalid_priority")
    deadline = headers.get(TTFT_HEADER)
    max_ttft_ms: int | None = None
    if deadline is not None:
        # ASCII digits only: str.isdigit() also accepts "①" and other digits int() refuses, and length bounds int().
        digits = deadline.strip()
        if not (0 < len(digits) <= MAX_TTFT_DIGITS and digits.isascii() and digits.isdigit()) or int(digits) < 1:
            raise RequestError(400, Reason.INVALID_FIELD,
                               f"{TTFT_HEADER} must be a positive integer of at most {MAX_TTFT_DIGITS} digits "
                               "(milliseconds)", "invalid_max_ttft_ms")
        max_ttft_ms = int(digits)
    session = headers.get(SESSION_HEADER) or None
    if session is not None and len(session) > MAX_SESSION_KEY:
        raise RequestError(400, Reason.INVALID_FIELD, f"{SESSION_HEADER} is longer than {MAX_SESSION_KEY} characters",
                           "invalid_session")
    try:
        # json.loads(bytes) would decode the same way (UTF-8, -16 or -32, detected); the depth scan needs the text first.
        text = raw_body.decode(json.detect_encoding(raw_body), "surrogatepass")
    except UnicodeDecodeError as exc:
        raise _malformed(str(exc)) from None
    _check_nesting(text)
    try:
        body: Any = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and a UTF-8 BOM left in the text
        raise _malformed(str(exc)) from None
    except RecursionError:  # unreachable past the depth scan; kept so a scan defect is a 400, never a failed Check
        raise RequestError(400, Reason.MALFORMED_JSON, f"Request body nests deeper than {MAX_JSON_DEPTH} levels",
                           "json_too_deep") from None
    if not isinstance(body, dict):
        raise RequestError(400, Reason.MALFORMED_JSON, "Request body must be a JSON object", "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, Reason.MISSING_MODEL, "You must provide a model parameter", "missing_model")
    # Read the way engines read them: max_completion_tokens when it is a non-null value, else max_tokens (a null
    # max_completion_tokens must not hide max_tokens, or sluice would reserve its default while the engine runs long).
    completion_limit, legacy_limit = _token_limit(body, "max_completion_tokens"), _token_limit(body, "max_tokens")
    max_tokens = completion_limit if completion_limit is not None else legacy_limit
    prompt = body.get("messages") if route == "/v1/chat/completions" else body.get("prompt", body.get("input", ""))
    prompt_tokens = math.ceil(_text_length(prompt) / policy.chars_per_token)
    return InferenceRequest(method, route, model=model, stream=bool(body.get("stream")), prompt_tokens=prompt_tokens,
                            max_tokens=max_tokens, priority=priority,
                            max_ttft_ms=max_ttft_ms or policy.model(model).max_ttft_ms, session=session)


# -- the rules ------------------------------------------------------------------------------------------------------------
def need_tokens(request: InferenceRequest, policy: Policy) -> int:
    return request.prompt_tokens + (request.max_tokens or policy.default_max_tokens)


def held_tokens(engine: EngineView, fleet: Fleet) -> float:
    ledger = fleet.of(engine.name)
    capacity = engine.kv_capacity_tokens
    usage = engine.sample.kv_usage if engine.sample is not None else None
    probe_held = 0.0
    if usage is not None and capacity:
        probe_held = max(0.0, usage * capacity + ledger.unseen_reserved_tokens - ledger.released_since_probe_tokens)
    return max(float(ledger.committed_tokens), probe_held)


def model_len(engine: EngineView, model: str) -> int | None:
    return next((m.max_model_len for m in engine.models if m.model_id == model), None)


def quality_cap(engine: EngineView, model: str, fleet: Fleet, policy: Policy) -> int | None:
    floor = policy.model(model).decode_floor_tokens_per_s
    if not floor:
        return None
    solo = fleet.rates.solo_decode.get((model, engine.chip_class)) or policy.model(model).solo_decode_tokens_per_s
    if not solo:
        return None
    return max(1, math.floor(solo * policy.quality_overcommit / floor))


def _box_misfit(engine: EngineView, model: str, need: int, fleet: Fleet, policy: Policy) -> bool:
    box = policy.box_of(engine.name)
    if box is None:
        return False
    members = [e for e in fleet.engines if e.name in box.engines]
    rates = {e.name: policy.model(e.models[0].model_id).kv_bytes_per_token if e.models else None for e in members}
    own_rate = policy.model(model).kv_bytes_per_token
    known = [m.kv_bytes_per_token for m in policy.models.values() if m.kv_bytes_per_token]
    if box.kv_budget_bytes and known:
        worst = max(known)  # an unknown rate is priced at the largest configured: never under-charge the shared pool
        used = sum(held_tokens(e, fleet) * (rates[e.name] or worst) for e in members)
        return used + need * (own_rate or worst) > box.kv_budget_bytes
    if box.kv_budget_tokens:
        return sum(held_tokens(e, fleet) for e in members) + need > box.kv_budget_tokens
    return False


def misfits(engine: EngineView, request: InferenceRequest, fleet: Fleet, policy: Policy) -> tuple[Reason, ...]:
    """Every rule ``engine`` fails for ``request`` (empty: it fits). See the module docstring for the formulas."""
    assert request.model is not None
    need = need_tokens(request, policy)
    out = []
    if engine.cap is not None and effective_load(engine, fleet) >= engine.cap:
        out.append(Reason.CAP)
    usage = engine.sample.kv_usage if engine.sample is not None else None
    if usage is not None and usage >= policy.kv_high_watermark:
        out.append(Reason.KV_WATERMARK)
    capacity = engine.kv_capacity_tokens
    if capacity and held_tokens(engine, fleet) + need > capacity * policy.kv_high_watermark:
        out.append(Reason.KV_NEED)
    if _box_misfit(engine, request.model, need, fleet, policy):
        out.append(Reason.BOX_POOL)
    q_cap = quality_cap(engine, request.model, fleet, policy)
    if q_cap is not None and fleet.of(engine.name).open_for(request.model) >= q_cap:
        out.append(Reason.QUALITY_CAP)
    return tuple(out)


def expected_seconds(engine: EngineView, request: InferenceRequest, policy: Policy) -> float:
    """How long ``request`` should take on ``engine`` once running: prompt / prefill rate + max_tokens / decode rate."""
    rates = engine.rates
    prefill = (rates.prefill_tokens_per_s if rates else None) or policy.default_prefill_tokens_per_s
    decode = (rates.decode_tokens_per_s_each if rates else None) or policy.default_decode_tokens_per_s
    return request.prompt_tokens / prefill + (request.max_tokens or policy.default_max_tokens) / decode


def retry_after(candidates: list[EngineView], fleet: Fleet, policy: Policy, now: float, queued_ahead: int = 0) -> int:
    """Seconds until the ledger expects the ``(queued_ahead + 1)``-th slot among ``candidates`` to free, clamped."""
    done = sorted(t for e in candidates for t in fleet.of(e.name).expected_done)
    wait = 0.0
    if done:
        wait = done[min(queued_ahead, len(done) - 1)] - now
        if queued_ahead >= len(done):  # deeper than every open ticket: each extra slot-round costs a typical request
            typical = (done[-1] - now) / len(done) if done[-1] > now else 0.0
            wait += (queued_ahead - len(done) + 1) * typical
    return int(min(policy.retry_after_max_s, max(policy.retry_after_min_s, math.ceil(wait))))


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


# -- the decision ---------------------------------------------------------------------------------------------------------
def decide(
    request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, queued_ahead: int = 0,
    affinity: str | None = None, pick: float = 0.5, behind: int = 0,
) -> Decision:
    """Choose what happens to ``request`` (see the module docstring and route.py). ``queued_ahead``: parked requests of
    this model in this request's priority class or a higher one; ``affinity``: the engine the request's session used last;
    ``pick``: a uniform draw in [0, 1) for the satisficing band's weighted choice; ``behind``: parked requests of this
    model queued after this one (a woken head's backlog)."""
    model = request.model
    if model is None:
        return Decision(Verdict.ANSWER, Reason.MODEL_LIST, status=200, body=model_list(fleet))
    if fleet.index is not None:
        indexed = _indexed(request, fleet, policy, now, queued_ahead, affinity, pick, behind)
        if indexed is not None:
            return indexed
    serving = [e for e in fleet.engines if e.serves(model) and not e.drained]
    if not serving and any(e.serves(model) for e in fleet.engines):
        return shed(Reason.NO_READY_ENGINE, f"every engine serving {model} is drained", policy.retry_after_max_s)
    if not serving:
        return refuse(RequestError(404, Reason.UNKNOWN_MODEL, f"The model `{model}` does not exist.", "model_not_found"))
    floor = policy.floor_for(model)
    eligible = [e for e in serving if meets_floor(e.version, floor)]
    if not eligible:
        versions = ", ".join(f"{e.name}={e.version or 'unknown'}" for e in serving)
        return shed(Reason.VERSION_FLOOR, f"{model} needs engine version >= {floor}; engines serving it: {versions}",
                    policy.retry_after_max_s)
    fresh = [e for e in eligible if not e.stale]
    admitted_reason = Reason.FINISH_SOONEST
    if not fresh and fleet.admit_stale:
        # Fail-open (seed 004): an engine whose metrics went quiet may well be serving; admitting beats refusing.
        fresh, admitted_reason = eligible, Reason.STALE_FAIL_OPEN
    if not fresh:
        detail = f"no ready engine serves {model} ({', '.join(e.name for e in eligible)} stale)"
        return shed(Reason.NO_READY_ENGINE, detail, policy.retry_after_min_s)

    need = need_tokens(request, policy)
    candidates = [e for e in fresh if (model_len(e, model) or need) >= need]
    budgets = [e.kv_capacity_tokens * policy.kv_high_watermark for e in candidates if e.kv_capacity_tokens]
    if not candidates or (len(budgets) == len(candidates) and need > max(budgets)):
        limit = max((model_len(e, model) or 0 for e in fresh), default=0)
        message = (f"This model's maximum context length is {limit} tokens. However, you requested {need} tokens "
                   f"({request.prompt_tokens} in the messages, {need - request.prompt_tokens} in the completion).")
        return refuse(RequestError(400, Reason.CONTEXT_LENGTH, message, "context_length_exceeded"))

    deadline_s = request.max_ttft_ms / 1000 if request.max_ttft_ms else None
    park_limit: float | None = None
    if deadline_s is not None:
        # Prefill alone, on an idle engine: if even that misses the deadline, nothing can meet it. Waits are uncertain
        # (seed 002: a pessimistic estimate over-sheds), so a request that only needs a slot parks, for at most as long
        # as its deadline leaves room for prefill, and real releases decide.
        prefill_floor = min(request.prompt_tokens / prefill_rate(e, model, fleet, policy) for e in candidates)
        if prefill_floor > deadline_s:
            return shed(Reason.TTFT_UNMEETABLE,
                        f"no engine can prefill {request.prompt_tokens} tokens of {model} within "
                        f"{request.max_ttft_ms} ms (best {prefill_floor * 1000:.0f} ms on an idle engine)",
                        retry_after(candidates, fleet, policy, now))
        park_limit = deadline_s - prefill_floor
    if queued_ahead:
        return _wait(request, candidates, fleet, policy, now, queued_ahead, Reason.QUEUED_BEHIND,
                     f"{queued_ahead} parked ahead", park_limit)
    blocked = {e.name: misfits(e, request, fleet, policy) for e in candidates}
    # Engines that fit now, and engines only short of a slot (worth waiting for if they finish sooner).
    pressure = any(blocked.values())
    estimates = [estimate(e, request, not blocked[e.name], fleet, policy, now, pressure, behind)
                 for e in candidates if not blocked[e.name] or blocked[e.name] == (Reason.CAP,)]
    if deadline_s is not None and estimates:
        meeting = [x for x in estimates if x.ttft_s <= deadline_s]
        if not meeting:
            soonest_ttft = min(x.ttft_s for x in estimates)
            if any(x.can_start for x in estimates) and all(x.ttft_s - x.slot_wait_s > deadline_s for x in estimates):
                # Even without any wait no engine meets it, and a slot is free now: parking would only idle that slot
                # until the park limit sheds the request anyway.
                return shed(Reason.TTFT_UNMEETABLE,
                            f"no engine can start {request.prompt_tokens} tokens of {model} within {request.max_ttft_ms} "
                            f"ms (best {soonest_ttft * 1000:.0f} ms)", retry_after(candidates, fleet, policy, now))
            return _wait(request, candidates, fleet, policy, now, 0, Reason.CAP,
                         f"estimated TTFT {soonest_ttft * 1000:.0f} ms after waiting for a slot", park_limit)
        estimates = meeting
        decode_floor = policy.model(model).decode_floor_tokens_per_s or 0.0
        band = [x for x in estimates if x.can_start and x.ttft_s <= deadline_s - policy.band_margin_ms / 1000
                and x.decode_rate >= decode_floor]
        if band:
            sticky = next((x for x in band if x.engine.name == affinity), None)
            if sticky is not None:
                return _admit(request, sticky, Reason.SESSION_AFFINITY, policy, now, fleet)
            chosen = weighted_pick(band, fleet.recent_serves, pick)
            return _admit(request, chosen, Reason.SATISFICING_BAND, policy, now, fleet)
    free = [x for x in estimates if x.can_start]
    if not free:
        # Nothing can start now (or what could start misses the deadline while a busy engine would meet it).
        reasons = [r for name, rs in blocked.items() for r in rs]
        first = reasons[0] if reasons and not any(not rs for rs in blocked.values()) else Reason.WAITING_FOR_FASTER
        detail = "; ".join(f"{name}: {', '.join(r.value for r in rs) or 'misses the deadline'}"
                           for name, rs in blocked.items())
        return _wait(request, candidates, fleet, policy, now, 0, first, detail, park_limit)

    admitted = _finish_soonest(request, estimates, free, fleet, policy, now, affinity, admitted_reason)
    if admitted is not None:
        return admitted
    best = min(estimates, key=lambda x: _soonest(x, fleet))
    return _wait(request, candidates, fleet, policy, now, 0, Reason.WAITING_FOR_FASTER,
                 f"{best.engine.name} finishes in {best.finish_s:.1f} s after a {best.slot_wait_s:.1f} s wait",
                 park_limit)


def _soonest(x: Estimate, fleet: Fleet) -> tuple[float, float, float, str]:
    # Equal estimates (no rates measured yet) fall back to the lighter load, then more headroom, then the name.
    load = effective_load(x.engine, fleet)
    return (round(x.finish_s, 6), load, load / x.engine.cap if x.engine.cap else load, x.engine.name)


def _finish_soonest(request: InferenceRequest, estimates: list[Estimate], free: list[Estimate], fleet: Fleet,
                    policy: Policy, now: float, affinity: str | None, admitted_reason: Reason) -> Decision | None:
    """Without a deadline: the engine where the request finishes soonest (route.py), or None when that means waiting."""
    def soonest(x: Estimate) -> tuple[float, float, float, str]:
        return _soonest(x, fleet)

    best = min(estimates, key=soonest)
    acceptable = [x for x in free if x.finish_s <= best.finish_s * (1 + policy.wait_for_faster_margin)]
    if not best.can_start and not acceptable and waits_too_long(best, policy):
        # Work conservation (route.py): the faster engine's wait is unbounded enough that a free slot is taken instead.
        acceptable = free
        if admitted_reason is Reason.FINISH_SOONEST:
            admitted_reason = Reason.WORK_CONSERVING
    sticky = next((x for x in acceptable if x.engine.name == affinity), None)
    if sticky is not None:
        return _admit(request, sticky, Reason.SESSION_AFFINITY, policy, now, fleet)
    if request.priority == "sheddable" and not acceptable:
        acceptable = free  # a sheddable request takes any free slot rather than being shed for want of a faster one
    if best.can_start or acceptable:
        chosen = best if best.can_start else min(acceptable, key=soonest)
        return _admit(request, chosen, admitted_reason, policy, now, fleet)
    return None


def _indexed(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, queued_ahead: int,
             affinity: str | None, pick: float, behind: int) -> Decision | None:
    """``decide`` on the fleet's index (fleetindex.py): the fit rules and the no-wait estimate of every candidate at once
    (numpy over the model's rows), then real ``Estimate`` objects only for the engines that can be chosen: the band (its
    weighted pick on a cumulative sum), or the soonest free slot, the busy engines whose no-wait lower bound could beat it,
    and the session's engine. Returns the same decision as the full scan below, or None when the full scan must decide
    (boxes, parked requests ahead, nothing fits now, an empty band, any refusal or shed)."""
    index = fleet.index
    model = request.model
    if index is None or queued_ahead or policy.boxes or index.policy is not policy or index.admit_stale != fleet.admit_stale:
        return None
    rows = index.models.get(model)
    if rows is None:
        return None
    need = need_tokens(request, policy)
    candidate = rows.ok & (rows.model_len >= need)
    if not candidate.any():
        return None
    capacity = rows.capacity
    watermark = policy.kv_high_watermark
    if (capacity[candidate] > 0).all() and need > float((capacity[candidate] * watermark).max()):
        return None  # context_length_exceeded: the full scan words the refusal
    deadline_s = request.max_ttft_ms / 1000 if request.max_ttft_ms else None
    if deadline_s is not None and request.prompt_tokens / float(rows.prefill[candidate].max()) > deadline_s:
        return None  # ttft_unmeetable
    cap_block = rows.load >= rows.cap
    other = (rows.usage >= watermark) | ((capacity > 0) & (rows.held + need > capacity * watermark)) | rows.quality_block
    fits = candidate & ~(cap_block | other)
    if not fits.any():
        return None
    busy = candidate & cap_block & ~other
    pressure = bool((candidate & (cap_block | other)).any())
    rate = rows.d_press if pressure else rows.d_free
    prefill_s = request.prompt_tokens / rows.prefill
    out = expected_output_tokens(request, fleet, policy)
    ttft = prefill_s + 1.0 / rate  # route.estimate with no wait (0.0 + x is x)

    def exact(i: int, can_start: bool) -> Estimate:
        return estimate(rows.views[i], request, can_start, fleet, policy, now, pressure, behind)

    at = rows.position.get(affinity) if affinity is not None else None
    if deadline_s is not None:
        floor = policy.model(model).decode_floor_tokens_per_s or 0.0
        band = fits & (ttft <= deadline_s - policy.band_margin_ms / 1000) & (rate >= floor)
        if not band.any():
            # No band: finish-soonest among the engines that meet the deadline (busy ones filtered once estimated).
            return _soonest_indexed(request, rows, candidate, fits & (ttft <= deadline_s), busy, ttft + out / rate,
                                    prefill_s, out, exact, at, affinity, deadline_s, fleet, policy, now)
        if at is not None and band[at]:
            return _admit(request, exact(at, True), Reason.SESSION_AFFINITY, policy, now, fleet)
        members = np.flatnonzero(band)
        serves = rows.serve_value[members] * np.power(
            0.5, np.maximum(0.0, index.now - rows.serve_at[members]) / index.half_life_s)
        cumulative = np.cumsum(1.0 / (1.0 + serves))
        chosen = int(np.searchsorted(cumulative, pick * float(cumulative[-1]), side="right"))
        return _admit(request, exact(int(members[min(chosen, len(members) - 1)]), True), Reason.SATISFICING_BAND,
                      policy, now, fleet)
    return _soonest_indexed(request, rows, candidate, fits, busy, ttft + out / rate, prefill_s, out, exact, at, affinity,
                            None, fleet, policy, now)


def _soonest_indexed(request: InferenceRequest, rows: Any, candidate: Any, free: Any, busy: Any, finish: Any,
                     prefill_s: Any, out: float, exact: Any, at: int | None, affinity: str | None,
                     deadline_s: float | None, fleet: Fleet, policy: Policy, now: float) -> Decision | None:
    """Finish-soonest on the index: ``free`` rows can start now (with a deadline, those meeting it), ``busy`` rows are only
    short of a slot; None when no free row is left (the full scan parks or sheds). Waiting for a faster busy engine parks
    here, as the full scan would."""
    if not free.any():
        return None
    free_rows = np.flatnonzero(free)
    free_finish = finish[free_rows]
    # The soonest free slot by _soonest's key: finish rounded to 1 us (Python's round, on the few distinct values near the
    # minimum), then the lighter load, the more headroom, the name.
    near = free_finish <= float(free_finish.min()) + 1e-6
    rounded = {float(v): round(float(v), 6) for v in np.unique(free_finish[near])}
    lowest = min(rounded.values())
    tied = free_rows[near & np.isin(free_finish, [v for v, r in rounded.items() if r == lowest])]
    load = rows.load[tied]
    cap = rows.cap[tied]
    headroom = np.where(np.isfinite(cap) & (cap > 0), load / np.where(np.isfinite(cap) & (cap > 0), cap, 1.0), load)
    best_free = int(tied[np.lexsort((rows.name_rank[tied], headroom, load))[0]])
    estimates = [exact(best_free, True)]
    bound = estimates[0].finish_s + 1e-6
    # A busy engine runs the request at its full batch after its slot wait, which is at least until its soonest ticket's
    # expected finish (or one service when it has none): beyond the bound even so, it cannot win.
    service = prefill_s + out / rows.d_press
    first_done = rows.first_done
    wait = np.where(np.isnan(first_done), service, np.maximum(0.0, np.nan_to_num(first_done) - now))
    lower = wait + prefill_s + 1.0 / rows.d_press + out / rows.d_press
    estimates += [x for x in (exact(int(i), False) for i in np.flatnonzero(busy & (lower <= bound)))
                  if deadline_s is None or x.ttft_s <= deadline_s]
    if at is not None and (free[at] or busy[at]) and all(x.engine.name != affinity for x in estimates):
        sticky = exact(at, bool(free[at]))
        if deadline_s is None or sticky.ttft_s <= deadline_s:
            estimates.append(sticky)
    admitted = _finish_soonest(request, estimates, [x for x in estimates if x.can_start], fleet, policy, now, affinity,
                               Reason.FINISH_SOONEST)
    if admitted is not None:
        return admitted
    best = min(estimates, key=lambda x: _soonest(x, fleet))
    park_limit = None
    if deadline_s is not None:
        park_limit = deadline_s - request.prompt_tokens / float(rows.prefill[candidate].max())
    candidates = [rows.views[i] for i in np.flatnonzero(candidate)]
    return _wait(request, candidates, fleet, policy, now, 0, Reason.WAITING_FOR_FASTER,
                 f"{best.engine.name} finishes in {best.finish_s:.1f} s after a {best.slot_wait_s:.1f} s wait",
                 park_limit)


def _admit(request: InferenceRequest, chosen: Estimate, reason: Reason, policy: Policy, now: float,
           fleet: Fleet) -> Decision:
    return Decision(
        Verdict.ADMIT, reason, engine=chosen.engine.name, reserved_tokens=need_tokens(request, policy),
        expected_done_at=now + chosen.finish_s, expected_ttft_s=chosen.ttft_s,
        detail=f"expected TTFT {chosen.ttft_s:.2f} s, finish {chosen.finish_s:.2f} s, load "
               f"{effective_load(chosen.engine, fleet):g}",
    )


def _wait(request: InferenceRequest, candidates: list[EngineView], fleet: Fleet, policy: Policy, now: float,
          queued_ahead: int, reason: Reason, detail: str, park_limit: float | None = None) -> Decision:
    if request.priority == "sheddable":
        # Under saturation a sheddable request is shed at once rather than holding a place in the queue.
        return shed(Reason.SATURATED, f"fleet saturated for {request.model}: {detail}",
                    retry_after(candidates, fleet, policy, now, queued_ahead))
    return Decision(Verdict.PARK, reason, detail=detail, park_limit_s=park_limit,
                    retry_after_s=retry_after(candidates, fleet, policy, now, queued_ahead))


@dataclass(frozen=True, slots=True)
class EngineExplanation:
    name: str
    serves_model: bool
    meets_floor: bool
    stale: bool
    drained: bool
    misfits: tuple[Reason, ...]
    ttft_s: float | None
    finish_s: float | None
    load: float


def explain(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float) -> tuple[EngineExplanation, ...]:
    """Every engine's standing for ``request``: the facts ``decide`` weighs, without deciding (for operators)."""
    assert request.model is not None
    floor = policy.floor_for(request.model)
    blocked = {e.name: misfits(e, request, fleet, policy) for e in fleet.engines if e.serves(request.model)}
    pressure = any(blocked.values())
    out = []
    for e in fleet.engines:
        serves = e.serves(request.model)
        reasons = blocked.get(e.name, ())
        x = estimate(e, request, not reasons, fleet, policy, now, pressure) if serves else None
        out.append(EngineExplanation(e.name, serves, meets_floor(e.version, floor), e.stale, e.drained, reasons,
                                     x.ttft_s if x else None, x.finish_s if x else None, effective_load(e, fleet)))
    return tuple(out)


def earliest_fit(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float) -> float | None:
    """When ``request`` could start at the earliest if open tickets finish when the ledger expects: per engine, release
    its tickets soonest first until no fit rule blocks; the soonest engine's time (``now`` if one fits already). None when
    no candidate frees up within its open tickets (backfill then has no bound to respect)."""
    assert request.model is not None
    floor = policy.floor_for(request.model)
    best: float | None = None
    for engine in fleet.engines:
        if not engine.serves(request.model) or engine.drained or not meets_floor(engine.version, floor):
            continue
        if engine.stale and not fleet.admit_stale:
            continue
        if not misfits(engine, request, fleet, policy):
            return now
        ledger = fleet.of(engine.name)
        tokens = 0
        for freed, (done_at, reserved) in enumerate(ledger.finishing, start=1):
            tokens += reserved
            what_if = replace(ledger, open_tickets=ledger.open_tickets - freed, unseen_load=ledger.unseen_load - freed,
                              committed_tokens=ledger.committed_tokens - tokens,
                              released_since_probe_tokens=ledger.released_since_probe_tokens + tokens)
            if not misfits(engine, request, replace(fleet, ledger={**fleet.ledger, engine.name: what_if}), policy):
                at = max(now, done_at)
                best = at if best is None else min(best, at)
                break
    return best
