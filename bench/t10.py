"""``sluice bench t10``: seed 000's experiment on the ``thor`` and ``spark`` simulator profiles through Envoy.

Both boxes run ``max_num_seqs=2``; per-request decode rates are the measured ones (Thor 18.18 tok/s alone, 50.71 aggregate
at two streams; Spark 49.24 and 87.82). Each run is a burst of N concurrent streamed requests of 111 completion tokens;
throughput is completion tokens over the burst's makespan, in emulated time (wall x SPEED). Output-length model: every
request generates exactly its 111 tokens (``ignore_eos``), as in the seed's experiment. The control plane learns the
boxes' rates from their metrics during a warm-up; nothing about them is configured.

Also reported: the direct-to-Thor baseline (the same burst straight to one box), the even-split ceiling, and the best
possible assignment found by brute force over every split of the burst between the boxes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp

from enginesim.profiles import PROFILES
from bench.common import median, pyplot, save_figure, write_report
from bench.workload import bare_sim, gateway, stream_chat

SPEED = 1.0
"""Real time: the gateway's own few milliseconds per request would otherwise be magnified SPEED-fold in emulated time."""
TOKENS = 111
RUNS = 5
WARMUP_BURSTS = 4


def makespan_s(profile: str, requests: int) -> float:
    """Emulated seconds for ``requests`` 111-token requests on one 2-slot box: pairs at the two-stream rate, a last odd
    one alone."""
    p = PROFILES[profile]
    pairs, alone = divmod(requests, p.max_num_seqs)
    return pairs * TOKENS / p.per_request_decode_rate(p.max_num_seqs) + alone * TOKENS / p.per_request_decode_rate(1)


def best_assignment(n: int) -> tuple[float, int]:
    """(tok/s, requests on spark) of the best split of an n-way burst (brute force)."""
    best = max(range(n + 1), key=lambda k: n * TOKENS / max(makespan_s("spark", k), makespan_s("thor", n - k)))
    return n * TOKENS / max(makespan_s("spark", best), makespan_s("thor", n - best)), best


def even_split(n: int) -> float:
    return n * TOKENS / max(makespan_s("spark", n // 2), makespan_s("thor", n - n // 2))


async def bursts(base: str, n: int, count: int) -> list[tuple[float, Counter[str], int]]:
    """``count`` n-way bursts, one after another, from one client with kept-alive connections (as any production client
    keeps them): per burst (emulated tok/s, requests per engine, failures)."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(session.get(base + "/v1/models") for _ in range(n)))  # open the connections
        for _ in range(count):
            out.append(await _burst(session, base, n))
            await asyncio.sleep(0.5)  # let the access log close the tickets: each burst meets an idle fleet
    return out


async def _burst(session: aiohttp.ClientSession, base: str, n: int) -> tuple[float, Counter[str], int]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_chat(session, base, "t10", "cortex", "Write about rivers.", TOKENS,
                                                     ignore_eos=True)
                                     for _ in range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in results)
    failures = sum(1 for r in results if r.status != 200 or r.completion_tokens != TOKENS)
    return tokens / (wall * SPEED), Counter(r.engine or "direct" for r in results), failures


def _plot(runs: dict[str, list[float]], targets: dict[str, float]) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = list(runs)
    for i, label in enumerate(labels):
        ax.scatter([i] * len(runs[label]), runs[label], zorder=3)
        ax.hlines(median(runs[label]), i - 0.25, i + 0.25, color="black")
    for name, value in targets.items():
        ax.axhline(value, linestyle=":", color="grey")
        ax.text(len(labels) - 0.5, value, f" {name} {value:.1f}", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("tok/s (emulated)")
    ax.set_title("seed 000 t10: Thor + Spark, 111-token bursts")
    return save_figure(fig, "t10")


def run_t10_bench() -> int:
    engines = [{"name": "thor", "sim": "thor", "speed": SPEED}, {"name": "spark", "sim": "spark", "speed": SPEED}]
    runs: dict[str, list[float]] = {}
    splits: dict[str, list[str]] = {}
    failures = 0
    with gateway(engines, observe={"poll_interval_seconds": 0.25, "poll_timeout_seconds": 0.2}) as config:
        base = config["base_url"]
        asyncio.run(bursts(base, 8, WARMUP_BURSTS))
        for n in (4, 8):
            label = f"sluice {n}-way"
            runs[label], splits[label] = [], []
            for rate, served, failed in asyncio.run(bursts(base, n, RUNS)):
                runs[label].append(rate)
                splits[label].append(f"Spark {served['spark']} / Thor {served['thor']}")
                failures += failed
    with bare_sim("thor", SPEED, name="thor-direct") as url:
        runs["direct to Thor 8-way"] = [rate for rate, _, _ in asyncio.run(bursts(url, 8, 3))]
    best4, spark4 = best_assignment(4)
    best8, spark8 = best_assignment(8)
    targets = {"target 4-way": 98.0, "target 8-way": 111.0, "best 8-way": best8}
    plot = _plot(runs, targets)
    rows = "\n".join(
        f"| {label} | {' / '.join(f'{v:.1f}' for v in values)} | {median(values):.1f} | {min(values):.1f} | "
        f"{', '.join(sorted(set(splits.get(label, ['-']))))} |"
        for label, values in runs.items()
    )
    ok4 = min(runs["sluice 4-way"]) >= 98.0
    ok8 = min(runs["sluice 8-way"]) >= 111.0
    body = f"""Simulator speed x{SPEED:g}; tok/s are completion tokens over the burst's makespan in emulated time. {RUNS} runs
each after {WARMUP_BURSTS} warm-up bursts (the control plane learns each box's decode rate per batch size from its
metrics). Requests failed or cut short: {failures}.

| arm | tok/s per run | median | worst | split |
|---|---|---|---|---|
{rows}

Computed from the profiles (seed 000's measured rates):

| | 4-way | 8-way |
|---|---|---|
| best assignment (brute force) | {best4:.1f} (Spark {spark4} / Thor {4 - spark4}) | {best8:.1f} (Spark {spark8} / Thor {8 - spark8}) |
| even split | {even_split(4):.1f} | {even_split(8):.1f} |
| seed 000 measured | 98.6 best, 50.8 worst of five | 66.92 median (pooled) |
| target | >= 98 in every run: {"met" if ok4 else "NOT met"} | >= 111 (95% of best): {"met" if ok8 else "NOT met"} |

![t10 runs]({plot})
"""
    path = write_report("t10", "sluice bench t10: unequal boxes, seed 000", body)
    print(body)
    print(f"report: {path}")
    return 0 if ok4 and ok8 and not failures else 1
