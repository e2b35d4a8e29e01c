"""Reading a request: ``parse_request(method, path, body, headers, policy) -> InferenceRequest`` or ``RequestError``.

Pure and total: Envoy fails an ext_authz error open, so for any method, path, headers and body this returns or raises
``RequestError``, never anything else, within these bounds:

- ``x-sluice-max-ttft-ms`` is 1 to ``MAX_TTFT_DIGITS`` ASCII digits, not 0 (else ``invalid_max_ttft_ms``);
- ``max_completion_tokens`` / ``max_tokens`` are integers from 1 to ``MAX_TOKENS_LIMIT`` (else ``invalid_max_tokens``);
- the body nests at most ``MAX_JSON_DEPTH`` levels (else ``json_too_deep``), checked by a linear scan before parsing;
- ``x-sluice-session`` is at most ``MAX_SESSION_KEY`` characters (else ``invalid_session``).

A refusal carries only its ``Reason`` and a message; the edge (``controlplane/edge.py``) maps it to a status and an error
code. Prompt tokens come from the rules learned from the engines (prompt_tokens.py); with ``prefix_routing`` the prompt
is also cut into hashed blocks for the prefix index (prefix.py).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from itertools import accumulate
from typing import Any

from controlplane.core.model import InferenceRequest, Priority, Reason
from controlplane.core.policy import Policy
from controlplane.core.prefix import prompt_blocks, render_prompt
from controlplane.core.prompt_tokens import PromptShape, PromptTokenRules, TokenRule
from controlplane.names import PRIORITY_HEADER, SESSION_HEADER, TTFT_HEADER

_PRIORITIES = {p.value: p for p in Priority}

#: Paths whose body names a model and is routed to an engine.
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MODELS_PATH = "/v1/models"
MAX_SESSION_KEY = 256
MAX_TTFT_DIGITS = 9
"""``x-sluice-max-ttft-ms`` is 1 to 9 ASCII digits (up to 999,999,999 ms); more -> ``invalid_max_ttft_ms``."""
MAX_TOKENS_LIMIT = 10_000_000
"""``max_tokens`` / ``max_completion_tokens`` above this (no engine has such a context) -> ``invalid_max_tokens``."""
MAX_JSON_DEPTH = 64
"""Arrays/objects nested deeper than this -> ``json_too_deep``, found by a scan that runs before ``json.loads`` (whose
decoder recurses once per level and raises ``RecursionError`` near 1000)."""

__all__ = [
    "INFERENCE_PATHS", "MAX_JSON_DEPTH", "MAX_SESSION_KEY", "MAX_TOKENS_LIMIT", "MAX_TTFT_DIGITS", "MODELS_PATH",
    "RequestError", "parse_request",
]


class RequestError(Exception):
    """A request refused before any decision: its reason (which the edge maps to a status and an error code) and the
    message the client reads."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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


def _too_deep() -> RequestError:
    return RequestError(Reason.JSON_TOO_DEEP, f"Request body nests deeper than {MAX_JSON_DEPTH} levels")


def _check_nesting(text: str) -> None:
    """Refuse ``text`` when its arrays/objects nest deeper than ``MAX_JSON_DEPTH`` (``json_too_deep``), without parsing
    it, so ``json.loads`` (whose decoder recurses once per level) never sees such a body. Linear, in C, never recursive:
    escaped backslashes and quotes are cut, then every byte but brackets and quotes; adjacent quote pairs (strings without
    brackets) go; brackets still inside a string are dropped; a running sum (``accumulate``) of the steps is the depth.
    An odd number of quotes is an unterminated string: ``invalid_json``."""
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
        raise _too_deep()


