"""``sluice bench fairness``: two and then eight tenants on one model, one flooding inside its rate limits; FIFO against
fair share, and fair share with a reserved share.

World: ``sluice up`` (Envoy, the Check, the access log) in front of ``ENGINES`` simulated ``spark`` engines at speed
x``SPEED`` (2 slots each), tenants ``a``, ``b`` and ``l1``..``l6`` configured with keys and rate limits well above
what they send (``LIMIT_HEADROOM`` x: the limiter refuses nothing, so what is measured is the parking lot's order).
Every request is the same shape: a ``PROMPT_TOKENS``-token prompt with a random head (no shared prefix) and exactly
``OUTPUT_TOKENS`` output tokens (``ignore_eos``), streamed, no ``x-sluice-*`` header (every tenant's default class,
standard).

Capacity: a calibration through the gateway (one tenant, closed loop at ``CAL_CONCURRENCY_PER_SLOT`` x the slots, for
``CAL_S`` s after ``WARMUP_S`` s) in completed requests per second. Load, as the issue asks, relative to it:
- ``b`` steady at 30% of capacity (Poisson arrivals);
- two tenants: ``a`` flooding at 5x its usual share: its usual is taken as 18% of capacity (the two together at 48% on
  a normal day), so the flood is 90%, and the offered load 120% (the top of the issue's 80-120% range);
- two tenants at 80% (the bottom of the range): ``a`` flooding at 5x a usual 10% (50%), ``b`` as before;
- eight tenants: ``b`` as before, six light tenants ``l1``..``l6`` steady at 4% each, and ``a`` flooding at 5x a usual
  13% (65%): 119% offered.

Arms, each a fresh ``sluice up`` on the same engines' settings, in rotated order each round (``rotated_rounds``), the
same arrival times in every arm of a round and workload (seeded per round):
- ``b alone``: ``b``'s arrivals only (its reference TTFT);
- ``fifo``: both tenants, ``fairness.enabled: false`` (the parking lot as before fair share: FIFO per class);
- ``fair``: both tenants, ``fairness.enabled: true`` (the default with tenants configured);
- ``fair, paper's lift``: as ``fair`` with ``fairness.lift_credit_requests: 0``: a tenant back from idle is lifted
  exactly to the backlogged minimum, as the VTC paper lifts (the default leaves it sixteen of its requests below:
  decision 0031);
- ``fair reserved``: as ``fair``, ``b`` with ``reserved_share: 0.5`` (2 of the 4 slots held for it while it has work
  waiting, core/reserve.py);
- ``a last``: as ``fair``, every tenant's requests but ``a``'s critical (its tenant's default class), ``a``'s standard:
  every slot that frees goes to ``b`` while it has a request waiting. No order of the line starts ``b`` sooner without
  ending ``a``'s work: the reference ``b``'s TTFT is judged against (below);
- ``fair 2 replicas``: as ``fair``, ``sluice up --replicas 2 --store valkey`` (Envoy spreads the Checks over two
  control planes on one Valkey): the counters and the fair pick are the store's (``fairness.across_replicas``, the
  default; decision 0025), so the two replicas should serve as one does;
- ``per-replica fair``: as ``fair 2 replicas`` with ``fairness.across_replicas: false``: each replica is fair among the
  requests it holds, with counters of its own (the issue's per-replica fair queue, as the anchors run it);
- ``80% fifo``, ``80% fair``, ``80% a last``: the two tenants at 80% offered, FIFO, fair share, ``a`` last;
- ``8 no flood``: the eight tenants' arrivals without ``a``'s (the reference TTFT of ``b`` and the light tenants);
- ``8 fifo``, ``8 fair``: the eight tenants, FIFO or fair share; ``8 a last``: as ``8 fair`` with every tenant but
  ``a`` critical (``b`` and the light tenants share the critical class first come, first served, as without the flood).
Each window sends ``WARMUP_S`` s of traffic that is not measured (the control plane learns the engines' rates and the
answers' lengths), then ``WINDOW_S`` s that are.

Figures per arm, over the rounds together: each tenant's requests, completed, shed (429/503); ``b``'s TTFT p50/p90/p99
over every request (a shed one counts as infinite: what ``b``'s clients see) and over completed ones; throughput =
completion tokens of the measured requests per second from the window's start to its last completion; Jain's index.

Jain's index (over served tokens per weight, equal weights here): ``(sum x)^2 / (n sum x^2)`` with ``x_i`` = tenant
``i``'s served tokens over its max-min fair allocation (water-filling the arm's measured throughput among the
tenants' offered token rates): a tenant asking less than its share is owed its demand, not the share (the issue's
"among backlogged tenants": ``b`` at 30% is not backlogged under fair share, so its allocation is its demand).

Targets (the issue's), for two tenants (fair, and fair with b's reserved share; fair at 80%) and for eight (fair):
- ``b``'s TTFT p90 (every request) with ``a`` flooding <= 1.25x ``a last``'s (the same flood, every other tenant ahead
  of ``a`` in every wake). The issue asks for 1.25x ``b`` without the flood; that reference is out of reach of any
  gateway that lets ``a`` take what ``b`` leaves (the throughput target below) and ends nothing running: with ``a``
  holding every slot, a request of ``b`` waits for one to free, which ``b`` alone never does. Revised on 2026-12-05 to
  the least wait any order of the line gives ``b`` under the flood while treating the other tenants as the flood's
  absence does, keeping the ratio; the ratio to ``b`` alone is printed beside. With eight tenants the reference was
  ``b`` alone critical until 2026-12-05 (the report of d05a2db; ``b`` ahead of the light tenants too): more than ``b``
  gets without the flood, where it shares the line with them, and more than any fair order gives one of equal tenants;
- work-conserving: throughput >= 0.95x the FIFO arm's of the same workload;
- Jain's index >= 0.95;
and with 2 replicas the same as with 1: ``fair 2 replicas``' b TTFT p90 <= 1.25x ``fair``'s, its throughput >= 0.95x
``fair``'s, its Jain's index >= 0.95. The FIFO arms' and the per-replica arm's figures are printed beside them.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common import Target, exit_code, pct, rotated_rounds, verdicts, write_report
from bench.workload import Result, gateway, stream_chat, unique_prompt
from controlplane.core.fairshare import FairShare

SPEED = 5.0
ENGINES = 2
PROFILE = "spark"
MODEL = "cortex"
PROMPT_TOKENS = 200
OUTPUT_TOKENS = 48
B_SHARE = 0.30
A_USUAL_SHARE = 0.18
FLOOD = 5.0
WARMUP_S = 4.0
WINDOW_S = 20.0
ROUNDS = 3
CAL_S = 8.0
CAL_CONCURRENCY_PER_SLOT = 3
LIMIT_HEADROOM = 4.0
LIGHT = tuple(f"l{i}" for i in range(1, 7))
LIGHT_SHARE = 0.04
A_USUAL_SHARE_8 = 0.13
A_USUAL_SHARE_80 = 0.10
"""``a``'s usual share in the two-tenant workload at 80% offered (``FLOOD`` x it + ``B_SHARE``)."""
RESERVED_B = 0.5
KEYS = {t: f"sk-bench-fair-{t}" for t in ("a", "b", *LIGHT)}


