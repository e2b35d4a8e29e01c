"""``sluice bench lora``: routing requests for many LoRA adapters of one base model (issue 43) against the strongest
adapter-blind Envoy arms and an EPP-like LoRA-affinity arm, on four simulated vLLM engines of two speeds.

Fleet: ``spark-a``, ``spark-b`` (prefill 4,000 tok/s, decode 49 / 88 tok/s at 1 / 2+ streams) and ``thor-a``,
``thor-b`` (1,500 tok/s, 18 / 51 tok/s), each ``--max-num-seqs {SEQS}`` and ``--max-loras {SLOTS}`` with the same
{ADAPTERS} adapters of ``cortex`` registered (``--lora-modules``), simulator speed x{SPEED}. A request for an adapter
the engine does not hold in a slot loads it (a swap: the engine's whole batch stalls {SWAP_S:g} s emulated, an assumption
of the order of a load from host memory, not a measurement); one whose adapter finds every slot held by running
requests of other adapters waits inside the engine (enginesim/batcher.py). Times are reported in emulated seconds (wall
x {SPEED}).

Workload: every request names one adapter, drawn with a Zipf-like popularity (adapter ``k`` of {ADAPTERS} with weight
``1 / k^{ZIPF}``), a unique ~{PROMPT_TOKENS}-token prompt (no prefix sharing) and an answer length drawn from a lognormal
(median {OUT_MEDIAN} tokens, sigma 0.5) sent as ``sim_output_tokens`` (``max_tokens`` {MAX_TOKENS}); streamed.

Capacity: every engine saturated alone with base-model requests ({SEQS} clients, closed loop, {CAL_S:g} s wall): no
swaps, the fleet's ceiling. Loads are {LEVELS} of it, Poisson arrivals (as many uniform times as the rate implies,
sorted), one seed per cell and round, so every arm gets the same arrivals, adapters and lengths.

Arms, interleaved: in every round each arm runs one segment ({WARM_S:g} s of arrivals to warm the engines' slots to its
own placement, then the measured window of {WINDOW_S:g} s), in an order rotated by round, on the same engines:

- ``sluice``: ``sluice up`` with its defaults on the running engines (adapters and slots discovered from ``/v1/models``
  and ``vllm:lora_requests_info``).
- ``LR``: plain Envoy ``LEAST_REQUEST`` (envoy/bench-plain.yaml).
- ``LR+w+cap``: the same, weighted by each engine's calibrated rate and capped at its sequence slots: the strongest
  plain Envoy.
- ``ring``: plain Envoy ``RING_HASH`` on a header carrying the adapter's name: consistent hashing of adapters to engines,
  what a plain Envoy user would do for affinity.
- ``EPP-LoRA``: the EPP-like arm (bench/epp.py, bench/epp_arm.py) with the ``lora-affinity-scorer`` added at weight
  {LORA_WEIGHT:g} to the default profile, so it prefers an engine running the adapter, else one with a free slot, then
  the shortest waiting queue and least KV; ``/metrics`` scraped every 50 ms wall.

Figures (requests that arrive in the window): TTFT p50 / p90 (first content chunk, client side); adapter swaps per 100
requests (the simulators' load counters, ``/sim/stats`` ``lora_swaps``, from the window's start until its requests have
finished, over the window's requests); throughput (completion tokens per emulated second from the window's start to its
last completion); answered / sent; parked (sluice: requests its control plane held before admitting, and the p90 of
that wait, emulated). Targets (issue 43): sluice's swaps at most half the EPP-like arm's, and its TTFT p90
at most the best other arm's, in every cell.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.common import Target, exit_code, pct, rotated_rounds, verdicts, write_report
from bench.epp_arm import epp_arm
from bench.plain import plain_envoy_arm
from bench.workload import Result, bare_sim, gateway, sim_stats, stream_chat, unique_prompt

SPEED = 2.0
ENGINES = (("spark-a", "spark"), ("spark-b", "spark"), ("thor-a", "thor"), ("thor-b", "thor"))
MODEL = "cortex"
SEQS = 8
SLOTS = 4
ADAPTERS = 32
ZIPF = 1.0
SWAP_S = 0.5
PROMPT_TOKENS = 300
OUT_MEDIAN = 60
MAX_TOKENS = 256
LORA_WEIGHT = 100.0
CAL_S = 15.0
LEVELS = (0.6, 0.8, 0.95)
ROUNDS = 2
WARM_S = 10.0
WINDOW_S = 30.0
QUICK_LEVELS = (0.6, 0.95)
QUICK_WARM_S = 6.0
QUICK_WINDOW_S = 20.0
"""``--quick``: these loads, one round, these windows."""
ADAPTER_HEADER = "x-bench-adapter"
ARMS = ("sluice", "LR", "LR+w+cap", "ring", "EPP-LoRA")

__doc__ = (__doc__ or "").format(**{k: v for k, v in globals().items() if k.isupper()})


def adapter_names() -> list[str]:
    return [f"lora-{k:02d}" for k in range(1, ADAPTERS + 1)]


def zipf_weights(n: int = ADAPTERS, s: float = ZIPF) -> list[float]:
    """Adapter ``k``'s share of the requests: ``k^-s`` normalised."""
    raw = [1.0 / k ** s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True, slots=True)
