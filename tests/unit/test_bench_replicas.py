"""The pure helpers of ``sluice bench replicas``: the FIFO measure, the histogram quantile, the exposition reader and the
longest pause. (The benchmark itself is not run by ``make test``.)"""

from __future__ import annotations

import itertools
import random

import pytest

from bench.common import histogram, histogram_quantile, metric_sum, parse_samples
from bench.replicas import ENVOY_CHECK_REQUEST, Fifo, _template, fifo_order, longest_gap


def brute_force(rows: list[tuple[float, float]], arrival_tol: float, admission_tol: float) -> Fifo:
    pairs = overtaken_pairs = 0
    worst = 0.0
    overtaken: set[int] = set()
    for (i, (arrived_a, admitted_a)), (j, (arrived_b, admitted_b)) in itertools.permutations(enumerate(rows), 2):
        if arrived_a < arrived_b - arrival_tol:
            pairs += 1
            if admitted_b < admitted_a - admission_tol:
                overtaken_pairs += 1
                overtaken.add(i)
                worst = max(worst, admitted_a - admitted_b)
    return Fifo(len(rows), pairs, overtaken_pairs, len(overtaken), worst)


def test_strict_fifo_has_no_overtaken_pair() -> None:
    rows = [(float(i), 10.0 + i) for i in range(50)]
    assert fifo_order(rows) == Fifo(50, 50 * 49 // 2, 0, 0, 0.0)


def test_one_late_admission_is_overtaken_by_everyone_after_it() -> None:
    rows = [(0.0, 9.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]  # the first arrival is admitted last
    assert fifo_order(rows) == Fifo(4, 6, 3, 1, 7.0)


def test_tolerances_ignore_what_the_instruments_cannot_order() -> None:
    rows = [(0.000, 1.004), (0.002, 1.000), (0.050, 2.000)]
    assert fifo_order(rows).overtaken_pairs == 1
    assert fifo_order(rows, 0.010).overtaken_pairs == 0  # arrivals 2 ms apart: not ordered
    assert fifo_order(rows, 0.0, 0.010).overtaken_pairs == 0  # admissions 4 ms apart: not ordered


@pytest.mark.parametrize("seed", range(20))
def test_fifo_order_agrees_with_the_pairwise_definition(seed: int) -> None:
    rng = random.Random(seed)
    rows = [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(rng.randint(0, 40))]
    for arrival_tol, admission_tol in ((0.0, 0.0), (0.05, 0.05), (0.0, 0.1)):
        got = fifo_order(rows, arrival_tol, admission_tol)
        want = brute_force(rows, arrival_tol, admission_tol)
        assert (got.pairs, got.overtaken_pairs, got.overtaken) == (want.pairs, want.overtaken_pairs, want.overtaken)
        assert got.worst_s == pytest.approx(want.worst_s)


EXPOSITION = """# HELP sluice_store_seconds Time one call to the shared store took.
# TYPE sluice_store_seconds histogram
sluice_store_seconds_bucket{le="0.001",op="reserve"} 90.0
sluice_store_seconds_bucket{le="0.002",op="reserve"} 99.0
sluice_store_seconds_bucket{le="+Inf",op="reserve"} 100.0
sluice_store_seconds_count{op="reserve"} 100.0
sluice_store_seconds_bucket{le="0.001",op="release"} 10.0
sluice_store_seconds_bucket{le="0.002",op="release"} 10.0
sluice_store_seconds_bucket{le="+Inf",op="release"} 10.0
sluice_tickets_open{engine="e0"} 2.0
sluice_tickets_open{engine="e1"} 3.0
sluice_tickets_open_other 7.0
"""


def test_the_exposition_reader_matches_names_exactly_and_sums_label_sets() -> None:
    assert metric_sum(EXPOSITION, "sluice_tickets_open") == 5.0
    assert metric_sum(EXPOSITION, "sluice_tickets_open", engine="e1") == 3.0
    assert parse_samples(EXPOSITION, "sluice_store_seconds_count") == [({"op": "reserve"}, 100.0)]
    assert histogram(EXPOSITION, "sluice_store_seconds", op="reserve") == {0.001: 90.0, 0.002: 99.0,
                                                                           float("inf"): 100.0}
    assert histogram(EXPOSITION, "sluice_store_seconds")[0.001] == 100.0


def test_histogram_quantile_interpolates_within_the_bucket_between_two_scrapes() -> None:
    before = {0.001: 10.0, 0.002: 10.0, float("inf"): 10.0}
    after = {0.001: 60.0, 0.002: 110.0, float("inf"): 110.0}  # 50 new in (0, 1 ms], 50 in (1, 2 ms]
    assert histogram_quantile(before, after, 0.5) == pytest.approx(1.0)
    assert histogram_quantile(before, after, 0.75) == pytest.approx(1.5)
    assert histogram_quantile(before, before, 0.5) != histogram_quantile(before, before, 0.5)  # NaN: nothing observed


def test_longest_gap_counts_the_window_edges() -> None:
    assert longest_gap([1.0, 1.5, 4.0], 0.0, 5.0) == pytest.approx(2.5)
    assert longest_gap([], 2.0, 3.0) == pytest.approx(1.0)
    assert longest_gap([0.5, 9.0], 1.0, 2.0) == pytest.approx(1.0)  # times outside the window are ignored


def test_the_captured_check_request_is_what_the_control_plane_reads() -> None:
    http = _template().attributes.request.http
    assert (http.method, http.path) == ("POST", "/v1/chat/completions")
    assert http.headers["x-sluice-model"] == "cortex" and http.raw_body.startswith(b'{"model": "cortex"')
    assert ENVOY_CHECK_REQUEST.count("headers {") == len(http.headers)
