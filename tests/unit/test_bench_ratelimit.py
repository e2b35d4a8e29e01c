"""The limiter side of ``sluice bench ratelimit`` at a tiny scale on the memory backend: its functions work, and the
claim the benchmark reports holds for its own world (pre-charge overshoots by at most one request's max_tokens; post-hoc
charging does not hold the budget at all)."""

from __future__ import annotations

from ratelimit import LimiterSettings, Limits, Scope, open_limiter
from bench.ratelimit import BUDGET_TPM, burst_overshoot, burst_world, measure_throughput


async def test_a_burst_overshoots_by_at_most_one_max_tokens_only_when_pre_charged() -> None:
    world = burst_world(200, seed=12)
    pre = await burst_overshoot("memory", open_limiter("memory"), world, pre_charge=True)
    post = await burst_overshoot("memory", open_limiter("memory"), world, pre_charge=False)
    assert pre.overshoot_tokens <= pre.largest_max_tokens
    assert post.admitted == 200 and post.used_tokens > 2 * BUDGET_TPM  # racing requests all got in
    assert 0 < pre.admitted < post.admitted


async def test_throughput_is_measured_per_charge() -> None:
    limiter = open_limiter("memory", LimiterSettings())
    scopes = (Scope("t", Limits.per_minute(requests=10**6, tokens=10**9, concurrent=100)),)
    result = await measure_throughput("memory", [limiter], scopes, in_flight=4, charges=200)
    assert result.charges_per_s > 0 and 0 <= result.p50_ms <= result.p99_ms
