"""``ServeCounter.merge`` (route.py): a replica that starts, or missed events, takes the shared store's count of an
engine's recent admissions when it is the larger, both decayed to the later of their times."""

from __future__ import annotations

import pytest

from controlplane.core.route import ServeCounter


def test_the_larger_count_wins_decayed_to_the_later_time() -> None:
    counter = ServeCounter(half_life_s=10.0)
    assert counter.merge("a", 3.0, 100.0), "an engine this counter never saw takes the other count"
    assert counter.values()["a"] == (3.0, 100.0)
    counter.add("b", 100.0)
    assert not counter.merge("b", 1.0, 90.0), "one admission 10 s earlier is half of one now: this counter's stays"
    assert counter.merge("b", 4.0, 90.0)
    count, at = counter.values()["b"]
    assert at == 100.0 and count == pytest.approx(2.0), "the other's 4, one half-life older than this counter's time"
    assert not counter.merge("b", 2.0, 100.0), "equal is no change"
