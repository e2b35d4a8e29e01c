"""The t10 benchmark's reference figures against seed 000's own measurements (shared/seeds/000: the amendment's per-box
table and its even-split ceiling), not against numbers produced by the same formula."""

from __future__ import annotations

import pytest

from enginesim.profiles import PROFILES
from bench.t10 import best_assignment, even_split, profile_box

# Seed 000, "Per-box, measured directly against each vllm-primary": tok/s at 1 stream and at 2 streams (max_num_seqs).
SEED_THOR = (18.18, 50.71)
SEED_SPARK = (49.24, 87.82)
SEED_EVEN_SPLIT_CEILING_4 = 101.4
"""Seed 000: "Thor 222 tokens / 50.71 = 4.38 s, Spark 222 / 87.82 = 2.53 s -> 444 / 4.38 = 101.4 tok/s CEILING"."""


def test_profiles_carry_the_seeds_measured_rates() -> None:
    for name, (one, two) in (("thor", SEED_THOR), ("spark", SEED_SPARK)):
        profile = PROFILES[name]
        assert profile.max_num_seqs == 2
        assert profile.per_request_decode_rate(1) == pytest.approx(one, rel=1e-3)
        assert profile.per_request_decode_rate(2) * 2 == pytest.approx(two, rel=1e-3)


def test_even_split_reproduces_the_seeds_ceiling() -> None:
    assert even_split(4, profile_box("spark"), profile_box("thor")) == pytest.approx(SEED_EVEN_SPLIT_CEILING_4,
                                                                                      abs=0.05)


def test_best_assignment_is_never_worse_than_even_and_favours_the_fast_box() -> None:
    spark, thor = profile_box("spark"), profile_box("thor")
    for burst in (4, 6, 8):
        best, spark_share = best_assignment(burst, spark, thor)
        assert best >= even_split(burst, spark, thor) - 1e-9
        assert spark_share >= burst // 2  # capacity-proportional: the faster box takes at least half
    assert best_assignment(8, spark, thor)[0] > even_split(8, spark, thor)  # beyond fleet capacity, proportional beats even (the seed's point)
