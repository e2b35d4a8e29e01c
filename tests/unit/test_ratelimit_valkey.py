"""What only the Valkey backend has: Lua scripts by EVALSHA (reloaded after NOSCRIPT), TTLs on every key, a store that
goes away, and scripts that must compute exactly what the Python core computes (a differential test over random
interleavings). Real valkey-server processes throughout."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from controlplane.store.valkeyserver import ValkeyServer
from ratelimit import ChargeRequest, LimiterSettings, Limits, Rate, Scope, StoreUnavailable, open_limiter
from ratelimit.memory import MemoryRateLimiter
from ratelimit.valkey import ValkeyRateLimiter

T0 = 1_760_000_000.0


def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:8]}:"


async def test_a_flushed_script_is_loaded_again(valkey: ValkeyServer) -> None:
    limiter = ValkeyRateLimiter(valkey.url, key_prefix=prefix())
    raw = Redis.from_url(valkey.url)
    try:
        scopes = (Scope("k", Limits.per_minute(requests=10)),)
        assert (await limiter.charge(ChargeRequest(scopes), T0)).allowed
        loaded = limiter.scripts_loaded
        await raw.script_flush()
        assert (await limiter.charge(ChargeRequest(scopes), T0)).allowed
        assert limiter.scripts_loaded == loaded + 1
        assert [s.remaining for s in await limiter.peek(scopes, T0)] == [8]
    finally:
        await limiter.close()
        await raw.aclose()


async def test_every_key_expires_on_its_own(valkey: ValkeyServer) -> None:
    """Each key's TTL is when it stops mattering: a meter when its debt is 0, a slot set and a charge with the lease."""
    limiter = ValkeyRateLimiter(valkey.url, LimiterSettings(lease_s=120.0), key_prefix=prefix())
    raw = Redis.from_url(valkey.url, decode_responses=True)
    try:
        scopes = (Scope("k", Limits.per_minute(requests=60, tokens=6000, concurrent=5)),)
        await limiter.charge(ChargeRequest(scopes, tokens=1500, charge_id="c1"), time.time())
        ttls = {key.rsplit(":", 1)[-1]: await raw.pttl(key) for key in await limiter.stored_keys()}
        assert set(ttls) == {"requests", "tokens", "concurrent", "c1"}
        assert 0 < ttls["requests"] <= 1000       # 1 of 60/min: 1 s
        assert 14_000 < ttls["tokens"] <= 15_000  # 1500 of 6000/min: 15 s
        assert 119_000 < ttls["concurrent"] <= 120_000 and 119_000 < ttls["c1"] <= 120_000
    finally:
        await limiter.close()
        await raw.aclose()


async def test_a_store_that_goes_away_raises_store_unavailable_fast_and_comes_back() -> None:
    server = ValkeyServer().start()
    limiter = open_limiter(server.url, timeout_s=0.3)
    try:
        scopes = (Scope("k", Limits.per_minute(requests=10, concurrent=2)),)
        assert (await limiter.charge(ChargeRequest(scopes, charge_id="a"), T0)).allowed
        server.stop()
        for call in (limiter.charge(ChargeRequest(scopes, charge_id="b"), T0), limiter.settle("a", 0, T0),
                     limiter.peek(scopes, T0)):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await call
            assert time.monotonic() - started < 2.0
        server.start()  # the same port, an empty server without the scripts
        assert (await limiter.charge(ChargeRequest(scopes, charge_id="b"), T0)).allowed
        assert isinstance(limiter, ValkeyRateLimiter) and limiter.scripts_loaded >= 2
    finally:
        await limiter.close()
        server.close()


def test_store_urls() -> None:
    assert isinstance(open_limiter(None), MemoryRateLimiter)
    assert isinstance(open_limiter("memory"), MemoryRateLimiter)
    assert isinstance(open_limiter("valkey://127.0.0.1:1/0"), ValkeyRateLimiter)
    with pytest.raises(ValueError, match="memory"):
        open_limiter("memcached://x")


# ---- the scripts compute what the core computes ---------------------------------------------------------------------

SCOPES = (Scope("t", Limits(requests=Rate(8, 60.0), tokens=Rate(1000, 60.0), concurrent=3)),
          Scope("t/m", Limits(tokens=Rate(700, 30.0))))

ops = st.lists(st.one_of(
    st.tuples(st.just("charge"), st.integers(0, 800), st.sampled_from([0.0, 0.0, 2.0]) | st.floats(0, 40)),
    st.tuples(st.just("settle"), st.integers(0, 20), st.sampled_from([0.0, 0.5, 1.0, 1.3]),
              st.sampled_from([0.0, 1.0]) | st.floats(0, 20), st.booleans()),
    st.tuples(st.just("peek"), st.floats(0, 10)),
), min_size=1, max_size=30)


async def _run(limiter: Any, sequence: list[tuple[Any, ...]]) -> list[Any]:
    now = T0
    seen: list[Any] = []
    charged: list[tuple[str, int]] = []
    for i, op in enumerate(sequence):
        if op[0] == "charge":
            now += op[2]
            v = await limiter.charge(ChargeRequest(SCOPES, tokens=op[1], charge_id=f"c{i}"), now)
            if v.allowed:
                charged.append((f"c{i}", op[1]))
            retry = None if v.retry_after_s is None else round(v.retry_after_s, 6)
            seen.append((v.outcome, [(s.key, s.kind, s.remaining, round(s.reset_s, 6)) for s in v.states],
                         [(s.key, s.kind) for s in v.denied_by], retry))
        elif op[0] == "settle":
            now += op[3]
            if charged:
                charge_id, tokens = charged[op[1] % len(charged)]
                settled = await limiter.settle(charge_id, int(tokens * op[2]), now, refund_request=op[4])
                seen.append(settled)
        else:
            now += op[1]
            seen.append([(s.remaining, round(s.reset_s, 6)) for s in await limiter.peek(SCOPES, now)])
    return seen


# The cases the core's property test found (an overdrawn meter refusing a charge of 0; a too-large charge while every
# slot is held): the scripts must report them alike.
@example([("charge", 700, 0.0), ("settle", 0, 1.3, 0.0, False), ("charge", 0, 0.0)])
@example([("charge", 0, 0.0), ("charge", 0, 0.0), ("charge", 0, 0.0), ("charge", 801, 0.0)])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_the_scripts_decide_exactly_as_the_core(valkey: ValkeyServer, sequence: list[tuple[Any, ...]]) -> None:
    async def both() -> tuple[list[Any], list[Any]]:
        shared = ValkeyRateLimiter(valkey.url, LimiterSettings(lease_s=25.0), key_prefix=prefix())
        try:
            return await _run(MemoryRateLimiter(LimiterSettings(lease_s=25.0)), sequence), await _run(shared, sequence)
        finally:
            await shared.close()

    in_memory, in_valkey = asyncio.run(both())
    assert in_valkey == in_memory
