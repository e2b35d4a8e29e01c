"""``sluice bench fleet``: the real control-plane path at fleet scale, minus gRPC, on a discrete-event model of a large
heterogeneous fleet. It measures what only scale shows: real ``decide`` calls per CPU second, the share of traffic the
busiest 10% of engines take, TTFT-SLO attainment, over-shed, and how often the fallback weights are pushed.

What runs is what ``controlplane/app.py`` wires: a ``ControlPlane`` built from a config of N engines, one
``EnginePoller`` per engine whose probes land through the poller's own callback (``Observation.probed``: the index,
RateBook, then the admission service: ledger probe note, output lengths, index update, wake) as the probe worker's reader
lands them at this scale: in the batches the worker sends every ``FLUSH_S``, ``FRAMES_PER_TURN`` reports at a time, each
slice followed by ``Observation.refresh_rows`` (their engines' index rows redone between Checks; until 756a9ff
(2026-12-02) the bench left every row to the next Check's snapshot, and until 450c765 (2026-12-03) a slice's last rows
when the batch ended short of a slice, which the real process does not), every Check as ``authz.py`` makes it
(``plane.observation.fleet(now)`` then ``plane.admission.check``, ``record_outcome``, a parked Check waiting on the future ``wake``
resolves), every release as the access log makes it (``plane.release_ticket``: ledger, wake, and the loop turns its
store write and wake take, while they are in flight; until 6c2f4d2 (2026-12-03) four turns, empty or not), the
park-deadline sweep every 0.1 s and the staleness loop's ``refresh_weights`` every 0.5 s. Start-up objects are frozen
out of the collector's reach after the warm-up, as the process does after ``start``. Only the clock is simulated (the
plane reads it), so 60 s of traffic runs in seconds.

Fleet: four tiers (seed 002's shape: a few fast boxes, many modest ones), per tier a solo decode rate, a prefill rate and
a cap; per-request decode at batch n = solo x n^-0.3. Every engine is probed once a second (staggered), reporting its true
running count and the rates an interval would measure (prefill and decode jittered by +-5%), after a warm-up that makes
every (model, chip class) median and each engine's per-batch decode medians trusted. Each tier is a chip class, as an
operator would configure it; the "no chip classes" arm leaves ``chip_class`` unset, so every engine is its own class (a
new user's fleet: a class median per engine, each changing with that engine's probes). Requests: Poisson at LOAD x capacity,
prompts 200-4000 tokens, outputs lognormal around 150 tokens, every request with a TTFT deadline of SLO_S (planned
with the policy's ``ttft_headroom_fraction``, as ``parse_request`` does).

Decisions are counted where they happen (``AdmissionCore.decisions``: every ``decide`` call, arrivals and woken heads,
and those the fleet index answered); the CPU is
the process time of every control-plane call above (Checks with their fleet, releases and probes with their wakes, sweeps,
weights), measured around those calls only, so the simulator's own bookkeeping is not charged. A probe's CPU here
is its callback only: fetching and parsing ``/metrics`` is ``sluice bench observe``'s (its report gives that cost). It
measures the code as it is: the fleet this path replaced (every view rebuilt per Check, every candidate estimated) and
its push rule were measured beside it until 2026-12-05 (6a6a3ff's report: 76 and 418 decisions per CPU second at 1000
and 200 engines), not kept here.

Over-shed: a request shed although, at that moment, some engine had a free slot where its true TTFT (prefill + one token)
met the deadline.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import math
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any


from controlplane.app import ControlPlane
from controlplane.config import parse_config
from controlplane.core.model import InferenceRequest, Outcome, Verdict
from controlplane.core.engines import EngineRates, EngineSample, EngineView, Flavor, ServedModel
from controlplane.core.request import ttft_deadline
from controlplane.observe.observation import FRAMES_PER_TURN
from controlplane.observe.poller import EnginePoller
from controlplane.observe.worker import FLUSH_S
from bench.common import Target, exit_code, pyplot, save_figure, verdicts, write_report

NO_CLASSES = "sluice (band), no chip classes"
Report = tuple[EnginePoller, EngineView, EngineRates]
"""A probe's result as the probe worker sends it: the poller it is for, the view it makes, the rates it measured."""
SIZES = tuple(int(s) for s in __import__("os").environ.get("SLUICE_FLEET_SIZES", "200,1000").split(","))
REQUESTS = int(__import__("os").environ.get("SLUICE_FLEET_REQUESTS", "6000"))
ROUNDS = int(__import__("os").environ.get("SLUICE_FLEET_ROUNDS", "3"))
TARGET_DECISIONS_PER_CPU_S = 2000.0
"""Issue 9's target at the largest fleet, on one core."""
"""Runs of each arm, interleaved (every arm once per round): a row is the run with the median
decisions per CPU-s, and every round's figure is shown. The same arm moved by 20% from one run to the next on this shared
host (1888 to 2319 at 1000 engines, 2026-12-03), so one run judged the target by the host's load."""
IDLE_SECONDS = 60.0
LOAD = 0.9
SLO_S = 3.0
SEED = 7
TIERS = (  # (share of engines, solo decode tok/s, prefill tok/s, cap)
    (0.1, 90.0, 12_000.0, 8),
    (0.2, 45.0, 6_000.0, 4),
    (0.4, 25.0, 3_000.0, 4),
    (0.3, 15.0, 1_500.0, 2),
)
KV_CAPACITY = 10**7


