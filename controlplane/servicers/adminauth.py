"""Who may call the admin API, and the audit trail of what they changed.

Tokens come from the file ``admin.token_file`` and/or the environment variable ``admin.token_env``, read once when the
control plane starts. A token is ``name:secret`` or just ``secret`` (named ``default``); a file holds one per line (blank
lines and ``#`` comments skipped). A caller sends ``authorization: Bearer <secret>``; every configured secret is compared
with ``hmac.compare_digest``, and the matching token's *name* is who the audit log says acted (the secret is never logged).

Mutating calls (reload, drain, undrain, floors) always need a token: with no token configured they are refused. Reads need
one only with ``admin.require_token_for_reads``. A refusal is ``UNAUTHENTICATED``, counted in
``sluice_admin_refused_total{method}`` and logged (method and peer, never what was sent).

The audit log (logger ``sluice.audit``) writes one JSON line per accepted or refused change: ``who`` (token name, or
``-``), ``what`` (method and arguments), ``before``, ``after``, ``result``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from controlplane.config import AdminConfig, ConfigError
from controlplane.metrics import SluiceMetrics

log = logging.getLogger("sluice.admin")
audit_log = logging.getLogger("sluice.audit")


@dataclass(frozen=True, slots=True)
class Token:
    name: str
    secret: str


def parse_tokens(text: str, where: str) -> list[Token]:
    """Tokens in ``text`` (one per line, ``name:secret`` or ``secret``); ``ConfigError`` for an empty secret."""
    tokens = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, secret = line.partition(":")
        if not sep:
            name, secret = "default", line
        name, secret = name.strip(), secret.strip()
        if not name or len(secret) < 8:
            raise ConfigError([f"{where} line {n}: a token is 'name:secret' or 'secret', the secret 8 characters or more"])
        tokens.append(Token(name, secret))
    return tokens


def load_tokens(config: AdminConfig, environ: dict[str, str] | None = None) -> tuple[Token, ...]:
    """Every token the config names (``ConfigError`` if a named source is missing, unreadable or empty)."""
    env = os.environ if environ is None else environ
    tokens: list[Token] = []
    if config.token_file:
        try:
            text = Path(config.token_file).read_text()
        except OSError as exc:
            raise ConfigError([f"admin.token_file: cannot read {config.token_file}: {exc}"]) from None
        found = parse_tokens(text, "admin.token_file")
        if not found:
            raise ConfigError([f"admin.token_file: {config.token_file} holds no token"])
        tokens += found
    if config.token_env:
        value = env.get(config.token_env, "")
        if not value.strip():
            raise ConfigError([f"admin.token_env: the environment variable {config.token_env} is empty or unset"])
        tokens += parse_tokens(value, "admin.token_env")
    return tuple(tokens)


def bearer(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, secret = text.partition(" ")
            return secret.strip() if scheme.lower() == "bearer" else None
    return None


class AdminGuard:
    """Checks a call's bearer token; counts, logs and refuses the ones that fail."""

    def __init__(self, tokens: tuple[Token, ...], require_for_reads: bool, metrics: SluiceMetrics) -> None:
        self.tokens = tokens
        self.require_for_reads = require_for_reads
        self.metrics = metrics

    def who(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """The name of the token the call carries, or None (none sent, or no configured token matches)."""
        sent = bearer(context)
        if not sent:
            return None
        match = None
        for token in self.tokens:  # compare with every one, so the time taken says nothing about which matched
            if hmac.compare_digest(token.secret.encode(), sent.encode()):
                match = token.name
        return match

    async def require(self, context: grpc.aio.ServicerContext[Any, Any], method: str, *, mutating: bool,
                      what: dict[str, Any] | None = None) -> str:
        """The caller's token name; a call that needs a token and has no valid one is aborted ``UNAUTHENTICATED`` (and,
        when it would have changed something, audited as refused)."""
        who = self.who(context)
        if who is not None:
            return who
        if not mutating and not self.require_for_reads:
            return "-"
        self.metrics.admin_refused.labels(method).inc()
        why = ("no admin token is configured (admin.token_file / admin.token_env): changes are refused"
               if not self.tokens else "missing or wrong bearer token")
        log.warning("admin %s refused from %s: %s", method, context.peer(), why)
        if mutating:
            audit(who="-", what={"method": method, **(what or {})}, before=None, after=None,
                  result="refused: unauthenticated", peer=context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        raise AssertionError("unreachable")  # context.abort raises


def audit(*, who: str, what: dict[str, Any], before: Any, after: Any, result: str, peer: str | None = None) -> None:
    """One structured line per accepted or refused change."""
    record = {"at": round(time.time(), 3), "who": who, "what": what, "before": before, "after": after,
              "result": result}
    if peer:
        record["peer"] = peer
    audit_log.info("%s", json.dumps(record, sort_keys=True, default=str))
