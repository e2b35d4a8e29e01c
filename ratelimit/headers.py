"""A verdict as the response headers OpenAI's API sends (pure).

OpenAI's names and formats (its rate-limits guide, "Rate limits in headers")::

    x-ratelimit-limit-requests      60        requests allowed before the limit is exhausted
    x-ratelimit-limit-tokens        150000
    x-ratelimit-remaining-requests  59        what remains
    x-ratelimit-remaining-tokens    149984
    x-ratelimit-reset-requests      1s        time until the limit is back to its initial state
    x-ratelimit-reset-tokens        6m0s      (a Go duration: 12ms, 8.64s, 6m0s, 1h0m0s)

plus ``retry-after`` in whole seconds on a refusal: seconds until there is room for *this* request (rounded up, so a
client that waits exactly that long fits). A charge that touched several scopes (a tenant and its model) reports, per
kind, the limit with the least remaining (on a tie, the one that takes longer to reset). Concurrency limits have no
OpenAI header and are not rendered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ratelimit.core import SLACK_S, LimitKind, LimitState, Verdict


def go_duration(seconds: float) -> str:
    """Seconds as Go's ``time.Duration.String()`` at millisecond precision, rounded up (what OpenAI sends): ``0s``,
    ``12ms``, ``1s``, ``8.64s``, ``6m0s``, ``1h2m3.5s``."""
    if not seconds > 0:
        return "0s"
    millis = math.ceil((seconds - SLACK_S) * 1000)  # an epoch timestamp's rounding is not a millisecond more
    if millis < 1000:
        return f"{max(1, millis)}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def retry_after_seconds(retry_after_s: float) -> int:
    """Whole seconds, rounded up, at least 1 (a client waiting this long finds room)."""
    return max(1, math.ceil(retry_after_s))


def tightest(states: Sequence[LimitState], kind: LimitKind) -> LimitState | None:
    """Of the limits of ``kind``, the one with the least remaining; on a tie, the one that takes longer to reset."""
    of_kind = [s for s in states if s.kind is kind]
    if not of_kind:
        return None
    return min(of_kind, key=lambda s: (s.remaining, -s.reset_s))


def openai_headers(verdict: Verdict) -> tuple[tuple[str, str], ...]:
    """The ``x-ratelimit-*`` headers for the request and token limits the verdict touched, and ``retry-after`` when it
    refused with a known wait. Header names are lower case (HTTP/2)."""
    headers: list[tuple[str, str]] = []
    for kind in (LimitKind.REQUESTS, LimitKind.TOKENS):
        state = tightest(verdict.states, kind)
        if state is None:
            continue
        headers += [(f"x-ratelimit-limit-{kind}", str(state.limit)),
                    (f"x-ratelimit-remaining-{kind}", str(state.remaining)),
                    (f"x-ratelimit-reset-{kind}", go_duration(state.reset_s))]
    if not verdict.allowed and verdict.retry_after_s is not None:
        headers.append(("retry-after", str(retry_after_seconds(verdict.retry_after_s))))
    return tuple(headers)
