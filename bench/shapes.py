"""``sluice bench shapes``: three workload shapes the field publishes, generated from their published statistics (nothing
is downloaded), scaled to four simulated engines, sluice against the strongest arms of the same run.

Fleet: ``spark-a``, ``spark-b`` (prefill 4,000 tok/s, decode 49 / 88 tok/s aggregate at 1 / 2 streams, 95k KV tokens)
and ``thor-a``, ``thor-b`` (1,500 tok/s, 18 / 51 tok/s, 132k KV tokens), 2 slots each, simulator speed x1, vLLM-style
automatic prefix caching. {WORLD}

Shapes (every prompt is pseudo-random words; sizes below are nominal tokens at 4 characters, about 1.2x as many
simulator tokens; each request streams, ``max_tokens`` {MAX_TOKENS}, and its natural answer length is sent as
``sim_output_tokens``: the engine stops there, sluice does not see it):

- ``sharegpt``: multi-turn chat sessions with ShareGPT's published shape: {TURNS_MEAN} turns a conversation on average
  (the ShareGPT row of ShareChat's table 1, arXiv 2512.17843: 330,239 turns in 94,145 conversations), drawn as 1 plus
  a geometric number of further turns, at most {TURNS_MAX}; a user message lognormal with mean {USER_MEAN} tokens and
  an answer lognormal with mean {ANSWER_MEAN} tokens (the ShareGPT means of the PagedAttention paper, Kwon et al., SOSP
  2023, figure 11: 161 and 338), sigma {SIGMA:g} both; answers scaled by {ANSWER_SCALE:g} (the simulated engines decode at
  18-88 tokens/s, so full-length answers would leave a few conversations a window). Every turn resends the whole
  history plus a new message, {THINK_S:g} s after the previous answer ended. Conversations arrive as a Poisson process.
- ``tenants``: the many-tenant shape llm-d publishes for its prefix-aware scheduling benchmark (inference-perf's
  ``shared_prefix`` data: 150 groups of 5 users, a 6,000-token system prompt per group, a 1,200-token question per
  user, 1,000 output tokens, Poisson stages rising until the fleet saturates), scaled: {GROUPS} groups of {USERS} users,
  {SYSTEM_TOKENS:,}-token system prompts, {QUESTION_TOKENS:,}-token questions (a user always asks the same one, as
  inference-perf cycles through its prompts), {TENANT_OUTPUT} output tokens each; every request picks a group and a user
  at random. All prompts together are about {TENANT_KV:.1f}x the fleet's KV. Levels rise as llm-d's stages do.
- ``fanout``: an agent's fan-out: episodes arrive as a Poisson process; each sends one {FANOUT_CONTEXT:,}-token context
  (a document, a repository) with {FANOUT_WIDTH} different {FANOUT_TASK}-token sub-tasks, all at once; answers
  lognormal, median {FANOUT_OUTPUT} tokens, sigma {SIGMA:g}. Its figure of merit is the episode's makespan (the first
  request sent to the last answer's end): the agent waits for every sub-answer.

Capacity per shape: every engine saturated alone (closed loop: slots + 1 conversations, requests or episodes of that
shape, {CAL_S:g} s after {CAL_WARM_S:g} s of warm-up), on its own quarter of the groups (``tenants``); the sum is the
fleet's capacity in requests per second, and the levels are fractions of it.

Arms, each cell's arrivals identical across arms, the arm order rotated from cell to cell (one round a cell):

- ``sluice``: ``sluice up`` with its defaults.
- ``LR+w+cap``: plain Envoy ``LEAST_REQUEST`` weighted by each engine's measured capacity and capped at its slots (per-host
  ``max_connections``, one worker): the strongest cache-blind Envoy arm of ``bench steady``.
- ``ring``: plain Envoy ``RING_HASH`` on a header the client sets to a hash of the request's first message (the system
  prompt, a conversation's first message, an episode's context).
- ``EPP``: the Gateway API Inference Extension's default endpoint picker reimplemented from its v1.5.0 source
  (bench/epp.py): queue, KV use and its approximate prefix index weighted 2 / 2 / 3, metrics every 50 ms.

Figures: TTFT p50 / p90 over every request (one that failed after the openai client's two retries counted as never
answered), hit rate (the answers' ``cached_tokens`` over their prompt tokens), throughput (completion tokens per second
from the window's start to the last completion), and for ``fanout`` the episodes' makespan p50 / p90 (an episode with a
failed request never ends). The measured window is the sessions that arrive in it, after {WARM_S:g} s of warm-up
(``fanout``: twice as long a window, its episodes being few).

Targets (issue 41: every target against the best other arm of the same cell): sluice's TTFT p90 at most the best other
arm's; on ``tenants`` its hit rate at least the best other arm's; on ``fanout`` its makespan p90 at most the best other
arm's.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.common import Target, exit_code, pct, rotated_rounds, sim_world, verdicts, write_report
from bench.epp_arm import epp_arm
from bench.plain import plain_envoy_arm
from bench.prefix import (ENGINES, EPP, HASH_HEADER, MAX_TOKENS, Arm, Outcome, Texts, _epp_note, _sims, _wait_idle,
                          send)
from bench.workload import gateway
from enginesim.profiles import PROFILES

SHAPES = ("sharegpt", "tenants", "fanout")
TURNS_MEAN = 330_239 / 94_145
TURNS_MAX = 8
USER_MEAN = 161
ANSWER_MEAN = 338
ANSWER_SCALE = 0.25
SIGMA = 0.8
THINK_S = 2.0
GROUPS = 32
USERS = 5
SYSTEM_TOKENS = 6000
QUESTION_TOKENS = 1200
TENANT_OUTPUT = 100
FANOUT_CONTEXT = 8000
FANOUT_WIDTH = 16
FANOUT_TASK = 80
FANOUT_OUTPUT = 60
LEVELS = {"sharegpt": (0.5, 0.9), "tenants": (0.5, 0.8, 1.0, 1.2), "fanout": (0.5, 0.9)}
QUICK_LEVELS = {"sharegpt": (0.9,), "tenants": (0.8, 1.1), "fanout": (0.9,)}
WARM_S = 20.0
WINDOW_S = 60.0
QUICK_WARM_S = 15.0
QUICK_WINDOW_S = 40.0
WINDOW_FACTOR = {"fanout": 2.0}
"""A shape whose sessions are few (an episode is ``FANOUT_WIDTH`` requests) measures over this many windows."""
CAL_S = 20.0
CAL_WARM_S = 5.0
SEED = 41_2026
ARMS = ("sluice", "LR+w+cap", "ring", EPP)
NAN = float("nan")


# -- the shapes ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One request: the shared first message (``context`` key and size; none when ``context_tokens`` is 0), the user's
    message (its key and size) and the answer's natural length."""

    context: str
    context_tokens: int
    message: str
    message_tokens: int
    output: int


