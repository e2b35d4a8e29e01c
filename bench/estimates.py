"""``sluice bench estimates``: how far sluice's time estimates are from what happens, at 50-95% load (issue 38 item 3).

Fleet: one ``thor`` and one ``spark`` simulator (``enginesim/profiles.py``, speed xSPEED), whose tokenizer, chunked
prefill and context-dependent decode differ from the estimator's priors (the paragraph below says how). Client mix:
open-loop Poisson arrivals, streamed chat requests with ``stream_options.include_usage``, each a unique prompt of
PROMPT_MIN-PROMPT_MAX tokens (uniform, 4 characters a token as the bench writes them) and an answer whose natural length
is drawn from a lognormal (median OUT_MEDIAN tokens, sigma OUT_SIGMA, at most MAX_TOKENS) and sent as
``sim_output_tokens`` (the engine stops there; sluice does not see it). Load levels are shares of the fleet's capacity
measured first (each engine saturated alone for CAL_S s on the mean request). Each level runs each arm once (the arm
order rotated by level), WARM_S s of arrivals unmeasured, then WINDOW_S s measured.

What is measured, per engine and arm, over the window (the control plane's own histograms, scraped before and after):

- ``TTFT error``: a stream's first token at the engine over the TTFT the admission estimated
  (``sluice_ttft_estimate_error_ratio``), median;
- ``E2E error``: its whole time at the engine over the estimate for an answer of its real length (expected TTFT +
  (tokens - 1) / the decode rate the estimate used: ``sluice_end_to_end_estimate_error_ratio``), median; the answer's
  length is the one thing left out, since no admission can know it.

Arms (one ``sluice up`` each, same engines): ``sluice`` with its defaults, and ``no-feedback`` (``ttft_correction_gain:
0``: the estimate from the engines' measured rates alone, without the TTFT feedback): the before and after of the
feedback. Target (issue 38 item 3): with the defaults, both medians within 0.8-1.25x on every engine at every level.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from contextlib import ExitStack
from typing import Any

import aiohttp

from bench.common import Target, closed_loop, exit_code, histogram, histogram_quantile, parse_samples, pct, \
    rotated_rounds, scrape, sim_world, verdicts, write_report
from bench.workload import Result, bare_sim, gateway, stream_chat, unique_prompt
from enginesim.profiles import PROFILES

SPEED = 4.0
ENGINES = (("thor", "thor"), ("spark", "spark"))
MODEL = "cortex"
PROMPT_MIN, PROMPT_MAX = 200, 1500
OUT_MEDIAN, OUT_SIGMA, MAX_TOKENS = 100, 0.6, 512
LEVELS = (0.5, 0.8, 0.95)
WARM_S = 15.0
WINDOW_S = 40.0
CAL_S = 15.0
SEED = 38_3
ARMS: dict[str, dict[str, Any]] = {"sluice": {}, "no-feedback": {"ttft_correction_gain": 0}}
BOUNDS = (0.8, 1.25)
HISTOGRAMS = {"ttft": "sluice_ttft_estimate_error_ratio", "e2e": "sluice_end_to_end_estimate_error_ratio"}


def draw_output(rng: random.Random) -> int:
    return max(1, min(MAX_TOKENS, round(OUT_MEDIAN * math.exp(rng.gauss(0.0, OUT_SIGMA)))))


def mean_output() -> float:
    rng = random.Random(SEED)
    return sum(draw_output(rng) for _ in range(20_000)) / 20_000


def scrape_errors(port: int) -> dict[tuple[str, str], dict[float, float]]:
    """Every engine's cumulative buckets of the two error histograms: (kind, engine) -> upper bound -> count."""
    text = scrape(port)
    out: dict[tuple[str, str], dict[float, float]] = {}
    for kind, name in HISTOGRAMS.items():
        for have, _ in parse_samples(text, name + "_bucket"):
            out[(kind, have["engine"])] = histogram(text, name, engine=have["engine"])
    return out


async def drive(base: str, rate: float, seconds: float, seed: int) -> list[Result]:
    """Poisson arrivals at ``rate`` for ``seconds``; every request's result."""
    rng = random.Random(seed)
    at, jobs = 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            break
        jobs.append((at, rng.randint(PROMPT_MIN, PROMPT_MAX), draw_output(rng)))
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(at: float, prompt: int, natural: int) -> Result:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await stream_chat(session, base, "e", MODEL, unique_prompt(prompt), MAX_TOKENS, t0=t0,
                                     extra={"sim_output_tokens": natural})
        return list(await asyncio.gather(*(one(*job) for job in jobs)))


