"""The first probe round (observe/poller.py ``first_round``): a large fleet's first probes run a bounded number at a time,
each timed from its own start, so a fleet whose probes cost CPU is not failed wholesale by the probe timeout (1000 engines
all at once: 969 first probes failed together and requests parked until the next round)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from controlplane.observe.poller import FIRST_ROUND_CONCURRENCY, first_round, first_round_bound_s


@dataclass
class _Name:
    name: str


@dataclass
class CpuBoundProbe:
    """A probe that holds the CPU for ``cost_s`` (parsing an exposition), then waits ``answer_s`` (the engine)."""
    name: str
    cost_s: float
    answer_s: float = 0.0
    in_flight: list[int] = field(default_factory=lambda: [0, 0])  # now, most ever (shared by the fleet)

    @property
    def config(self) -> _Name:
        return _Name(self.name)

    async def poll_once(self) -> None:
        self.in_flight[0] += 1
        self.in_flight[1] = max(self.in_flight[1], self.in_flight[0])
        try:
            await asyncio.sleep(self.answer_s)
            time.sleep(self.cost_s)
        finally:
            self.in_flight[0] -= 1


def test_costly_first_probes_all_succeed_when_each_is_timed_from_its_own_start() -> None:
    shared = [0, 0]
    pollers: list[Any] = [CpuBoundProbe(f"e{i}", cost_s=0.004, in_flight=shared) for i in range(200)]
    failed: list[str] = []
    # All at once, the 200th probe would finish 0.8 s after the round began: past the 0.5 s timeout.
    asyncio.run(first_round(pollers, 0.5, lambda p: failed.append(p.config.name)))
    assert failed == []
    assert shared[1] == FIRST_ROUND_CONCURRENCY


def test_a_silent_engine_fails_its_first_probe_with_a_message_that_says_so(caplog: pytest.LogCaptureFixture) -> None:
    pollers: list[Any] = [CpuBoundProbe("quick", 0.0), CpuBoundProbe("silent", 0.0, answer_s=10.0)]
    failed: list[str] = []
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        asyncio.run(first_round(pollers, 0.2, lambda p: failed.append(p.config.name)))
    assert failed == ["silent"] and time.monotonic() - started < 2.0
    assert "engine silent: first probe failed: no answer within 0.2 s (observe.poll_timeout_seconds)" in caplog.text


def test_the_round_is_bounded_by_one_timeout_per_wave() -> None:
    assert first_round_bound_s(1, 0.8) == pytest.approx(0.8)
    assert first_round_bound_s(1000, 0.8) == pytest.approx(0.8 * -(-1000 // FIRST_ROUND_CONCURRENCY))
