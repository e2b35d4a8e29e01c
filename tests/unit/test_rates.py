"""Rates between probes, solo-decode detection and trusted medians."""

from __future__ import annotations

import pytest

from controlplane.core.model import EngineRates, EngineSample
from controlplane.observe.rates import MedianRing, RateBook, rates_between


def s(t: float, **kw: float) -> EngineSample:
    return EngineSample(taken_at=t, **kw)  # type: ignore[arg-type]


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
    ],
    ids=["throughput", "prefill", "tiny-prompts-give-no-prefill-rate", "solo-decode", "contended-start", "queue-at-start", "unchanged-is-no-sample",
         "counter-reset", "unknown-start"],
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