def per_request_rate(solo: float, n: int) -> float:
    return solo * math.pow(max(1, n), -0.3)


@dataclass
class SimEngine:
    name: str
    chip: str
    solo: float
    prefill: float
    cap: int
    running: dict[str, float] = field(default_factory=dict)  # request id -> finish time
    served: int = 0


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt: int
    output: int


def build_fleet(rng: random.Random, size: int) -> list[SimEngine]:
    engines: list[SimEngine] = []
    for tier, (share, solo, prefill, cap) in enumerate(TIERS):
        for _ in range(round(share * size)):
            jitter = rng.uniform(0.9, 1.1)
            engines.append(SimEngine(f"e{len(engines)}", f"tier{tier}", solo * jitter, prefill * jitter, cap))
    return engines


def capacity_rps(engines: list[SimEngine], mean_prompt: float, mean_out: float) -> float:
    return sum(e.cap / (mean_prompt / e.prefill + mean_out / per_request_rate(e.solo, e.cap)) for e in engines)


def arrivals(rng: random.Random, rate: float, count: int) -> list[Arrival]:
    out, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(Arrival(t, rng.randint(200, 4000), int(min(1000, max(16, rng.lognormvariate(math.log(150), 0.5))))))
    return out


class Plane:
    """A ``ControlPlane`` of the sim's engines with a simulated clock, every call timed in process CPU."""

    def __init__(self, engines: list[SimEngine], band: bool) -> None:
        raw = {
            "controlplane": {"grpc_port": 1, "metrics_port": 2},
            "envoy": {"listen_port": 3, "admin_port": 4},
            "observe": {"poll_interval_seconds": 1.0},
            "admission": {"default_max_tokens": 256, "max_park_seconds": 60, "max_queue_depth": 10_000,
                          "band_margin_ms": 1000.0 if band else 1e9},
            "engines": [{"name": e.name, "url": "http://127.0.0.1:9", "max_num_seqs": e.cap, "chip_class": e.chip,
                         "models": ["m"]} for e in engines],
        }
        self.now = 0.0
        self.plane = ControlPlane(parse_config(raw), clock=lambda: self.now)
        self.plane.admission.draw = random.Random(SEED).random
        self.pollers: dict[str, EnginePoller] = {}
        for config in self.plane.config.engines:
            # This bench never lets a poller probe (``probe`` below stores what a probe would).
            poller = EnginePoller(config, self.plane.config.observe, self.plane.observation.probed, clock=lambda: self.now)
            self.plane.observation.pollers.append(poller)
            self.pollers[config.name] = poller
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.probes = 0
        self.rng = random.Random(SEED + 11)

    def timed(self, what: str, call: Callable[[], Any]) -> Any:
        started = time.process_time()
        try:
            return call()
        finally:
            self.cpu[what] += time.process_time() - started

    def report(self, e: SimEngine, running: int | None = None, noise: bool = False) -> Report:
        """What a probe of ``e`` measures now, as ``EnginePoller.poll_once`` would store it: the probe worker's report, which
        lands when its batch is delivered (``deliver``)."""
        poller = self.pollers[e.name]
        n = len(e.running) if running is None else running
        if noise:
            n += self.rng.choice((0, 0, 1))  # traffic that bypasses sluice, seen only by the probe
        jitter = self.rng.uniform(0.95, 1.05)
        rates = EngineRates(1.0, prefill_tokens_per_s=e.prefill * jitter,
                            decode_tokens_per_s_each=per_request_rate(e.solo, n) * self.rng.uniform(0.95, 1.05),
                            solo=n == 1, batch=n or None)
        sample = EngineSample(self.now, running=n, waiting=0, kv_usage=0.0, kv_capacity_tokens=KV_CAPACITY)
        view = replace(poller._view, sample=sample, last_ok_at=self.now, stale=False, version="0.11.0",
                       models=(ServedModel("m", 32_768),), flavor=Flavor.VLLM, rates=rates)
        return poller, view, rates

    def deliver(self, reports: list[Report]) -> None:
        """What the probe worker's reader does with a batch of reports (``observation._run_worker``): FRAMES_PER_TURN of
        them through the poller's callback, then the index rows of their engines (between Checks), and so on to the
        batch's end; the worker sends a batch every ``FLUSH_S``."""
        observation = self.plane.observation

        def land(chunk: list[Report]) -> None:
            for poller, view, rates in chunk:
                poller._view = view
                observation.probed(view, rates)
            observation.refresh_rows(self.now)

        for start in range(0, len(reports), FRAMES_PER_TURN):
            chunk = reports[start:start + FRAMES_PER_TURN]
            self.timed("probes", lambda: land(chunk))
        self.probes += len(reports)

    def probe(self, e: SimEngine, running: int | None = None, noise: bool = False) -> None:
        """A probe whose report lands at once (the warm-up)."""
        self.deliver([self.report(e, running, noise)])


