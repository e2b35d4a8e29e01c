"""Tenants' budgets in the request path: the asyncio shell between the Check, the access log and ``ratelimit/``.

- **Charge** (the Check, ``authz.py``): after the key and the body are read and before admission decides, a tenant's
  request is charged its prompt estimate + ``max_tokens`` (``core/tenants.py``'s ``precharge_tokens``) on every scope
  it draws on, under the request's id (which becomes its ticket id, so the access log can settle it). Refused: 429
  ``rate_limit_exceeded`` with ``retry-after`` and OpenAI's ``x-ratelimit-*`` headers. A charge the Check then does not
  turn into an admission (shed, refused, a park that timed out, a client that left, a failure) is given back whole
  (``refund``: its tokens and its request).
- **Settle** (the access log, ``accesslog.py``): the stream's real usage replaces the pre-charge (``settle``), and the
  tenant's token counters move.
- **Give back before a retry** (the retry redirector, ``httpendpoint.py``): an engine that failed before its first byte
  generated nothing; the retry through a new Check is charged anew.

The limiter's store is the ledger's (``store.url`` with ``store.backend: valkey``; else this process's memory), so every
replica draws on one budget. When it cannot be reached, ``ratelimit.on_failure`` decides: ``open`` admits the request
uncharged (``sluice_ratelimit_errors_total``, decision ``store_error``), ``closed`` answers 503
``ratelimit_unavailable``. Settles and refunds run in the background (a Check or a log entry never waits for one; the
retry redirector does, so the retry's charge finds its id free); a failed one is counted and left to the charge's lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from controlplane.config import Config, RateLimitOnFailure, StoreBackend
from controlplane.core.model import Decision, InferenceRequest, Reason, Verdict
from controlplane.core.tenants import Tenant, Usage, every_scope, limiter_scopes, precharge_tokens
from controlplane.metrics import SluiceMetrics
from ratelimit import (
    ChargeRequest, LimiterSettings, LimitKind, LimitState, Outcome, RateLimiter, StoreUnavailable, open_limiter,
    openai_headers,
)
from ratelimit import Verdict as LimitVerdict
from ratelimit.headers import retry_after_seconds

_T = TypeVar("_T")

log = logging.getLogger("sluice.quota")

RATELIMIT_HEADER_PREFIX = "x-ratelimit-"


@dataclass(frozen=True, slots=True)
class Charged:
    """The limiter let a tenant's request through."""

    charge_id: str | None
    """The open charge to settle or give back; None: nothing was charged (the tenant has no limits, or the store
    failed open)."""
    headers: tuple[tuple[str, str], ...] = ()
    """OpenAI's ``x-ratelimit-*`` headers as the charge left the tenant's limits (added to the response)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The limiter refused (429), or could not be asked and ``ratelimit.on_failure`` is closed (503)."""

    decision: Decision
    headers: tuple[tuple[str, str], ...] = ()
    """The ``x-ratelimit-*`` headers of the refusal (its ``retry-after`` is the decision's)."""


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """A tenant's limits as they stand (``sluice admin tenants``)."""

    tenant: Tenant
    states: tuple[LimitState, ...]
    """Every limit of every scope (the tenant's, then each model's), charging nothing; empty when the store could not
    be read (``error``)."""
    error: str = ""


def make_limiter(config: Config) -> RateLimiter:
    """The limiter on the ledger's store: Valkey at ``store.url`` (keys under ``<store.prefix>:rl:``), else memory. A
    charge's lease outlives the longest park plus the ticket's own lease: a lost access-log entry frees its
    concurrency slot no later than the ticket is reaped."""
    settings = LimiterSettings(lease_s=config.tickets.lease_seconds + config.authz_timeout_s,
                               concurrency_retry_after_s=config.ratelimit.concurrency_retry_after_seconds)
    url = config.store.url if config.store.backend is StoreBackend.VALKEY else None
    return open_limiter(url, settings, key_prefix=f"{config.store.prefix}:rl:",
                        timeout_s=config.ratelimit.timeout_seconds, max_connections=config.ratelimit.max_connections)


def _rate_headers(verdict: LimitVerdict) -> tuple[tuple[str, str], ...]:
    """The verdict's ``x-ratelimit-*`` headers (a refusal's ``retry-after`` travels in its decision)."""
    return tuple((k, v) for k, v in openai_headers(verdict) if k.startswith(RATELIMIT_HEADER_PREFIX))