@dataclass(frozen=True)
class Arm:
    name: str
    workload: str
    """``2``, ``80`` (two tenants at 80%) or ``8``: whose arrivals (``rates``)."""
    tenants: tuple[str, ...]
    fair: bool = True
    reserved: float = 0.0
    """``b``'s reserved_share."""
    replicas: int = 1
    across: bool = True
    """``fairness.across_replicas`` (with ``replicas`` > 1): the store's fair line, or each replica's own."""
    a_last: bool = False
    """Every tenant's requests but ``a``'s critical (``a``'s standard)."""
    lift_credit: float | None = None
    """``fairness.lift_credit_requests`` (None: the default)."""


ARMS = (
    Arm("b alone", "2", ("b",)),
    Arm("fifo", "2", ("a", "b"), fair=False),
    Arm("fair", "2", ("a", "b")),
    Arm("fair, paper's lift", "2", ("a", "b"), lift_credit=0.0),
    Arm("fair reserved", "2", ("a", "b"), reserved=RESERVED_B),
    Arm("a last", "2", ("a", "b"), a_last=True),
    Arm("fair 2 replicas", "2", ("a", "b"), replicas=2),
    Arm("per-replica fair", "2", ("a", "b"), replicas=2, across=False),
    Arm("80% fifo", "80", ("a", "b"), fair=False),
    Arm("80% fair", "80", ("a", "b")),
    Arm("80% a last", "80", ("a", "b"), a_last=True),
    Arm("8 no flood", "8", ("b", *LIGHT)),
    Arm("8 fifo", "8", ("a", "b", *LIGHT), fair=False),
    Arm("8 fair", "8", ("a", "b", *LIGHT)),
    Arm("8 a last", "8", ("a", "b", *LIGHT), a_last=True),
)
SEED = 42


