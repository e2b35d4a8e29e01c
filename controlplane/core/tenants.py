"""Tenants: who a request belongs to, what it may use, and what it is charged (pure: no I/O, no clock).

A tenant is configured in ``tenants:`` (reloadable); its API keys are stored as SHA-256 digests only, and the Check
hashes the presented bearer key, so neither the config, the admin API nor a log line holds a key. No tenant
configured: authentication is off and every request is anonymous. In the order the Check applies them:

1. **Who**: the key's digest names one tenant; an unknown or missing key is refused 401 ``invalid_api_key``.
2. **Which models**: ``models_allowed`` (absent: every model; an adapter is a model of its own); else 403.
3. **Which class**: no ``x-sluice-priority`` gets the tenant's ``default``; a class above its ``max`` gets ``max``.
4. **What budget**: the tenant's own scope (``<tenant>``) and, when its ``models`` section limits the model, its share
   of that model (``<tenant>/<model>``), in one all-or-nothing charge (``ratelimit/``).
5. **How much**: the pre-charge, the prompt estimate plus ``max_tokens`` (or ``default_max_tokens``; embeddings: the
   prompt only); ``settled_usage`` settles it from the access log (the engine's ``usage``, else the counted deltas).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from controlplane.core.model import InferenceRequest, Priority
from controlplane.core.policy import Policy
from ratelimit.core import Limits, Scope

PRIORITY_RANK: Mapping[Priority, int] = MappingProxyType(
    {Priority.SHEDDABLE: 0, Priority.STANDARD: 1, Priority.CRITICAL: 2})
"""Higher is more important: a tenant's ``max`` caps the rank a request may ask for."""

EMBEDDINGS_PATH = "/v1/embeddings"
BEARER = "bearer "


def key_digest(key: str) -> str:
    """What the config stores for an API key: its SHA-256, lower-case hex (``printf %s KEY | sha256sum``)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    """Also the metrics label and the limiter key: config validation keeps it short and without ``/``."""
    key_digests: tuple[str, ...]
    default_priority: Priority = Priority.STANDARD
    """The class of a request that names none."""
    max_priority: Priority = Priority.STANDARD
    """The highest class its requests may ask for (``x-sluice-priority`` above it is lowered to it)."""
    limits: Limits = Limits()
    """The tenant's own budget: requests and tokens per minute, concurrent requests."""
    model_limits: Mapping[str, Limits] = field(default_factory=lambda: MappingProxyType({}))
    """Per model: the tenant's share of that model (a second scope on the same charge)."""
    models_allowed: frozenset[str] | None = None
    """None: every model."""
    weight: float | None = None
    """Its weight in fair share (core/fairshare.py; None: ``fairness.default_weight``): while backlogged, a tenant of
    weight 2 is served twice the tokens of one of weight 1."""
    reserved_share: float = 0.0
    """Its guaranteed fraction of each model's sequence slots (core/reserve.py; 0: none): held back from other tenants
    while it has a fitting request parked, lent out while it has none."""

    def __post_init__(self) -> None:
        if type(self.model_limits) is not MappingProxyType:
            object.__setattr__(self, "model_limits", MappingProxyType(dict(self.model_limits)))

    def allows(self, model: str) -> bool:
        return self.models_allowed is None or model in self.models_allowed


