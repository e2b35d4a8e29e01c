"""``sluice bench steady``: constant and Poisson arrivals at 50/80/95/110% of each fleet's *measured* capacity, sluice
against the strongest plain-Envoy configurations and an EPP-like arm, all in the same run on the same simulated engines.

Fleets (every engine serves ``cortex``): ``thor+spark`` (seed 000: thor and spark, 2 slots each) and ``mixed6`` (2 spark,
2 thor, 2 v100pp2 with 4 slots each: three speeds, two slot counts).

Output-length model: the simulator's end-of-sequence model (enginesim/profiles.py). Each request's natural length is drawn
from the ``cortex`` lognormal (median 180 tokens, sigma 0.8: mean ~248, p90 ~500, p99 ~1,150) with the simulator's own
``Profile.draw_output_tokens``, seeded, and sent as ``sim_output_tokens``: the engine stops there (``finish_reason: stop``),
capped by ``max_tokens`` when the request sets one. Drawing in the client rather than in each simulator gives every arm the
identical request sequence (a simulator draws per request in arrival order, so lengths would follow routing), and keeps the
v100pp2 engines on cortex's lengths (their own profile draws the ``reasoning`` model's). The control plane never reads
``sim_output_tokens``; it learns expected lengths from the engines' generation-token histograms like everyone else.
Prompts: lognormal, median 500 tokens, sigma 0.8, clipped to 32..4000 (about 4 characters per token in the body), each
with a random head (`unique_prompt`), so no two share a prefix and the engines' prefix caches never shorten a prefill.
Arrivals: ``constant`` (evenly spaced, like the issue's load generator) or ``poisson`` (conditioned on its count: as many
uniform times in the window as the level's rate implies, sorted, so a short window is not an accidentally lighter level).

Client mixes (streaming chat through aiohttp, no ``x-sluice-*`` headers unless said):
- ``open``: no deadline, no ``max_tokens`` (engines run to end of sequence; sluice reserves its default in KV).
- ``capped``: ``max_tokens`` = 2 x the median natural length (360).
- ``deadline``: the ``open`` bodies plus ``x-sluice-max-ttft-ms`` = the TTFT SLO, to sluice only. The baselines cannot use
  the header, so their requests in this mix are byte-identical to ``open``'s: their ``deadline`` rows are the ``open``
  rows' measurements (same run, same requests), not a rerun.

Capacity: a calibration run per fleet and mix body shape saturates every engine alone (direct, closed loop at
max_num_seqs + 1 concurrent requests) with the same prompts and output model for CAL_S wall seconds and reads its
generation-token counter; an engine's capacity in requests/s is its measured tokens/s over the mix's mean output length.
The fleet's sum sets the load levels; each engine's measured tokens/s is its ``load_balancing_weight`` in the weighted arms.

Rounds (``--rounds``, default ``ROUNDS``): every arm of a cell runs once a round, the arms' order rotated each round so
none always runs first or last, each arm from idle engines (the previous arm's streams have ended); each round has
its own seeded arrivals, the same for every arm of that round. Figures pool every round's requests; each round's
figure is printed beside them, and every ratio a target reads is also given round by round (its spread).
``--quick``: fleet ``thor+spark``, mix ``open``, the arms of ``QUICK_ARMS``, windows ``QUICK_WINDOWS_S``.

Arms (in the same run, each cell's requests identical across arms):
- ``sluice``: ``sluice up`` with its defaults (no admission settings at all).
- ``RR``, ``LR``: plain Envoy ``ROUND_ROBIN`` / ``LEAST_REQUEST``, equal weights, no caps (the engines queue overflow).
- ``RR+w+cap``, ``LR+w+cap``: the same policies with endpoint weights proportional to measured throughput and each engine
  capped at max_num_seqs concurrent requests *in Envoy*: HTTP/1.1 upstream, ``per_host_thresholds.max_connections`` =
  the smallest max_num_seqs (an engine with m times that many slots is listed m times), ``max_pending_requests`` 100000,
  one Envoy worker (per-worker pools would strand connections), so overflow waits in Envoy's pending queue for a free
  connection instead of queueing in an engine or being rejected. The sims' sampled running + waiting verifies the cap.
- ``LR+scan+cap``, ``LR+w+cap b=0|1|2``: ``LEAST_REQUEST`` capped the same way, configured through its
  ``load_balancing_policy`` extension with ``FULL_SCAN`` and ``choice_count`` = the host count (bench/
  least_request.py): equal weights (the full scan picks the host with the fewest active requests), or the measured
  weights with ``active_request_bias`` 0, 1 (Envoy's default) and 2 (with unequal weights Envoy ignores the choice
  count and weighs each host by ``weight / (active + 1) ^ bias``).
- ``EPP``: the Gateway API Inference Extension's default endpoint picker (llm-d's EPP) reimplemented from its v1.5.0
  source (bench/epp.py, bench/epp_arm.py): each engine's ``/metrics`` scraped every 50 ms (wall), each request sent to
  the highest of 2 x queue score (``vllm:num_requests_waiting``, min-max normalised) + 2 x (1 -
  ``vllm:kv_cache_usage_perc``) + 3 x its prefix score (always 0 here: no two prompts share a block), ties at random;
  no cap, no shedding. Its own asyncio proxy in the data path instead of Envoy with an ``ext_proc`` hop. Not run
  against real engines (``--engines``): llama.cpp exposes none of the vLLM gauges it scores.
- ``clairvoyant``: the reference (bench/clairvoyant.py): it knows each request's true output length and the
  simulator's step rule, holds every request in one central queue and sends it straight to the engine (no Envoy) where
  it finishes first, never past an engine's slots or KV.

Figures: TTFT percentiles twice: over completed requests only (served-only), and over every request with a refused
(429/503) or failed one counted as infinite (every-request; the targets use these). TTFT and end-to-end over completed
requests (wall seconds at simulator speed x{SPEED}); throughput = completion
tokens per emulated second until the last completion; goodput = requests completed with TTFT within the SLO per wall
second of the arrival window (a shed request is not good); shed = requests answered 429 or 503, with how many 503s
came after the client had waited more than ``LATE_SHED_S`` ("late": a refusal after a long wait is the worst answer)
and the longest wait for a 503 ("max"); share = requests each engine served (its ``/sim/stats``);
refill = how long a freed slot waited for its next request (``refill_gaps``, from each simulator's ``/sim/log``).
Targets per cell: sluice's every-request TTFT p90 <= the lowest baseline arm's, sluice's goodput >= the highest
baseline arm's (the baselines: every Envoy arm and the EPP arm; each "best" taken over them separately), and at 110%
sluice's goodput >= 1.3x the best baseline arm's where the best baseline leaves that room: goodput cannot pass the
fleet's measured capacity (requests per second), so where the best baseline's goodput is above 1/1.3 of it no gateway
reaches 1.3x, and that target does not stand (the report prints the room, capacity over the best baseline's goodput,
instead). At 80% and 95% also: sluice's every-request TTFT p90 <= 1.25x the
clairvoyant arm's (and <= the best baseline arm's).
Every arm is shown as a ratio of the clairvoyant arm (TTFT p90, goodput).

``--engines FILE`` (llama.cpp only): the one fleet is the engines a YAML file lists (as for ``sluice bench overhead``:
started by the user, on 127.0.0.1, fronted by ``sluice up`` as engines without ``sim:``), at speed x1 and the report is
``bench/results/steady-llamacpp.md``. The model is the first of the engines' ``/v1/models``; slots are an entry's
``max_num_seqs`` or llama.cpp's ``/props`` ``total_slots``. Output lengths are the same draws, sent as llama.cpp's
``{"n_predict": N, "ignore_eos": true}`` (sluice does not read ``n_predict``); prompts are ``"word " * N`` (one token a
word with llama.cpp's tokenizer, plus the chat template's few), both clipped so prompt + output fit a slot's context
(``/props`` ``default_generation_settings.n_ctx``). The prompts share their prefix, so llama.cpp's prompt cache makes
prefill nearly free. Engine-side figures: running = ``/slots`` entries ``is_processing``, waiting =
``llamacpp:requests_deferred``, capacity and "served" = ``llamacpp:tokens_predicted_total`` (completion tokens per
engine, not requests); preemptions "-" (llama.cpp has none). Windows ``REAL_WINDOW_S``; the ``--fleet`` option does not
apply. Other engine flavours (vLLM, SGLang) are not supported here.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import random
import re
import statistics
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from enginesim.profiles import PROFILES
from bench.clairvoyant import EngineRates
from bench.clairvoyant_arm import MEASURED, PREDICTED, ArmJob
from bench.clairvoyant_arm import TAG as CLAIRVOYANT_TAG
from bench.clairvoyant_arm import drive as drive_clairvoyant
from bench.common import by_round, interleaved, pct, pyplot, save_figure, write_report
from bench.epp import SCRAPE_INTERVAL_S
from bench.epp_arm import EppArm, describe, epp_arm
from bench.least_request import LeastRequestArm, least_request_arm
from bench.plain import PlainEnvoy, plain_envoy_arm
from bench.workload import Result, gateway, sim_log, sim_stats, stream_chat, unique_prompt

SPEED = 10.0
WINDOWS_S = {"thor+spark": 30.0, "mixed6": 15.0}
"""Wall seconds of arrivals per cell up to 100% (mixed6 has 2.5x the capacity: about as many requests in half the time).
They were 10 and 5 s until ffaacce (2026-12-01): 27-60 requests a cell, whose p90 is the third to sixth worst, and the
same requests sent twice gave a plain Envoy arm TTFT p90s of 0.15 and 0.43 s (thor+spark, 80%). Each cell's target
compares sluice's p90 with the lowest of four such noisy p90s, which is biased low, so a cell passed or missed by luck;
at 30 s (81-154 requests on thor+spark) a run shows the difference between the policies rather than between two runs."""
OVERLOAD_WINDOW_S = 40.0
"""Wall seconds of arrivals in an overloaded cell (level above 1), for every fleet. Sustained overload takes time to show:
at 110% a FIFO backlog grows by a tenth of the fleet's capacity each second, so its queueing delay passes the 2 s SLO
only after about 20 s. In a 10 s window 110% measures a transient, not an overload (issue 9's 1.3x target cannot show
there: the best baseline already served 92% of the capacity within the SLO)."""
CAL_S = 10.0
CAL_WARM_S = 3.0
SLO_MS = 2000
LATE_SHED_S = 1.0
"""Wall seconds: a 503 answered after the client waited longer than this counts as late."""
SEED = 20261130
LEVELS = (0.5, 0.8, 0.95, 1.1)
MODEL = "cortex"
CAPPED_MAX_TOKENS = 2 * round(PROFILES["thor"].output_median_tokens)
FLEETS: dict[str, tuple[tuple[str, str], ...]] = {
    "thor+spark": (("thor", "thor"), ("spark", "spark")),
    "mixed6": (("spark-a", "spark"), ("spark-b", "spark"), ("thor-a", "thor"), ("thor-b", "thor"),
               ("v100-a", "v100pp2"), ("v100-b", "v100pp2")),
}
MIXES = ("open", "capped", "deadline")
LEAST_REQUEST_ARMS = (
    LeastRequestArm("LR+scan+cap", weighted=False, active_request_bias=None),
    LeastRequestArm("LR+w+cap b=0", weighted=True, active_request_bias=0.0),
    LeastRequestArm("LR+w+cap b=1", weighted=True, active_request_bias=1.0),
    LeastRequestArm("LR+w+cap b=2", weighted=True, active_request_bias=2.0),
)
"""The tuned ``LEAST_REQUEST`` arms (bench/least_request.py), capped like ``LR+w+cap``, with ``FULL_SCAN`` and
``choice_count`` = the host count. ``b=1`` is Envoy's default bias set explicitly: with unequal weights it is
``LR+w+cap``'s policy, so the two rows differ only by the run's noise."""
CAPPED = ("RR+w+cap", "LR+w+cap", *(a.name for a in LEAST_REQUEST_ARMS))
EPP = "EPP"
"""The EPP-like arm (bench/epp_arm.py): a baseline, not an Envoy arm (no Envoy counters, no cap)."""
BASELINES = ("RR", "LR", *CAPPED, EPP)
REFERENCE = CLAIRVOYANT_TAG
ARMS = ("sluice", *BASELINES, REFERENCE)
TARGET_LEVELS = (0.8, 0.95)
"""Load levels where sluice is judged against the clairvoyant arm (issue 38 item 6)."""
OVERLOAD_FACTOR = 1.3
"""Above 100%: sluice's goodput at least this many times the best baseline arm's, where the fleet's capacity leaves
that room (``verdict``)."""
CLAIRVOYANT_FACTOR = 1.25
"""Target: sluice's TTFT p90 (every request, refused ones infinite) at most this many times the clairvoyant arm's."""
POISSON = ("thor+spark", 0.95)
"""Poisson arrivals run beside constant ones only on this fleet at this level, in every mix: near capacity is where bursts
matter (at 50-80% both processes leave slack, at 110% both overload), and thor+spark is issue 9's fleet. Constant arrivals
(the issue's load generator) run everywhere. The whole matrix in both processes would take over an hour here."""
_GEN = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)", re.M)
_LLAMA_GEN = re.compile(r"^llamacpp:tokens_predicted_total ([0-9.e+]+)", re.M)
_LLAMA_DEFERRED = re.compile(r"^llamacpp:requests_deferred ([0-9.e+]+)", re.M)
REAL_WINDOW_S = 10.0
REAL_REPORT = "steady-llamacpp"
ROUNDS = 2
"""Rounds per cell (``--rounds``): every arm of a cell runs once a round, in an order rotated each round
(``rotated_rounds``), all on that round's arrivals; each round draws its own (seed + ``ROUND_SEED_STRIDE`` x round). An
arm's figures pool every round's requests; each round's figure stands beside them (the spread)."""
ROUND_SEED_STRIDE = 10_007
QUICK_ARMS = ("sluice", "LR+scan+cap", "RR+w+cap", EPP, REFERENCE)
"""``--quick``'s arms: sluice, the two capped Envoy arms that were a cell's best baseline most often in the latest run
with every arm (``bench/results/steady-limit.md``, 2026-12-05: four of its twelve best-arm picks each; full-scan
``LEAST_REQUEST`` on equal weights, and weighted round robin, load-blind like ``LR+w+cap b=0``), the EPP arm (uncapped
like ``RR`` and ``LR``, but routing on queue depth and KV) and the clairvoyant arm (only at ``TARGET_LEVELS``, where its
target is). Left out: ``RR``, ``LR``, ``LR+w+cap`` and its duplicate ``LR+w+cap b=1``, ``b=0``, ``b=2``. The full run
keeps every arm."""
QUICK_WINDOWS_S = (6.0, 14.0)
"""``--quick``'s wall seconds of arrivals per round: up to 100%, and above (a transient, not a sustained overload:
``OVERLOAD_WINDOW_S``)."""


