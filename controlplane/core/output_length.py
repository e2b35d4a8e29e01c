"""How many tokens a model's requests really generate, learned from completed requests. Pure: no I/O, no clock.

Two numbers describe a request's output and they must not be confused: the **reservation** (``max_tokens``, or
``admission.default_max_tokens`` when the client names none) is the worst case the KV rules hold back, while the
**expected length** is the best guess of when it finishes, which is what slot waits, finish-soonest and the ledger's
expected finish times need. Real engines stop at end of sequence, usually far below ``max_tokens``, and most clients send no
``max_tokens`` at all, so predicting time from the reservation makes every busy engine look much slower than it is (and, the
other way round, every estimate of a free slot far too long).

Per model the book keeps a bounded ring of the last ``window`` completion lengths and trusts their **mean** once it holds
``min_samples``: waits add service times up, and the expected sum of service times follows the mean, long tail included
(a median would hide exactly the long answers that make queues slow). Lengths cut off by a client's ``max_tokens`` are
recorded as they are: they are what that traffic really costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from types import MappingProxyType


class OutputLengthBook:
    """Per-model ring of completion lengths; ``expected(model)`` is their mean once trusted, else None."""

    def __init__(self, window: int = 256, min_samples: int = 20) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("need window >= 1 and 1 <= min_samples <= window")
        self.window = window
        self.min_samples = min_samples
        self._rings: dict[str, deque[int]] = {}
        self._sums: dict[str, int] = {}
        self._trusted: dict[str, float] = {}
        """model -> mean, only for models with ``min_samples`` or more (what ``snapshot`` hands the decision core)."""

    def record(self, model: str, completion_tokens: int) -> None:
        """One finished request of ``model`` generated ``completion_tokens`` (negative counts are ignored)."""
        if completion_tokens < 0:
            return
        ring = self._rings.setdefault(model, deque())
        total = self._sums.get(model, 0) + completion_tokens
        ring.append(completion_tokens)
        if len(ring) > self.window:
            total -= ring.popleft()
        self._sums[model] = total  # a running sum keeps record() and the mean O(1) on the request path
        if len(ring) >= self.min_samples:
            self._trusted[model] = total / len(ring)

    def expected(self, model: str) -> float | None:
        return self._trusted.get(model)

    def samples(self, model: str) -> int:
        return len(self._rings.get(model, ()))

    def snapshot(self) -> Mapping[str, float]:
        """Trusted means by model (a read-only copy: a ``Fleet`` must not change under a decision)."""
        return MappingProxyType(dict(self._trusted))
