"""``sluice bench load``: Poisson arrivals at 80% and 120% of a heterogeneous fleet's capacity, sluice against Envoy's own
ROUND_ROBIN and LEAST_REQUEST on the same three simulated engines in the same run.

Fleet (all serving ``cortex``): ``spark`` (2 slots, 87.8 tok/s aggregate), ``thor`` (2 slots, 50.7) and ``v100`` (the
v100pp2 profile: 4 slots, 30.9, prefill 262 tok/s). Requests: prompt 200-2000 tokens (uniform), output lengths lognormal
(median 80 tokens, clipped to 16..400), streamed; the same seeded sequence for every arm. Capacity = the fleet's aggregate
decode rate / mean output length. The TTFT SLO is sent to sluice as ``x-sluice-max-ttft-ms`` (it sheds what it cannot
start in time, with Retry-After); the Envoy-only arms queue everything in the engines. Goodput = requests that completed
with TTFT within the SLO, per second of the arrival window. Times are wall seconds at simulator speed x{SPEED}.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp

from enginesim.profiles import PROFILES
from sluice.bench.common import median, pct, pyplot, save_figure, write_report
from sluice.bench.plain import plain_envoy
from sluice.bench.workload import Result, gateway, sim_stats, stream_chat

SPEED = 10.0
WINDOW_S = 20.0
SLO_MS = 2500
SEED = 20261129
FLEET = (("spark", "spark"), ("thor", "thor"), ("v100", "v100pp2"))


@dataclass(frozen=True)
class Job:
    at: float
    prompt_tokens: int
    max_tokens: int


def workload(rate: float, seconds: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return jobs
        out = int(min(400, max(16, rng.lognormvariate(math.log(80), 0.6))))
        jobs.append(Job(t, rng.randint(200, 2000), out))


def capacity_rps() -> float:
    """Fleet requests/s (wall) at the workload's mean output length."""
    aggregate = sum(PROFILES[p].decode_aggregate_tokens_per_s[PROFILES[p].max_num_seqs - 1] for _, p in FLEET)
    mean_out = sum(j.max_tokens for j in workload(50.0, 200.0, SEED)) / len(workload(50.0, 200.0, SEED))
    return aggregate / mean_out * SPEED


async def drive(base: str, jobs: list[Job], slo_header: bool) -> list[Result]:
    headers = {"x-sluice-max-ttft-ms": str(SLO_MS)} if slo_header else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def one(job: Job) -> Result:
            await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
            return await stream_chat(session, base, "load", "cortex", "x" * (job.prompt_tokens * 4), job.max_tokens,
                                     headers, t0=t0)

        return list(await asyncio.gather(*(one(j) for j in jobs)))


def summarise(results: list[Result]) -> dict[str, float]:
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s * 1000 <= SLO_MS]
    end = max((r.started + r.total_s for r in results), default=WINDOW_S)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "throughput": sum(r.completion_tokens for r in ok) / end / SPEED,
        "ttft_p50": median(ttfts) if ttfts else float("nan"),
        "ttft_p95": pct(ttfts, 95) if ttfts else float("nan"),
        "goodput": len(good) / WINDOW_S,
        "good_share": len(good) / len(results) if results else 0.0,
        "errors": float(sum(1 for r in results if r.status != 200)),
        "shed": float(sum(1 for r in results if r.status == 503)),
    }


def _wait_idle(urls: list[str]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if all(sim_stats(u)["running"] == 0 and sim_stats(u)["waiting"] == 0 for u in urls):
            return
        time.sleep(0.2)


def _plot(table: dict[tuple[str, str], dict[str, float]]) -> str:
    plt = pyplot()
    arms = ["sluice", "LEAST_REQUEST", "ROUND_ROBIN"]
    loads = sorted({load for _, load in table})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in ((axes[0], "goodput", "goodput (req/s within SLO)"), (axes[1], "ttft_p95", "TTFT p95 (s)")):
        for i, arm in enumerate(arms):
            ax.bar([j + i * 0.25 for j in range(len(loads))], [table[(arm, load)][metric] for load in loads], 0.25,
                   label=arm)
        ax.set_xticks([j + 0.25 for j in range(len(loads))], loads)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("sluice bench load: heterogeneous fleet, Poisson arrivals")
    return save_figure(fig, "load")


def run_load_bench() -> int:
    engines = [{"name": n, "sim": p, "speed": SPEED, "sim_model": "cortex"} for n, p in FLEET]
    capacity = capacity_rps()
    levels = {"80%": 0.8 * capacity, "120%": 1.2 * capacity}
    table: dict[tuple[str, str], dict[str, float]] = {}
    preemptions: dict[tuple[str, str], int] = {}
    with gateway(engines, admission={"max_park_seconds": 60}) as config:
        urls = [e["url"] for e in config["engines"]]
        ports = [int(u.rsplit(":", 1)[1]) for u in urls]
        for level, rate in levels.items():
            jobs = workload(rate, WINDOW_S, SEED)
            for arm in ("sluice", "LEAST_REQUEST", "ROUND_ROBIN"):
                _wait_idle(urls)
                before = sum(sim_stats(u)["preemptions"] for u in urls)
                if arm == "sluice":
                    results = asyncio.run(drive(config["base_url"], jobs, slo_header=True))
                else:
                    with plain_envoy(ports, arm) as base:
                        results = asyncio.run(drive(base, jobs, slo_header=False))
                table[(arm, level)] = summarise(results)
                preemptions[(arm, level)] = sum(sim_stats(u)["preemptions"] for u in urls) - before
    rows = []
    for (arm, level), s in table.items():
        rows.append(f"| {level} | {arm} | {s['throughput']:.1f} | {s['ttft_p50']:.2f} / {s['ttft_p95']:.2f} | "
                    f"{s['goodput']:.2f} ({s['good_share']:.0%}) | {s['errors']:.0f} ({s['shed']:.0f} shed) | "
                    f"{preemptions[(arm, level)]} |")
    ratio = table[("sluice", "120%")]["goodput"] / max(table[("LEAST_REQUEST", "120%")]["goodput"], 1e-9)
    plot = _plot(table)
    body = f"""{__doc__.replace("{SPEED}", f"{SPEED:g}")}
Fleet capacity {capacity:.1f} requests/s; 80% = {levels["80%"]:.1f}/s, 120% = {levels["120%"]:.1f}/s over a
{WINDOW_S:g} s window; TTFT SLO {SLO_MS} ms.

| load | arm | throughput (tok/s, emulated) | TTFT p50 / p95 (s) | goodput req/s (share) | errors | preemptions |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Goodput at 120%: sluice / LEAST_REQUEST = **{ratio:.2f}x** (target >= 1.3x, zero preemptions).

![load]({plot})
"""
    path = write_report("load", "sluice bench load: sluice vs Envoy's ROUND_ROBIN and LEAST_REQUEST", body)
    print(body)
    print(f"report: {path}")
    return 0 if ratio >= 1.3 and preemptions[("sluice", "120%")] == 0 else 1