@dataclass
class Target:
    """What the bench drives: the simulators (defaults) or real llama.cpp servers (``--engines FILE``)."""

    real: bool = False
    speed: float = SPEED
    model: str = MODEL
    n_ctx: int = 0
    """Tokens of context per slot (real engines): prompt + output are clipped to fit."""
    quick: bool = False
    """``--quick``: ``QUICK_ARMS`` only, ``QUICK_WINDOWS_S`` windows."""


_T = Target()


@dataclass(frozen=True)
class Job:
    at: float
    prompt_tokens: int
    natural: int


@dataclass
class Cell:
    fleet: str
    mix: str
    level: float
    arrival: str
    rate: float
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)


def mix_max_tokens(mix: str) -> int | None:
    return CAPPED_MAX_TOKENS if mix == "capped" else None


def draw_jobs(rate: float, seconds: float, arrival: str, seed: int) -> list[Job]:
    """Arrival times (constant spacing or Poisson) with each request's prompt and natural output length."""
    rng = random.Random(seed)
    profile = PROFILES["thor"]  # the cortex output model
    times: list[float] = []
    if arrival == "constant":
        times = [i / rate for i in range(int(rate * seconds))]
    else:  # a Poisson process given its count: that many uniform times, sorted (the cell carries its level exactly)
        times = sorted(rng.uniform(0, seconds) for _ in range(int(rate * seconds)))
    jobs = []
    for at in times:
        prompt = int(min(4000, max(32, rng.lognormvariate(math.log(500), 0.8))))
        jobs.append(Job(at, prompt, profile.draw_output_tokens(rng)))
    return jobs


