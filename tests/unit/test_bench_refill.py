"""``sluice bench steady``'s refill figure: how long a freed slot waited for its next request, read from a simulator's
``/sim/log`` (emulated seconds) and reported in wall seconds."""

from __future__ import annotations

import pytest

from bench.steady import REFILL_WITHIN_S, refill_gaps


def entry(arrived: float, finished: float | None) -> dict[str, object]:
    return {"arrived_at": arrived, **({"finished_at": finished} if finished is not None else {})}


def test_each_end_is_paired_with_the_next_arrival_in_wall_seconds() -> None:
    # Two slots: a and b run together; c arrives 0.05 emulated s after a ends, d 0.5 s after b ends.
    log = [entry(0.0, 4.0), entry(0.1, 6.0), entry(4.05, 9.0), entry(6.5, 10.0)]
    assert refill_gaps(log, speed=10.0) == pytest.approx([0.005, 0.05])


def test_an_engine_left_idle_is_not_a_refill() -> None:
    # Nothing arrived for longer than REFILL_WITHIN_S after the first stream ended: the engine was idle, no slot waited
    # on the gateway. The last stream has no later arrival at all.
    log = [entry(0.0, 1.0), entry(1.0 + REFILL_WITHIN_S + 0.1, 9.0)]
    assert refill_gaps(log, speed=10.0) == []


def test_unfinished_streams_and_arrivals_in_the_same_instant() -> None:
    # A stream still running has no end to measure from; an arrival at the very moment of an end is a zero gap.
    log = [entry(0.0, 2.0), entry(0.5, None), entry(2.0, 3.0)]
    assert refill_gaps(log, speed=1.0) == [0.0]
