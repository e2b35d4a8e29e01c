"""``bench fleet`` reports each arm's median run over interleaved rounds (a single run moved by 20% with the host's load),
with every round's figure shown."""

from __future__ import annotations

from bench.fleet import median_run


def test_the_row_is_the_median_run_and_every_round_is_kept() -> None:
    runs = [{"decisions_per_cpu_s": 1888.0, "tag": "a"}, {"decisions_per_cpu_s": 2319.0, "tag": "b"},
            {"decisions_per_cpu_s": 1964.0, "tag": "c"}]
    row = median_run(runs)
    assert row["tag"] == "c"  # the whole median run, not a mix of figures from different runs
    assert row["rounds"] == [1888.0, 2319.0, 1964.0]  # in the order they ran


def test_an_even_number_of_rounds_takes_the_lower_middle() -> None:
    row = median_run([{"decisions_per_cpu_s": 2100.0}, {"decisions_per_cpu_s": 1900.0}])
    assert row["decisions_per_cpu_s"] == 1900.0  # a target is never met on the better half of a pair