class Job:
    at: float
    """Wall seconds after the segment's start."""
    adapter: str
    output_tokens: int
    measured: bool
    """It arrives in the window (else in the warm-up)."""


def draw_jobs(rate: float, warm: float, window: float, seed: int) -> list[Job]:
    """Poisson arrivals at ``rate`` per wall second over ``warm + window`` seconds, each with its adapter and length."""
    rng = random.Random(seed)
    names, weights = adapter_names(), zipf_weights()
    span = warm + window
    times = sorted(rng.uniform(0, span) for _ in range(max(1, round(rate * span))))
    return [Job(t, rng.choices(names, weights)[0], max(1, min(MAX_TOKENS, round(rng.lognormvariate(
        math.log(OUT_MEDIAN), 0.5)))), t >= warm) for t in times]


async def _send(http: aiohttp.ClientSession, base: str, job: Job, t0: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
    try:
        return await stream_chat(http, base, job.adapter, job.adapter, unique_prompt(PROMPT_TOKENS), MAX_TOKENS,
                                 {ADAPTER_HEADER: job.adapter}, t0, extra={"sim_output_tokens": job.output_tokens})
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Result(job.adapter, 0, job.at)


def _swaps(urls: dict[str, str]) -> int:
    return sum(int(sim_stats(url)["lora_swaps"]) for url in urls.values())


async def run_segment(base: str, jobs: list[Job], urls: dict[str, str], warm: float) -> dict[str, Any]:
    """Send ``jobs``; the figures of those arriving in the window (see the module docstring)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_send(http, base, job, t0)) for job in jobs]
        await asyncio.sleep(max(0.0, t0 + warm - time.perf_counter()))
        before = await asyncio.to_thread(_swaps, urls)
        results = await asyncio.gather(*tasks)
        after = await asyncio.to_thread(_swaps, urls)
    measured = [r for job, r in zip(jobs, results) if job.measured]
    ok = [r for r in measured if r.status == 200 and r.ttft_s is not None]
    ttfts = [r.ttft_s * SPEED for r in ok if r.ttft_s is not None]
    end = max((r.started + r.total_s for r in ok), default=warm)
    return {
        "sent": len(measured), "ok": len(ok), "parked": sum(r.parked_ms > 0 for r in ok),
        "parked_ms": [r.parked_ms * SPEED for r in ok if r.parked_ms > 0],
        "ttft_p50": pct(ttfts, 50) if ttfts else math.nan, "ttft_p90": pct(ttfts, 90) if ttfts else math.nan,
        "swaps_per_100": 100.0 * (after - before) / max(1, len(measured)),
        "throughput": sum(r.completion_tokens for r in ok) / max(1e-9, (end - warm) * SPEED),
        "ttfts": ttfts, "swaps": after - before,
    }


async def calibrate(urls: dict[str, str]) -> list[float]:
    """Base-model requests per wall second each engine serves, each saturated alone, all at once (in ``urls``'
    order)."""
    async def one(url: str) -> float:
        done = 0
        stop_at = time.perf_counter() + CAL_S
        rng = random.Random(url)

        async def worker(http: aiohttp.ClientSession) -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                tokens = max(1, round(rng.lognormvariate(math.log(OUT_MEDIAN), 0.5)))
                result = await stream_chat(http, url, "cal", MODEL, unique_prompt(PROMPT_TOKENS), MAX_TOKENS,
                                           extra={"sim_output_tokens": tokens})
                done += result.status == 200

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            started = time.perf_counter()
            await asyncio.gather(*(worker(http) for _ in range(SEQS)))
            return done / (time.perf_counter() - started)

    return list(await asyncio.gather(*(one(url) for url in urls.values())))


def _merge(segments: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [t for s in segments for t in s["ttfts"]]
    sent = sum(s["sent"] for s in segments)
    parked_ms = [t for s in segments for t in s["parked_ms"]]
    return {"sent": sent, "ok": sum(s["ok"] for s in segments), "parked": sum(s["parked"] for s in segments),
            "parked_p90_ms": pct(parked_ms, 90) if parked_ms else 0.0,
            "ttft_p50": pct(ttfts, 50) if ttfts else math.nan, "ttft_p90": pct(ttfts, 90) if ttfts else math.nan,
            "swaps_per_100": 100.0 * sum(s["swaps"] for s in segments) / max(1, sent),
            "throughput": sum(s["throughput"] for s in segments) / len(segments)}


def run_lora_bench(quick: bool = False) -> int:
    levels = QUICK_LEVELS if quick else LEVELS
    rounds = 1 if quick else ROUNDS
    warm = QUICK_WARM_S if quick else WARM_S
    window = QUICK_WINDOW_S if quick else WINDOW_S
    modules = ("--lora-modules", *(f"{name}=/loras/{name}" for name in adapter_names()))
    sim_args = ("--max-num-seqs", str(SEQS), "--max-loras", str(SLOTS), "--lora-swap-s", f"{SWAP_S:g}", *modules)
    with ExitStack() as stack:
        urls = {name: stack.enter_context(bare_sim(profile, SPEED, name, extra=sim_args)) for name, profile in ENGINES}
        ports = [int(url.rsplit(":", 1)[1]) for url in urls.values()]
        rates = asyncio.run(calibrate(urls))
        capacity = sum(rates)
        print(f"capacity: {capacity:.2f} req/s wall ({capacity / SPEED:.2f} emulated)", flush=True)
        bases = {
            "sluice": stack.enter_context(gateway([{"name": n, "url": u, "max_num_seqs": SEQS}
                                                   for n, u in urls.items()]))["base_url"],
            "LR": stack.enter_context(plain_envoy_arm(ports, "LEAST_REQUEST")).base,
            # The strongest plain Envoy: weighted by each engine's measured rate, capped at its sequence slots.
            "LR+w+cap": stack.enter_context(plain_envoy_arm(
                ports, "LEAST_REQUEST", weights=[max(1, round(100 * r / max(rates))) for r in rates],
                max_per_host=[SEQS] * len(ports), concurrency=1)).base,
            "ring": stack.enter_context(plain_envoy_arm(ports, "RING_HASH", hash_header=ADAPTER_HEADER)).base,
        }
        epp = stack.enter_context(epp_arm(urls, lora_weight=LORA_WEIGHT))
        bases["EPP-LoRA"] = epp.base
        cells: dict[float, dict[str, list[dict[str, Any]]]] = {}
        for level in levels:
            cells[level] = {arm: [] for arm in ARMS}
            for r, order in enumerate(rotated_rounds(list(ARMS), rounds)):
                jobs = draw_jobs(level * capacity, warm, window, seed=hash((level, r)) & 0xFFFF)
                for arm in order:
                    segment = asyncio.run(run_segment(bases[arm], jobs, urls, warm))
                    cells[level][arm].append(segment)
                    print(f"{level:.0%} round {r + 1} {arm}: TTFT p50/p90 {segment['ttft_p50']:.2f}/"
                          f"{segment['ttft_p90']:.2f} s, swaps/100 {segment['swaps_per_100']:.1f}, "
                          f"{segment['ok']}/{segment['sent']} answered, {segment['parked']} parked", flush=True)
        epp_line = epp.description
    return _report(cells, capacity, quick, rounds, warm, window, epp_line)


def _report(cells: dict[float, dict[str, list[dict[str, Any]]]], capacity: float, quick: bool, rounds: int,
            warm: float, window: float, epp_line: str) -> int:
    targets: list[Target] = []
    tables = []
    for level, arms in cells.items():
        merged = {arm: _merge(segments) for arm, segments in arms.items()}
        rows = ["| arm | TTFT p50 (s) | TTFT p90 (s) | swaps / 100 req | throughput (tok/s) | answered / sent | "
                "parked (p90 wait) |", "|---|---|---|---|---|---|---|"]
        for arm, f in merged.items():
            parked = f"{f['parked']} ({f['parked_p90_ms'] / 1000:.2f} s)" if f["parked"] else "-"
            rows.append(f"| {arm} | {f['ttft_p50']:.2f} | {f['ttft_p90']:.2f} | {f['swaps_per_100']:.1f} | "
                        f"{f['throughput']:.1f} | {f['ok']} / {f['sent']} | {parked} |")
        tables.append(f"### {level:.0%} of capacity\n\n" + "\n".join(rows))
        s = merged["sluice"]
        targets.append(Target(f"{level:.0%}: sluice swaps / 100 at most half EPP-LoRA's", s["swaps_per_100"],
                              merged["EPP-LoRA"]["swaps_per_100"] / 2, at_least=False))
        best = min((a for a in ARMS if a != "sluice"), key=lambda a: merged[a]["ttft_p90"])
        targets.append(Target(f"{level:.0%}: sluice TTFT p90 at most the best other arm's ({best})", s["ttft_p90"],
                              merged[best]["ttft_p90"], at_least=False, unit="s"))
    setup = (f"Capacity (base-model requests, no swaps): {capacity / SPEED:.2f} req/s emulated. "
             f"{'`--quick`: ' if quick else ''}{rounds} round(s) per load, each arm {warm:g} s warm-up + "
             f"{window:g} s window (wall), speed x{SPEED:g}.\n\n"
             f"EPP-LoRA arm: {epp_line}.\n\nLR / ring: plain Envoy `LEAST_REQUEST` / `RING_HASH` on "
             f"`{ADAPTER_HEADER}` (the adapter's name), no caps (envoy/bench-plain.yaml). LR+w+cap: `LEAST_REQUEST` "
             f"weighted by each engine's calibrated rate, at most {SEQS} requests per engine (`max_requests`), one "
             "Envoy worker.")
    body = (f"{(__doc__ or '').strip()}\n\n## Setup\n\n{setup}\n\n## Results\n\n" + "\n\n".join(tables)
            + f"\n\n## Targets\n\n{verdicts(targets)}\n")
    path = write_report("lora", "sluice bench lora: LoRA adapters on four engines of two speeds", body)
    print(verdicts(targets))
    print(f"report: {path}")
    return exit_code(targets)