async def run_arm(engines: list[SimEngine], jobs: list[Arrival], band: bool) -> dict[str, Any]:
    sim = Plane(engines, band)
    plane = sim.plane
    try:
        return await _run(sim, plane, engines, jobs)
    finally:
        gc.unfreeze()  # _run froze the start-up objects as the process does; the next arm starts afresh


async def _run(sim: Plane, plane: ControlPlane, engines: list[SimEngine], jobs: list[Arrival]) -> dict[str, Any]:
    by_name = {e.name: e for e in engines}
    counts = plane.admission.decisions
    # Warm-up: enough probes at every batch size for every median to be trusted (rate_min_samples), then the true state.
    for e in engines:
        for batch in range(1, e.cap + 1):
            for _ in range(plane.config.observe.rate_min_samples):
                sim.probe(e, running=batch)
        sim.probe(e, running=0)
    await plane.refresh_weights()
    # What ``serve_until_signalled`` does once the plane has started: what start-up built (config, pollers, index, series)
    # lives for the process, so it is moved out of the collector's reach.
    gc.collect()
    gc.freeze()
    sim.cpu.clear()
    sim.probes = 0

    # Idle: probes jitter (a little bypass traffic), no requests; pushes counted.
    pushes_before_idle = plane.xds.weight_pushes
    events: list[tuple[float, int, str, str]] = []
    seq = 0
    pending: list[Report] = []  # reports the probe worker has not sent yet (a batch every FLUSH_S)

    def queue(report: Report) -> None:
        """A probe's report waits for the worker's next batch (the first one of a batch schedules its delivery)."""
        nonlocal seq
        if not pending:
            heapq.heappush(events, (sim.now + FLUSH_S, seq, "flush", ""))
            seq += 1
        pending.append(report)

    def flush() -> None:
        sim.deliver(pending)
        pending.clear()

    for i, e in enumerate(engines):
        heapq.heappush(events, (i / len(engines), seq, "probe", e.name))
        seq += 1
    t = 0.0
    while t < IDLE_SECONDS:
        heapq.heappush(events, (t, seq, "weights", ""))
        seq += 1
        t += 0.5
    while events and events[0][0] < IDLE_SECONDS:
        sim.now, _, kind, name = heapq.heappop(events)
        if kind == "probe":
            queue(sim.report(by_name[name], noise=True))
            heapq.heappush(events, (sim.now + 1.0, seq, "probe", name))
            seq += 1
        elif kind == "flush":
            flush()
        else:
            await plane.refresh_weights()
    flush()
    idle_pushes = plane.xds.weight_pushes - pushes_before_idle
    # The requests start where the idle phase ended: the clock runs on (the plane's staleness deadlines stay true).
    base = sim.now = IDLE_SECONDS
    events = [(at, s, k, n) for at, s, k, n in events if k == "probe"]
    heapq.heapify(events)
    for e in engines:
        sim.probe(e)
    sim.cpu.clear()
    sim.probes = 0

    requests: dict[str, tuple[Arrival, InferenceRequest]] = {}
    # The deadline as parse_request sets it (with the policy's headroom planned into it).
    deadline_ms, headroom_ms = ttft_deadline(int(SLO_S * 1000), "m", plane.config.policy)
    for i, job in enumerate(jobs):
        rid = f"r{i}"
        requests[rid] = (job, InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=job.prompt,
                                               max_tokens=job.output, max_ttft_ms=deadline_ms,
                                               ttft_headroom_ms=headroom_ms))
        heapq.heappush(events, (base + job.at, seq, "arrive", rid))
        seq += 1
    end = base + jobs[-1].at + 60.0
    for tick in range(int((end - base) * 10)):
        heapq.heappush(events, (base + tick / 10, seq, "sweep", ""))
        if tick % 5 == 0:
            heapq.heappush(events, (base + tick / 10 + 0.05, seq + 1, "weights", ""))
        seq += 2
    owner: dict[str, SimEngine] = {}
    last_arrival = base + jobs[-1].at
    last_event = base
    window: dict[str, Any] = {}
    pushes_before = plane.xds.weight_pushes
    ttft: dict[str, float] = {}
    shed: dict[str, str] = {}
    over_shed = 0
    settled: list[Outcome] = []
    loop = asyncio.get_running_loop()

    def free_slot_meets(job: Arrival) -> bool:
        return any(len(e.running) < e.cap and job.prompt / e.prefill + 1 / per_request_rate(e.solo, len(e.running) + 1)
                   <= SLO_S for e in engines)

    def settle(o: Outcome) -> None:
        nonlocal seq, over_shed
        job, _ = requests[o.request_id]
        if o.ticket is None:
            if o.decision.verdict is Verdict.SHED:
                shed[o.request_id] = o.decision.reason.value
                over_shed += free_slot_meets(job)
            return
        e = by_name[o.ticket.engine]
        n = len(e.running) + 1
        first = job.prompt / e.prefill + 1 / per_request_rate(e.solo, n)
        ttft[o.request_id] = (sim.now - base - job.at) + first
        finish = sim.now + first + job.output / per_request_rate(e.solo, n)
        e.running[o.request_id] = finish
        owner[o.request_id] = e
        e.served += 1
        heapq.heappush(events, (finish, seq, "finish", o.request_id))
        seq += 1

    async def check(rid: str) -> None:
        """authz.py's Check: the service's check (the fleet, the core's answer, the write to the store), the metrics; a
        parked Check waits on the plane's future."""
        outcome = await plane.service.check(rid, requests[rid][1])
        plane.service.record_outcome("m", outcome)
        if outcome.decision.verdict is Verdict.PARK:
            future: asyncio.Future[Outcome] = loop.create_future()
            future.add_done_callback(lambda f: settled.append(f.result()))
            plane.service._parked[rid] = future
        else:
            settled.append(outcome)

    wall = time.perf_counter()
    while events:
        at, _, kind, name = heapq.heappop(events)
        if kind in ("probe", "flush", "sweep", "weights") and at > last_arrival and not owner \
                and not plane.admission.depth():
            continue  # every request answered and finished: the run ends (no idle tail charged to the path)
        if at > last_arrival and not window:
            # The arrival window is over: what the path cost while requests were arriving, probes and weights included.
            window.update(cpu=sum(sim.cpu.values()), decisions=counts.decided)
        sim.now = last_event = at
        if kind == "arrive":
            started = time.process_time()
            await check(name)
            sim.cpu["checks"] += time.process_time() - started
        elif kind == "finish":
            del owner.pop(name).running[name]
            sim.timed("releases", lambda: plane.service.release_ticket(name))
            # The wake a release schedules (and the store write before it) runs on the next turns of the loop: turned
            # while that work is in flight (an empty turn is the bench's, not the release's).
            started = time.process_time()
            for _ in range(WAKE_TURNS):
                service = plane.service
                if not service.replication._background and (service._wake_task is None or service._wake_task.done()):
                    break
                await asyncio.sleep(0)
            sim.cpu["releases"] += time.process_time() - started
        elif kind == "probe":
            if sim.now > end:
                continue
            queue(sim.report(by_name[name]))
            heapq.heappush(events, (sim.now + 1.0, seq, "probe", name))
            seq += 1
        elif kind == "flush":
            flush()
        elif kind == "sweep":
            if plane.admission.depth():
                sim.timed("sweeps", lambda: plane.service.answer(plane.admission.expire_parked(plane.observation.fleet(sim.now), sim.now)))
        elif kind == "weights":
            started = time.process_time()
            await plane.refresh_weights()
            sim.cpu["weights"] += time.process_time() - started
        await asyncio.sleep(0)  # resolved parked futures run their callbacks
        for outcome in settled:
            settle(outcome)
        settled.clear()
    wall = time.perf_counter() - wall
    duration = last_event - base
    served = sorted((e.served for e in engines), reverse=True)
    top = sum(served[: max(1, len(served) // 10)]) / max(1, sum(served))
    met = sum(1 for t in ttft.values() if t <= SLO_S + 1e-9)
    admission_cpu = sim.cpu["checks"] + sim.cpu["releases"] + sim.cpu["sweeps"]
    path_cpu = sum(sim.cpu.values())
    return {
        "engines": len(engines),
        "requests": len(jobs),
        "decisions": counts.decided,
        "indexed": counts.on_index,
        "full_scan": counts.full_scan,
        "decisions_per_cpu_s": counts.decided / admission_cpu,
        "decisions_per_cpu_s_all": window["decisions"] / window["cpu"] if window else counts.decided / path_cpu,
        "probe_us": 1e6 * sim.cpu["probes"] / max(1, sim.probes),
        "duration_s": duration,
        "check_ms": 1000 * sim.cpu["checks"] / len(jobs),
        "cpu": dict(sim.cpu),
        "wall_s": wall,
        "top10_share": top,
        "slo_attainment": met / len(jobs),
        "served": len(ttft) / len(jobs),
        "shed": len(shed) / len(jobs),
        "over_shed": over_shed / len(jobs),
        "idle_engines": sum(1 for e in engines if e.served == 0) / len(engines),
        "ttft_p50": statistics.median(ttft.values()) if ttft else float("nan"),
        "shed_reasons": Counter(shed.values()),
        "served_sorted": served,
        "pushes_per_min_idle": idle_pushes / IDLE_SECONDS * 60,
        "pushes_per_min_traffic": (plane.xds.weight_pushes - pushes_before) / duration * 60,
    }


WAKE_TURNS = 4
"""Event-loop turns after a release, at most: its store write, then the wake it scheduled, then the futures the wake
resolved."""


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median decisions per CPU-s (the lower middle of an even count), with every run's figure in
    ``rounds``."""
    ranked = sorted(runs, key=lambda r: r["decisions_per_cpu_s"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds": [r["decisions_per_cpu_s"] for r in runs]}


def run_fleet_bench() -> int:
    results: dict[str, dict[str, Any]] = {}
    rates: dict[int, float] = {}
    for size in SIZES:
        engines = build_fleet(random.Random(SEED), size)
        probe = arrivals(random.Random(SEED + 2), 1.0, 2000)
        rate = LOAD * capacity_rps(engines, statistics.mean(j.prompt for j in probe),
                                   statistics.mean(j.output for j in probe))
        rates[size] = rate
        jobs = arrivals(random.Random(SEED + 1), rate, REQUESTS)
        arms = [("sluice (band)", True), (NO_CLASSES, True)]
        if size == SIZES[0]:
            # The band's purpose at scale (seed 002); at saturation fastest-first parks heads that nothing fits, which the
            # full scan decides, so it runs at the smaller size only.
            arms.insert(1, ("fastest-first", False))
        runs: dict[str, list[dict[str, Any]]] = {}
        for round_ in range(ROUNDS):
            for arm, band in arms:
                # NO_CLASSES: no chip_class configured, so each engine is its own class (a new user's fleet).
                fresh = [SimEngine(e.name, e.name if arm == NO_CLASSES else e.chip, e.solo, e.prefill, e.cap)
                         for e in engines]
                key = f"{size} | {arm}"
                r = asyncio.run(run_arm(fresh, jobs, band))
                runs.setdefault(key, []).append(r)
                print(f"round {round_ + 1}/{ROUNDS}, {key}: {r['decisions_per_cpu_s']:.0f} decisions/CPU-s (all-in "
                      f"{r['decisions_per_cpu_s_all']:.0f}), check {r['check_ms']:.3f} ms, probe {r['probe_us']:.0f} us, "
                      f"indexed {r['indexed']} / full {r['full_scan']}, pushes/min idle {r['pushes_per_min_idle']:.1f} "
                      f"traffic {r['pushes_per_min_traffic']:.1f}, wall {r['wall_s']:.1f} s", flush=True)
        for key, arm_runs in runs.items():
            results[key] = median_run(arm_runs)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, r in results.items():
        served = r["served_sorted"]
        ax.plot([i / len(served) for i in range(1, len(served) + 1)], served, label=key.replace(" | ", " engines, "))
    ax.set_xlabel("engines, busiest first (fraction of the fleet)")
    ax.set_ylabel("requests served")
    ax.set_title("traffic per engine")
    ax.legend()
    plot = save_figure(fig, "fleet")
    rows = "\n".join(
        f"| {key} | {r['requests']} | {r['decisions']} | **{r['decisions_per_cpu_s']:.0f}** | "
        f"{' / '.join(f'{x:.0f}' for x in r['rounds'])} | "
        f"{r['decisions_per_cpu_s_all']:.0f} | {r['check_ms']:.3f} | {r['probe_us']:.0f} | "
        f"{r['indexed']} / {r['full_scan']} | {r['top10_share']:.0%} | {r['idle_engines']:.0%} | "
        f"{r['slo_attainment']:.1%} | {r['shed']:.1%} | {r['over_shed']:.1%} | {r['ttft_p50']:.2f} | "
        f"{r['pushes_per_min_idle']:.1f} / {r['pushes_per_min_traffic']:.1f} |"
        for key, r in results.items()
    )
    load = __import__("os").getloadavg()
    cpu_rows = "\n".join(
        f"| {key} | " + " | ".join(f"{r['cpu'].get(k, 0.0):.2f}" for k in ("checks", "releases", "probes", "sweeps",
                                                                        "weights")) + f" | {r['wall_s']:.1f} |"
        for key, r in results.items()
    )
    largest = results[f"{SIZES[-1]} | sluice (band)"]
    targets = [Target(f"decisions per CPU second at {SIZES[-1]} engines, admission path (median run)",
                      largest["decisions_per_cpu_s"], TARGET_DECISIONS_PER_CPU_S),
               Target(f"decisions per CPU second at {SIZES[-1]} engines, all-in (probes and weights on the same loop)",
                      largest["decisions_per_cpu_s_all"], TARGET_DECISIONS_PER_CPU_S)]
    doc = __doc__.replace("LOAD", f"{LOAD:g}").replace("SLO_S", f"{SLO_S:g} s")
    body = f"""{doc}
Arrival rates: {", ".join(f"{size} engines {rate:.1f} requests/s ({LOAD:.0%} of capacity)" for size, rate in rates.items())};
{REQUESTS} requests per arm, seed {SEED}. Pushes per minute: idle (probes with a little bypass traffic, {IDLE_SECONDS:g}
s) / with the traffic. Each arm ran {ROUNDS} times, interleaved
(every arm once per round); a row is its median run, and every round's figure is shown.

| engines, arm | requests | decide calls | decisions per CPU-s (admission: Checks, releases + wakes, sweeps; median run) | the same, round by round | decisions per CPU-s while requests arrive (all-in: + probes, weights) | Check CPU (ms, fleet + decide) | CPU per probe (us) | decided on the index / full scan | busiest 10% take | engines idle | TTFT SLO met | shed | over-shed | TTFT p50 (s) | weight pushes/min idle / traffic |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

CPU seconds by call (process time, one core; the run ends when the last request finished). Load average at the end
{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (other engineers' benchmarks share the 2 cores; process time is this process's
own CPU, so contention costs wall time more than these figures).

| engines, arm | Checks | releases (+ wakes) | probes (+ wakes) | park sweeps | weights (compute + push) | wall (s) |
|---|---|---|---|---|---|---|
{cpu_rows}

Shed reasons: {"; ".join(f"{key}: {dict(r['shed_reasons']) or 'none'}" for key, r in results.items())}.

## Targets

Issue 9: at 1000 engines at least 2000 decisions/s on one core, judged on the admission path alone and all-in (the
probes' callbacks and the weights run on the same loop as the Checks).

{verdicts(targets)}

![traffic per engine]({plot})
"""
    path = write_report("fleet", "sluice bench fleet: the control-plane path at fleet scale", body)
    print(body)
    print(f"report: {path}")
    return exit_code(targets)