def tenants_config(rates: dict[str, float], reserved_b: float = 0.0, a_last: bool = False) -> dict[str, Any]:
    """Every tenant, each with limits ``LIMIT_HEADROOM`` x what it sends (requests, tokens per minute, concurrency);
    ``reserved_b``: ``b``'s reserved share (0: none); ``a_last``: every tenant's requests but ``a``'s critical."""
    from controlplane.core.tenants import key_digest

    out: dict[str, Any] = {}
    for name, key in KEYS.items():
        per_min = max(1.0, rates.get(name, 1.0)) * 60 * LIMIT_HEADROOM
        out[name] = {"keys": [key_digest(key)], "limits": {
            "requests_per_minute": int(per_min), "tokens_per_minute": int(per_min * (PROMPT_TOKENS + OUTPUT_TOKENS + 64)),
            "concurrent_requests": 10_000}}
        if name == "b" and reserved_b:
            out[name]["reserved_share"] = reserved_b
        if name != "a" and a_last:
            out[name]["priority"] = {"default": "critical", "max": "critical"}
    return out


def engines() -> list[dict[str, Any]]:
    return [{"name": f"spark{i}", "sim": PROFILE, "speed": SPEED, "sim_model": MODEL} for i in range(ENGINES)]


def poisson(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, seconds): as many as the rate implies (rounded), uniform and sorted (Poisson conditioned on
    its count, so a short window is not an accidentally lighter load)."""
    return sorted(rng.uniform(0, seconds) for _ in range(round(rate * seconds)))


@dataclass
class Sent:
    tenant: str
    at: float
    """Seconds after the window's start (negative: warm-up, not measured)."""
    result: Result | None = None


@dataclass
class ArmFigures:
    arm: str
    sent: list[Sent] = field(default_factory=list)
    spans: list[float] = field(default_factory=list)
    """Per window: seconds from its measured start to its last completion."""
    tokens: int = 0
    shares: list[str] = field(default_factory=list)
    round_b_p90: list[float] = field(default_factory=list)
    """``b``'s TTFT p90 (every request) in each round's window alone: the spread behind the pooled figure."""

    def measured(self, tenant: str) -> list[Result]:
        return [s.result for s in self.sent if s.tenant == tenant and s.at >= 0 and s.result is not None]

    def throughput(self) -> float:
        return self.tokens / sum(self.spans) if self.spans else float("nan")

    def served_tokens(self, tenant: str) -> int:
        return sum(r.completion_tokens + PROMPT_TOKENS for r in self.measured(tenant) if r.status == 200)


