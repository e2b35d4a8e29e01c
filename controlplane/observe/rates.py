"""Rates from counters and histograms: deltas between two consecutive probes of one engine, and the medians they feed.

Pure: samples in, rates out. For probes ``a`` then ``b`` (``dt = b.taken_at - a.taken_at``)::

    prompt_tokens_per_s       = d(prompt_tokens_total) / dt
    generation_tokens_per_s   = d(generation_tokens_total) / dt
    prefill_tokens_per_s      = d(prefill_tokens_total) / d(prefill_seconds_total)    (computed tokens per second of
                                prefill; when prefill_tokens_total counts cache hits too, x (1 - cached))
    cached                    = d(prefix_cache_hits_total) / d(prefix_cache_queries_total)     (``cached_share``)
    decode_tokens_per_s_each  = d(decode_tokens_total) / d(decode_seconds_total)        (one request's decode rate)
    mean_output_tokens        = d(finished_output_tokens_total) / d(finished_requests_total)  (real answer lengths)
    finished_by_length        = d(each bucket of that histogram)                (how those lengths spread)

A restart, a delta of zero or too few prefill tokens gives no rate; a decode rate may be solo (``rates_between``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import TypeVar

from controlplane.core.sharedmap import SharedMap
from controlplane.core.engines import EngineRates, EngineSample
from controlplane.core.fleet import BatchRates, ClassChangeLog, RateTables

_Key = TypeVar("_Key", tuple[str, str], tuple[str, int])


def _delta(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b < a:
        return None
    return b - a


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or num <= 0 or den <= 0:
        return None
    return num / den


def rates_between(a: EngineSample, b: EngineSample, min_prefill_tokens: float = 256) -> EngineRates | None:
    """The rates of the module docstring between ``a`` and ``b``; None when ``b`` is not later. A counter that went
    backwards means the engine restarted (core/prefix.py's ``restarted``) and a delta of zero is no new sample (seed
    002): neither gives a rate. A prefill rate needs at least ``min_prefill_tokens`` computed prompt tokens in the
    interval: prefill time carries a fixed cost per request, so a few tiny prompts would read ten times too slow. A
    cached prompt token costs no prefill time, so hits are not counted as prefill work: vLLM's
    ``request_prefill_kv_computed_tokens`` counts only computed tokens and is read when present; older vLLMs' prompt
    histogram counts the hits, and the ``cached`` share corrects it roughly (it swings between intervals, so the median
    needs many samples). A decode rate is **solo** only when the engine ran exactly one request and queued none at both
    ends of the interval (seed 002: quality caps need the model's own uncontended rate)."""
    dt = b.taken_at - a.taken_at
    if dt <= 0:
        return None
    decode = _ratio(_delta(a.decode_tokens_total, b.decode_tokens_total),
                    _delta(a.decode_seconds_total, b.decode_seconds_total))
    solo = decode is not None and a.running == 1 and b.running == 1 and not a.waiting and not b.waiting
    batch = int(b.running) if decode is not None and a.running == b.running and b.running else None
    prefill_tokens = _delta(a.prefill_tokens_total, b.prefill_tokens_total)
    if prefill_tokens is not None and b.prefill_counts_cached:
        prefill_tokens *= 1.0 - cached_share(a, b)
    finished = _delta(a.finished_requests_total, b.finished_requests_total)
    output = _delta(a.finished_output_tokens_total, b.finished_output_tokens_total)
    return EngineRates(
        interval_s=dt,
        prompt_tokens_per_s=_ratio(_delta(a.prompt_tokens_total, b.prompt_tokens_total), dt),
        generation_tokens_per_s=_ratio(_delta(a.generation_tokens_total, b.generation_tokens_total), dt),
        prefill_tokens_per_s=_ratio(prefill_tokens, _delta(a.prefill_seconds_total, b.prefill_seconds_total))
        if prefill_tokens is not None and prefill_tokens >= min_prefill_tokens else None,
        decode_tokens_per_s_each=decode,
        solo=solo,
        batch=batch,
        finished_requests=int(finished or 0),
        mean_output_tokens=_ratio(output, finished),
        finished_by_length=_by_length(a.finished_length_buckets, b.finished_length_buckets),
    )


def _by_length(a: tuple[tuple[float, float], ...] | None,
               b: tuple[tuple[float, float], ...] | None) -> tuple[tuple[float, float, int], ...]:
    """The requests that finished between two probes, by length bucket: (lower, upper, count) of every bucket that gained
    some. Empty when either probe lacks buckets, their bounds differ, or a count went backwards (a restart)."""
    if not a or not b or [le for le, _ in a] != [le for le, _ in b]:
        return ()
    out = []
    lower, before_a, before_b = 0.0, 0.0, 0.0
    for (le, cum_a), (_, cum_b) in zip(a, b):
        gained = (cum_b - before_b) - (cum_a - before_a)
        if gained < 0 or cum_b < cum_a:
            return ()
        if gained >= 1:
            out.append((lower, le, int(round(gained))))
        lower, before_a, before_b = le, cum_a, cum_b
    return tuple(out)


def cached_share(a: EngineSample, b: EngineSample) -> float:
    """The share of looked-up prompt tokens the engine's prefix cache served between two probes (since it started when
    nothing was looked up in between); 0 without its counters."""
    hits = _delta(a.prefix_cache_hits_total, b.prefix_cache_hits_total)
    queries = _delta(a.prefix_cache_queries_total, b.prefix_cache_queries_total)
    if hits is not None and queries:
        return min(1.0, hits / queries)
    if b.prefix_cache_hits_total and b.prefix_cache_queries_total:
        return min(1.0, b.prefix_cache_hits_total / b.prefix_cache_queries_total)
    return 0.0


class MedianRing:
    """The last ``capacity`` samples of one rate; its median is trusted only from ``min_samples`` on. The median is computed
    once per change (at the first read after an ``add``), never per read."""

    __slots__ = ("_values", "min_samples", "_median", "_fresh")

    def __init__(self, capacity: int, min_samples: int) -> None:
        if capacity < 1 or not 1 <= min_samples <= capacity:
            raise ValueError("need capacity >= 1 and 1 <= min_samples <= capacity")
        self._values: deque[float] = deque(maxlen=capacity)
        self.min_samples = min_samples
        self._median: float | None = None
        self._fresh = True

    def add(self, value: float) -> None:
        self._values.append(value)
        self._fresh = False

    def __len__(self) -> int:
        return len(self._values)

    @property
    def median(self) -> float | None:
        """The median when trusted (enough samples), else None."""
        if not self._fresh:
            self._median = statistics.median(self._values) if len(self._values) >= self.min_samples else None
            self._fresh = True
        return self._median


class RateBook:
    """Medians fed by every engine's probes: prefill and solo decode per (model, chip class), and each engine's per-request
    decode rate per batch size (decode speed as a function of running requests).

    ``tables()`` is called on every Check, so the book keeps its ``RateTables`` up to date as it records: a ring's median is
    recomputed when the ring changes, and a new ``RateTables`` is built only after a trusted median changed; until then
    ``tables()`` returns the same object. A returned ``RateTables`` is never mutated afterwards (its dicts are copied on
    write), so callers may hold it."""

    def __init__(self, capacity: int = 64, min_samples: int = 5) -> None:
        self.capacity = capacity
        self.min_samples = min_samples
        self._prefill: dict[tuple[str, str], MedianRing] = {}
        self._solo_decode: dict[tuple[str, str], MedianRing] = {}
        self._decode_by_batch: dict[tuple[str, int], MedianRing] = {}
        # Trusted medians as the next tables will hold them; inner per-engine dicts are replaced, never changed in place.
        # SharedMaps: a table's mappings are their snapshots, so a new table copies none of the entries that did not move
        # (sharedmap.py; at 1000 engines a probe moves some engine's median nearly every Check).
        self._solo_medians: SharedMap[tuple[str, str], float] = SharedMap()
        self._prefill_medians: SharedMap[tuple[str, str], float] = SharedMap()
        self._by_engine: SharedMap[str, BatchRates] = SharedMap()
        self._tables = RateTables()
        self._class_stale = False  # a (model, chip class) median changed since the last tables()
        self._changed_classes: set[tuple[str, str]] = set()  # ... which ones
        self._class_changes = ClassChangeLog()
        self._batch_stale = False  # an engine's per-batch median changed since the last tables()

    def _ring(self, table: dict[_Key, MedianRing], key: _Key) -> MedianRing:
        if key not in table:
            table[key] = MedianRing(self.capacity, self.min_samples)
        return table[key]

    def _add(self, rings: dict[tuple[str, str], MedianRing], medians: SharedMap[tuple[str, str], float], key: tuple[str, str],
             value: float) -> None:
        ring = self._ring(rings, key)
        ring.add(value)
        median = ring.median
        if medians.get(key) != median:
            if median is None:
                medians.pop(key, None)
            else:
                medians[key] = median
            self._class_stale = True
            self._changed_classes.add(key)

    def _add_by_batch(self, engine: str, batch: int, value: float) -> None:
        ring = self._ring(self._decode_by_batch, (engine, batch))
        ring.add(value)
        median = ring.median
        current: Mapping[int, float] = self._by_engine.get(engine, {})
        if current.get(batch) == median:
            return
        updated = {**current, batch: median} if median is not None else {b: r for b, r in current.items() if b != batch}
        if updated:
            self._by_engine[engine] = BatchRates(updated)
        else:
            self._by_engine.pop(engine, None)
        self._batch_stale = True

    def record(self, model: str, chip_class: str, rates: EngineRates, engine: str = "") -> None:
        key = (model, chip_class)
        if rates.prefill_tokens_per_s is not None:
            self._add(self._prefill, self._prefill_medians, key, rates.prefill_tokens_per_s)
        if rates.solo and rates.decode_tokens_per_s_each is not None:
            self._add(self._solo_decode, self._solo_medians, key, rates.decode_tokens_per_s_each)
        if engine and rates.batch and rates.decode_tokens_per_s_each is not None:
            self._add_by_batch(engine, rates.batch, rates.decode_tokens_per_s_each)

    def tables(self) -> RateTables:
        """Every trusted median, for the decision core: the same object until a median changes (O(1) per call)."""
        if self._class_stale or self._batch_stale:
            # A published table never changes: the top-level mappings are SharedMap snapshots (no entry copied), and
            # each engine's inner mapping is a read-only view of a dict this book replaces instead of changing. Copying every engine's inner dict (what
            # RateTables does with plain dicts) cost about 1 ms per Check at 1000 engines, whose probes move some
            # median almost every Check. The per-class tables stay the same objects until one of theirs moves, so the
            # fleet index can keep what it derives from them (FleetIndex._freeze).
            old = self._tables
            solo, prefill, serial = old.solo_decode, old.prefill_median, old.class_serial
            if self._class_stale:
                solo, prefill = self._solo_medians.snapshot(), self._prefill_medians.snapshot()
                serial += 1
                self._class_changes.append(serial, frozenset(self._changed_classes))
                self._changed_classes.clear()
            by_batch = self._by_engine.snapshot() if self._batch_stale else old.decode_by_batch
            self._tables = RateTables(solo, prefill, by_batch, serial, self._class_changes)
            self._class_stale = self._batch_stale = False
        return self._tables

    def prefill_median(self, model: str, chip_class: str) -> float | None:
        ring = self._prefill.get((model, chip_class))
        return ring.median if ring else None

    def solo_decode_median(self, model: str, chip_class: str) -> float | None:
        ring = self._solo_decode.get((model, chip_class))
        return ring.median if ring else None

    def counts(self, model: str, chip_class: str) -> tuple[int, int]:
        """(prefill samples, solo decode samples) held for the key."""
        p, d = self._prefill.get((model, chip_class)), self._solo_decode.get((model, chip_class))
        return (len(p) if p else 0, len(d) if d else 0)
