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

Pure: no clock, no I/O. Each control-plane replica derives its own from the access-log entries it receives.
"""

from __future__ import annotations

import math

_CHANGE = 0.02
"""A factor is reported as changed (the index refreshes the engine's rows) once it moved this far (relative)."""


class TtftCorrections:
    def __init__(self, gain: float, maximum: float) -> None:
        self.gain = gain
        self.maximum = maximum
        self._factors: dict[str, float] = {}
        self._published: dict[str, float] = {}

    def factor(self, engine: str) -> float:
        """What ``engine``'s TTFT estimates are multiplied by (1: no correction)."""
        return self._published.get(engine, 1.0)

    def observe(self, engine: str, ratio: float) -> bool:
        """One served request's measured TTFT over its estimate. True when the engine's published factor changed (the
        caller refreshes what holds it)."""
        if self.gain <= 0 or not ratio > 0 or math.isinf(ratio):
            return False
        current = self._factors.get(engine, 1.0)
        moved = min(self.maximum, max(1.0, current * ratio ** self.gain))
        self._factors[engine] = moved
        published = self._published.get(engine, 1.0)
        if abs(moved - published) <= _CHANGE * published and not (moved == 1.0 and published != 1.0):
            return False
        if moved == 1.0:
            self._published.pop(engine, None)
        else:
            self._published[engine] = moved
        return True

    def forget(self, engine: str) -> bool:
        """``engine`` restarted or left: its history says nothing of what comes next. True when it had a factor."""
        self._factors.pop(engine, None)
        return self._published.pop(engine, None) is not None

    def configure(self, gain: float, maximum: float) -> list[str]:
        """A policy reload; returns the engines whose published factor changed (a lower maximum clamps them)."""
        self.gain, self.maximum = gain, maximum
        changed = []
        for engine, value in list(self._published.items()):
            clamped = min(maximum, value)
            if gain <= 0 or clamped <= 1.0:
                self._published.pop(engine)
                self._factors.pop(engine, None)
                changed.append(engine)
            elif clamped != value:
                self._published[engine] = self._factors[engine] = clamped
                changed.append(engine)
        return changed