@dataclass(frozen=True)
class Session:
    """A conversation (its steps one after another, each resending the history), a single request, or an episode (its
    steps all at once)."""

    at: float
    key: int
    steps: tuple[Step, ...]
    together: bool = False


def _lognormal(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    """A lognormal draw with the given mean (not median): median = mean / exp(sigma^2 / 2)."""
    median = mean / math.exp(sigma * sigma / 2)
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def draw_session(shape: str, rng: random.Random, key: int, at: float = 0.0, groups: range = range(GROUPS)) -> Session:
    """One session of ``shape`` (module docstring); ``groups``: the ``tenants`` groups it may draw from."""
    if shape == "sharegpt":
        turns = 1
        while turns < TURNS_MAX and rng.random() > 1 / TURNS_MEAN:
            turns += 1
        steps = tuple(Step("", 0, f"c{key}-t{t}", _lognormal(rng, USER_MEAN, SIGMA, 4, 2048),
                           _lognormal(rng, ANSWER_MEAN * ANSWER_SCALE, SIGMA, 1, MAX_TOKENS)) for t in range(turns))
        return Session(at, key, steps)
    if shape == "tenants":
        group, user = rng.choice(groups), rng.randrange(USERS)
        return Session(at, group, (Step(f"g{group}", SYSTEM_TOKENS, f"g{group}-u{user}", QUESTION_TOKENS,
                                        TENANT_OUTPUT),))
    if shape == "fanout":
        steps = tuple(Step(f"e{key}", FANOUT_CONTEXT, f"e{key}-s{i}", FANOUT_TASK,
                           _lognormal(rng, FANOUT_OUTPUT * math.exp(SIGMA * SIGMA / 2), SIGMA, 1, MAX_TOKENS))
                      for i in range(FANOUT_WIDTH))
        return Session(at, key, steps, together=True)
    raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")


def mean_requests(shape: str) -> float:
    """Requests per session of ``shape`` on average (the turn count's mean under its cap for ``sharegpt``)."""
    if shape == "sharegpt":
        p = 1 / TURNS_MEAN
        return sum((1 - p) ** t for t in range(TURNS_MAX))
    return FANOUT_WIDTH if shape == "fanout" else 1


def draw_sessions(shape: str, requests_per_s: float, seconds: float, seed: int) -> list[Session]:
    """Poisson sessions for ``seconds`` carrying ``requests_per_s`` on average (conditioned on their count)."""
    rng = random.Random(seed)
    count = round(requests_per_s * seconds / mean_requests(shape))
    times = sorted(rng.uniform(0, seconds) for _ in range(count))
    return [draw_session(shape, rng, i, at) for i, at in enumerate(times)]


def messages_of(step: Step, texts: Texts) -> list[dict[str, str]]:
    """A step's first request: its context as the system message (when it has one) and its own message."""
    own = {"role": "user", "content": texts.get(step.message, 0, step.message_tokens)}
    if not step.context_tokens:
        return [own]
    return [{"role": "system", "content": texts.get(step.context, 0, step.context_tokens)}, own]


# -- driving ------------------------------------------------------------------------------------------------------------
async def run_session(session: aiohttp.ClientSession, arm: Arm, s: Session, texts: Texts, t0: float,
                      on_done: Callable[[Outcome], None] = lambda _: None) -> list[Outcome]:
    """Send ``s`` through ``arm``: an episode's steps at once; a conversation's one after another, each with the whole
    history, ``THINK_S`` after the previous answer; stops at a failed turn. ``on_done`` hears each request as it ends."""
    async def one(messages: list[dict[str, str]], natural: int) -> Outcome:
        result = await send(session, arm, messages, natural, t0)
        on_done(result)
        return result

    out: list[Outcome]
    if s.together:
        out = list(await asyncio.gather(*(one(messages_of(step, texts), step.output) for step in s.steps)))
    else:
        out = []
        history: list[dict[str, str]] = []
        for turn, step in enumerate(s.steps):
            messages = [*history, *messages_of(step, texts)]
            result = await one(messages, step.output)
            out.append(result)
            if result.status != 200 or turn + 1 == len(s.steps):
                break
            history = [*messages, {"role": "assistant", "content": result.content}]
            await asyncio.sleep(THINK_S)
    for result in out:
        result.arrived, result.key = s.at, s.key
    return out


async def drive(arm: Arm, sessions: list[Session], texts: Texts) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as client:
        t0 = time.perf_counter()

        async def one(s: Session) -> list[Outcome]:
            await asyncio.sleep(max(0.0, t0 + s.at - time.perf_counter()))
            return await run_session(client, arm, s, texts, t0)

        return [r for batch in await asyncio.gather(*(one(s) for s in sessions)) for r in batch]


async def calibrate(shape: str, urls: dict[str, str]) -> dict[str, float]:
    """Requests per second each engine completes alone within ``CAL_S`` after ``CAL_WARM_S``, closed loop: slots + 1
    conversations or requests of ``shape`` (``tenants``: its own quarter of the groups, each group's prompt sent once
    first), or one episode at a time (``fanout``: its width alone saturates an engine). What is still running at the
    end is abandoned."""
    done: list[tuple[str, float]] = []
    texts = Texts(f"calibrate-{shape}-{time.time_ns()}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as client:
        async def worker(index: int, name: str, url: str, slot: int) -> None:
            rng = random.Random(f"{shape}-{name}-{slot}")
            arm = Arm(name, base=url + "/v1")
            mine = range(index, GROUPS, len(urls))
            n = 0
            while True:
                n += 1
                s = draw_session(shape, rng, 10_000 * (index * 100 + slot) + n, groups=mine)
                await run_session(client, arm, s, texts, 0.0,
                                  lambda r: done.append((name, r.done_s)) if r.status == 200 else None)

        if shape == "tenants":
            async def prime(index: int, url: str) -> None:
                arm = Arm("prime", base=url + "/v1")
                for group in range(index, GROUPS, len(urls)):
                    step = Step(f"g{group}", SYSTEM_TOKENS, f"g{group}-u0", QUESTION_TOKENS, 1)
                    await send(client, arm, messages_of(step, texts), 1, 0.0)
            await asyncio.gather(*(prime(i, url) for i, url in enumerate(urls.values())))
        tasks = [asyncio.create_task(worker(i, name, url, slot)) for i, (name, url) in enumerate(urls.items())
                 for slot in range(1 if shape == "fanout" else PROFILES[dict(ENGINES)[name]].max_num_seqs + 1)]
        await asyncio.sleep(CAL_WARM_S)
        start = time.perf_counter()
        await asyncio.sleep(CAL_S)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    counted = Counter(name for name, at in done if start <= at < start + CAL_S)
    return {name: counted[name] / CAL_S for name in urls}


async def prime_groups(arm: Arm, texts: Texts) -> None:
    """``tenants``: every group's system prompt once through the arm (8 at a time), so each arm starts with its own
    placement of every group, as a fleet that has served these tenants before would."""
    groups = list(range(GROUPS))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as client:
        async def worker() -> None:
            while groups:
                group = groups.pop(0)
                step = Step(f"g{group}", SYSTEM_TOKENS, f"g{group}-u0", QUESTION_TOKENS, 1)
                await send(client, arm, messages_of(step, texts), 1, 0.0)
        await asyncio.gather(*(worker() for _ in range(sum(PROFILES[p].max_num_seqs for _, p in ENGINES))))


# -- figures ------------------------------------------------------------------------------------------------------------
def figures(results: list[Outcome], warm: float) -> dict[str, Any]:
    """The window's figures (module docstring): sessions arriving from ``warm`` on."""
    results = [r for r in results if r.arrived >= warm]
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None] + [math.inf] * (len(results) - len(ok))
    prompt = sum(r.prompt_tokens for r in ok)
    episodes: dict[int, list[Outcome]] = {}
    for r in results:
        episodes.setdefault(r.key, []).append(r)
    makespans = [max(r.done_s for r in rs) - min(r.started for r in rs)
                 if all(r.status == 200 for r in rs) else math.inf for rs in episodes.values()]
    end = max((r.done_s for r in ok), default=warm + 1.0)
    return {
        "n": len(results), "ok": len(ok),
        "ttft_p50": pct(ttft, 50) if ttft else NAN, "ttft_p90": pct(ttft, 90) if ttft else NAN,
        "hit": sum(r.cached_tokens for r in ok) / prompt if prompt else NAN,
        "throughput": sum(r.completion_tokens for r in ok) / max(1e-9, end - warm),
        "makespan_p50": pct(makespans, 50) if makespans else NAN,
        "makespan_p90": pct(makespans, 90) if makespans else NAN,
        "sessions": len(episodes),
        "reasons": Counter(r.reason for r in results if r.reason),
    }


@dataclass
class Cell:
    shape: str
    level: float
    rate: float
    figures: dict[str, dict[str, Any]]
    order: list[str]


def targets(cell: Cell) -> list[Target]:
    """Sluice against the best other arm of the cell (module docstring)."""
    f, others = cell.figures, [a for a in cell.figures if a != "sluice"]
    where = f"{cell.shape} {cell.level:.0%}"

    def best(key: str, low: bool) -> tuple[str, float]:
        name = (min if low else max)(others, key=lambda a: f[a][key])
        return name, f[name][key]

    out = []
    name, value = best("ttft_p90", True)
    out.append(Target(f"{where}: sluice TTFT p90 <= the best other arm's ({name})", f["sluice"]["ttft_p90"], value,
                      at_least=False, unit="s"))
    if cell.shape == "tenants":
        name, value = best("hit", False)
        out.append(Target(f"{where}: sluice hit rate >= the best other arm's ({name})", f["sluice"]["hit"], value))
    if cell.shape == "fanout":
        name, value = best("makespan_p90", True)
        out.append(Target(f"{where}: sluice makespan p90 <= the best other arm's ({name})",
                          f["sluice"]["makespan_p90"], value, at_least=False, unit="s"))
    return out


def _row(name: str, s: dict[str, Any], shape: str) -> str:
    reasons = ", ".join(f"{k} {n}" for k, n in s["reasons"].most_common(3)) or "-"
    makespan = f" {s['makespan_p50']:.2f} / {s['makespan_p90']:.2f} |" if shape == "fanout" else ""
    return (f"| {name} | {s['ok']}/{s['n']} | {s['ttft_p50']:.2f} / {s['ttft_p90']:.2f} |{makespan} {s['hit']:.1%} | "
            f"{s['throughput']:.0f} | {reasons} |")


def _table(cell: Cell) -> str:
    makespan = " makespan p50 / p90 (s) |" if cell.shape == "fanout" else ""
    rule = "---|" if cell.shape == "fanout" else ""
    rows = "\n".join(_row(name, cell.figures[name], cell.shape) for name in ARMS if name in cell.figures)
    return (f"#### {cell.shape}, {cell.level:.0%} ({cell.rate:.2f} requests/s; arms in the order "
            f"{', '.join(cell.order)})\n\n| arm | ok / sent | TTFT p50 / p90 (s) |{makespan} hit rate | tok/s | "
            f"route reasons |\n|---|---|---|{rule}---|---|---|\n{rows}\n")


# -- the run ------------------------------------------------------------------------------------------------------------
def run_shapes_bench(quick: bool = False, shapes: list[str] | None = None) -> int:
    """Every shape at its levels (``--quick``: fewer levels, shorter windows); writes ``bench/results/shapes.md``
    (``shapes-quick.md``; a run narrowed to some shapes: ``shapes-partial.md``). Returns 1 when a target is missed."""
    shapes = shapes or list(SHAPES)
    warm, window = (QUICK_WARM_S, QUICK_WINDOW_S) if quick else (WARM_S, WINDOW_S)
    started = time.monotonic()
    cells: list[Cell] = []
    capacities: list[str] = []
    notes: list[str] = []
    with _sims() as urls:
        ports = [int(u.rsplit(":", 1)[1]) for u in urls.values()]
        engines = [{"name": n, "url": u, "max_num_seqs": PROFILES[p].max_num_seqs}
                   for (n, p), u in zip(ENGINES, urls.values())]
        slots = [PROFILES[p].max_num_seqs for _, p in ENGINES]
        for shape in shapes:
            measured = asyncio.run(calibrate(shape, urls))
            capacity = sum(measured.values())
            capacities.append(f"- `{shape}`: " + ", ".join(f"{n} {r:.2f}" for n, r in measured.items())
                              + f" requests/s; fleet {capacity:.2f}")
            print(capacities[-1], flush=True)
            weights = [max(1, round(100 * r / capacity)) for r in measured.values()]
            with gateway([dict(e) for e in engines]) as sluice, \
                    plain_envoy_arm(ports, "LEAST_REQUEST", weights, slots, concurrency=1) as lrw, \
                    plain_envoy_arm(ports, "RING_HASH", hash_header=HASH_HEADER) as ring, \
                    epp_arm(urls, seed=SEED) as epp:
                arms = {"sluice": Arm("sluice", sluice["base_url"] + "/v1"),
                        "LR+w+cap": Arm("LR+w+cap", lrw.base + "/v1"),
                        "ring": Arm("ring", ring.base + "/v1", hashed=True),
                        EPP: Arm(EPP, epp.base + "/v1")}
                levels = (QUICK_LEVELS if quick else LEVELS)[shape]
                for level, order in zip(levels, rotated_rounds(list(ARMS), len(levels))):
                    sessions = draw_sessions(shape, level * capacity, warm + window * WINDOW_FACTOR.get(shape, 1.0),
                                             SEED + SHAPES.index(shape) * 1000 + round(level * 100))
                    cell = Cell(shape, level, level * capacity, {}, order)
                    for name in order:
                        _wait_idle(urls)
                        texts = Texts(f"{shape}-{level}-{name}-{time.time_ns()}")
                        if shape == "tenants":
                            asyncio.run(prime_groups(arms[name], texts))
                            _wait_idle(urls)
                        results = asyncio.run(drive(arms[name], sessions, texts))
                        cell.figures[name] = s = figures(results, warm)
                        makespan = f" makespan p90 {s['makespan_p90']:.2f} s" if shape == "fanout" else ""
                        print(f"  {shape} {level:.0%} {name}: {s['ok']}/{s['n']} TTFT p50/p90 {s['ttft_p50']:.2f}/"
                              f"{s['ttft_p90']:.2f} s hit {s['hit']:.1%}{makespan}", flush=True)
                    cells.append(cell)
                notes.append(f"`{shape}`: {_epp_note(epp)}")
    all_targets = [t for cell in cells for t in targets(cell)]
    doc = (__doc__ or "").format(
        WORLD=sim_world([p for _, p in ENGINES], "per shape, below."), MAX_TOKENS=MAX_TOKENS,
        TURNS_MEAN=f"{TURNS_MEAN:.2f}", TURNS_MAX=TURNS_MAX, USER_MEAN=USER_MEAN, ANSWER_MEAN=ANSWER_MEAN,
        SIGMA=SIGMA, ANSWER_SCALE=ANSWER_SCALE, THINK_S=THINK_S, GROUPS=GROUPS, USERS=USERS,
        SYSTEM_TOKENS=SYSTEM_TOKENS, QUESTION_TOKENS=QUESTION_TOKENS, TENANT_OUTPUT=TENANT_OUTPUT,
        TENANT_KV=GROUPS * (SYSTEM_TOKENS + USERS * QUESTION_TOKENS) / sum(
            PROFILES[p].kv_capacity_tokens for _, p in ENGINES),
        FANOUT_CONTEXT=FANOUT_CONTEXT, FANOUT_WIDTH=FANOUT_WIDTH, FANOUT_TASK=FANOUT_TASK,
        FANOUT_OUTPUT=FANOUT_OUTPUT, CAL_S=CAL_S, CAL_WARM_S=CAL_WARM_S, WARM_S=warm)
    body = f"""{doc}
Run: {'`--quick`: ' if quick else ''}{warm:g} + {window:g} s of arrivals per cell and arm; {
        (time.monotonic() - started) / 60:.1f} min.

## Measured capacity

{chr(10).join(capacities)}

## Targets

{verdicts(all_targets)}

## Cells

TTFT and makespan in seconds over every request (a failed one never answered).

{chr(10).join(_table(c) for c in cells)}
## The EPP arm

{chr(10).join(notes)}
"""
    name = "shapes" + ("-quick" if quick else "") + ("-partial" if shapes != list(SHAPES) else "")
    path = write_report(name, "sluice bench shapes: the field's workload shapes", body)
    print(body[body.index("## Targets"):body.index("## Cells")])
    print(f"report: {path}")
    return exit_code(all_targets)