def ttfts(results: Sequence[Result], every: bool) -> list[float]:
    """TTFT ms of completed requests; ``every``: a refused or failed one counts as infinite."""
    out = [r.ttft_s * 1000 for r in results if r.status == 200 and r.ttft_s is not None]
    if every:
        out += [math.inf] * sum(1 for r in results if r.status != 200 or r.ttft_s is None)
    return out


def maxmin(capacity: float, demands: dict[str, float]) -> dict[str, float]:
    """Water-filling: each tenant gets its demand if below an equal split of what is left, else the split."""
    left, alloc, open_ = capacity, {}, sorted(demands, key=demands.__getitem__)
    while open_:
        split = left / len(open_)
        tenant = open_[0]
        if demands[tenant] <= split:
            alloc[tenant] = demands[tenant]
            left -= demands[tenant]
            open_.pop(0)
        else:
            for t in open_:
                alloc[t] = split
            break
    return alloc


def jain(values: Sequence[float]) -> float:
    if not values or not any(values):
        return float("nan")
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def _send(base: str, plan: list[Sent], t0: float) -> None:
    import aiohttp

    async def one(session: aiohttp.ClientSession, sent: Sent) -> None:
        delay = t0 + sent.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            sent.result = await stream_chat(session, base, sent.tenant, MODEL, unique_prompt(PROMPT_TOKENS),
                                            OUTPUT_TOKENS, t0=t0, ignore_eos=True)
        except aiohttp.ClientError:
            sent.result = Result(sent.tenant, 599, time.perf_counter() - t0)

    sessions = {t: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         headers={"authorization": f"Bearer {KEYS[t]}"}) for t in KEYS}
    try:
        await asyncio.gather(*(one(sessions[s.tenant], s) for s in plan))
    finally:
        for session in sessions.values():
            await session.close()


async def _calibrate(base: str, slots: int) -> float:
    """Completed requests per second with every slot busy (closed loop, tenant ``a``, after a warm-up)."""
    import aiohttp

    done: list[float] = []
    stop_at = time.perf_counter() + WARMUP_S + CAL_S
    measure_from = time.perf_counter() + WARMUP_S

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop_at:
            r = await stream_chat(session, base, "a", MODEL, unique_prompt(PROMPT_TOKENS), OUTPUT_TOKENS,
                                  ignore_eos=True)
            if r.status == 200 and time.perf_counter() >= measure_from:
                done.append(time.perf_counter())

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers={"authorization": f"Bearer {KEYS['a']}"}) as session:
        await asyncio.gather(*(worker(session) for _ in range(slots * CAL_CONCURRENCY_PER_SLOT)))
    return len(done) / CAL_S