@dataclass(frozen=True, slots=True)
class Tenants:
    """Every configured tenant, and the digest -> tenant index the Check looks keys up in."""

    by_name: Mapping[str, Tenant] = field(default_factory=lambda: MappingProxyType({}))
    by_digest: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, tenants: list[Tenant] | tuple[Tenant, ...]) -> Tenants:
        """The index of ``tenants`` (a digest listed by two tenants raises: validation reports it first)."""
        by_digest: dict[str, str] = {}
        for tenant in tenants:
            for digest in tenant.key_digests:
                if by_digest.setdefault(digest, tenant.name) != tenant.name:
                    raise ValueError(f"key digest {digest[:12]}... belongs to two tenants")
        return cls(MappingProxyType({t.name: t for t in tenants}), MappingProxyType(by_digest))

    @property
    def enabled(self) -> bool:
        """Authentication is on as soon as one tenant is configured."""
        return bool(self.by_name)

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant an ``Authorization`` header's bearer key belongs to; None for a missing, malformed or unknown
        key. The key is hashed and dropped: only its digest is compared (against stored digests, never keys)."""
        if not authorization or authorization[:len(BEARER)].lower() != BEARER:
            return None
        key = authorization[len(BEARER):].strip()
        if not key:
            return None
        name = self.by_digest.get(key_digest(key))
        return self.by_name.get(name) if name is not None else None


def tenant_priority(tenant: Tenant, asked: str | None, parsed: Priority) -> Priority:
    """The class a tenant's request runs at: its ``default`` when it asked for none (``asked``: the raw
    ``x-sluice-priority`` value, None or blank when absent), else what it asked for (``parsed``) capped at its ``max``."""
    if asked is None or not asked.strip():
        return tenant.default_priority
    return parsed if PRIORITY_RANK[parsed] <= PRIORITY_RANK[tenant.max_priority] else tenant.max_priority


def limiter_scopes(tenant: Tenant, model: str | None) -> tuple[Scope, ...]:
    """The budgets a request of ``tenant`` for ``model`` draws on (empty: the tenant has no limits at all)."""
    scopes = [] if tenant.limits.unlimited else [Scope(tenant.name, tenant.limits)]
    model_limits = tenant.model_limits.get(model) if model is not None else None
    if model_limits is not None and not model_limits.unlimited:
        scopes.append(Scope(f"{tenant.name}/{model}", model_limits))
    return tuple(scopes)


def every_scope(tenant: Tenant) -> tuple[Scope, ...]:
    """Every budget of a tenant: its own, then each limited model's, by model id (``sluice admin tenants``)."""
    own = limiter_scopes(tenant, None)
    return own + tuple(Scope(f"{tenant.name}/{model}", limits) for model, limits in sorted(tenant.model_limits.items())
                       if not limits.unlimited)


def precharge_tokens(request: InferenceRequest, policy: Policy) -> int:
    """What a request is charged before it runs: its prompt estimate plus what it may generate (``max_tokens``, else
    the policy's ``default_max_tokens``); an embeddings request generates nothing."""
    if request.path == EMBEDDINGS_PATH:
        return request.prompt_tokens
    return request.prompt_tokens + (request.max_tokens if request.max_tokens is not None else policy.default_max_tokens)


@dataclass(frozen=True, slots=True)
class Usage:
    """What a finished request used, as its settle and the tenant's token counters take it."""

    prompt_tokens: int
    completion_tokens: int
    reported: bool
    """The engine's own ``usage`` object (else: the prompt estimate and the streamed deltas Envoy counted)."""

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class ObservedResponse:
    """What the access-log entry says about a charged request's response (``controlplane/servicers/accesslog.py`` reads it)."""

    prompt_estimate: int
    """The Check's prompt estimate (carried in the ext_authz metadata)."""
    status: int
    """The response code Envoy logged (0: none reached the client)."""
    reached_engine: bool
    """The request was sent to an engine (Envoy logged its last upstream byte sent)."""
    deltas: int = 0
    """Content deltas the Lua usage filter counted in the response body."""
    prompt_tokens: int | None = None
    """From the engine's ``usage`` object, when its body carried one."""
    completion_tokens: int | None = None
    total_tokens: int | None = None


def settled_usage(seen: ObservedResponse) -> Usage:
    """The usage a request is settled with.

    - The engine's ``usage`` (the non-streaming body's, or the last SSE chunk's with ``stream_options.include_usage``):
      taken as it is; ``total_tokens`` alone (embeddings send no completion count) is all prompt.
    - Else, a request that reached an engine and was not refused by it (status below 400, or none: the client left):
      the prompt estimate plus one token per streamed content delta (what the client was sent).
    - Else (never sent, or the engine refused it): nothing used.
    """
    if seen.completion_tokens is not None or seen.total_tokens is not None or seen.prompt_tokens is not None:
        total = seen.total_tokens
        completion = seen.completion_tokens
        if completion is None:
            completion = total - seen.prompt_tokens if total is not None and seen.prompt_tokens is not None else 0
        prompt = seen.prompt_tokens
        if prompt is None:
            prompt = total - completion if total is not None else 0
        return Usage(max(0, prompt), max(0, completion), reported=True)
    if seen.reached_engine and seen.status < 400:
        return Usage(seen.prompt_estimate, seen.deltas, reported=False)
    return Usage(0, 0, reported=False)