def refusal(tenant: Tenant, verdict: LimitVerdict, tokens: int) -> Decision:
    """A refused charge as a decision: 429 ``rate_limit_exceeded``, its message in OpenAI's words (which limit, how
    much is left, how much was asked, when to try again). Over a whole budget (``TOO_LARGE``) no retry helps: no
    retry-after."""
    denied = verdict.denied_by[0] if verdict.denied_by else None
    what = {LimitKind.REQUESTS: "requests per min (RPM)", LimitKind.TOKENS: "tokens per min (TPM)",
            LimitKind.CONCURRENT: "concurrent requests"}
    asked = tokens if denied is not None and denied.kind is LimitKind.TOKENS else 1
    scope = f" and model {denied.key.split('/', 1)[1]}" if denied is not None and "/" in denied.key else ""
    head = f"Rate limit reached for tenant {tenant.name}{scope}"
    if denied is not None:
        head += f" on {what[denied.kind]}: Limit {denied.limit}, Remaining {denied.remaining}, Requested {asked}"
    if verdict.outcome is Outcome.TOO_LARGE or verdict.retry_after_s is None:
        return Decision(Verdict.REJECT, Reason.RATE_LIMITED,
                        detail=f"{head}. The request is larger than the whole budget; lower max_tokens or the prompt.")
    wait = retry_after_seconds(verdict.retry_after_s)
    return Decision(Verdict.SHED, Reason.RATE_LIMITED, retry_after_s=wait,
                    detail=f"{head}. Please try again in {wait}s.")


class Quota:
    """``clock``: wall-clock seconds (``time.time``), the one clock every replica sharing the store agrees on."""

    def __init__(self, config: Config, limiter: RateLimiter, metrics: SluiceMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        """Replaced on a reload: the tenants' limits travel with every call, so the budgets stay."""
        self.limiter = limiter
        self.metrics = metrics
        self.clock = clock
        self._background: set[asyncio.Task[None]] = set()

    # -- the Check ---------------------------------------------------------------------------------------------------
    async def charge(self, tenant: Tenant, request: InferenceRequest, charge_id: str) -> Charged | Refused:
        """Pre-charge a tenant's request under ``charge_id`` (raises ``ratelimit.ChargeIdInUse`` when that id is open
        already: the caller picks another)."""
        scopes = limiter_scopes(tenant, request.model)
        if not scopes:
            self.metrics.ratelimit_decisions.labels(tenant.name, "allowed").inc()
            return Charged(None)
        tokens = precharge_tokens(request, self.config.policy)
        try:
            verdict = await self._timed("charge", self.limiter.charge(
                ChargeRequest(scopes, tokens=tokens, requests=1, charge_id=charge_id), self.clock()))
        except StoreUnavailable as exc:
            self.metrics.ratelimit_decisions.labels(tenant.name, "store_error").inc()
            rl = self.config.ratelimit
            if rl.on_failure is RateLimitOnFailure.OPEN:
                log.warning("rate limiter unavailable (%s): tenant %s's request admitted uncharged "
                            "(ratelimit.on_failure: open)", exc, tenant.name)
                return Charged(None)
            return Refused(Decision(Verdict.SHED, Reason.RATELIMIT_UNAVAILABLE,
                                    retry_after_s=rl.failure_retry_after_seconds,
                                    detail="The rate limiter cannot be reached; retry later"))
        self.metrics.ratelimit_decisions.labels(tenant.name, verdict.outcome.value).inc()
        if verdict.allowed:
            return Charged(charge_id, _rate_headers(verdict))
        return Refused(refusal(tenant, verdict, tokens), _rate_headers(verdict))

    def refund(self, charge_id: str) -> None:
        """Give a charge back whole (its tokens and its request), in the background: the Check did not admit it."""
        self._spawn(self.refund_now(charge_id))

    async def refund_now(self, charge_id: str) -> None:
        try:
            await self._timed("settle", self.limiter.settle(charge_id, 0, self.clock(), refund_request=True))
        except StoreUnavailable as exc:
            log.warning("refund of %s failed (%s); its lease frees it", charge_id, exc)

    # -- the access log ----------------------------------------------------------------------------------------------
    def settle(self, tenant: str, charge_id: str | None, usage: Usage) -> None:
        """A tenant's request finished: count its tokens and, when it was charged, settle the charge with them."""
        self.metrics.tenant_tokens.labels(tenant, "prompt").inc(usage.prompt_tokens)
        self.metrics.tenant_tokens.labels(tenant, "completion").inc(usage.completion_tokens)
        if charge_id is not None:
            self._spawn(self._settle(charge_id, usage.total))

    async def _settle(self, charge_id: str, tokens: int) -> None:
        try:
            await self._timed("settle", self.limiter.settle(charge_id, tokens, self.clock()))
        except StoreUnavailable as exc:
            log.warning("settle of %s failed (%s); its pre-charge stands", charge_id, exc)

    # -- operators ---------------------------------------------------------------------------------------------------
    async def usage(self) -> tuple[TenantUsage, ...]:
        """Every tenant's limits as they stand, in name order (``sluice admin tenants``)."""
        out = []
        now = self.clock()
        for name in sorted(self.config.tenants.by_name):
            tenant = self.config.tenants.by_name[name]
            scopes = every_scope(tenant)
            try:
                states = await self._timed("peek", self.limiter.peek(scopes, now)) if scopes else ()
            except StoreUnavailable as exc:
                out.append(TenantUsage(tenant, (), str(exc)))
                continue
            out.append(TenantUsage(tenant, states))
        return tuple(out)

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.config.ratelimit.timeout_seconds * 2)
        for task in self._background:
            task.cancel()
        await self.limiter.close()

    async def _timed(self, op: str, call: Awaitable[_T]) -> _T:
        try:
            return await call
        except StoreUnavailable:
            self.metrics.ratelimit_errors.labels(op).inc()
            raise

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            await work
        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
