"""The limiter side of ``sluice bench ratelimit`` at a tiny scale on the memory backend: its functions work, and the
claims the benchmark reports hold for its own world (pre-charge overshoots by at most one request's max_tokens; the
baselines, which check on arrival and charge at the end, do not hold the budget in a burst), and the baselines' counters
keep the windows and the limit comparisons their sources do."""

from __future__ import annotations

import pytest

from ratelimit import LimiterSettings, Limits, Scope, open_limiter
from bench.ratelimit import (BASELINES, BUDGET_TPM, FixedWindow, baseline_burst, burst_overshoot, burst_world,
                             measure_throughput)


async def test_a_burst_overshoots_by_at_most_one_max_tokens_only_when_pre_charged() -> None:
    world = burst_world(200, seed=12)
    pre = await burst_overshoot("memory", open_limiter("memory"), world)
    assert pre.overshoot_tokens <= pre.largest_max_tokens
    for name, make in BASELINES.items():
        post = baseline_burst(name, make(BUDGET_TPM), world, t0=1_000_000.0)
        assert post.admitted == 200 and post.used_tokens > 2 * BUDGET_TPM  # every check saw an empty counter
        assert 0 < pre.admitted < post.admitted and pre.overshoot_tokens < post.overshoot_tokens


@pytest.mark.parametrize(("name", "count", "admitted"), [
    pytest.param("Envoy AI Gateway", 100, True, id="envoy-ratelimit-refuses-only-past-the-limit"),
    pytest.param("Envoy AI Gateway", 101, False, id="envoy-ratelimit-over-the-limit"),
    pytest.param("AIBrix", 99, True, id="aibrix-below-the-limit"),
    pytest.param("AIBrix", 100, False, id="aibrix-refuses-at-the-limit"),
])
def test_the_arrival_check_compares_with_the_limit_as_the_source_does(name: str, count: int, admitted: bool) -> None:
    counter = BASELINES[name](100)
    counter.charge(count, now=6000.0)
    assert counter.admits(6001.0) is admitted


def test_windows_are_clock_minutes_for_envoy_and_start_at_the_first_charge_for_aibrix() -> None:
    envoy = FixedWindow(100, aligned=True, refuse_at_limit=False)
    envoy.charge(500, now=6050.0)  # 50 s into the minute that began at 6000
    assert not envoy.admits(6059.0) and envoy.admits(6060.0)  # the next minute starts empty
    aibrix = FixedWindow(100, aligned=False, refuse_at_limit=True)
    aibrix.charge(500, now=6050.0)
    assert not aibrix.admits(6060.0) and not aibrix.admits(6109.0) and aibrix.admits(6110.0)


async def test_throughput_is_measured_per_charge() -> None:
    limiter = open_limiter("memory", LimiterSettings())
    scopes = (Scope("t", Limits.per_minute(requests=10**6, tokens=10**9, concurrent=100)),)
    result = await measure_throughput("memory", [limiter], scopes, in_flight=4, charges=200)
    assert result.charges_per_s > 0 and 0 <= result.p50_ms <= result.p99_ms
