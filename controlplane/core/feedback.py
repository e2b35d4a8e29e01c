"""TTFT feedback: each engine's measured TTFT against the estimate corrects its later estimates. Pure (time passed in).

The access log times a served request's first token in Envoy (``FirstToken``, from the request fully sent to the engine;
decision 0001); the ticket carries the TTFT its decision estimated. ``TtftCorrections`` keeps one factor per engine
multiplying the engine's own part of the estimate (prefill and first token, not a slot wait; route.estimate):

- each streamed observation multiplies the factor by ``ratio ** gain``, against an estimate that already carried it, so
  the factor settles where measured and estimated agree (a non-streaming first token is the whole body: not observed);
- the factor stays within ``[minimum, maximum]``;
- it holds for ``half_life_s`` after the engine's last measured request, then decays toward 1, halving in log space
  every ``half_life_s`` (``decay``): a high factor keeps requests away, so it could not learn otherwise;
- a factor within 2% of 1 is published as 1, and a published factor changes only by more than 2%.

Each control-plane replica derives its own from the access-log entries it receives.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

_CHANGE = 0.02
"""A factor is reported as changed (the index refreshes the engine's rows) once it moved this far (relative)."""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """When a served request's first token passed Envoy, from its access-log entry."""

    engine_s: float
    """From the request fully sent to the engine to its first token (a non-streaming response's whole body)."""
    gateway_s: float
    """From the request's arrival at Envoy to its being fully sent to the engine: the Check, any park, the body."""
    streamed: bool
    """A stream's first token event; False: a non-streaming response, whose first token is its whole body."""
    whole_s: float | None = None
    """From the request fully sent to the engine to the response's last byte; None when Envoy did not record it."""
    output_tokens: int | None = None
    """The answer's tokens when known: the engine's ``usage.completion_tokens`` (a non-streaming answer, or a stream
    that asked for usage), else the content deltas counted for a tenant's stream; None otherwise."""


def end_to_end_error(timing: FirstToken, expected_ttft_s: float, decode_tokens_per_s: float) -> float | None:
    """A served request's time at its engine (``whole_s``) over what its admission's estimate gives for an answer of
    its real length: ``expected_ttft_s + (output_tokens - 1) / decode_tokens_per_s``. The length is only guessed at
    admission (the model's mean, output_length.py); taking the real one measures the timing model alone (prefill,
    decode, their interference). None without the length (at least 2 tokens), the time, or the estimate's rate (a
    ticket another replica admitted)."""
    tokens = timing.output_tokens
    if timing.whole_s is None or timing.whole_s <= 0 or tokens is None or tokens < 2 or decode_tokens_per_s <= 0 \
            or expected_ttft_s <= 0:
        return None
    return timing.whole_s / (expected_ttft_s + (tokens - 1) / decode_tokens_per_s)


class TtftCorrections:
    def __init__(self, gain: float, maximum: float, half_life_s: float = 0.0, minimum: float = 1.0) -> None:
        self.gain = gain
        self.maximum = maximum
        self.minimum = minimum
        """The smallest factor (1: correct upward only)."""
        self.half_life_s = half_life_s
        """0: a factor never decays."""
        self._factors: dict[str, tuple[float, float]] = {}
        """engine -> (its factor, when its last measured request came in)."""
        self._published: dict[str, float] = {}

    def factor(self, engine: str) -> float:
        """What ``engine``'s TTFT estimates are multiplied by (1: no correction)."""
        return self._published.get(engine, 1.0)

    def observe(self, engine: str, ratio: float, now: float) -> bool:
        """One served request's measured TTFT over its estimate. True when the engine's published factor changed (the
        caller refreshes what holds it)."""
        if self.gain <= 0 or not ratio > 0 or math.isinf(ratio):
            return False
        moved = min(self.maximum, max(self.minimum, self._decayed(engine, now) * ratio ** self.gain))
        self._factors[engine] = (moved, now)
        return self._publish(engine, moved)

    def decay(self, now: float) -> list[str]:
        """The engines whose published factor moved as it decayed (held past ``half_life_s`` without a request)."""
        if self.half_life_s <= 0:
            return []
        return [engine for engine in list(self._published) if self._publish(engine, self._decayed(engine, now))]

    def _decayed(self, engine: str, now: float) -> float:
        factor, at = self._factors.get(engine, (1.0, now))
        idle = now - at - self.half_life_s
        if self.half_life_s <= 0 or idle <= 0:
            return factor
        return float(factor ** (2.0 ** (-idle / self.half_life_s)))

    def _publish(self, engine: str, value: float) -> bool:
        if 1.0 / (1.0 + _CHANGE) < value < 1.0 + _CHANGE:
            value = 1.0
        published = self._published.get(engine, 1.0)
        if value == published or (value != 1.0 and abs(value - published) <= _CHANGE * published):
            return False
        if value == 1.0:
            self._published.pop(engine)
        else:
            self._published[engine] = value
        return True

    def forget(self, engine: str) -> bool:
        """``engine`` restarted or left: its history says nothing of what comes next. True when it had a factor."""
        self._factors.pop(engine, None)
        return self._published.pop(engine, None) is not None

    def configure(self, gain: float, maximum: float, half_life_s: float, minimum: float = 1.0) -> list[str]:
        """A policy reload; returns the engines whose published factor changed (new bounds clamp them)."""
        self.gain, self.maximum, self.half_life_s, self.minimum = gain, maximum, half_life_s, minimum
        changed = []
        for engine, value in list(self._published.items()):
            clamped = min(maximum, max(minimum, value))
            if gain <= 0 or clamped == 1.0:
                self._published.pop(engine)
                self._factors.pop(engine, None)
                changed.append(engine)
            elif clamped != value:
                factor, at = self._factors[engine]
                self._published[engine] = clamped
                self._factors[engine] = (min(maximum, max(minimum, factor)), at)
                changed.append(engine)
        return changed


@dataclass(frozen=True, slots=True)
class TtftSummary:
    """An engine's last ``RecentTtfts.size`` served requests' first tokens (``sluice admin engines``)."""

    samples: int
    p50_s: float | None
    p90_s: float | None
    error_median: float | None
    """The median of the streamed ones' measured TTFT over the estimate; None without one."""
    correction: float = 1.0
    """The engine's TTFT correction now (``TtftCorrections.factor``)."""
    end_to_end_error_median: float | None = None
    """The median of ``end_to_end_error`` over the ones that had it; None without one."""


class RecentTtfts:
    """A ring of each engine's last ``size`` first tokens (``FirstToken.engine_s``) and, for streams with an estimate,
    the estimate's error ratio: what clients saw lately, engine by engine. An engine's rings live as long as the process
    (``size`` floats each), so an engine that left and came back shows its earlier requests too."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._ttfts: dict[str, deque[float]] = {}
        self._errors: dict[str, deque[float]] = {}
        self._end_to_end: dict[str, deque[float]] = {}

    def record(self, engine: str, ttft_s: float, error_ratio: float | None,
               end_to_end_ratio: float | None = None) -> None:
        self._ttfts.setdefault(engine, deque(maxlen=self.size)).append(ttft_s)
        if error_ratio is not None:
            self._errors.setdefault(engine, deque(maxlen=self.size)).append(error_ratio)
        if end_to_end_ratio is not None:
            self._end_to_end.setdefault(engine, deque(maxlen=self.size)).append(end_to_end_ratio)

    def summary(self, engine: str) -> TtftSummary:
        ttfts = sorted(self._ttfts.get(engine, ()))
        errors = sorted(self._errors.get(engine, ()))
        end_to_end = sorted(self._end_to_end.get(engine, ()))
        return TtftSummary(len(ttfts), _quantile(ttfts, 0.5), _quantile(ttfts, 0.9), _quantile(errors, 0.5),
                           end_to_end_error_median=_quantile(end_to_end, 0.5))


def _quantile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of an ascending list; None when it is empty."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