def _shares(metrics_url: str) -> list[str]:
    """The control plane's fair-share gauges at the end of a window (one line per series)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return [line for line in text.splitlines()
            if re.match(r"sluice_tenant_(fair_counter|served_tokens|waiting_requests)\{", line)]


def run_window(arm: Arm, plan: list[Sent], rates: dict[str, float], figures: ArmFigures) -> None:
    fairness: dict[str, bool | float] = {"enabled": arm.fair}
    if arm.lift_credit is not None:
        fairness["lift_credit_requests"] = arm.lift_credit
    if arm.replicas > 1:
        fairness["across_replicas"] = arm.across
    up_args = () if arm.replicas == 1 else ("--replicas", str(arm.replicas), "--store", "valkey")
    with gateway(engines(), up_args=up_args, tenants=tenants_config(rates, arm.reserved, arm.a_last),
                 fairness=fairness) as config:
        base = config["base_url"]
        t0 = time.perf_counter() + WARMUP_S + 0.5
        asyncio.run(_send(base, plan, t0))
        measured = [s.result for s in plan if s.at >= 0 and s.result is not None and s.result.status == 200]
        if measured:
            figures.spans.append(max(r.started + r.total_s for r in measured))
            figures.tokens += sum(r.completion_tokens for r in measured)
        figures.sent.extend(plan)
        metrics_url = f"http://127.0.0.1:{config['controlplane']['metrics_port']}/metrics"
        figures.shares = _shares(metrics_url)


def run_fairness_bench() -> int:
    started = time.monotonic()
    slots = ENGINES * 2
    with gateway(engines(), tenants=tenants_config({"a": 100.0})) as config:
        capacity = asyncio.run(_calibrate(config["base_url"], slots))
    print(f"capacity: {capacity:.2f} requests/s ({slots} slots, {PROMPT_TOKENS} + {OUTPUT_TOKENS} tokens each)",
          flush=True)
    workloads = {
        "2": {"a": FLOOD * A_USUAL_SHARE * capacity, "b": B_SHARE * capacity},
        "80": {"a": FLOOD * A_USUAL_SHARE_80 * capacity, "b": B_SHARE * capacity},
        "8": {"a": FLOOD * A_USUAL_SHARE_8 * capacity, "b": B_SHARE * capacity,
              **{t: LIGHT_SHARE * capacity for t in LIGHT}},
    }
    figures = {arm.name: ArmFigures(arm.name) for arm in ARMS}
    for round_, order in enumerate(rotated_rounds(ARMS, ROUNDS)):
        arrivals = {}
        for name, rates in workloads.items():
            rng = random.Random(f"{SEED}-{round_}-{name}")
            arrivals[name] = {t: poisson(rate, WARMUP_S + WINDOW_S, rng) for t, rate in sorted(rates.items())}
        for arm in order:
            plan = sorted((Sent(t, at - WARMUP_S) for t in arm.tenants for at in arrivals[arm.workload][t]),
                          key=lambda s: s.at)
            run_window(arm, plan, workloads[arm.workload], figures[arm.name])
            figures[arm.name].round_b_p90.append(pct(ttfts(
                [s.result for s in plan if s.tenant == "b" and s.at >= 0 and s.result is not None], True), 90))
            b = figures[arm.name].measured("b")
            print(f"round {round_ + 1}, {arm.name}: b TTFT p90 {pct(ttfts(b, True), 90):.0f} ms over {len(b)}",
                  flush=True)

    rows = ["| arm | tenant | sent | completed | shed | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | served-only p90 ms | "
            "parked p50 / p90 ms | served tokens/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        f = figures[arm.name]
        span = sum(f.spans) or float("nan")
        for tenant in arm.tenants:
            results = f.measured(tenant)
            if not results:
                continue
            every = ttfts(results, True)
            served = ttfts(results, False)
            shed = sum(1 for r in results if r.status in (429, 503))
            parked = [float(r.parked_ms) for r in results if r.status == 200]
            rows.append(f"| {arm.name} | {tenant} | {len(results)} | {sum(r.status == 200 for r in results)} | {shed} | "
                        f"{pct(every, 50):.0f} | {pct(every, 90):.0f} | {pct(every, 99):.0f} | "
                        f"{pct(served, 90) if served else float('nan'):.0f} | "
                        f"{pct(parked, 50) if parked else float('nan'):.0f} / "
                        f"{pct(parked, 90) if parked else float('nan'):.0f} | {f.served_tokens(tenant) / span:.0f} |")
    jains: dict[str, float] = {}
    for arm in ARMS:
        if "a" not in arm.tenants:
            continue
        rates = workloads[arm.workload]
        demand = {t: rates[t] * (PROMPT_TOKENS + OUTPUT_TOKENS) for t in rates}
        f = figures[arm.name]
        span = sum(f.spans)
        rate = {t: f.served_tokens(t) / span for t in rates}
        alloc = maxmin(sum(rate.values()), demand)
        jains[arm.name] = jain([rate[t] / alloc[t] for t in rates])

    def b_p90(arm: str) -> float:
        return pct(ttfts(figures[arm].measured("b"), True), 90)

    def light_p90(arm: str) -> float:
        return pct([x for t in LIGHT for x in ttfts(figures[arm].measured(t), True)], 90)

    alone, alone8 = b_p90("b alone"), b_p90("8 no flood")
    fair_b, fifo_b, reserved_b = b_p90("fair"), b_p90("fifo"), b_p90("fair reserved")
    paper = "fair, paper's lift"
    paper_b, paper_jain = b_p90(paper), jains[paper]
    paper_throughput = figures[paper].throughput() / figures["fifo"].throughput()
    fair8_b, fifo8_b = b_p90("8 fair"), b_p90("8 fifo")
    a_last_b, a_last8_b = b_p90("a last"), b_p90("8 a last")
    replicas_b, per_replica_b = b_p90("fair 2 replicas"), b_p90("per-replica fair")
    targets = [
        Target("2 tenants: b's TTFT p90 with a flooding, fair, over a last's", fair_b / a_last_b, 1.25,
               at_least=False, unit="x"),
        Target("2 tenants: throughput, fair over FIFO (work-conserving)", figures["fair"].throughput()
               / figures["fifo"].throughput(), 0.95, unit="x"),
        Target("2 tenants: Jain's index over served tokens per weight (max-min normalised), fair", jains["fair"], 0.95),
        Target(f"2 tenants, b reserved {RESERVED_B:g}: b's TTFT p90 with a flooding over a last's",
               reserved_b / a_last_b, 1.25, at_least=False, unit="x"),
        Target(f"2 tenants, b reserved {RESERVED_B:g}: throughput over FIFO (work-conserving)",
               figures["fair reserved"].throughput() / figures["fifo"].throughput(), 0.95, unit="x"),
        Target("2 tenants at 80%: b's TTFT p90 with a flooding, fair, over a last's",
               b_p90("80% fair") / b_p90("80% a last"), 1.25, at_least=False, unit="x"),
        Target("2 tenants at 80%: throughput, fair over FIFO (work-conserving)", figures["80% fair"].throughput()
               / figures["80% fifo"].throughput(), 0.95, unit="x"),
        Target("2 tenants at 80%: Jain's index over served tokens per weight (max-min normalised), fair",
               jains["80% fair"], 0.95),
        Target("8 tenants: b's TTFT p90 with a flooding, fair, over a last's", fair8_b / a_last8_b, 1.25,
               at_least=False, unit="x"),
        Target("8 tenants: throughput, fair over FIFO (work-conserving)", figures["8 fair"].throughput()
               / figures["8 fifo"].throughput(), 0.95, unit="x"),
        Target("8 tenants: Jain's index over served tokens per weight (max-min normalised), fair", jains["8 fair"], 0.95),
        Target("2 replicas (the store's fair line): b's TTFT p90 with a flooding over 1 replica's", replicas_b / fair_b,
               1.25, at_least=False, unit="x"),
        Target("2 replicas (the store's fair line): throughput over 1 replica's", figures["fair 2 replicas"].throughput()
               / figures["fair"].throughput(), 0.95, unit="x"),
        Target("2 replicas (the store's fair line): Jain's index", jains["fair 2 replicas"], 0.95),
    ]

    def round_ratios(arm: str, reference: str) -> str:
        ratios = [x / y for x, y in zip(figures[arm].round_b_p90, figures[reference].round_b_p90)]
        return f"{arm} / {reference} " + ", ".join(f"{r:.2f}x" for r in ratios)

    spread = "; ".join(round_ratios(arm, reference) for arm, reference in (
        ("fair", "a last"), ("fair reserved", "a last"), ("80% fair", "80% a last"), ("8 fair", "8 a last"),
        ("fair 2 replicas", "fair")))
    minutes = (time.monotonic() - started) / 60
    body = "\n".join([
        __doc__.split("\n\n", 1)[1].strip() if __doc__ else "",
        "",
        "## Setup",
        "",
        f"- fleet: {ENGINES} x `{PROFILE}` simulator (2 slots each) at speed x{SPEED:g}; capacity measured "
        f"{capacity:.2f} requests/s",
        f"- offered, 2 tenants: b {workloads['2']['b']:.2f} requests/s ({B_SHARE:.0%}), a {workloads['2']['a']:.2f} "
        f"requests/s ({FLOOD:g} x {A_USUAL_SHARE:.0%}); 8 tenants: b as before, l1..l6 "
        f"{workloads['8']['l1']:.2f} requests/s each ({LIGHT_SHARE:.0%}), a {workloads['8']['a']:.2f} requests/s "
        f"({FLOOD:g} x {A_USUAL_SHARE_8:.0%}); 2 tenants at 80%: b as before, a {workloads['80']['a']:.2f} "
        f"requests/s ({FLOOD:g} x {A_USUAL_SHARE_80:.0%}); windows {WARMUP_S:g} s warm-up + {WINDOW_S:g} s measured, {ROUNDS} "
        f"rounds, arms rotated",
        "- sluice: defaults (`admission` untouched), tenants with limits "
        f"{LIMIT_HEADROOM:g}x their rates; `fairness.enabled` false (fifo) or true (fair); `fair reserved`: "
        f"`tenants.b.reserved_share: {RESERVED_B:g}`; `a last`: every tenant but a with `priority: {{default: critical, max: critical}}`; 2 replicas: `--replicas 2 --store valkey`, "
        f"`fairness.across_replicas` true (`fair 2 replicas`) or false (`per-replica fair`)",
        f"- run time: {minutes:.1f} min",
        "",
        "## Targets",
        "",
        verdicts(targets),
        "",
        f"The TTFT ratios by round (each round's window alone, the pooled ratio above is over every round's requests; "
        f"b sends about {len(figures['fair'].measured('b')) // ROUNDS} requests a window, so one window's p90 rests on "
        f"its top tenth): {spread}.",
        "",
        f"Beside them: the lift as the paper has it (no credit): b's TTFT p90 {paper_b:.0f} ms, {paper_b / a_last_b:.2f}x "
        f"a last's, against {fair_b:.0f} ms with the default credit of "
        f"{FairShare().lift_credit_requests:g} requests (Jain's index {paper_jain:.3f}, "
        f"throughput {paper_throughput:.3f}x FIFO's). "
        f"The issue's reference, b without the flood: b's TTFT p90 {alone:.0f} ms alone, fair "
        f"{fair_b / alone:.2f}x it, reserved {reserved_b / alone:.2f}x, a last {a_last_b / alone:.2f}x; eight tenants "
        f"{alone8:.0f} ms without the flood, fair {fair8_b / alone8:.2f}x it, a last {a_last8_b / alone8:.2f}x. "
        f"b's TTFT p90 with a flooding under FIFO is {fifo_b / alone:.2f}x b alone's "
        f"({fifo_b:.0f} against {alone:.0f} ms); FIFO's Jain's index {jains['fifo']:.3f}; with b's reserved share, "
        f"Jain's index {jains['fair reserved']:.3f}. Eight tenants: b's p90 {fair8_b:.0f} ms fair, {fifo8_b:.0f} ms "
        f"FIFO, {alone8:.0f} ms without the flood; the light tenants' p90 {light_p90('8 fair'):.0f} ms fair, "
        f"{light_p90('8 fifo'):.0f} ms FIFO, {light_p90('8 no flood'):.0f} ms without the flood; FIFO's Jain's index "
        f"{jains['8 fifo']:.3f}. Two replicas, the store's fair line: b's p90 {replicas_b / alone:.2f}x b alone's "
        f"({replicas_b:.0f} ms; one replica {fair_b:.0f} ms). Per replica (2 replicas, each fair on its own, "
        f"`fairness.across_replicas: false`): b's p90 {per_replica_b / alone:.2f}x b alone's ({per_replica_b:.0f} ms), "
        f"{per_replica_b / fair_b:.2f}x one replica's, throughput "
        f"{figures['per-replica fair'].throughput() / figures['fifo'].throughput():.2f}x FIFO's, Jain's index "
        f"{jains['per-replica fair']:.3f}.",
        "",
        "## Per arm and tenant (measured windows of every round)",
        "",
        *rows,
        "",
        "TTFT columns count a shed request as infinite (what the tenant's clients see); \"served-only\" leaves them "
        "out. Parked: the wait in the parking lot (`x-sluice-parked-ms`) of completed requests. Served tokens/s: prompt + "
        "completion tokens of completed requests per second of the arm's windows.",
        "",
        "## Reading",
        "",
        f"While a floods, every slot is taken and one frees every {1000 / capacity:.0f} ms on average (1 / "
        "capacity). Fair share decides who takes it. b's arrivals are Poisson: at its rate, several often come "
        "within 100 ms. With the paper's lift (`fair, paper's lift`) b, lifted level with a when it parks and served "
        "less, takes the next slot, and a second request of b parked meanwhile waits for one of a's (equal weights "
        "alternate): a burst is served one b, one a, so its last request waits about twice the burst's length in "
        "slot turnovers. With the default lift credit (`fair`), b comes back from idle up to "
        f"{FairShare().lift_credit_requests:g} of its requests below a's counter (never below its own; b, under its "
        "share, usually stands that far below), so a burst of that many is served before a's next request "
        "(decision 0031); a flood is never lifted, since it always has requests waiting. b alone never waits for a "
        "slot, so b's TTFT with a flooding is b alone's plus its wait in the lot (the parked column). A lot that "
        "only orders who goes next cannot take the wait for a slot away: ending a's work (preemption) could. `a "
        "last` measures how much of it any order can take away: there every slot that frees goes to b while b "
        "waits, so what b still waits is the slot turnover alone, the floor of every gateway that keeps the fleet "
        "busy and ends nothing running. FIFO, for contrast, makes b wait behind a's whole backlog, and sheds b with "
        "a.",
        "",
        f"Reserved share (`fair reserved`): with b's {RESERVED_B:g} (2 of the 4 slots), a slot that frees while b has a "
        "request waiting and runs fewer than 2 goes to b whatever the counters, so even past the credit the second "
        "request of a burst does not wait for one of a's. The slots are lent to a while b has nothing waiting, and nothing running is "
        "stopped: b's first request of a burst still waits for a slot to free, which is why its TTFT stays above b "
        "alone's.",
        "",
        "Two replicas (`fair 2 replicas`): the counters live in the store and are charged in each admission's own "
        "step; a woken request is admitted only if it is the store's fair pick among both replicas' parked requests "
        "(a replica whose pick is refused learns the store's counters and tries again), so the slot that frees goes "
        "to b whichever replica holds b's request. Per replica (`per-replica fair`): each replica orders only the "
        "requests it holds, by counters of its own, so a replica holding none of b's requests serves a's while the "
        "other has b's waiting.",
        "",
        "Eight tenants: equal weights, so while they wait together each is owed an eighth of the slots. The light "
        "tenants (4% each) seldom wait more than one request at a time and go first when they come (lifted below "
        "the backlogged minimum, and served less than b); b (30%) waits while they pass, so its credit must cover "
        "its own burst and their returns: with 8 requests it ran out while they passed and b then took turns with a "
        "(1.20x-1.32x `8 a last` in two runs), with the default 16 it does not (decision 0031). `8 a last` serves b "
        "and the light tenants by fair share among themselves with a after them, as the flood's absence would order "
        "them: what separates the two arms is only whether a ever goes before b.",
        "",
        "## Fair-share gauges at the end of the last fair window",
        "",
        "```",
        *figures["fair"].shares,
        "```",
    ])
    path = write_report("fairness", "sluice bench fairness: a tenant's flood against another's latency", body)
    print(body)
    print(f"report: {path}")
    return exit_code(targets)
