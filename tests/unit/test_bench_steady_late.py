"""``sluice bench steady`` counts the 503s a client got only after waiting (``late_shed``: more than ``LATE_SHED_S``)
and the longest wait for one, beside the shed count."""

from __future__ import annotations

from bench.steady import LATE_SHED_S, _shed_text, summarise
from bench.workload import Result


def test_late_503s_are_counted_apart_from_early_ones() -> None:
    results = [Result("sluice", 200, 0.0, ttft_s=0.1, total_s=1.0), Result("sluice", 503, 0.1, total_s=0.02),
               Result("sluice", 503, 0.2, total_s=LATE_SHED_S + 0.5), Result("sluice", 429, 0.3, total_s=9.0)]
    s = summarise(results, [1], [1], 0, window=10.0)
    assert (s["shed"], s["late_shed"], s["shed_wait_max"]) == (3, 1, LATE_SHED_S + 0.5)
    assert _shed_text(s) == "3 (1 late, max 1.5 s)"
    assert _shed_text(summarise(results[:1], [1], [1], 0, window=10.0)) == "0"
