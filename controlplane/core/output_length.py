"""How many tokens a model's requests really generate, learned from completed requests. Pure: no I/O, no clock.

The **reservation** (``max_tokens``, else ``admission.default_max_tokens``) is the worst case the KV rules hold back; the
**expected length** is when a request is expected to finish, which slot waits, finish-soonest and the ledger's expected
finish times read. Per model the book keeps a ring of the last ``window`` completion lengths and trusts their **mean**
once it holds ``min_samples``: waits add service times up, and their expected sum follows the mean, long tail included.

**The rest of a running request** (``OutputTail``): a request that has produced a fraction ``y`` of the mean is expected
to produce ``E[x - y | x > y]`` more, over the ring's lengths as multiples ``x`` of their mean; never less than
``1 - y`` (the fleet index prunes with that bound), and 0 when no recorded length is longer (lengths that never vary:
an overdue ticket is late, not long). Until a model has ``min_samples`` lengths the tail is memoryless (``MEMORYLESS``:
one whole expected answer still ahead), the shape that assumes least. Why: bench/results/README.md (issue 9).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np


@dataclass(frozen=True, slots=True)
class OutputTail:
    """A model's recorded lengths as multiples of their mean, sorted, with the mean of every suffix: the expected rest
    of a request that has run part of the way (module docstring)."""

    ratios: tuple[float, ...]
    suffix_means: tuple[float, ...]
    """``suffix_means[i]`` is the mean of ``ratios[i:]``."""

    @classmethod
    def of(cls, lengths: Iterable[int]) -> OutputTail | None:
        # The suffix sums run from the end backward: the same figures, to the last bit, as summing in Python.
        values = np.sort(np.fromiter(lengths, dtype=float))
        total = float(values.sum())
        if not len(values) or total <= 0:
            return None
        ratios = values / (total / len(values))
        means = np.cumsum(ratios[::-1])[::-1] / np.arange(len(ratios), 0, -1)
        return cls(tuple(ratios.tolist()), tuple(means.tolist()))

    def remaining(self, done: float) -> float:
        """Expected rest, in multiples of the mean length, of a request that has produced ``done`` times the mean:
        ``E[x - done | x > done]``; 0 when no recorded length is longer."""
        if not self.ratios:
            return 1.0  # MEMORYLESS
        if done <= 0:
            return 1.0 - done  # the unconditional mean (1 by construction) minus what is done
        i = bisect.bisect_right(self.ratios, done)
        return self.suffix_means[i] - done if i < len(self.ratios) else 0.0


def lengths_from_buckets(by_length: Iterable[tuple[float, float, int]], mean: float, limit: int) -> list[int]:
    """One length per request an engine finished, from its length histogram's bucket counts (``(lower, upper, count)``):
    each at its bucket's geometric middle (``upper / 2`` in the first bucket, ``2 x lower`` in the open last one), then
    all scaled so their mean is the interval's exact ``mean`` (the histogram's sum over its count). At most ``limit``,
    evenly spaced over the sorted lengths so the shape survives. The book then holds the spread of real answers, not one
    interval mean per request (which would hide every long answer behind the short ones that finished beside it)."""
    middles: list[float] = []
    for lower, upper, count in by_length:
        if math.isinf(upper):
            middle = 2.0 * lower if lower > 0 else mean
        elif lower <= 0:
            middle = upper / 2.0
        else:
            middle = math.sqrt(lower * upper)
        middles += [middle] * count
    if not middles or mean <= 0:
        return []
    scale = mean / (sum(middles) / len(middles))
    middles.sort()
    if len(middles) > limit:
        step = len(middles) / limit
        middles = [middles[int(i * step + step / 2)] for i in range(limit)]
    return [max(1, round(m * scale)) for m in middles]


TAIL_REBUILD_FRACTION = 16
"""A model's ``OutputTail`` is rebuilt once this fraction of its window (16 lengths of 256) is new ..."""

TAIL_REBUILD_MIN_INTERVAL_S = 1.0
"""... and at most once a second (a large fleet's probes bring lengths at nearly every Check)."""

MEMORYLESS = OutputTail((), ())
"""The tail of a model with too few recorded lengths: the rest is one expected answer, however far along."""


class OutputLengthBook:
    """Per-model ring of completion lengths; ``expected(model)`` is their mean once trusted, else None."""

    def __init__(self, window: int = 256, min_samples: int = 20) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("need window >= 1 and 1 <= min_samples <= window")
        self.window = window
        self.min_samples = min_samples
        self._rings: dict[str, deque[int]] = {}
        self._trusted: dict[str, float] = {}
        """model -> mean, only for models with ``min_samples`` or more (what ``snapshot`` hands the decision core)."""
        self._tails: dict[str, OutputTail] = {}
        self._stale_tails: set[str] = set()
        self._untailed: dict[str, int] = {}
        """model -> lengths recorded since its tail was last built."""
        self._tail_built_at: dict[str, float] = {}
        self._tail_every = max(1, window // TAIL_REBUILD_FRACTION)
        self._tails_view: Mapping[str, OutputTail] = MappingProxyType({})

    def record(self, model: str, completion_tokens: int) -> None:
        """One finished request of ``model`` generated ``completion_tokens`` (negative counts are ignored)."""
        self.record_many(model, (completion_tokens,))

    def record_many(self, model: str, lengths: Iterable[int]) -> None:
        """Finished requests of ``model`` and what each generated (a probe reports an interval's at once)."""
        kept = [length for length in lengths if length >= 0]
        if not kept:
            return
        ring = self._rings.get(model)
        if ring is None:
            ring = self._rings[model] = deque(maxlen=self.window)
        ring.extend(kept)
        if len(ring) >= self.min_samples:
            self._trusted[model] = sum(ring) / len(ring)
            untailed = self._untailed.get(model, 0) + len(kept)
            self._untailed[model] = untailed
            if model not in self._tails or untailed >= self._tail_every:
                self._stale_tails.add(model)

    def expected(self, model: str) -> float | None:
        return self._trusted.get(model)

    def samples(self, model: str) -> int:
        return len(self._rings.get(model, ()))

    def tails(self, now: float) -> Mapping[str, OutputTail]:
        """Each trusted model's ``OutputTail`` (read-only). Rebuilt (one sort of the ring) when a model is first trusted,
        then once a ``1 / TAIL_REBUILD_FRACTION`` of its window is new, at most every ``TAIL_REBUILD_MIN_INTERVAL_S``
        (the shape of hundreds of lengths moves slowly)."""
        if self._stale_tails:
            # A clock read earlier than the last build (callers that pass times of their own) counts as due too.
            due = [model for model in self._stale_tails if model not in self._tails
                   or not 0 <= now - self._tail_built_at.get(model, -math.inf) < TAIL_REBUILD_MIN_INTERVAL_S]
            for model in due:
                self._stale_tails.discard(model)
                self._untailed[model] = 0
                self._tail_built_at[model] = now
                tail = OutputTail.of(self._rings[model])
                if tail is None:
                    self._tails.pop(model, None)
                else:
                    self._tails[model] = tail
            if due:
                self._tails_view = MappingProxyType(dict(self._tails))
        return self._tails_view

    def snapshot(self) -> Mapping[str, float]:
        """Trusted means by model (a read-only copy: a ``Fleet`` must not change under a decision)."""
        return MappingProxyType(dict(self._trusted))
