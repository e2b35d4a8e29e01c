"""TTFT feedback (issue 9): each engine's measured TTFT against the estimate corrects its later estimates.

The access log gives every served request's TTFT as the engine delivered it (its first byte after the request reached it,
after any park) and the ticket carries the TTFT the decision estimated. Their ratio is the estimate's error on that engine:
prefill slower than its measured rate says, a first step costlier than a decode step, queueing inside the engine that the
ledger does not see. ``TtftCorrections`` keeps one factor per engine that multiplies the engine's own part of the TTFT
estimate (prefill plus the first token, not a slot wait the ledger computes; route.estimate), so deadlines, the band and
finish-soonest judge that engine by what it has been delivering.

The factor moves like an integral controller: each observation multiplies it by ``ratio ** gain`` (the ratio is taken
against an estimate that already carried the factor, so the factor settles where measured and estimated agree). It only
ever corrects upward (never below 1) and never above ``maximum``:

- The first upstream byte is a lower bound on the first token (an engine that flushes its headers before it has a token
  makes the measured TTFT near zero): a ratio below 1 is no proof that the engine is faster than estimated, while a ratio
  above 1 is proof that it is slower. Estimates below 1 would also make deadline traffic trust an engine more than its
  measured rates do.
- The cap bounds what a burst of outliers (a stalled request, a restart) can do; the factor decays back once requests come
  in on time again.

A factor only learns from requests the engine serves, and a high one is what keeps requests away: an engine that was slow
for a while (a noisy neighbour, a stall) could stay out of deadline traffic for good, idle while requests park. So a
factor **holds for ``half_life_s`` after the engine's last measured request, then decays toward 1**, halving in log space
every ``half_life_s`` (``decay``, from the shell's periodic tick). Failure mode: an engine really that slow gets a few
requests back every few half-lives, estimated too fast, until their TTFTs raise its factor again (about ten requests at
gain 0.1). An engine in steady use never decays: each request restarts its hold.

Pure: no clock, no I/O (time is passed in). Each control-plane replica derives its own from the access-log entries it
receives.
"""

from __future__ import annotations

import math

_CHANGE = 0.02
"""A factor is reported as changed (the index refreshes the engine's rows) once it moved this far (relative)."""


class TtftCorrections:
    def __init__(self, gain: float, maximum: float, half_life_s: float = 0.0) -> None:
        self.gain = gain
        self.maximum = maximum
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
        moved = min(self.maximum, max(1.0, self._decayed(engine, now) * ratio ** self.gain))
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
        if value < 1.0 + _CHANGE:
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

    def configure(self, gain: float, maximum: float, half_life_s: float) -> list[str]:
        """A policy reload; returns the engines whose published factor changed (a lower maximum clamps them)."""
        self.gain, self.maximum, self.half_life_s = gain, maximum, half_life_s
        changed = []
        for engine, value in list(self._published.items()):
            clamped = min(maximum, value)
            if gain <= 0 or clamped <= 1.0:
                self._published.pop(engine)
                self._factors.pop(engine, None)
                changed.append(engine)
            elif clamped != value:
                factor, at = self._factors[engine]
                self._published[engine] = clamped
                self._factors[engine] = (min(maximum, factor), at)
                changed.append(engine)
        return changed