def mean_output(mix: str) -> float:
    """The mix's mean completion length (natural lengths, capped by its max_tokens), from 50,000 draws."""
    rng = random.Random(1)
    cap = mix_max_tokens(mix) or 10**9
    return statistics.fmean(min(cap, PROFILES["thor"].draw_output_tokens(rng)) for _ in range(50000))


async def _one(session: aiohttp.ClientSession, base: str, job: Job, mix: str, t0: float, tag: str) -> Result:
    headers = {"x-sluice-max-ttft-ms": str(SLO_MS)} if mix == "deadline" and tag == "sluice" else {}
    if _T.real:  # llama.cpp: n_predict + ignore_eos, one token a word, prompt + output within a slot's context
        cap = mix_max_tokens(mix) or 10**9
        natural = min(job.natural, cap, _T.n_ctx // 2)
        prompt = max(1, min(job.prompt_tokens, _T.n_ctx - natural - 64))
        content, extra = "word " * prompt, {"n_predict": natural, "ignore_eos": True}
    else:
        content, extra = unique_prompt(job.prompt_tokens), {"sim_output_tokens": job.natural}
    try:
        return await stream_chat(session, base, tag, _T.model, content, mix_max_tokens(mix), headers,
                                 t0=t0, extra=extra)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Result(tag, 599, time.perf_counter() - t0, headers={"error": type(exc).__name__})


async def _drive(base: str, jobs: list[Job], mix: str, tag: str, urls: list[str],
                 engines: list[EngineRates] | None = None) -> tuple[list[Result], list[int]]:
    """Send ``jobs`` on schedule (to ``base``, or, for the clairvoyant arm, through its scheduler straight to ``urls``,
    whose ``engines`` it knows); returns the results and each engine's sampled peak of running + waiting."""
    peaks = [0] * len(urls)
    stop = asyncio.Event()

    async def sample(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            for i, url in enumerate(urls):
                try:
                    s = await _engine_stats_async(session, url)
                    peaks[i] = max(peaks[i], s["running"] + s["waiting"])
                except (aiohttp.ClientError, ValueError):
                    pass
            await asyncio.sleep(0.1)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        sampler = asyncio.create_task(sample(session))
        t0 = time.perf_counter()

        async def at(job: Job) -> Result:
            await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
            return await _one(session, base, job, mix, t0, tag)

        if tag == REFERENCE:
            assert engines is not None, "the clairvoyant arm needs the engines' profiles"
            arm_jobs = [ArmJob(j.at, unique_prompt(j.prompt_tokens), j.natural, mix_max_tokens(mix)) for j in jobs]
            results = await drive_clairvoyant(urls, engines, arm_jobs, _T.model, _T.speed, t0)
        else:
            results = list(await asyncio.gather(*(at(j) for j in jobs)))
        stop.set()
        await sampler
    return results, peaks


def _gen_tokens(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        match = (_LLAMA_GEN if _T.real else _GEN).search(response.read().decode())
    return float(match.group(1)) if match else 0.0


def _llama_stats(slots: Any, metrics: str) -> dict[str, Any]:
    """llama.cpp's ``/slots`` and ``/metrics`` as the simulator's ``/sim/stats`` keys the bench reads (served = completion
    tokens so far, preemptions none)."""
    deferred, predicted = _LLAMA_DEFERRED.search(metrics), _LLAMA_GEN.search(metrics)
    return {"running": sum(1 for s in slots if s.get("is_processing")),
            "waiting": int(float(deferred.group(1))) if deferred else 0,
            "served": int(float(predicted.group(1))) if predicted else 0, "preemptions": 0}


def _engine_stats(url: str) -> dict[str, Any]:
    if not _T.real:
        return sim_stats(url)
    with urllib.request.urlopen(url + "/slots", timeout=5) as response:
        slots = json.load(response)
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        metrics = response.read().decode()
    return _llama_stats(slots, metrics)


async def _engine_stats_async(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    if not _T.real:
        async with session.get(url + "/sim/stats") as response:
            stats: dict[str, Any] = await response.json()
            return stats
    async with session.get(url + "/slots") as response:
        slots = await response.json()
    async with session.get(url + "/metrics") as response:
        metrics = await response.text()
    return _llama_stats(slots, metrics)


async def _calibrate(urls: list[str], slots: list[int], mix: str) -> list[float]:
    """Each engine's measured generation tokens per emulated second, saturated alone (closed loop, slots + 1)."""
    stop_at = time.perf_counter() + CAL_S
    rng = random.Random(SEED + 7)
    pool = draw_jobs(1000.0, 5.0, "poisson", SEED + 99)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(url: str) -> None:
            while time.perf_counter() < stop_at:
                await _one(session, url, rng.choice(pool), mix, 0.0, "calibrate")

        tasks = [asyncio.create_task(worker(u)) for u, n in zip(urls, slots) for _ in range(n + 1)]
        await asyncio.sleep(CAL_WARM_S)
        before, t_before = [_gen_tokens(u) for u in urls], time.perf_counter()
        await asyncio.sleep(CAL_S - CAL_WARM_S)
        after, t_after = [_gen_tokens(u) for u in urls], time.perf_counter()
        await asyncio.gather(*tasks)
    return [(a - b) / (t_after - t_before) / _T.speed for a, b in zip(after, before)]


def _wait_idle(urls: list[str]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        stats = [_engine_stats(u) for u in urls]
        if all(s["running"] == 0 and s["waiting"] == 0 for s in stats):
            time.sleep(0.3)  # let the access log close sluice's tickets
            return
        time.sleep(0.2)


def _span(results: list[Result], window: float) -> float:
    """Seconds from a segment's start to its last completion (``window`` when nothing completed)."""
    return max((r.started + r.total_s for r in results if r.status == 200 and r.ttft_s is not None), default=window)


def summarise(results: list[Result], served: list[int], peaks: list[int], preemptions: int | str,
              window: float, span: float | None = None) -> dict[str, Any]:
    """One arm's figures over ``results`` (module docstring, Figures): goodput per second of ``window``, throughput
    per second of ``span`` (default: from the start to the last completion)."""
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.total_s for r in ok]
    good = [t for t in ttfts if t * 1000 <= SLO_MS]
    end = _span(results, window) if span is None else span
    nan = float("nan")
    parked = [r.parked_ms for r in results if r.status == 200]
    every = [r.ttft_s if r.status == 200 and r.ttft_s is not None else math.inf for r in results]
    return {
        "n": len(results),
        "ttft_all_p50": pct(every, 50) if every else nan, "ttft_all_p90": pct(every, 90) if every else nan,
        "ttft_all_p99": pct(every, 99) if every else nan, "unserved": sum(1 for t in every if math.isinf(t)),
        "ttft_p50": pct(ttfts, 50) if ttfts else nan, "ttft_p90": pct(ttfts, 90) if ttfts else nan,
        "ttft_p99": pct(ttfts, 99) if ttfts else nan,
        "e2e_p50": pct(e2e, 50) if e2e else nan, "e2e_p99": pct(e2e, 99) if e2e else nan,
        "throughput": sum(r.completion_tokens for r in ok) / end / _T.speed,
        "goodput": len(good) / window, "good_share": len(good) / max(1, len(results)),
        "shed": sum(1 for r in results if r.status in (429, 503)),
        "late_shed": sum(1 for r in results if r.status == 503 and r.total_s > LATE_SHED_S),
        "shed_wait_max": max((r.total_s for r in results if r.status == 503), default=0.0),
        "errors": sum(1 for r in results if r.status not in (200, 429, 503)),
        "served": served, "peaks": peaks, "preemptions": preemptions,
        "parked_p50": pct(parked, 50) if parked else 0, "parked_p90": pct(parked, 90) if parked else 0,
        "reasons": Counter(r.headers.get("x-sluice-route-reason", "-") for r in results),
    }


REFILL_WITHIN_S = 3.0
"""Emulated seconds: a stream's end followed by the next arrival on its engine within this is a refill (a request was
waiting somewhere for that slot); a longer gap is an engine with nothing to do, not a refill's latency."""


def refill_gaps(log: list[dict[str, Any]], speed: float) -> list[float]:
    """Wall seconds from each stream's end on one engine (its ``/sim/log`` entries, emulated time) to the next request's
    arrival there, for the gaps under ``REFILL_WITHIN_S``. Under load this is how long a freed slot stays empty: the
    gateway's completion signal, wake and dispatch (sluice: access log, release, the parked Check's answer; a capped
    Envoy: its pending queue takes the freed connection)."""
    arrivals = sorted(float(r["arrived_at"]) for r in log)
    gaps = []
    for entry in log:
        finished = entry.get("finished_at")
        if finished is None:
            continue
        later = bisect.bisect_left(arrivals, float(finished))
        if later < len(arrivals) and arrivals[later] - finished < REFILL_WITHIN_S:
            gaps.append((arrivals[later] - finished) / speed)
    return gaps


def window_s(fleet: str, level: float) -> float:
    """Wall seconds of arrivals in one round of a cell."""
    if _T.quick:
        return QUICK_WINDOWS_S[1] if level > 1 else QUICK_WINDOWS_S[0]
    return OVERLOAD_WINDOW_S if level > 1 and not _T.real else WINDOWS_S[fleet]


@dataclass(frozen=True)
class Segment:
    """One arm's run on one round's arrivals of a cell: what ``summarise`` reads, and the refill gaps."""

    results: list[Result]
    served: list[int]
    peaks: list[int]
    preemptions: int | str
    gaps: list[float]
    loadavg: float


def pool(segments: list[Segment], window: float) -> dict[str, Any]:
    """An arm's figures over a cell's rounds (``segments`` in round order): percentiles over every round's requests
    together, counts summed, peaks the highest, goodput per second of all the rounds' windows, throughput per second of
    all their spans; ``rounds`` holds each round's own figures (``summarise`` of that segment alone), the spread."""
    results = [r for s in segments for r in s.results]
    served = [sum(n) for n in zip(*(s.served for s in segments))]
    peaks = [max(n) for n in zip(*(s.peaks for s in segments))]
    counts = [s.preemptions for s in segments]
    preemptions: int | str = sum(c for c in counts if isinstance(c, int)) if all(isinstance(c, int) for c in counts) \
        else "-"
    figures = summarise(results, served, peaks, preemptions, window * len(segments),
                        span=sum(_span(s.results, window) for s in segments))
    gaps = [g for s in segments for g in s.gaps]
    figures["refill_ms"] = (pct(gaps, 50) * 1000, pct(gaps, 90) * 1000) if gaps else None
    figures["loadavg"] = max(s.loadavg for s in segments)
    figures["rounds"] = [summarise(s.results, s.served, s.peaks, s.preemptions, window) for s in segments]
    return figures


def round_ratios(mine: Mapping[str, Any], theirs: Mapping[str, Any], key: str) -> str:
    """``mine / theirs`` on ``key`` round by round (``0.91x / 1.12x``): the spread of a pooled ratio."""
    return " / ".join(_ratio(a, b) for a, b in zip(by_round(mine, key), by_round(theirs, key)))


def run_segment(cell: Cell, jobs: list[Job], arm: str, base: str, urls: list[str],
                engines: list[EngineRates] | None = None) -> Segment:
    """One arm on one round's ``jobs``, from idle engines (it waits for the previous segment's streams to end)."""
    _wait_idle(urls)
    before = [_engine_stats(u) for u in urls]
    logged = [] if _T.real else [len(sim_log(u)) for u in urls]
    results, peaks = asyncio.run(_drive(base, jobs, cell.mix, arm, urls, engines))
    after = [_engine_stats(u) for u in urls]  # every stream has ended: its engine counted it
    gaps = [] if _T.real else [g for log, n in zip(map(sim_log, urls), logged) for g in refill_gaps(log[n:], _T.speed)]
    served = [a["served"] - b["served"] for a, b in zip(after, before)]
    pre = sum(a["preemptions"] - b["preemptions"] for a, b in zip(after, before))
    return Segment(results, served, peaks, pre if not _T.real else "-", gaps, _loadavg())


def run_cell(cell: Cell, rounds: list[list[Job]], arms: dict[str, str], urls: list[str],
             engines: list[EngineRates] | None = None) -> None:
    """Every arm of ``arms`` (name -> base URL; the clairvoyant arm's is unused) once per round, the arms' order rotated
    each round (``interleaved``), every arm of a round on that round's jobs (``rounds[n]``); each arm's figures pooled
    over the rounds (``pool``)."""
    segments: dict[str, list[Segment]] = {arm: [] for arm in arms}
    window = window_s(cell.fleet, cell.level)
    for number, arm in interleaved(list(arms), len(rounds)):
        segment = run_segment(cell, rounds[number], arm, arms[arm], urls, engines)
        segments[arm].append(segment)
        s = summarise(segment.results, segment.served, segment.peaks, segment.preemptions, window)
        print(f"  {cell.fleet} {cell.mix} {cell.level:.0%} {cell.arrival} round {number + 1}/{len(rounds)} {arm}: "
              f"n={s['n']} TTFT p50/p90 {s['ttft_p50']:.2f}/{s['ttft_p90']:.2f} (every request "
              f"{s['ttft_all_p90']:.2f}) goodput {s['goodput']:.2f} shed {s['shed']} ({s['late_shed']} late, "
              f"longest {s['shed_wait_max']:.1f} s) share {segment.served}", flush=True)
    for arm in arms:
        cell.figures[arm] = pool(segments[arm], window)
        if arm == REFERENCE:
            cell.figures[arm]["prediction"] = prediction_error([r for s in segments[arm] for r in s.results])


def prediction_error(results: list[Result]) -> tuple[float, float, float] | None:
    """The clairvoyant arm's measured / predicted time from dispatch to a request's end: p10, median and p90 over its
    served requests (None without any). Near 1: it knew what the engines would do."""
    ratios = [float(r.headers[MEASURED]) / float(r.headers[PREDICTED]) for r in results
              if r.status == 200 and PREDICTED in r.headers and float(r.headers[PREDICTED]) > 0]
    return (pct(ratios, 10), pct(ratios, 50), pct(ratios, 90)) if ratios else None


SAME_POLICY = ("LR+w+cap", "LR+w+cap b=1")
"""Two arms that run one policy (unequal weights, Envoy's default bias 1): their gap is the run's noise on a figure."""


def noise_note(figures: Mapping[str, Mapping[str, Any]]) -> str:
    """The every-request TTFT p90 gap between the two arms of ``SAME_POLICY`` ("" when either is missing)."""
    a, b = SAME_POLICY
    if a not in figures or b not in figures:
        return ""
    x, y = figures[a]["ttft_all_p90"], figures[b]["ttft_all_p90"]
    return (f" Noise: `{a}` and `{b}` run the same policy on the same requests; their TTFT p90s are {_seconds(x)} and "
            f"{_seconds(y)} s ({abs(x - y):.2f} s apart).")


def best_baseline_arm(figures: Mapping[str, Mapping[str, Any]], key: str = "ttft_all_p90") -> str:
    """The baseline arm (an Envoy arm or the EPP arm) of a cell with the lowest ``key`` (NaN counts as worst; ties go
    to the earlier arm in ``BASELINES``)."""
    present = [a for a in BASELINES if a in figures]
    return min(present, key=lambda a: math.inf if math.isnan(figures[a][key]) else figures[a][key])


def verdict(cell: Cell) -> dict[str, Any]:
    """The cell's targets against the best baseline arm: sluice's TTFT p90 over every request (a refused one infinite)
    at most the lowest baseline arm's, its goodput at least the highest, and at 110% 1.3x that where the fleet's
    capacity leaves room for it (``room``: the measured capacity, ``rate / level``, over the best baseline's goodput;
    None at or below 100%)."""
    base = {a: cell.figures[a] for a in BASELINES if a in cell.figures}
    s = cell.figures["sluice"]
    best_p90_arm = best_baseline_arm(base)
    best_good_arm = max(base, key=lambda a: base[a]["goodput"])
    best_p90, best_good = base[best_p90_arm]["ttft_all_p90"], base[best_good_arm]["goodput"]
    out = {
        "best_p90_arm": best_p90_arm, "best_good_arm": best_good_arm,
        "p90_ratio": s["ttft_all_p90"] / best_p90 if best_p90 > 0 else math.inf,
        "good_ratio": s["goodput"] / best_good if best_good > 0 else math.inf,
        "p90_pass": s["ttft_all_p90"] <= best_p90, "good_pass": s["goodput"] >= best_good,
    }
    room = cell.rate / cell.level / best_good if cell.level > 1.0 and best_good > 0 else None
    out["room"] = room
    out["overload_pass"] = out["good_ratio"] >= OVERLOAD_FACTOR if room is not None and room >= OVERLOAD_FACTOR \
        else None
    return out


@dataclass(frozen=True, slots=True)
class Judgement:
    """sluice in one cell against the clairvoyant arm and the best baseline arm, on TTFT p90 over every request (refused
    or failed ones infinite): met when ``sluice <= CLAIRVOYANT_FACTOR x clairvoyant`` and
    ``sluice <= best baseline``."""

    sluice_p90: float
    clairvoyant_p90: float
    best_baseline: str
    best_baseline_p90: float
    beat_reference: tuple[str, ...]
    """Arms whose TTFT p90 is below the clairvoyant arm's: there it is no lower bound."""

    @property
    def ratio(self) -> float:
        """sluice's p90 over the clairvoyant arm's."""
        return self.sluice_p90 / self.clairvoyant_p90 if self.clairvoyant_p90 > 0 else math.inf

    @property
    def within_reference(self) -> bool:
        return self.ratio <= CLAIRVOYANT_FACTOR

    @property
    def at_most_best_baseline(self) -> bool:
        return self.sluice_p90 <= self.best_baseline_p90

    @property
    def met(self) -> bool:
        return self.within_reference and self.at_most_best_baseline


def judge(figures: Mapping[str, Mapping[str, Any]], level: float) -> Judgement | None:
    """The clairvoyant target for a cell's figures (arm -> ``summarise`` output); None where it does not apply: a level
    outside ``TARGET_LEVELS``, or no clairvoyant arm (real engines)."""
    if REFERENCE not in figures or not any(math.isclose(level, t) for t in TARGET_LEVELS):
        return None
    best = best_baseline_arm(figures)
    reference = figures[REFERENCE]["ttft_all_p90"]
    beat = tuple(a for a in figures if a != REFERENCE and figures[a]["ttft_all_p90"] < reference)
    return Judgement(figures["sluice"]["ttft_all_p90"], reference, best, figures[best]["ttft_all_p90"], beat)


def _seconds(x: float) -> str:
    return "inf" if math.isinf(x) else "-" if math.isnan(x) else f"{x:.2f}"


def _ratio(x: float, reference: float) -> str:
    if math.isnan(x) or math.isnan(reference):
        return "-"
    return "inf" if math.isinf(x) or reference <= 0 else f"{x / reference:.2f}x"


def _fmt_table(cell: Cell, slots: list[int], names: list[str]) -> str:
    v = verdict(cell)
    arms = [a for a in ARMS if a in cell.figures]
    ref = cell.figures.get(REFERENCE)
    rows = []
    for arm in arms:
        s = cell.figures[arm]
        marks = []
        if arm == v["best_p90_arm"]:
            marks.append("best p90")
        if arm == v["best_good_arm"]:
            marks.append("best goodput")
        label = f"{arm}" + (f" (**{', '.join(marks)}**)" if marks else "")
        share = " / ".join(str(n) for n in s["served"])
        peak = " / ".join(str(p) for p in s["peaks"])
        vs_ref = "-" if ref is None else (f"{_ratio(s['ttft_all_p90'], ref['ttft_all_p90'])} / "
                                          f"{_ratio(s['goodput'], ref['goodput'])}")
        rows.append(f"| {label} | {s['ttft_p50']:.2f} / {s['ttft_p90']:.2f} / {s['ttft_p99']:.2f} | "
                    f"{_seconds(s['ttft_all_p50'])} / {_seconds(s['ttft_all_p90'])} / {_seconds(s['ttft_all_p99'])} | "
                    f"{' / '.join(_seconds(x) for x in by_round(s, 'ttft_all_p90'))} | {vs_ref} | "
                    f"{s['e2e_p50']:.2f} / {s['e2e_p99']:.2f} | {s['throughput']:.0f} | {s['goodput']:.2f} "
                    f"({s['good_share']:.0%}) | {' / '.join(f'{x:.2f}' for x in by_round(s, 'goodput'))} | {share} | {_shed_text(s)}"
                    f"{'+' + str(s['errors']) + ' err' if s['errors'] else ''} "
                    f"| {s['preemptions']} | {peak} |")
    def pf(ok: bool) -> str:
        return "PASS" if ok else "**MISS**"
    s = cell.figures["sluice"]
    b90, bg = cell.figures[v["best_p90_arm"]], cell.figures[v["best_good_arm"]]
    line = (f"sluice / best baseline arm: TTFT p90 (every request) {v['p90_ratio']:.2f}x, round by round "
            f"{round_ratios(s, b90, 'ttft_all_p90')} ({pf(v['p90_pass'])}), goodput {v['good_ratio']:.2f}x, round by "
            f"round {round_ratios(s, bg, 'goodput')} ({pf(v['good_pass'])})")
    if v["overload_pass"] is not None:
        line += f", goodput >= {OVERLOAD_FACTOR:g}x at 110%: {pf(v['overload_pass'])}"
    elif v["room"] is not None:
        line += (f", goodput >= {OVERLOAD_FACTOR:g}x at 110%: does not stand (the fleet's capacity is "
                 f"{v['room']:.2f}x the best baseline's goodput: no room for it)")
    j = judge(cell.figures, cell.level)
    if j is not None:
        line += (f". Against the clairvoyant arm: sluice's TTFT p90 {_ratio(j.sluice_p90, j.clairvoyant_p90)} of it "
                 f"(target <= {CLAIRVOYANT_FACTOR:g}x), best baseline arm {j.best_baseline} "
                 f"{_seconds(j.best_baseline_p90)} s: "
                 f"**{'met' if j.met else 'missed'}**")
    if ref is not None and ref.get("prediction"):
        lo, mid, hi = ref["prediction"]
        line += (f". The clairvoyant arm's measured / predicted time from dispatch to the last token: median "
                 f"{mid:.2f}, p10 {lo:.2f}, p90 {hi:.2f}")
    line += "." + noise_note(cell.figures)
    loads = [cell.figures[a].get("loadavg", float("nan")) for a in arms]
    reasons = ", ".join(f"{k} {n}" for k, n in s["reasons"].most_common())
    reuse = (" Baseline (Envoy, EPP) and clairvoyant rows: the `open` cell's (identical requests; only sluice reads "
             "the header)."
             if cell.mix == "deadline" else "")
    refills = [cell.figures[a].get("refill_ms") for a in arms]
    refill = "" if all(r is None for r in refills) else (
        f"\nA freed slot's wait for its next request (`refill_gaps`, wall ms p50 / p90; {', '.join(arms)}): "
        + " · ".join("-" if r is None else f"{r[0]:.1f} / {r[1]:.1f}" for r in refills) + ".")
    return f"""#### {cell.fleet}, {cell.mix}, {cell.level:.0%} ({cell.rate:.2f} req/s wall, {cell.arrival}, {s['n']} requests)

| arm | served-only TTFT p50 / p90 / p99 (s) | every-request TTFT p50 / p90 / p99 (s) | every-request p90 by round (s) | p90 / goodput vs clairvoyant | e2e p50 / p99 (s) | tok/s | goodput req/s (share) | goodput by round | served{' tokens' if _T.real else ''} {' / '.join(names)} | shed | preempt | peak run+wait (slots {' / '.join(map(str, slots))}) |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{line} sluice: parked p50 {s['parked_p50']} ms, p90 {s['parked_p90']} ms; route reasons: {reasons}.{reuse}
Machine load average, the highest after any of its rounds, per arm ({', '.join(arms)}): {' / '.join(f'{x:.1f}' for x in loads)}.{refill}
"""


def _shed_text(s: dict[str, Any]) -> str:
    """A cell's shed count, with how many of those 503s came late and the longest wait for one (``LATE_SHED_S``)."""
    if not s["shed"]:
        return "0"
    return f"{s['shed']} ({s.get('late_shed', 0)} late, max {s.get('shed_wait_max', 0.0):.1f} s)"


def _plot(cells: list[Cell], name: str = "steady") -> str:
    plt = pyplot()
    fleets = sorted({c.fleet for c in cells})
    mixes = [m for m in MIXES if any(c.mix == m for c in cells)]
    fig, axes = plt.subplots(len(fleets), len(mixes), figsize=(4.2 * len(mixes), 3.4 * len(fleets)), squeeze=False)
    for i, fleet in enumerate(fleets):
        for j, mix in enumerate(mixes):
            ax = axes[i][j]
            chosen = sorted((c for c in cells if c.fleet == fleet and c.mix == mix and c.arrival == "constant"),
                            key=lambda c: c.level)
            for arm in (a for a in ARMS if all(a in c.figures for c in chosen)):
                ax.plot([f"{c.level:.0%}" for c in chosen], [c.figures[arm]["goodput"] for c in chosen], marker="o",
                        label=arm, linewidth=2.5 if arm == "sluice" else 1.2)
            ax.set_title(f"{fleet}, {mix} (constant)")
            ax.set_ylabel("goodput (req/s within SLO)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"sluice bench steady: goodput, TTFT SLO {SLO_MS} ms")
    return save_figure(fig, name)


def _loadavg() -> float:
    """The machine's 1-minute load average (2 cores: above ~2.5 something else is competing with the bench)."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def _load_note() -> str:
    try:
        load = open("/proc/loadavg").read().split()[:3]
        return f"load average {' '.join(load)}"
    except OSError:
        return "load average unknown"


def _real_fleet(engines_file: str) -> tuple[str, list[dict[str, Any]], list[int], list[str]]:
    """The ``--engines`` file's llama.cpp servers: sets ``_T`` (speed 1, their model, a slot's context) and returns the
    fleet's name, entries, slots and names."""
    from bench.overhead import _get_json, _local_port, load_engines

    entries = load_engines(engines_file)
    slots, models, contexts = [], set(), []
    for entry in entries:
        if "sim" in entry:
            raise SystemExit(f"{engines_file}: {entry['name']}: steady --engines drives real llama.cpp servers only")
        url = entry["url"].rstrip("/")
        _local_port(url)
        props = _get_json(url + "/props") or {}
        listing = _get_json(url + "/v1/models") or {}
        models.add((entry.get("models") or [m["id"] for m in listing.get("data", [])] or ["?"])[0])
        slots.append(int(entry.get("max_num_seqs") or props.get("total_slots") or 1))
        contexts.append(int((props.get("default_generation_settings") or {}).get("n_ctx") or 2048))
    if len(models) != 1:
        raise SystemExit(f"the engines serve different models {sorted(models)}: the bench needs one")
    _T.real, _T.speed, _T.model, _T.n_ctx = True, 1.0, models.pop(), min(contexts)
    fleet = Path(engines_file).stem
    WINDOWS_S[fleet] = REAL_WINDOW_S
    return fleet, [dict(e) for e in entries], slots, [str(e["name"]) for e in entries]


def cell_arms(sluice: str, baselines: Mapping[str, str], clairvoyant: bool, level: float,
              quick: bool) -> dict[str, str]:
    """The arms a cell runs (name -> base URL; the clairvoyant arm's is unused): sluice, the ``baselines`` and, with
    ``clairvoyant``, the reference; with ``quick``, only ``QUICK_ARMS``, and the reference only at ``TARGET_LEVELS``
    (where a target reads it)."""
    arms = {"sluice": sluice, **baselines}
    if clairvoyant and (not quick or any(math.isclose(level, t) for t in TARGET_LEVELS)):
        arms[REFERENCE] = ""
    return {a: base for a, base in arms.items() if not quick or a in QUICK_ARMS}


def run_steady_bench(quick: bool = False, fleets: list[str] | None = None, mixes: list[str] | None = None,
                     levels: list[float] | None = None, engines_file: str | None = None,
                     admission: dict[str, Any] | None = None, report_name: str | None = None,
                     rounds: int = ROUNDS) -> int:
    """Run the chosen cells, ``rounds`` rounds each, print the headline and write the report (``report_name``, or a
    name from the cells run); 0 when every target is met, else 1."""
    _T.quick = quick
    fleets = fleets or (["thor+spark"] if quick else list(FLEETS))
    mixes = mixes or (["open"] if quick else list(MIXES))
    levels = levels or list(LEVELS)
    started, load_before = time.monotonic(), _load_note()
    cells: list[Cell] = []
    sections: list[str] = []
    configs: list[str] = []
    epp_lines: list[str] = []
    calibration_lines: list[str] = []
    plan: list[tuple[str, list[dict[str, Any]], list[int], list[str]]] = []
    if engines_file is not None:
        plan.append(_real_fleet(engines_file))
    else:
        for fleet in fleets:
            plan.append((fleet, [{"name": n, "sim": p, "speed": SPEED, "sim_model": MODEL} for n, p in FLEETS[fleet]],
                         [PROFILES[p].max_num_seqs for _, p in FLEETS[fleet]], [n for n, _ in FLEETS[fleet]]))
    slots_of = {fleet: slots for fleet, _, slots, _ in plan}
    for fleet, engines, slots, names in plan:
        settings: dict[str, Any] = {"admission": admission} if admission else {}
        with gateway(engines, **settings) as config:
            urls = [e["url"].rstrip("/") for e in config["engines"]]
            known = None if _T.real else [EngineRates.of(n, PROFILES[p]) for n, p in FLEETS[fleet]]
            ports = [int(u.rsplit(":", 1)[1]) for u in urls]
            shapes = {"open": "open", "deadline": "open", "capped": "capped"}
            measured: dict[str, list[float]] = {}
            for shape in sorted({shapes[m] for m in mixes}):
                _wait_idle(urls)
                measured[shape] = asyncio.run(_calibrate(urls, slots, shape))
                tok = measured[shape]
                profiles = ([f"{n} slots" for n in slots] if _T.real else
                            [f"{PROFILES[p].decode_aggregate_tokens_per_s[-1]:.1f} profile" for _, p in FLEETS[fleet]])
                calibration_lines.append(
                    f"- {fleet}, {shape} bodies (mean output {mean_output(shape):.0f} tokens): "
                    + ", ".join(f"{n} {t:.1f} tok/s ({p})" for n, p, t in zip(names, profiles, tok))
                    + f"; fleet {sum(tok) / mean_output(shape) * _T.speed:.2f} req/s wall")
                print(calibration_lines[-1], flush=True)
            for mix in mixes:
                shape = shapes[mix]
                capacity = sum(measured[shape]) / mean_output(mix) * _T.speed
                weights = [max(1, round(t)) for t in measured[shape]]
                with plain_envoy_arm(ports, "ROUND_ROBIN") as rr, plain_envoy_arm(ports, "LEAST_REQUEST") as lr, \
                        plain_envoy_arm(ports, "ROUND_ROBIN", weights, slots, concurrency=1) as rrw, \
                        plain_envoy_arm(ports, "LEAST_REQUEST", weights, slots, concurrency=1) as lrw, \
                        contextlib.ExitStack() as tuned:
                    plain: dict[str, PlainEnvoy] = {"RR": rr, "LR": lr, "RR+w+cap": rrw, "LR+w+cap": lrw}
                    for lr_arm in LEAST_REQUEST_ARMS:
                        plain[lr_arm.name] = tuned.enter_context(least_request_arm(ports, lr_arm, weights, slots))
                    baselines = {a: e.base for a, e in plain.items()}
                    epp: EppArm | None = None
                    if not _T.real:  # the EPP scores vLLM's gauges; llama.cpp has none of them
                        epp = tuned.enter_context(epp_arm(dict(zip(names, urls)), seed=SEED))
                        baselines[EPP] = epp.base
                    if mix != "deadline":
                        for arm, envoy in plain.items():
                            if arm not in cell_arms("", baselines, False, 1.0, quick):
                                continue
                            configs.append(f"#### {fleet}, {mix} bodies: `{arm}` (`envoy --concurrency "
                                           f"{envoy.concurrency}`)\n\n```yaml\n{_arm_part(envoy.bootstrap)}```\n")
                    for level in levels:
                        for arrival in ("constant", "poisson") if (fleet, level) == POISSON else ("constant",):
                            cell = Cell(fleet, mix, level, arrival, level * capacity)
                            seed = SEED + int(level * 100) + (1000 if arrival == "poisson" else 0)
                            jobs = [draw_jobs(cell.rate, window_s(fleet, level), arrival, seed + ROUND_SEED_STRIDE * r)
                                    for r in range(rounds)]
                            twin = None
                            if mix == "deadline":
                                twin = next((c for c in cells if c.fleet == fleet and c.mix == "open"
                                             and c.level == level and c.arrival == arrival), None)
                            if twin is not None:
                                cell.figures.update({a: twin.figures[a] for a in (*BASELINES, REFERENCE)
                                                     if a in twin.figures})
                            arms = cell_arms(config["base_url"], baselines if twin is None else {},
                                             known is not None and twin is None, level, quick)
                            counters_before = {a: plain[a].counters() for a in CAPPED}
                            run_cell(cell, jobs, arms, urls, known)
                            for a in CAPPED:
                                if a in arms:
                                    after = plain[a].counters()
                                    for k in ("upstream_rq_pending_total", "upstream_rq_pending_overflow",
                                              "upstream_cx_overflow"):
                                        cell.figures[a][k] = after.get(k, 0) - counters_before[a].get(k, 0)
                            cells.append(cell)
                            sections.append(_fmt_table(cell, slots, names))
                    if epp is not None:
                        epp_lines.append(_epp_line(fleet, mix, epp))
    elapsed = time.monotonic() - started
    verdicts = [(c, verdict(c)) for c in cells]
    summary = []
    misses = []
    for c, v in verdicts:
        s = c.figures["sluice"]
        b90, bg = c.figures[v["best_p90_arm"]], c.figures[v["best_good_arm"]]
        ok = v["p90_pass"] and v["good_pass"] and v["overload_pass"] is not False
        peak_load = max(c.figures[a].get("loadavg", 0.0) for a in ARMS if a in c.figures)
        summary.append(f"| {c.fleet} | {c.mix} | {c.level:.0%} | {c.arrival} | {s['ttft_p90']:.2f} / "
                       f"{_seconds(s['ttft_all_p90'])} | {_seconds(b90['ttft_all_p90'])} ({v['best_p90_arm']}) | "
                       f"{round_ratios(s, b90, 'ttft_all_p90')} | {s['goodput']:.2f} | {bg['goodput']:.2f} "
                       f"({v['best_good_arm']}) | {v['good_ratio']:.2f}x ({round_ratios(s, bg, 'goodput')}) | "
                       f"{s['n'] - s['shed'] - s['errors']} / "
                       f"{_shed_text(s)} | {'PASS' if ok else '**MISS**'} | {peak_load:.1f} |")
        if not ok:
            failed = [k for k, key in (("TTFT p90", "p90_pass"), ("goodput", "good_pass"), ("1.3x", "overload_pass"))
                      if v[key] is False]
            misses.append(f"{c.fleet}/{c.mix}/{c.level:.0%}/{c.arrival} ({', '.join(failed)})")
    judged = [(c, j) for c in cells if (j := judge(c.figures, c.level)) is not None]
    limit_rows, limit_misses, not_bounds = [], [], []
    for c, j in judged:
        where = f"{c.fleet}/{c.mix}/{c.level:.0%}/{c.arrival}"
        ref = c.figures[REFERENCE]
        limit_rows.append(
            f"| {c.fleet} | {c.mix} | {c.level:.0%} | {c.arrival} | {_seconds(j.sluice_p90)} | "
            f"{_seconds(j.clairvoyant_p90)} | {_ratio(j.sluice_p90, j.clairvoyant_p90)} "
            f"({round_ratios(c.figures['sluice'], ref, 'ttft_all_p90')}) | {j.best_baseline} "
            f"{_seconds(j.best_baseline_p90)} ({_ratio(j.best_baseline_p90, j.clairvoyant_p90)}) | "
            f"{c.figures['sluice']['goodput']:.2f} / {ref['goodput']:.2f} | "
            f"{'met' if j.within_reference else '**missed**'} | {'met' if j.at_most_best_baseline else '**missed**'} | "
            f"{'met' if j.met else '**missed**'} |")
        if not j.met:
            limit_misses.append(where)
        if j.beat_reference:
            not_bounds.append(f"{where}: {', '.join(j.beat_reference)} "
                              f"({', '.join(_seconds(c.figures[a]['ttft_all_p90']) for a in j.beat_reference)} s "
                              f"against {_seconds(j.clairvoyant_p90)} s; requests served per engine, clairvoyant "
                              f"{' / '.join(map(str, ref['served']))}, sluice "
                              f"{' / '.join(map(str, c.figures['sluice']['served']))})")
    verdict_lines = [f"{c.fleet}/{c.mix}/{c.level:.0%}/{c.arrival}: {'met' if j.met else 'missed'} (sluice TTFT p90 "
                     f"{_seconds(j.sluice_p90)} s = {_ratio(j.sluice_p90, j.clairvoyant_p90)} the clairvoyant arm's "
                     f"{_seconds(j.clairvoyant_p90)} s; best baseline arm {j.best_baseline} "
                     f"{_seconds(j.best_baseline_p90)} s; round by round, sluice / clairvoyant "
                     f"{round_ratios(c.figures['sluice'], c.figures[REFERENCE], 'ttft_all_p90')} and sluice / "
                     f"{j.best_baseline} {round_ratios(c.figures['sluice'], c.figures[j.best_baseline], 'ttft_all_p90')})."
                     + noise_note(c.figures) for c, j in judged]
    cap_lines, over_cap = [], []
    for c in cells:
        slots = slots_of[c.fleet]
        for a in CAPPED:
            f = c.figures.get(a, {})
            if "upstream_rq_pending_total" in f and c.mix != "deadline":
                where = f"{c.fleet}/{c.mix}/{c.level:.0%}/{c.arrival} {a}"
                cap_lines.append(f"{where}: peak run+wait {'/'.join(map(str, f['peaks']))}; held back by the "
                                 f"per-host cap {f['upstream_cx_overflow']} times; through the pending queue "
                                 f"{f['upstream_rq_pending_total']}; rejected {f['upstream_rq_pending_overflow']}")
                if any(p > s for p, s in zip(f["peaks"], slots)) or f["upstream_rq_pending_overflow"]:
                    over_cap.append(where)
        if REFERENCE in c.figures and c.mix != "deadline":
            f = c.figures[REFERENCE]
            where = f"{c.fleet}/{c.mix}/{c.level:.0%}/{c.arrival} {REFERENCE}"
            cap_lines.append(f"{where}: peak run+wait {'/'.join(map(str, f['peaks']))}; preemptions {f['preemptions']}")
            if any(p > s for p, s in zip(f["peaks"], slots)) or f["preemptions"]:
                over_cap.append(where)
    # A partial run must not overwrite the full matrix's report, nor a chosen cell (--fleet, --mix, --level,
    # --admission) the quick run's.
    full = (fleets, mixes, levels) == (list(FLEETS), list(MIXES), list(LEVELS)) and not admission
    quick_only = quick and (fleets, mixes, levels) == (["thor+spark"], ["open"], list(LEVELS)) and not admission
    report = report_name or (REAL_REPORT if _T.real else
                             "steady" if full else "steady-quick" if quick_only else "steady-partial")
    plot = _plot(cells, report)
    doc = (__doc__ or "").replace("{SPEED}", f"{_T.speed:g}")
    windows = {f: WINDOWS_S[f] for f in slots_of}
    engines_note = ""
    if engines_file is not None:
        engines_note = (f"Against the real engines of `{engines_file}` (model `{_T.model}`, slots "
                        f"{' / '.join(map(str, slots_of[plan[0][0]]))}, {_T.n_ctx} tokens of context a slot):\n\n"
                        f"```yaml\n{Path(engines_file).read_text().rstrip()}\n```\n\n")
    body = f"""{doc}
{engines_note}Run: {'real engines, speed x1' if _T.real else f'simulator speed x{SPEED:g}'}; {_rounds_note(rounds, windows)}
TTFT SLO {SLO_MS} ms wall ({SLO_MS * _T.speed / 1000:g} s emulated); calibration {CAL_S:g} s per fleet and body shape
({CAL_WARM_S:g} s warm-up); Poisson arrivals besides constant ones on {POISSON[0]} at {POISSON[1]:.0%} only. sluice: `sluice up` defaults, no setting
changed{'' if not admission else ' except admission ' + ', '.join(f'`{k}: {v}`' for k, v in admission.items())}. Machine {_load_note()} at the end, {load_before} at the start; {elapsed / 60:.1f} min.

## Measured capacity

{chr(10).join(calibration_lines)}

{_simulator_note(plan) if not _T.real else ''}
## The limit: every cell at {' and '.join(f'{t:.0%}' for t in TARGET_LEVELS)} against the clairvoyant arm

Target (issue 38 item 6, judged on this run's figures): sluice's TTFT p90 at most {CLAIRVOYANT_FACTOR:g}x the
clairvoyant arm's, and at most the best baseline arm's (the lowest p90 among {', '.join(f'`{a}`' for a in BASELINES if any(a in c.figures for c in cells))}). TTFT p90 here
counts every request, a refused (429/503) or failed one as infinite; the cells below show the served-only figures beside
it. Goodput: requests served with TTFT within the SLO, per wall second of the arrival window.

| fleet | mix | load | arrival | sluice TTFT p90 (s) | clairvoyant p90 (s) | sluice / clairvoyant (round by round) | best baseline arm p90 (s, / clairvoyant) | goodput sluice / clairvoyant | within {CLAIRVOYANT_FACTOR:g}x | <= best baseline | verdict |
|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(limit_rows) or '| (no cell at these levels in this run) |'}

{chr(10).join('- ' + ln for ln in verdict_lines)}

{len(judged) - len(limit_misses)} of {len(judged)} cells meet the target.{_missed(limit_misses)}
{_bound_note(not_bounds)}
## Headline (every cell against the best baseline arm of that cell, measured in the same run)

| fleet | mix | load | arrival | sluice TTFT p90 served / every request (s) | best baseline p90, every request (arm) | sluice / best p90, round by round | sluice goodput | best baseline goodput (arm) | goodput ratio (round by round) | sluice served / shed | targets | max load avg |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(summary)}

{len(cells) - len(misses)} of {len(cells)} cells meet every target.{' Missed: ' + '; '.join(misses) + '.' if misses else ''}

![steady]({plot})

## Cells

{chr(10).join(sections)}
## The capped Envoy arms stayed within max_num_seqs

Peak running + waiting per engine (sampled every 100 ms) and Envoy's own counters: `upstream_cx_overflow` (a request found
its host at the connection cap and stayed pending), `upstream_rq_pending_total` (requests that went through the pending
queue at all, including a wait for a new connection) and `upstream_rq_pending_overflow` (rejections):

{chr(10).join('- ' + ln for ln in cap_lines)}

{'Over a cap or rejected: ' + '; '.join(over_cap) if over_cap else 'No engine exceeded its max_num_seqs under a capped arm, and Envoy rejected nothing.'}

## Every baseline's Envoy configuration

Each plain Envoy runs `envoy/bench-plain.yaml` (listener, route with `timeout: 0s`, router) with these clusters, exactly as
rendered (ports are this run's):

{chr(10).join(configs)}
{_epp_section(epp_lines)}"""
    title = "sluice bench steady: sluice vs the best baseline arm (plain Envoy, EPP) at measured capacity"
    path = write_report(report, title + (f" ({Path(engines_file).stem}, real engines)" if engines_file else ""), body)
    print(body[body.index("## Measured capacity"):body.index("## Cells")])
    print(f"report: {path}")
    return 0 if not misses and not limit_misses else 1


def _rounds_note(rounds: int, windows: Mapping[str, float]) -> str:
    """The report's words for the rounds, the windows and what ``--quick`` left out."""
    if _T.quick:
        per = f"{QUICK_WINDOWS_S[0]:g} s of arrivals per round in every cell up to 100%, {QUICK_WINDOWS_S[1]:g} s above"
        left = [a for a in ARMS if a not in QUICK_ARMS]
        only = (f" `--quick`: arms {', '.join(f'`{a}`' for a in QUICK_ARMS)} only (the clairvoyant arm at "
                f"{' and '.join(f'{t:.0%}' for t in TARGET_LEVELS)} only, where its target is); "
                f"{', '.join(f'`{a}`' for a in left)} are left out to fit about ten minutes (some of them were a "
                "cell's best baseline in a full run: the full run keeps every arm, and a quick verdict is against "
                "the arms it ran); windows that make the cell above 100% a transient rather than a sustained "
                "overload.")
    else:
        per = (f"arrivals for {', '.join(f'{w:g} s ({f})' for f, w in windows.items())} per round of a cell, "
               f"{OVERLOAD_WINDOW_S:g} s in every cell above 100%")
        only = ""
    return (f"{rounds} round{'s' if rounds != 1 else ''} per cell, the arms' order rotated each round, each round on "
            f"its own seeded arrivals (the same for every arm of the round); {per}; figures pool the rounds' requests, "
            f"each round's figure beside them.{only}")


def _missed(where: list[str]) -> str:
    return " Missed: " + "; ".join(where) + "." if where else ""


def _bound_note(not_bounds: list[str]) -> str:
    """What the report says where some arm's TTFT p90 came in under the clairvoyant arm's."""
    if not not_bounds:
        return ("\nNo arm's TTFT p90 came in under the clairvoyant arm's in these cells: there it held as the lower "
                "reference.\n")
    return ("\nThe clairvoyant arm is no lower bound where another arm's TTFT p90 is lower: it minimises each "
            "request's "
            "finish time when it is routed, given what runs then, and knows nothing of the requests after it: a "
            "request that finishes sooner by waiting for a fast engine's slot waits for it (a later first token), "
            "which can load the fast engine past its share of the capacity while the slow one idles, and it never "
            "reorders the queue by length. An arm that starts each request on a free slot can then have the lower "
            "TTFT. The target is kept as issue 38 states it, and these cells say so: "
            + "; ".join(not_bounds) + ".\n")


def _simulator_note(plan: list[tuple[str, list[dict[str, Any]], list[int], list[str]]]) -> str:
    """The simulator settings the engines ran with (their profiles' fields: ``sluice up`` starts each simulator with
    ``--profile`` and no override) and the output-length model per mix."""
    lines = ["## Simulator settings and output lengths", ""]
    for fleet, _, _, _ in plan:
        for profile in sorted({p for _, p in FLEETS[fleet]}):
            pr = PROFILES[profile]
            interference = "chunked prefill: decode slows while a prompt is prefilled"
            lines.append(f"- {fleet}, `{profile}`: {pr.max_num_seqs} slots, KV {pr.kv_capacity_tokens} tokens, prefill "
                         f"{pr.prefill_tokens_per_s:g} tok/s, decode aggregate {pr.decode_aggregate_tokens_per_s} "
                         f"tok/s, chars_per_token {pr.chars_per_token:g}, template_tokens_per_message "
                         f"{pr.template_tokens_per_message}, prefill_chunk_tokens {pr.prefill_chunk_tokens} "
                         f"({interference if pr.prefill_chunk_tokens else 'no prefill/decode interference'}), "
                         f"decode_slowdown_per_1k_tokens {pr.decode_slowdown_per_1k_tokens:g}, output model "
                         f"`{pr.output_model}`.")
    lines += ["", "Output-length model per mix: every mix sends each request's natural length (the `cortex` lognormal, "
              "drawn by the bench, seeded) as `sim_output_tokens`; the engine ends the stream there (`finish_reason: "
              "stop`). `open` and `deadline`: that length, uncapped (the engine's limit, max_model_len - prompt, is "
              f"never reached); `capped`: that length cut at `max_tokens` {CAPPED_MAX_TOKENS}. The clairvoyant arm "
              "computes the same length (and the prompt's tokens as the simulator counts them, from the profile's "
              "chars_per_token and template tokens) before it routes; no other arm sees it.", ""]
    return "\n".join(lines)


def _epp_line(fleet: str, mix: str, epp: EppArm) -> str:
    """What the EPP-like arm did over a fleet's cells of one mix: requests per engine and its measured scrape period."""
    stats = epp.stats()
    period = stats["period_ms"]
    routed = ", ".join(f"{e} {n}" for e, n in sorted(stats["routed"].items()))
    return (f"- {fleet}, {mix}: requests routed {routed or 'none'}; scrape period p50 {period['p50']:.0f} ms, p90 "
            f"{period['p90']:.0f} ms, max {period['max']:.0f} ms over {stats['scrapes']} scrapes")


def _epp_section(lines: list[str]) -> str:
    if not lines:
        return ""
    return f"""
## The EPP-like arm

{describe()}. At simulator speed x{_T.speed:g} a {SCRAPE_INTERVAL_S * 1000:g} ms wall scrape period is \
{SCRAPE_INTERVAL_S * 1000 * _T.speed:g} ms of emulated time.

{chr(10).join(lines)}
"""


def _arm_part(bootstrap: str) -> str:
    """The lines of a plain-Envoy bootstrap that differ between arms (the rest is envoy/bench-plain.yaml, printed once):
    the cluster from ``lb_policy`` to the end."""
    return bootstrap[bootstrap.index("    - name: engine"):]

