"""Rates between probes, solo-decode detection and trusted medians."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from controlplane.core.engines import EngineRates, EngineSample
from controlplane.core.output_length import lengths_from_buckets
from controlplane.observe.parse import parse_metrics
from controlplane.core.prefix import restarted
from controlplane.observe.rates import MedianRing, RateBook, rates_between


def s(t: float, **kw: Any) -> EngineSample:
    return EngineSample(taken_at=t, **kw)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (s(0, prompt_tokens_total=100, generation_tokens_total=50), s(2, prompt_tokens_total=300, generation_tokens_total=90),
         EngineRates(2, prompt_tokens_per_s=100, generation_tokens_per_s=20)),
        (s(0, prefill_tokens_total=0, prefill_seconds_total=0), s(1, prefill_tokens_total=2620, prefill_seconds_total=10),
         EngineRates(1, prefill_tokens_per_s=262)),
        (s(0, prefill_tokens_total=0, prefill_seconds_total=0), s(1, prefill_tokens_total=2, prefill_seconds_total=0.02),
         EngineRates(1)),
        (s(0, running=1, waiting=0, decode_tokens_total=10, decode_seconds_total=1),
         s(1, running=1, waiting=0, decode_tokens_total=28, decode_seconds_total=2),
         EngineRates(1, decode_tokens_per_s_each=18, solo=True, batch=1)),
        (s(0, running=2, decode_tokens_total=10, decode_seconds_total=1),
         s(1, running=1, decode_tokens_total=28, decode_seconds_total=2),
         EngineRates(1, decode_tokens_per_s_each=18, solo=False)),
        (s(0, running=1, waiting=1, decode_tokens_total=10, decode_seconds_total=1),
         s(1, running=1, waiting=0, decode_tokens_total=28, decode_seconds_total=2),
         EngineRates(1, decode_tokens_per_s_each=18, solo=False, batch=1)),
        (s(0, running=1, decode_tokens_total=10, decode_seconds_total=1),
         s(1, running=1, decode_tokens_total=10, decode_seconds_total=1),
         EngineRates(1)),
        (s(0, prompt_tokens_total=500), s(1, prompt_tokens_total=20), EngineRates(1)),
        (s(0, prompt_tokens_total=None), s(1, prompt_tokens_total=20), EngineRates(1)),
        # 3/4 of the looked-up tokens were cache hits: only a quarter of the prompt tokens were prefilled in those 10 s.
        (s(0, prefill_tokens_total=0, prefill_seconds_total=0, prefix_cache_queries_total=0, prefix_cache_hits_total=0),
         s(1, prefill_tokens_total=10480, prefill_seconds_total=10, prefix_cache_queries_total=8000,
           prefix_cache_hits_total=6000, prefill_counts_cached=True),
         EngineRates(1, prefill_tokens_per_s=262)),
        # The computed-tokens histogram (prefill_counts_cached False): already without the hits, no correction.
        (s(0, prefill_tokens_total=0, prefill_seconds_total=0, prefix_cache_queries_total=0, prefix_cache_hits_total=0),
         s(1, prefill_tokens_total=2620, prefill_seconds_total=10, prefix_cache_queries_total=8000,
           prefix_cache_hits_total=6000),
         EngineRates(1, prefill_tokens_per_s=262)),
        # Nothing looked up in the interval: the share since the engine started.
        (s(0, prefill_tokens_total=0, prefill_seconds_total=0, prefix_cache_queries_total=100, prefix_cache_hits_total=50),
         s(1, prefill_tokens_total=5240, prefill_seconds_total=10, prefix_cache_queries_total=100,
           prefix_cache_hits_total=50, prefill_counts_cached=True),
         EngineRates(1, prefill_tokens_per_s=262)),
    ],
    ids=["throughput", "prefill", "tiny-prompts-give-no-prefill-rate", "solo-decode", "contended-start", "queue-at-start", "unchanged-is-no-sample",
         "counter-reset", "unknown-start", "prefill-less-cache-hits", "computed-tokens-histogram",
         "cache-share-since-start"],
)
def test_rates_between(a: EngineSample, b: EngineSample, expected: EngineRates) -> None:
    assert rates_between(a, b) == expected


def test_no_rate_without_time_passing() -> None:
    assert rates_between(s(1), s(1)) is None


def test_median_is_trusted_only_past_min_samples_and_ring_is_bounded() -> None:
    ring = MedianRing(capacity=5, min_samples=3)
    ring.add(100)
    ring.add(300)
    assert ring.median is None
    ring.add(200)
    assert ring.median == 200
    for v in (1, 1, 1, 1):
        ring.add(v)
    assert len(ring) == 5 and ring.median == 1


def test_rate_book_keys_by_model_and_chip_and_records_only_solo_decode() -> None:
    book = RateBook(capacity=8, min_samples=2)
    for _ in range(2):
        book.record("cortex", "gb10", EngineRates(1, prefill_tokens_per_s=4000, decode_tokens_per_s_each=49, solo=True))
        book.record("cortex", "gb10", EngineRates(1, decode_tokens_per_s_each=20, solo=False))
        book.record("cortex", "thor", EngineRates(1, prefill_tokens_per_s=1500))
    assert book.prefill_median("cortex", "gb10") == 4000
    assert book.solo_decode_median("cortex", "gb10") == 49
    assert book.prefill_median("cortex", "thor") == 1500
    assert book.solo_decode_median("cortex", "thor") is None
    assert book.counts("cortex", "gb10") == (2, 2)


def test_tables_is_the_same_object_until_a_median_changes_and_its_medians_stay_right() -> None:
    import random
    import statistics

    book = RateBook(capacity=6, min_samples=3)
    empty = book.tables()
    assert book.tables() is empty and empty.decode_by_batch == {} and empty.prefill_median == {}
    rng = random.Random(7)
    history: dict[tuple[str, str, Any], list[float]] = {}  # (kind, engine or model, batch size or chip class)
    held = []
    for step in range(400):
        engine, batch = f"e{rng.randrange(3)}", rng.choice((1, 2, 4))
        rate = float(rng.randrange(10, 60))
        model, chip = "m", rng.choice(("gb10", "thor"))
        solo = batch == 1 and rng.random() < 0.5
        prefill = float(rng.randrange(1000, 5000)) if rng.random() < 0.3 else None
        before = book.tables()
        held.append((before, {k: dict(v) for k, v in before.decode_by_batch.items()}, dict(before.prefill_median)))
        book.record(model, chip, EngineRates(1, prefill_tokens_per_s=prefill, decode_tokens_per_s_each=rate, solo=solo,
                                             batch=batch), engine)
        history.setdefault(("batch", engine, batch), []).append(rate)
        if solo:
            history.setdefault(("solo", model, chip), []).append(rate)
        if prefill is not None:
            history.setdefault(("prefill", model, chip), []).append(prefill)

        def expected(kind: str) -> dict[tuple[str, Any], float]:
            out: dict[tuple[str, Any], float] = {}
            for (k, a, b), values in history.items():
                if k == kind and len(values) >= 3:
                    out[(a, b)] = statistics.median(values[-6:])
            return out

        by_batch: dict[str, dict[int, float]] = {}
        for (engine_name, b), m in expected("batch").items():
            by_batch.setdefault(engine_name, {})[b] = m
        tables = book.tables()
        assert tables.decode_by_batch == by_batch
        assert tables.solo_decode == expected("solo")
        assert tables.prefill_median == expected("prefill")
        assert book.tables() is tables  # no record in between: the same object
        changed = (tables.decode_by_batch, tables.solo_decode, tables.prefill_median) != (
            before.decode_by_batch, before.solo_decode, before.prefill_median)
        assert (tables is not before) == changed, step
    # a RateTables once handed out is never changed afterwards
    for tables, by_batch_then, prefill_then in held:
        assert tables.decode_by_batch == by_batch_then and tables.prefill_median == prefill_then


def test_a_record_that_leaves_every_median_unchanged_keeps_the_tables() -> None:
    book = RateBook(capacity=8, min_samples=2)
    for _ in range(2):
        book.record("m", "gb10", EngineRates(1, decode_tokens_per_s_each=20, batch=2), "e0")
    tables = book.tables()
    assert tables.decode_by_batch == {"e0": {2: 20}}
    book.record("m", "gb10", EngineRates(1, decode_tokens_per_s_each=20, batch=2), "e0")
    assert book.tables() is tables
    for _ in range(3):  # 20 20 20 50 50 50
        book.record("m", "gb10", EngineRates(1, decode_tokens_per_s_each=50, batch=2), "e0")
    assert book.tables() is not tables and book.tables().decode_by_batch == {"e0": {2: 35}}
    assert tables.decode_by_batch == {"e0": {2: 20}}


def test_mean_output_length_comes_from_the_finished_requests_histogram() -> None:
    """Three requests finished between the probes with 40 + 200 + 60 tokens: the real answers average 100 tokens."""
    a = EngineSample(0.0, finished_requests_total=5, finished_output_tokens_total=900)
    b = EngineSample(2.0, finished_requests_total=8, finished_output_tokens_total=1200)
    rates = rates_between(a, b)
    assert rates is not None and rates.finished_requests == 3 and rates.mean_output_tokens == 100
    idle = rates_between(b, EngineSample(3.0, finished_requests_total=8, finished_output_tokens_total=1200))
    assert idle is not None and idle.finished_requests == 0 and idle.mean_output_tokens is None


def test_a_counter_going_backwards_is_a_restart() -> None:
    assert restarted(s(0, prompt_tokens_total=500, generation_tokens_total=10), s(1, prompt_tokens_total=20))
    assert restarted(s(0, prefix_cache_queries_total=9), s(1, prefix_cache_queries_total=0))
    assert not restarted(s(0, prompt_tokens_total=500), s(1, prompt_tokens_total=500, generation_tokens_total=3))
    assert not restarted(s(0), s(1, prompt_tokens_total=20))  # unknown before: nothing went backwards


def test_finished_requests_spread_over_the_length_histograms_buckets() -> None:
    a = s(0, finished_requests_total=3, finished_output_tokens_total=600,
          finished_length_buckets=((100.0, 1), (200.0, 2), (500.0, 3), (math.inf, 3)))
    b = s(1, finished_requests_total=7, finished_output_tokens_total=1600,
          finished_length_buckets=((100.0, 1), (200.0, 4), (500.0, 6), (math.inf, 7)))
    rates = rates_between(a, b)
    assert rates is not None and rates.finished_requests == 4 and rates.mean_output_tokens == 250
    assert rates.finished_by_length == ((100.0, 200.0, 2), (200.0, 500.0, 1), (500.0, math.inf, 1))
    # Bucket middles 141, 141, 316 and 1000 (twice the open bucket's lower bound), scaled to the exact mean of 250.
    lengths = lengths_from_buckets(rates.finished_by_length, 250.0, limit=32)
    scale = 250 / ((2 * math.sqrt(20_000) + math.sqrt(100_000) + 1000) / 4)
    assert lengths == [round(math.sqrt(20_000) * scale)] * 2 + [round(math.sqrt(100_000) * scale), round(1000 * scale)]
    assert sum(lengths) / 4 == pytest.approx(250, abs=1)
    # Different bounds, or a count that went backwards (a restart): no spread.
    other_bounds = rates_between(a, replace(b, finished_length_buckets=((50.0, 7),)))
    assert other_bounds is not None and other_bounds.finished_by_length == ()
    backwards = rates_between(b, replace(a, taken_at=2))
    assert backwards is not None and backwards.finished_by_length == ()


def test_a_busy_interval_keeps_its_spread_within_the_per_probe_limit() -> None:
    lengths = lengths_from_buckets([(0.0, 10.0, 50), (10.0, 20.0, 50)], mean=10.0, limit=10)
    assert len(lengths) == 10 and lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_parse_sums_the_length_buckets_over_label_sets() -> None:
    text = "\n".join(
        f'vllm:request_generation_tokens_bucket{{engine="{e}",le="{le}",model_name="m"}} {n}'
        for e in ("0", "1") for le, n in (("10.0", 1), ("100.0", 3), ("+Inf", 4))
    ) + '\nvllm:request_generation_tokens_sum{engine="0",model_name="m"} 150\n' \
        'vllm:request_generation_tokens_count{engine="0",model_name="m"} 4\nvllm:num_requests_running 0\n'
    sample = parse_metrics(text, 0.0)
    assert sample.finished_length_buckets == ((10.0, 2), (100.0, 6), (math.inf, 8))