def calibrate(urls: dict[str, str]) -> dict[str, float]:
    """Each engine's requests/s saturated alone (max_num_seqs + 1 clients) on the mean request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": unique_prompt((PROMPT_MIN + PROMPT_MAX) // 2)}],
            "max_tokens": MAX_TOKENS, "sim_output_tokens": round(mean_output())}
    return {name: asyncio.run(closed_loop(url + "/v1/chat/completions", PROFILES[profile].max_num_seqs + 1, CAL_S,
                                          body))
            for (name, profile), url in zip(ENGINES, urls.values())}


def run_estimates_bench() -> int:
    started = time.monotonic()
    with ExitStack() as stack:
        urls = {name: stack.enter_context(bare_sim(profile, SPEED, name)) for name, profile in ENGINES}
        capacity = calibrate(urls)
        fleet = sum(capacity.values())
        print("capacity (requests/s): " + ", ".join(f"{n} {r:.2f}" for n, r in capacity.items()), flush=True)
        engines = [{"name": n, "url": u, "max_num_seqs": PROFILES[p].max_num_seqs}
                   for (n, p), u in zip(ENGINES, urls.values())]
        gateways = {arm: stack.enter_context(gateway([dict(e) for e in engines], admission=settings))
                    for arm, settings in ARMS.items()}
        cells: dict[tuple[float, str], dict[Any, Any]] = {}
        for level, order in zip(LEVELS, rotated_rounds(list(ARMS), len(LEVELS))):
            for arm in order:
                g = gateways[arm]
                port = g["controlplane"]["metrics_port"]
                seed = SEED + int(level * 100)
                warm = asyncio.run(drive(g["base_url"], level * fleet, WARM_S, seed))
                before = scrape_errors(port)
                results = asyncio.run(drive(g["base_url"], level * fleet, WINDOW_S, seed + 1))
                time.sleep(1.0)  # the access log's last entries
                after = scrape_errors(port)
                ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
                ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
                cell: dict[Any, Any] = {"sent": len(results), "ok": len(ok), "ttft_p50": pct(ttfts, 50),
                                        "ttft_p90": pct(ttfts, 90), "warm_ok": sum(r.status == 200 for r in warm)}
                for (kind, engine), buckets in after.items():
                    prior = before.get((kind, engine), {})
                    cell[(kind, engine)] = histogram_quantile(prior, buckets, 0.5) / 1000
                    cell[(kind, engine, "n")] = buckets.get(math.inf, 0.0) - prior.get(math.inf, 0.0)
                cells[(level, arm)] = cell
                print(f"  {level:.0%} {arm}: ok {cell['ok']}/{cell['sent']} " + " ".join(
                    f"{kind} {engine} {cell.get((kind, engine), math.nan):.2f}"
                    for kind in HISTOGRAMS for engine in urls), flush=True)
    targets = [Target(f"{level:.0%} {engine}: {kind} error median {'>=' if low else '<='} {bound:g}x",
                      cells[(level, "sluice")].get((kind, engine), math.nan), bound, at_least=low)
               for level in LEVELS for engine in urls for kind in HISTOGRAMS
               for low, bound in ((True, BOUNDS[0]), (False, BOUNDS[1]))]
    rows = []
    for (level, arm), cell in cells.items():
        figures = " | ".join(f"{cell.get((kind, engine), math.nan):.2f} ({cell.get((kind, engine, 'n'), 0):.0f})"
                             for engine in urls for kind in HISTOGRAMS)
        rows.append(f"| {level:.0%} | {arm} | {cell['ok']}/{cell['sent']} | {cell['ttft_p50']:.2f} / "
                    f"{cell['ttft_p90']:.2f} | {figures} |")
    columns = " | ".join(f"{engine} {kind} error median (n)" for engine in urls for kind in HISTOGRAMS)
    doc = (__doc__ or "").split("\n", 2)[2]
    for name, value in (("SPEED", f"{SPEED:g}"), ("PROMPT_MIN", str(PROMPT_MIN)), ("PROMPT_MAX", str(PROMPT_MAX)),
                        ("OUT_MEDIAN", str(OUT_MEDIAN)), ("OUT_SIGMA", f"{OUT_SIGMA:g}"),
                        ("MAX_TOKENS", str(MAX_TOKENS)), ("CAL_S", f"{CAL_S:g}"), ("WARM_S", f"{WARM_S:g}"),
                        ("WINDOW_S", f"{WINDOW_S:g}")):
        doc = doc.replace(name, value)
    world = sim_world([p for _, p in ENGINES], f"lognormal, median {OUT_MEDIAN} tokens, sigma {OUT_SIGMA:g}.")
    body = f"""{doc}
{world}

Capacity (requests per wall second at speed x{SPEED:g}): {", ".join(f"{n} {r:.2f}" for n, r in capacity.items())};
fleet {fleet:.2f}. Run: {(time.monotonic() - started) / 60:.1f} min.

## Targets

{verdicts(targets)}

## Cells

Client TTFT in wall seconds (x{SPEED:g} emulated); error medians from the control plane's histograms (bucket
interpolation), observations in brackets.

| load | arm | ok / sent | TTFT p50 / p90 (s) | {columns} |
|---|---|---|---|{'---|' * (2 * len(urls))}
{chr(10).join(rows)}
"""
    path = write_report("estimates", "sluice bench estimates: time estimates against what happens", body)
    print(body[body.index("## Targets"):])
    print(f"report: {path}")
    return exit_code(targets)
