"""The reference figures the t10 benchmark compares against, recomputed from the simulator profiles, match seed 000."""

from __future__ import annotations

import pytest

from sluice.bench.t10 import best_assignment, even_split


def test_best_and_even_split_match_seed_000() -> None:
    assert best_assignment(8) == (pytest.approx(117.1, abs=0.05), 6)  # Spark 6 / Thor 2
    assert even_split(8) == pytest.approx(101.4, abs=0.05)
    assert best_assignment(4) == (pytest.approx(101.4, abs=0.05), 2)