def _token_limit(body: dict[str, Any], key: str) -> int | None:
    """A token-count field: absent or null is None; anything else must be an integer in 1..``MAX_TOKENS_LIMIT``."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise RequestError(Reason.INVALID_MAX_TOKENS, f"{key} must be an integer from 1 to {MAX_TOKENS_LIMIT}")
    return value


def _malformed(detail: str) -> RequestError:
    return RequestError(Reason.INVALID_JSON, f"Request body is not valid JSON: {detail}")


def parse_request(
    method: str, path: str, raw_body: bytes, headers: Mapping[str, str] | None = None, policy: Policy | None = None,
    tokens: PromptTokenRules | None = None,
) -> InferenceRequest:
    """Read what the decision needs from an HTTP request; raise ``RequestError`` for anything malformed. ``tokens``: the
    prompt-token rules learned from the engines (None: the policy's ``chars_per_token`` for every model).

    Total: for any method, path, headers and body this returns or raises ``RequestError``, never anything else (a Check
    that raises is an ext_authz error, which Envoy fails open). The bounds are in the module docstring."""
    policy = policy or Policy()
    headers = headers or {}
    route = path.split("?", 1)[0]
    if method == "GET" and route == MODELS_PATH:
        return InferenceRequest(method, route, model=None)
    if method != "POST" or route not in INFERENCE_PATHS:
        raise RequestError(Reason.UNKNOWN_PATH, f"Unknown request URL: {method} {route}")
    priority = _PRIORITIES.get(headers.get(PRIORITY_HEADER, "standard").strip().lower() or "standard")
    if priority is None:
        raise RequestError(Reason.INVALID_PRIORITY, f"{PRIORITY_HEADER} must be one of {', '.join(Priority)}")
    deadline = headers.get(TTFT_HEADER)
    max_ttft_ms: int | None = None
    if deadline is not None:
        # ASCII digits only: str.isdigit() also accepts "①" and other digits int() refuses, and length bounds int().
        digits = deadline.strip()
        if not (0 < len(digits) <= MAX_TTFT_DIGITS and digits.isascii() and digits.isdigit()) or int(digits) < 1:
            raise RequestError(Reason.INVALID_MAX_TTFT_MS,
                               f"{TTFT_HEADER} must be a positive integer of at most {MAX_TTFT_DIGITS} digits "
                               "(milliseconds)")
        max_ttft_ms = int(digits)
    session = headers.get(SESSION_HEADER) or None
    if session is not None and len(session) > MAX_SESSION_KEY:
        raise RequestError(Reason.INVALID_SESSION, f"{SESSION_HEADER} is longer than {MAX_SESSION_KEY} characters")
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
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise RequestError(Reason.INVALID_JSON, "Request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(Reason.MISSING_MODEL, "You must provide a model parameter")
    # Read the way engines read them: max_completion_tokens when it is a non-null value, else max_tokens (a null
    # max_completion_tokens must not hide max_tokens, or sluice would reserve its default while the engine runs long).
    completion_limit, legacy_limit = _token_limit(body, "max_completion_tokens"), _token_limit(body, "max_tokens")
    max_tokens = completion_limit if completion_limit is not None else legacy_limit
    prompt = body.get("messages") if route == "/v1/chat/completions" else body.get("prompt", body.get("input", ""))
    shape = PromptShape(_text_length(prompt), len(prompt) if route == "/v1/chat/completions" and
                        isinstance(prompt, list) else 0)
    prompt_tokens = (tokens or PromptTokenRules(TokenRule(1.0 / policy.chars_per_token))).tokens(model, shape)
    blocks: tuple[int, ...] = ()
    if policy.prefix_routing:
        blocks = prompt_blocks(render_prompt(route, body), policy.prefix_block_chars, policy.prefix_max_blocks)
    max_ttft_ms, headroom_ms = ttft_deadline(max_ttft_ms, model, policy)
    return InferenceRequest(method, route, model=model, stream=bool(body.get("stream")), prompt_tokens=prompt_tokens,
                            prompt_chars=shape.chars, prompt_messages=shape.messages, max_tokens=max_tokens, priority=priority, max_ttft_ms=max_ttft_ms,
                            ttft_headroom_ms=headroom_ms, session=session, prefix_blocks=blocks)


def ttft_deadline(asked_ms: int | None, model: str, policy: Policy) -> tuple[int | None, int]:
    """A request's TTFT deadline (what it asked, else its model's default) and the headroom planned into it (policy
    ``ttft_headroom_fraction``), in ms."""
    deadline_ms = asked_ms or policy.model(model).max_ttft_ms
    return deadline_ms, round(deadline_ms * policy.ttft_headroom_fraction) if deadline_ms else 0
