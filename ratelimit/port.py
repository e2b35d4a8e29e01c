"""The limiter's one port: what the Check, the access log and the rate-limit service call, whatever holds the state.

Exceptions (all from this module)::

    RateLimitError                 anything the limiter raises on purpose
    ├── StoreUnavailable           the store did not answer (refused, reset, timed out, out of memory, read-only): the
    │                              operation may or may not have run. Admit or refuse is the caller's policy (open or
    │                              closed); the limiter never decides it.
    └── ChargeIdInUse              a charge named an id that is still open (ids must be unique, like ticket ids)

Bad arguments (a negative cost, a malformed key) are ``ValueError`` from the dataclasses in ``core.py``, raised before
any store is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ratelimit.core import ChargeRequest, LimiterSettings, LimitState, Scope, Settlement, Verdict


class RateLimitError(Exception):
    pass


class StoreUnavailable(RateLimitError):
    """The store could not be reached or did not answer within the limiter's timeout. Whether the call took effect is
    unknown (a charge whose reply was lost may have been recorded; it is then settled or expires by its lease)."""


class ChargeIdInUse(RateLimitError):
    pass


class RateLimiter(Protocol):
    """One budget store, shared by everything that holds the same backend (every replica on one Valkey).

    Times are the caller's clock in seconds, non-decreasing; a store shared by processes needs a clock they share
    (``time.time()``)."""

    settings: LimiterSettings

    async def charge(self, request: ChargeRequest, now: float) -> Verdict:
        """Charge every limit of every scope, all or nothing. Admitted with a ``charge_id``: one concurrency slot per
        scope that limits concurrency is held until ``settle`` or the lease (``settings.lease_s``)."""
        ...

    async def settle(self, charge_id: str, actual_tokens: int, now: float, *,
                     refund_request: bool = False) -> Settlement:
        """Replace the charge's tokens by ``actual_tokens`` (a refund of the unused part still ahead of ``now``, or
        the extra billed now), free its slots. ``refund_request``: also give back its request (it never ran: refused
        after the charge, by admission). Idempotent: a second settle of one id, or a settle after the lease, is
        ``NOT_OPEN`` and changes nothing."""
        ...

    async def peek(self, scopes: Sequence[Scope], now: float) -> tuple[LimitState, ...]:
        """The limits of ``scopes`` as they stand (``sluice admin``'s usage view); charges nothing."""
        ...

    async def close(self) -> None:
        ...
