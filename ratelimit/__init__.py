"""sluice's rate limiter: requests per period, tokens per period and concurrent requests per key (a tenant, a tenant and
model), charged before a request runs and settled with what it used. See ``ratelimit/README.md``.

- ``core.py``: the arithmetic (GCRA meters, leased slots, settle), pure; the types every caller uses.
- ``port.py``: the ``RateLimiter`` protocol and the exceptions.
- ``memory.py``, ``valkey.py``: the backends (one process; any number of processes on one Valkey).
- ``headers.py``: a verdict as OpenAI's ``x-ratelimit-*`` and ``retry-after`` headers.
- ``config.py``: limits from YAML, checked with dotted paths; the rate-limit service's descriptors.
- ``rls.py``: the same limiter as Envoy's ``envoy.service.ratelimit.v3.RateLimitService`` (``sluice ratelimit``).
"""

from __future__ import annotations

from ratelimit.core import (
    ChargeRequest, LimiterSettings, Limits, LimitKind, LimitState, Outcome, Rate, Scope, SettleOutcome, Settlement,
    Verdict,
)
from ratelimit.headers import openai_headers
from ratelimit.port import ChargeIdInUse, RateLimiter, RateLimitError, StoreUnavailable

__all__ = [
    "ChargeIdInUse", "ChargeRequest", "LimiterSettings", "LimitKind", "LimitState", "Limits", "Outcome", "Rate",
    "RateLimitError", "RateLimiter", "Scope", "SettleOutcome", "Settlement", "StoreUnavailable", "Verdict",
    "open_limiter", "openai_headers",
]


def open_limiter(store_url: str | None, settings: LimiterSettings | None = None, *, key_prefix: str = "sluice:rl:",
                 timeout_s: float = 0.5, max_connections: int = 32) -> RateLimiter:
    """The backend a URL names: ``None`` or ``memory`` -> this process only; ``redis://`` / ``rediss://`` /
    ``unix://`` / ``valkey://`` -> a Valkey (or Redis) server shared by every limiter that names it."""
    if store_url is None or store_url == "memory":
        from ratelimit.memory import MemoryRateLimiter

        return MemoryRateLimiter(settings)
    scheme = store_url.split("://", 1)[0]
    if scheme in ("redis", "rediss", "unix", "valkey", "valkeys"):
        from ratelimit.valkey import ValkeyRateLimiter

        url = store_url.replace("valkey", "redis", 1) if scheme.startswith("valkey") else store_url
        return ValkeyRateLimiter(url, settings, key_prefix=key_prefix, timeout_s=timeout_s,
                                 max_connections=max_connections)
    raise ValueError(f"store URL {store_url!r}: expected 'memory' or redis://host:port/db (rediss:// with TLS)")
