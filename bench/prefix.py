"""``sluice bench prefix``: prefix-cache-aware routing (issue 14) against cache-blind and cache-keyed routing, on four
simulated engines of two speeds whose prefix caches work like vLLM's (enginesim/prefixcache.py).

Fleet: ``spark-a``, ``spark-b`` (prefill 4,000 tok/s, decode 49 / 88 tok/s at 1 / 2 streams, 95k KV tokens) and
``thor-a``, ``thor-b`` (1,500 tok/s, 18 / 51 tok/s, 132k KV tokens), 2 slots each, simulator speed x{SPEED}. Times are
reported in emulated seconds (wall x {SPEED}).

Workloads (every prompt is pseudo-random words, 4 characters a token; answers are short, drawn per request from a
lognormal with median {OUT_MEDIAN} tokens, sigma 0.5, sent as ``sim_output_tokens``, ``max_tokens`` {MAX_TOKENS}):

- ``system``: {GROUPS} groups, each with its own {SYSTEM_TOKENS}-token system prompt; each request is one group's system
  prompt (group drawn uniformly) and a fresh ~{QUESTION_TOKENS}-token question. All prefixes together ({GROUPS} x
  {SYSTEM_TOKENS} tokens) are about 2x the KV of the largest engine (2.7x the smallest), so no engine can cache them all:
  where a group's requests go decides whether they hit.
- ``chat``: conversations, each opening with its own {DOC_TOKENS}-token document and a question, then {TURNS} turns in all;
  every turn resends the whole history (the assistant's answers as they came back) plus a new question, {THINK_S:g} s
  (emulated) after the previous answer ended. Conversations arrive as a Poisson process.
- ``control``: no sharing: every prompt is unique text as long as a ``system`` request ({SYSTEM_TOKENS} + question);
  measured over {CONTROL_WINDOW_FACTOR} times the window, arms ``sluice``, ``sluice-noindex`` and ``LR`` only (its rate is
  low, and its targets compare the two sluice arms).

Capacity and loads: for each workload, every engine is saturated alone (closed loop, slots + 1 clients, {CAL_S:g} s wall
after {CAL_WARM_S:g} s of warm-up; ``system``: after one request per group) on its own share of that workload's prefixes
(``system``: every fourth group; ``chat``: whole conversations; ``control``: unique prompts), so the sum is what the fleet
serves when each prefix is cached where its requests go: the capacity a prefix-aware router can use. Loads are {LEVELS}
of it. On ``control`` nothing is shared, and its line is the cold capacity of prompts as long as ``system``'s. A
cache-blind router offered 90% of a shared workload's capacity is therefore overloaded when the prompts' prefill is most
of the work (that is the point: the cache is capacity).

Arrivals: Poisson given its count (as many uniform times as the rate implies, sorted), one seed per cell, so every arm
gets the same arrival times, groups, lengths and answers. On ``system`` each arm first sends every group's system prompt
once through itself (8 at a time, the fleet's slots; not measured), so it starts with its own placement of every prefix,
as a fleet that has served these groups before would: starting cold at 90% of the warm capacity is a transient no router
recovers from within minutes (every group's first request prefills its whole prompt at a third of the warm rate). Then
each arm's arrivals run {WARM_S:g} s (wall) before the measured window of {WINDOW_S:g} s; the figures are those of the
requests (``chat``: conversations) that arrive in the window. Each arm's prompt texts carry their own random salt:
an arm never finds prefixes an earlier arm left in the engines' caches or in sluice's index (what the engines still hold
from earlier arms is unrelated text, evicted as new prompts need room, the same for every arm after the first).

The client answers errors as the official openai client does with its defaults: a 408, 409, 429 or 5xx (a shed) is
retried twice, after its Retry-After (when within 60 s; else 0.5 s doubling), and a request's TTFT counts from its
first attempt, so a shed's wait is in it. A turn still failing after that ends its conversation. The plain Envoy arms
and the oracle never answer an error here; the last column counts what sluice answered before a retry.

Arms (the same engines, one after another):

- ``sluice``: ``sluice up`` with its defaults (prefix routing on).
- ``sluice-noindex``: a second ``sluice up`` on the same engines with ``admission.prefix_routing: false`` (the engines
  still cache; hits are whatever finish-soonest happens to produce).
- ``LR``: plain Envoy ``LEAST_REQUEST``, equal weights (envoy/bench-plain.yaml).
- ``ring``: plain Envoy ``RING_HASH`` on a header the client sets to a hash of the request's first message (the system
  prompt; a conversation's document): what a plain Envoy user could do to keep a prefix on one engine.
- ``EPP``: the Gateway API Inference Extension's default endpoint picker (llm-d's EPP) reimplemented from its v1.5.0
  source (bench/epp.py, bench/epp_arm.py): every engine's ``/metrics`` scraped every 50 ms, each request sent to the
  highest of 2 x queue score (``vllm:num_requests_waiting``, min-max normalised) + 2 x (1 -
  ``vllm:kv_cache_usage_perc``) + 3 x prefix score (the share of the prompt's first 256 blocks of 64 characters its
  index says the engine holds: it records each request's blocks for the engine it picked, an LRU of ``num_gpu_blocks``
  entries per engine), ties at random; no cap, no shedding. Its own asyncio proxy in the data path (no Envoy). The
  cache-aware baseline the field deploys.
- ``oracle``: knows every engine's cache exactly: before each request the client asks every simulator
  (``POST /sim/cache``) how many of this prompt's tokens it holds right now and how many requests it runs and queues,
  and sends the request straight to the engine (no Envoy hop) holding the most among those with a free slot; when none
  has a free slot, to the one holding the most (ties: the shortest queue, then spark before thor). It is a cache-greedy
  router with perfect knowledge, the upper reference for hit rate; it is not a bound on TTFT (it ignores speed and queues
  on a full engine when that engine holds the prompt).
- ``sluice-2rep`` (``system`` only, not with ``--quick``): ``sluice up --replicas 2 --store valkey``: Envoy spreads Checks
  over two control planes, each deriving its prefix index from its own admissions and the other's admission events.

Figures: hit rate = prompt tokens the engines reported cached (``usage.prompt_tokens_details.cached_tokens``) over all
prompt tokens, completed requests only; TTFT p50 / p90 of completed requests (first content chunk, client side);
throughput = completion tokens per emulated second from the first arrival to the last completion; share = requests each
engine served (``/sim/stats``), and the largest share over that engine's fair share: its part of the fleet's measured
capacity for the workload (the engines are unequal, so a capacity-aware router should give a spark more than a thor;
an even 1/4 is shown beside it, ``even``).

Targets (issue 14): on ``system`` and ``chat``, sluice's hit rate >= 0.9 x the oracle's; at 90%, sluice's TTFT p50 at
least 3x lower than LR's and its throughput >= 1.5x LR's; no engine above 1.5x its fair share of sluice's requests; on
``control``, sluice within noise of ``sluice-noindex`` (TTFT p50 and p90 at most 1.1x, throughput at least 0.95x).
Issue 41: on ``system`` and ``chat`` also, at every level, sluice's TTFT p50 (a request that failed counted as never
answered) at most, and its hit rate at least, the best of ``LR``, ``ring`` and ``EPP`` in the same cell.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from enginesim.profiles import PROFILES
from bench.common import by_round, interleaved, pct, write_report
from bench.epp_arm import ENDPOINT_HEADER, EppArm, describe, epp_arm
from bench.plain import plain_envoy_arm
from bench.workload import bare_sim, gateway, sim_stats
from sluice.up import REPLICA_PORT_STRIDE

SPEED = 1.0
ENGINES = (("spark-a", "spark"), ("spark-b", "spark"), ("thor-a", "thor"), ("thor-b", "thor"))
MODEL = "cortex"
GROUPS = 32
SYSTEM_TOKENS = 8000
QUESTION_TOKENS = 40
DOC_TOKENS = 6000
"""A conversation's opening document (RAG context, an agent's tool definitions). It was 2500 until 47beb74 (2026-12-01):
then a turn's prefill was so small a part of its work that even the oracle served only 1.30x LR's throughput at 90% load
(bench/results/README.md, 2026-12-01, 4578ca6), and issue 14's 1.5x target measured the workload, not the router."""
TURNS = 4
THINK_S = 2.0
OUT_MEDIAN = 40
MAX_TOKENS = 256
LEVELS = (0.5, 0.9)
WARM_S = 30.0
"""Wall seconds of arrivals before the measured window: every group's prefix has been sent somewhere by then."""
WINDOW_S = 40.0
QUICK_WARM_S = 20.0
QUICK_WINDOW_S = 20.0
CONTROL_WINDOW_FACTOR = 3
"""``control``'s measured window is this many times the others'. Its arrival rate is a third of ``system``'s (every
prompt is cold), so a plain window held 12 requests (``--quick``, 50%) to 27: the largest share moved 0.2x of fair with
one request, and sluice against sluice-noindex (the same decisions on prompts that share nothing) differed by 27% at the
TTFT p50. Its targets compare sluice with sluice-noindex only, so ``ring`` and the ``oracle`` (both about prefixes) do
not run on it, which keeps the cells' time about what five arms took before."""
CONTROL_ARMS = ("sluice", "sluice-noindex", "LR")
CAL_S = 20.0
CAL_WARM_S = 5.0
SEED = 14_2026
ROUNDS = 2
"""Rounds per cell (``--rounds``): every arm runs once a round, in an order rotated each round; each round has its own
seeded arrivals (seed + ``ROUND_SEED_STRIDE`` x round), the same for every arm of that round."""
ROUND_SEED_STRIDE = 10_007
WORKLOADS = ("system", "chat", "control")
"""What ``sluice bench prefix`` runs by default; ``kv-pressure`` runs only when named (its engines differ)."""
EPP = "EPP"
"""The EPP-like arm (bench/epp_arm.py)."""
ARMS = ("sluice", "sluice-noindex", "LR", "ring", EPP, "oracle")
HASH_HEADER = "x-prefix-hash"
KV_WORKLOAD = "kv-pressure"
"""Prefixes under KV pressure (issue 38 item 5): its own fleet and arms, ``run_kv_pressure``."""
KV_GROUPS = 8
KV_SYSTEM_TOKENS = 2000
KV_BLOCKS = 384
"""Each engine's KV in 16-token blocks (``sluice sim --num-gpu-blocks``): 6,144 tokens, three 2,000-token prompts at
most while nothing runs, about two and a half while two requests do."""
KV_LEVEL = 0.7
KV_OFF = {"prefix_eviction_charge": 0}
"""The ``sluice-before`` arm's admission settings: the capacity-aware prefix affinity off, as sluice decided before
it."""
KV_ARMS = ("sluice", "sluice-before", "pin", "LR+w+cap", "ring", EPP)
KV_BASELINES = ("LR+w+cap", "ring", EPP)
"""The arms ``kv-pressure``'s last two targets take the best of: the Envoy arms and the EPP arm."""
PREFIX_BASELINES = ("LR", "ring", EPP)
"""The baseline arms of the ``system`` and ``chat`` cells: sluice is judged against the best of them too."""
FAIR = 1 / len(ENGINES)
_WORDS = [hashlib.blake2b(str(i).encode(), digest_size=4).hexdigest()[: 3 + i % 6] for i in range(4096)]


def text(rng: random.Random, tokens: int) -> str:
    """``tokens`` tokens (4 characters each) of pseudo-random words."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[: tokens * 4]


def _rng(*parts: object) -> random.Random:
    return random.Random(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest())


def draw_output(rng: random.Random) -> int:
    return max(1, min(MAX_TOKENS, round(rng.lognormvariate(math.log(OUT_MEDIAN), 0.5))))


# -- requests -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One request of ``system`` / ``control``, or one conversation of ``chat`` (``naturals`` per turn)."""

    at: float
    key: int
    """The group (system), the conversation (chat), the request (control)."""
    naturals: tuple[int, ...]
    question: int


def groups_of(workload: str) -> int:
    """How many shared system prompts ``workload`` draws its requests from (0: none shared)."""
    return {"system": GROUPS, KV_WORKLOAD: KV_GROUPS}.get(workload, 0)


def system_tokens_of(workload: str) -> int:
    return KV_SYSTEM_TOKENS if workload == KV_WORKLOAD else SYSTEM_TOKENS


def draw_jobs(workload: str, rate: float, seconds: float, seed: int) -> list[Job]:
    """Arrivals for ``seconds`` wall seconds at ``rate`` requests per wall second (``chat``: conversations at rate / TURNS)."""
    rng = random.Random(seed)
    per = TURNS if workload == "chat" else 1
    count = int(rate * seconds / per)
    times = sorted(rng.uniform(0, seconds) for _ in range(count))
    groups = groups_of(workload)
    return [Job(at, rng.randrange(groups) if groups else i,
                tuple(draw_output(rng) for _ in range(per)), rng.randrange(10**9)) for i, at in enumerate(times)]


@dataclass
class Texts:
    """Prompt texts of one arm of one cell (``salt``): generated once, looked up per request."""

    salt: str
    _cache: dict[tuple[str, int], str] = field(default_factory=dict)

    def get(self, kind: str, key: int, tokens: int) -> str:
        if (kind, key) not in self._cache:
            self._cache[(kind, key)] = text(_rng(self.salt, kind, key), tokens)
        return self._cache[(kind, key)]

    def question(self, key: int) -> str:
        return "Question: " + text(_rng(self.salt, "q", key), QUESTION_TOKENS - 3)


def first_messages(workload: str, job: Job, texts: Texts) -> list[dict[str, str]]:
    if groups_of(workload):
        return [{"role": "system", "content": texts.get(workload, job.key, system_tokens_of(workload))},
                {"role": "user", "content": texts.question(job.question)}]
    if workload == "control":
        return [{"role": "system", "content": texts.get("unique", job.key, SYSTEM_TOKENS)},
                {"role": "user", "content": texts.question(job.question)}]
    return [{"role": "user", "content": texts.get("doc", job.key, DOC_TOKENS) + "\n" + texts.question(job.question)}]


# -- one request ------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int
    started: float
    arrived: float = 0.0
    """When its job (a ``chat`` conversation: its first turn) arrived, wall seconds into the arm's run."""
    ttft_s: float | None = None
    done_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    content: str = ""
    engine: str = ""
    reason: str = ""
    shed_reasons: list[str] = field(default_factory=list)
    """What each attempt the client repeated (``CLIENT_RETRIES``) was answered (sluice's ``x-sluice-route-reason``,
    else the status)."""
    key: int = -1
    """Its job's key: the group whose system prompt it carries (``system``, ``kv-pressure``)."""


@dataclass
class Arm:
    name: str
    base: str = ""
    """The OpenAI base URL (Envoy); empty for the oracle."""
    engines: dict[str, str] = field(default_factory=dict)
    """Engine name -> URL (the oracle sends there directly)."""
    hashed: bool = False
    pinned: bool = False
    """The pinning oracle: group ``g`` always goes to engine ``g mod len(ENGINES)`` (``pins``, set per run)."""
    pins: dict[str, str] = field(default_factory=dict)
    """Hash of a request's first message (its group's system prompt) -> the engine the oracle sends it to."""


def prompt_hash(messages: list[dict[str, str]]) -> str:
    """What the ring-hash arm's header carries and the pinning oracle looks up: a hash of the first message."""
    return hashlib.blake2b(messages[0]["content"].encode(), digest_size=8).hexdigest()


async def _oracle_pick(session: aiohttp.ClientSession, arm: Arm, body: dict[str, Any]) -> str:
    """The engine the oracle sends ``body`` to (module docstring)."""
    async def ask(name: str, url: str) -> tuple[str, dict[str, Any]]:
        async with session.post(url + "/sim/cache", json=body) as response:
            return name, dict(await response.json())

    views = await asyncio.gather(*(ask(n, u) for n, u in arm.engines.items()))
    order = {name: i for i, (name, _) in enumerate(ENGINES)}

    def key(item: tuple[str, dict[str, Any]]) -> tuple[int, int, int]:
        name, v = item
        return (-int(v["cached_tokens"]), int(v["running"]) + int(v["waiting"]), order[name])

    free = [x for x in views if int(x[1]["running"]) + int(x[1]["waiting"]) < int(x[1]["max_num_seqs"])]
    return min(free or views, key=key)[0]


CLIENT_RETRIES = 2
"""The official openai client's default (``DEFAULT_MAX_RETRIES``): a 408, 409, 429 or 5xx answer is retried twice, after
its Retry-After when that is within 60 s, else after 0.5 s doubling (at most 8 s) less up to a quarter of jitter."""


def _retry_delay(response: aiohttp.ClientResponse, retries: int, rng: random.Random) -> float:
    """The openai client's ``_calculate_retry_timeout``: Retry-After (``-ms`` first) when 0 < it <= 60 s, else backoff."""
    for header, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            value = float(response.headers.get(header, "")) / divisor
        except ValueError:
            continue
        if 0 < value <= 60:
            return value
    return min(0.5 * 2.0 ** retries, 8.0) * (1 - 0.25 * rng.random())


def _retried(status: int) -> bool:
    return status in (408, 409, 429) or status >= 500


async def send(session: aiohttp.ClientSession, arm: Arm, messages: list[dict[str, str]], natural: int,
               t0: float) -> Outcome:
    """One request as the openai client sends it: retried on 408/409/429/5xx (``CLIENT_RETRIES``, after Retry-After);
    TTFT and the outcome count from the first attempt, so a shed's wait is in the retried request's TTFT."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                            "stream_options": {"include_usage": True}, "sim_output_tokens": natural}
    headers: dict[str, str] = {}
    if arm.hashed:
        headers[HASH_HEADER] = prompt_hash(messages)
    started = time.perf_counter()
    result = Outcome(0, started - t0)
    rng = random.Random(f"{messages[-1]['content'][:64]}-{natural}")
    try:
        for attempt in range(CLIENT_RETRIES + 1):
            if arm.pins:
                engine = arm.pins[prompt_hash(messages)]
                url, result.engine = arm.engines[engine] + "/v1/chat/completions", engine
            elif arm.engines:
                engine = await _oracle_pick(session, arm, body)
                url, result.engine = arm.engines[engine] + "/v1/chat/completions", engine
            else:
                url = arm.base + "/chat/completions"
            parts: list[str] = []
            async with session.post(url, json=body, headers=headers) as response:
                result.status = response.status
                result.engine = (response.headers.get("x-sluice-engine") or response.headers.get(ENDPOINT_HEADER)
                                 or result.engine)
                result.reason = response.headers.get("x-sluice-route-reason", "")
                if response.status != 200:
                    await response.read()
                    if attempt < CLIENT_RETRIES and _retried(response.status):
                        result.shed_reasons.append(result.reason or str(response.status))
                        delay = _retry_delay(response, attempt, rng)
                        await asyncio.sleep(delay / SPEED)
                        continue
                    break
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or ():
                        delta = (choice.get("delta") or {}).get("content")
                        if delta:
                            if result.ttft_s is None:
                                result.ttft_s = time.perf_counter() - started
                            parts.append(delta)
                    usage = chunk.get("usage")
                    if usage:
                        result.prompt_tokens = int(usage["prompt_tokens"])
                        result.completion_tokens = int(usage["completion_tokens"])
                        result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                result.content = "".join(parts)
                break
    except (aiohttp.ClientError, asyncio.TimeoutError):
        result.status = 599
    result.done_s = time.perf_counter() - t0
    return result


async def drive(arm: Arm, workload: str, jobs: list[Job], texts: Texts, urls: dict[str, str],
                warm: float) -> tuple[list[Outcome], dict[str, dict[str, Any]]]:
    """Run ``jobs``; returns every request's outcome and the engines' ``/sim/stats`` when the measured window began."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def snapshot() -> dict[str, dict[str, Any]]:
            await asyncio.sleep(max(0.0, t0 + warm - time.perf_counter()))
            out = {}
            for name, url in urls.items():
                async with session.get(url + "/sim/stats") as response:
                    out[name] = dict(await response.json())
            return out

        async def one(job: Job) -> list[Outcome]:
            await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
            messages = first_messages(workload, job, texts)
            out = []
            for turn, natural in enumerate(job.naturals):
                result = await send(session, arm, messages, natural, t0)
                result.arrived, result.key = job.at, job.key
                out.append(result)
                if result.status != 200 or turn + 1 == len(job.naturals):
                    break
                await asyncio.sleep(THINK_S / SPEED)
                messages = [*messages, {"role": "assistant", "content": result.content},
                            {"role": "user", "content": texts.question(job.question * 31 + turn + 1)}]
            return out

        at_window = asyncio.create_task(snapshot())
        results = [r for batch in await asyncio.gather(*(one(j) for j in jobs)) for r in batch]
        return results, await at_window


async def prime(arm: Arm, texts: Texts, workload: str = "system",
                engines: tuple[tuple[str, str], ...] = ENGINES) -> None:
    """Every group's system prompt once, through the arm itself (it places them), the fleet's slots at a time: the arm starts its
    measured arrivals with its own placement of every prefix, as a fleet that has served these groups before would."""
    groups = list(range(groups_of(workload)))
    slots = sum(PROFILES[profile].max_num_seqs for _, profile in engines)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            while groups:
                group = groups.pop(0)
                await send(session, arm, first_messages(workload, Job(0.0, group, (1,), -group), texts), 1, 0.0)
        await asyncio.gather(*(worker() for _ in range(slots)))


# -- calibration ------------------------------------------------------------------------------------------------------
async def calibrate(workload: str, urls: dict[str, str]) -> dict[str, float]:
    """Requests per wall second each engine completes alone, closed loop (slots + 1), on its own share of the workload
    (``system``, ``kv-pressure``: every ``len(urls)``-th group, after one request per group of its share, so its
    prefixes are cached when the measurement starts)."""
    groups = groups_of(workload)
    counted: Counter[str] = Counter()
    texts = Texts(f"calibrate-{workload}-{time.time_ns()}")
    measuring = [False]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        if groups:
            async def prime(index: int, url: str) -> None:
                for group in range(index, groups, len(urls)):
                    job = Job(0.0, group, (1,), group)
                    await send(session, Arm("prime", base=url + "/v1"), first_messages(workload, job, texts), 1, 0.0)
            await asyncio.gather(*(prime(i, url) for i, url in enumerate(urls.values())))
        stop_at = time.perf_counter() + CAL_WARM_S + CAL_S
        async def worker(index: int, name: str, url: str, slot: int) -> None:
            rng = random.Random(f"{workload}-{name}-{slot}")
            arm = Arm(name, base=url + "/v1")
            n = 0
            while time.perf_counter() < stop_at:
                n += 1
                key = (rng.randrange(groups // len(urls)) * len(urls) + index if groups else rng.randrange(10**9))
                job = Job(0.0, key, tuple(draw_output(rng) for _ in range(TURNS if workload == "chat" else 1)),
                          rng.randrange(10**9))
                messages = first_messages(workload, job, texts)
                for turn, natural in enumerate(job.naturals):
                    result = await send(session, arm, messages, natural, 0.0)
                    if result.status == 200 and measuring[0] and time.perf_counter() < stop_at:
                        counted[name] += 1
                    if time.perf_counter() >= stop_at or turn + 1 == len(job.naturals):
                        break
                    messages = [*messages, {"role": "assistant", "content": result.content},
                                {"role": "user", "content": texts.question(job.question + turn + 1)}]

        tasks = [asyncio.create_task(worker(i, name, url, slot))
                 for i, (name, url) in enumerate(urls.items())
                 for slot in range(PROFILES[dict(ENGINES)[name]].max_num_seqs + 1)]
        await asyncio.sleep(CAL_WARM_S)
        measuring[0] = True
        await asyncio.gather(*tasks)
    return {name: counted[name] / CAL_S for name in urls}


# -- the run ----------------------------------------------------------------------------------------------------------
@dataclass
class Cell:
    workload: str
    level: float
    rate: float
    fair: dict[str, float] = field(default_factory=dict)
    """engine -> its part of the workload's measured capacity (its fair share of requests)."""
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)


def _wait_idle(urls: dict[str, str]) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if all((s := sim_stats(u))["running"] == 0 and s["waiting"] == 0 for u in urls.values()):
            time.sleep(1.5)  # the access log closes sluice's tickets; probes see the idle engines
            return
        time.sleep(0.5)


def _span(results: list[Outcome], warm: float) -> float:
    """Wall seconds from the measured window's start to the last completion of a request that arrived in it (1 when
    none completed)."""
    return max((r.done_s for r in results if r.arrived >= warm and r.status == 200 and r.ttft_s is not None),
               default=warm + 1.0) - warm


def summarise(results: list[Outcome], served: dict[str, int], warm: float,
              fair: dict[str, float] | None = None, span: float | None = None) -> dict[str, Any]:
    """The measured window's figures: requests whose job arrived from ``warm`` on. ``fair``: each engine's fair share of
    requests (its part of the measured capacity); an even split without it. Throughput is per emulated second of
    ``span`` (wall seconds; default ``_span``)."""
    span = _span(results, warm) if span is None else span
    results = [r for r in results if r.arrived >= warm]
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    ttft = [r.ttft_s * SPEED for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    total = sum(served.values()) or 1
    nan = float("nan")
    return {
        "n": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "hit": sum(r.cached_tokens for r in ok) / prompt if prompt else nan,
        "ttft_p50": pct(ttft, 50) if ttft else nan, "ttft_p90": pct(ttft, 90) if ttft else nan,
        # A request that failed (shed after its retries) counts as never getting a first token.
        "ttft_p50_all": pct(ttft + [math.inf] * (len(results) - len(ok)), 50) if results else nan,
        "ttft_p90_all": pct(ttft + [math.inf] * (len(results) - len(ok)), 90) if results else nan,
        "throughput": sum(r.completion_tokens for r in ok) / max(1e-9, span * SPEED),
        "served": served,
        "max_share": max(n / total / (fair or {}).get(e, FAIR) for e, n in served.items()) if served else nan,
        "max_even": max(served.values()) / total / FAIR if served else nan,
        "reasons": Counter(r.reason for r in results if r.reason),
        "retried": Counter(why for r in results for why in r.shed_reasons),
        **stickiness(ok),
    }


def stickiness(ok: list[Outcome]) -> dict[str, float]:
    """How a router keeps each group together, over completed requests that carry a group (``key`` >= 0): ``same``, the
    share that went to the engine its group's previous request (by start) went to; ``spread``, the mean number of
    engines a group's requests went to."""
    by_group: dict[int, list[Outcome]] = {}
    for r in sorted((r for r in ok if r.key >= 0 and r.engine), key=lambda r: r.started):
        by_group.setdefault(r.key, []).append(r)
    pairs = [(a.engine, b.engine) for rs in by_group.values() for a, b in zip(rs, rs[1:])]
    nan = float("nan")
    return {"same": sum(a == b for a, b in pairs) / len(pairs) if pairs else nan,
            "spread": sum(len({r.engine for r in rs}) for rs in by_group.values()) / len(by_group) if by_group else nan}


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " "))


@dataclass(frozen=True)
class Segment:
    """One arm's run on one round's arrivals of a cell."""

    results: list[Outcome]
    served: dict[str, int]
    """Requests each engine served in the measured window (its ``/sim/stats``)."""
    hits: int
    queries: int
    """The engines' own ``prefix_cache_hits`` / ``prefix_cache_queries`` over the measured window."""
    wall_s: float


def pool(segments: list[Segment], warm: float, fair: dict[str, float] | None = None) -> dict[str, Any]:
    """An arm's figures over a cell's rounds: ``summarise`` of every round's requests together (served counts summed,
    throughput per second of all the rounds' spans), and under ``rounds`` each round's own figures (the spread)."""
    served = {name: sum(s.served[name] for s in segments) for name in segments[0].served}
    figures = summarise([r for s in segments for r in s.results], served, warm, fair,
                        span=sum(_span(s.results, warm) for s in segments))
    figures["wall_s"] = sum(s.wall_s for s in segments)
    figures["engine_hit"] = sum(s.hits for s in segments) / max(1, sum(s.queries for s in segments))
    figures["rounds"] = [summarise(s.results, s.served, warm, fair) for s in segments]
    return figures


def run_segment(cell: Cell, jobs: list[Job], name: str, arm: Arm, urls: dict[str, str], warm: float) -> Segment:
    """One arm on one round's ``jobs``, from idle engines, with prompt texts of its own (its salt)."""
    _wait_idle(urls)
    texts = Texts(f"{cell.workload}-{cell.level}-{name}-{time.time_ns()}")
    if arm.pinned:
        arm.pins = {prompt_hash(first_messages(cell.workload, Job(0.0, g, (1,), 0), texts)):
                    ENGINES[g % len(ENGINES)][0] for g in range(groups_of(cell.workload))}
    started = time.monotonic()
    if groups_of(cell.workload):
        asyncio.run(prime(arm, texts, cell.workload))
        _wait_idle(urls)
    results, before = asyncio.run(drive(arm, cell.workload, jobs, texts, urls, warm))
    after = {n: sim_stats(u) for n, u in urls.items()}
    return Segment(results, {n: int(after[n]["served"] - before[n]["served"]) for n in urls},
                   int(sum(after[n]["prefix_cache_hits"] - before[n]["prefix_cache_hits"] for n in urls)),
                   int(sum(after[n]["prefix_cache_queries"] - before[n]["prefix_cache_queries"] for n in urls)),
                   time.monotonic() - started)


def run_cell(cell: Cell, arms: dict[str, Arm], urls: dict[str, str], warm: float, window: float,
             replica_ports: list[int], rounds: int = ROUNDS) -> None:
    """Every arm once per round, the arms' order rotated each round (``interleaved``), every arm of a round on that
    round's arrivals (seed + ``ROUND_SEED_STRIDE`` x round); each arm's figures pooled over the rounds (``pool``)."""
    seed = SEED + int(cell.level * 100) + (*WORKLOADS, KV_WORKLOAD).index(cell.workload)
    segments: dict[str, list[Segment]] = {name: [] for name in arms}
    jobs = [draw_jobs(cell.workload, cell.rate, warm + window, seed + ROUND_SEED_STRIDE * n) for n in range(rounds)]
    for number, name in interleaved(list(arms), rounds):
        segment = run_segment(cell, jobs[number], name, arms[name], urls, warm)
        segments[name].append(segment)
        f = summarise(segment.results, segment.served, warm, cell.fair)
        print(f"  {cell.workload} {cell.level:.0%} round {number + 1}/{rounds} {name}: n={f['n']} ok={f['ok']} "
              f"hit {f['hit']:.2f} TTFT p50/p90 {f['ttft_p50']:.2f}/{f['ttft_p90']:.2f} s tok/s "
              f"{f['throughput']:.0f} share {segment.served} ({segment.wall_s:.0f} s)", flush=True)
    for name in arms:
        figures = pool(segments[name], warm, cell.fair)
        if name == "sluice-2rep":
            figures["index_blocks"] = [_metric(p, "sluice_prefix_index_blocks") for p in replica_ports]
            figures["reserve_ms"] = [
                1000 * _metric(p, 'sluice_store_seconds_sum{op="reserve"}')
                / max(1.0, _metric(p, 'sluice_store_seconds_count{op="reserve"}')) for p in replica_ports]
            figures["checks"] = [_metric(p, "sluice_prefix_prompt_tokens_total") for p in replica_ports]
        cell.figures[name] = figures


def spread(figures: dict[str, Any], key: str, spec: str) -> str:
    """`` (rounds a / b)``: an arm's ``key`` in each round, formatted with ``spec``; "" when it ran one round."""
    values = by_round(figures, key)
    return f" (rounds {' / '.join(format(v, spec) for v in values)})" if len(values) > 1 else ""


def kv_verdicts(cell: Cell) -> list[tuple[str, bool, str]]:
    """(target, met, figures) for the ``kv-pressure`` cell (``KV_DOC``). TTFT percentiles count a request that failed
    after its retries as never answered (``ttft_*_all``)."""
    f = cell.figures
    s, pin, before = f["sluice"], f["pin"], f["sluice-before"]

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.inf

    return [
        ("hit rate >= 0.9 x the pinning oracle's", s["hit"] >= 0.9 * pin["hit"],
         f"{s['hit']:.1%}{spread(s, 'hit', '.1%')} vs {pin['hit']:.1%}{spread(pin, 'hit', '.1%')} "
         f"({ratio(s['hit'], pin['hit']):.2f}x)"),
        ("TTFT p50 no worse than sluice without the affinity (sluice-before; <= 1.1x, the run-to-run noise allowed "
         "on control)", s["ttft_p50_all"] <= 1.1 * before["ttft_p50_all"],
         f"{s['ttft_p50_all']:.3f}{spread(s, 'ttft_p50_all', '.3f')} vs {before['ttft_p50_all']:.3f}"
         f"{spread(before, 'ttft_p50_all', '.3f')} s "
         f"({ratio(s['ttft_p50_all'], before['ttft_p50_all']):.2f}x)"),
        *best_baseline_verdicts(f, KV_BASELINES),
    ]


def best_baseline_verdicts(f: dict[str, Any], baselines: tuple[str, ...]) -> list[tuple[str, bool, str]]:
    """sluice's TTFT p50 (a failed request never answered) at most, and its hit rate at least, the best of the
    ``baselines`` arms the cell ran (issue 41: every target against the strongest arm of the same run)."""
    s = f["sluice"]
    base = {name: f[name] for name in baselines if name in f}
    if not base:
        return []
    best_p50 = min(base, key=lambda n: base[n]["ttft_p50_all"])
    best_hit = max(base, key=lambda n: base[n]["hit"])
    return [
        (f"TTFT p50 <= the best baseline arm's ({best_p50})", s["ttft_p50_all"] <= base[best_p50]["ttft_p50_all"],
         f"{s['ttft_p50_all']:.3f}{spread(s, 'ttft_p50_all', '.3f')} vs {base[best_p50]['ttft_p50_all']:.3f}"
         f"{spread(base[best_p50], 'ttft_p50_all', '.3f')} s; "
         + ", ".join(f"{n} {b['ttft_p50_all']:.3f} s" for n, b in base.items())
         + f"; p90 sluice {s['ttft_p90_all']:.2f} s, "
         + ", ".join(f"{n} {b['ttft_p90_all']:.2f} s" for n, b in base.items())),
        (f"hit rate >= the best baseline arm's ({best_hit})", s["hit"] >= base[best_hit]["hit"],
         f"{s['hit']:.1%}{spread(s, 'hit', '.1%')} vs {base[best_hit]['hit']:.1%}{spread(base[best_hit], 'hit', '.1%')}; "
         + ", ".join(f"{n} {b['hit']:.1%}" for n, b in base.items())),
    ]


def verdicts(cell: Cell) -> list[tuple[str, bool, str]]:
    """(target, met, figures) for one cell (module docstring)."""
    if cell.workload == KV_WORKLOAD:
        return kv_verdicts(cell)
    f = cell.figures
    s = f["sluice"]
    out: list[tuple[str, bool, str]] = []
    if cell.workload == "control":
        base = f["sluice-noindex"]
        for key, bound in (("ttft_p50", 1.1), ("ttft_p90", 1.1)):
            ratio = s[key] / base[key] if base[key] else math.inf
            out.append((f"{key} within noise of sluice-noindex (<= {bound}x)", ratio <= bound,
                        f"{s[key]:.2f}{spread(s, key, '.2f')} vs {base[key]:.2f}{spread(base, key, '.2f')} s "
                        f"({ratio:.2f}x)"))
        ratio = s["throughput"] / base["throughput"] if base["throughput"] else math.inf
        out.append(("throughput within noise of sluice-noindex (>= 0.95x)", ratio >= 0.95,
                    f"{s['throughput']:.0f}{spread(s, 'throughput', '.0f')} vs {base['throughput']:.0f}"
                    f"{spread(base, 'throughput', '.0f')} tok/s ({ratio:.2f}x)"))
    else:
        oracle = f["oracle"]["hit"]
        out.append(("hit rate >= 0.9 x oracle's", s["hit"] >= 0.9 * oracle,
                    f"{s['hit']:.1%}{spread(s, 'hit', '.1%')} vs {oracle:.1%}{spread(f['oracle'], 'hit', '.1%')} "
                    f"({s['hit'] / oracle if oracle else math.inf:.2f}x)"))
        if cell.level >= 0.9:
            lr = f["LR"]
            ratio = lr["ttft_p50"] / s["ttft_p50"] if s["ttft_p50"] else math.inf
            out.append(("TTFT p50 >= 3x lower than LR", ratio >= 3,
                        f"{s['ttft_p50']:.2f}{spread(s, 'ttft_p50', '.2f')} vs {lr['ttft_p50']:.2f}"
                        f"{spread(lr, 'ttft_p50', '.2f')} s ({ratio:.1f}x)"))
            ratio = s["throughput"] / lr["throughput"] if lr["throughput"] else math.inf
            out.append(("throughput >= 1.5x LR", ratio >= 1.5,
                        f"{s['throughput']:.0f}{spread(s, 'throughput', '.0f')} vs {lr['throughput']:.0f}"
                        f"{spread(lr, 'throughput', '.0f')} tok/s ({ratio:.2f}x)"))
        out.extend(best_baseline_verdicts(f, PREFIX_BASELINES))
    fair = " / ".join(f"{cell.fair.get(n, FAIR):.0%}" for n in s["served"])
    out.append(("no engine above 1.5x its fair share (its part of the capacity)", s["max_share"] <= 1.5,
                f"largest share {s['max_share']:.2f}x{spread(s, 'max_share', '.2f')} of fair ({' / '.join(map(str, s['served'].values()))} against "
                f"fair {fair}; {s['max_even']:.2f}x an even 1/4)"))
    return out


def _table(cell: Cell) -> str:
    rows = []
    for name, s in cell.figures.items():
        reasons = ", ".join(f"{k} {n}" for k, n in s["reasons"].most_common(4)) or "-"
        retried = ", ".join(f"{k} {n}" for k, n in s["retried"].most_common(3)) or "-"
        rows.append(f"| {name} | {s['ok']}/{s['n']} | {s['hit']:.1%} ({s['engine_hit']:.1%}) | "
                    f"{s['ttft_p50']:.2f} / {s['ttft_p90']:.2f} | {s['throughput']:.0f} | "
                    f"{s['same']:.0%} / {s['spread']:.1f} | "
                    f"{' / '.join(str(v) for v in s['served'].values())} ({s['max_share']:.2f}x; even "
                    f"{s['max_even']:.2f}x) | {reasons} | {retried} |")
    marks = "\n".join(f"- {'PASS' if ok else '**MISS**'}: {what}: {detail}" for what, ok, detail in verdicts(cell))
    extra = ""
    two = cell.figures.get("sluice-2rep")
    if two is not None:
        extra = (f"\nTwo replicas: index entries at the end {' / '.join(f'{b:.0f}' for b in two['index_blocks'])}; "
                 f"mean `reserve` (store call carrying the blocks) {' / '.join(f'{m:.2f}' for m in two['reserve_ms'])} "
                 f"ms; admitted prompt tokens per replica {' / '.join(f'{c:.0f}' for c in two['checks'])} (Envoy spread "
                 "the Checks over both).\n")
    return f"""#### {cell.workload}, {cell.level:.0%} ({cell.rate:.2f} requests/s wall)

| arm | ok / sent | hit rate (engine counters) | TTFT p50 / p90 (s) | tok/s | same engine as the group's last / \
engines per group | served {' / '.join(n for n, _ in ENGINES)} (largest / fair; / even 1/4) | route reasons | \
retried after (answer: count) |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{marks}
{extra}"""


@contextmanager
def _sims(extra: tuple[str, ...] = ()) -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        yield {name: stack.enter_context(bare_sim(profile, SPEED, name, extra=extra)) for name, profile in ENGINES}


def run_prefix_bench(quick: bool = False, workloads: list[str] | None = None, levels: list[float] | None = None,
                     admission: dict[str, Any] | None = None, rounds: int = ROUNDS) -> int:
    """Run the chosen workloads' cells, ``rounds`` rounds each, print the targets and write the report; 1 when a target
    is missed."""
    if workloads and KV_WORKLOAD in workloads:
        if workloads != [KV_WORKLOAD]:
            raise ValueError(f"{KV_WORKLOAD} runs on engines of its own: name it alone")
        return run_kv_pressure(quick, levels, admission, rounds)
    workloads = workloads or (["system"] if quick else list(WORKLOADS))
    levels = levels or ([0.9] if quick else list(LEVELS))
    warm, window = (QUICK_WARM_S, QUICK_WINDOW_S) if quick else (WARM_S, WINDOW_S)
    started, load_before = time.monotonic(), _loadavg()
    cells: list[Cell] = []
    capacities: list[str] = []
    configs: list[str] = []
    with _sims() as urls:
        ports = [int(u.rsplit(":", 1)[1]) for u in urls.values()]
        engines = [{"name": n, "url": u, "max_num_seqs": PROFILES[p].max_num_seqs} for (n, p), u in
                   zip(ENGINES, urls.values())]
        two_replicas = "system" in workloads and not quick
        settings = dict(admission or {})
        with gateway([dict(e) for e in engines], admission=settings) as sluice, \
                gateway([dict(e) for e in engines], admission={**settings, "prefix_routing": False}) as noindex, \
                plain_envoy_arm(ports, "LEAST_REQUEST") as lr, \
                plain_envoy_arm(ports, "RING_HASH", hash_header=HASH_HEADER) as ring, \
                epp_arm(urls, seed=SEED) as epp, \
                ExitStack() as optional:
            arms = {
                "sluice": Arm("sluice", sluice["base_url"] + "/v1"),
                "sluice-noindex": Arm("sluice-noindex", noindex["base_url"] + "/v1"),
                "LR": Arm("LR", lr.base + "/v1"),
                "ring": Arm("ring", ring.base + "/v1", hashed=True),
                EPP: Arm(EPP, epp.base + "/v1"),
                "oracle": Arm("oracle", engines=dict(urls)),
            }
            replica_ports: list[int] = []
            if two_replicas:
                rep = optional.enter_context(gateway([dict(e) for e in engines], admission=settings,
                                                     up_args=("--replicas", "2", "--store", "valkey")))
                arms["sluice-2rep"] = Arm("sluice-2rep", rep["base_url"] + "/v1")
                replica_ports = [rep["controlplane"]["metrics_port"] + REPLICA_PORT_STRIDE * i for i in range(2)]
            for name, envoy in (("LR", lr), ("ring", ring)):
                configs.append(f"`{name}`:\n\n```yaml\n{envoy.bootstrap[envoy.bootstrap.index('    - name: engine'):]}"
                               f"```\nroute: `{_route_line(envoy.bootstrap)}`\n")
            for workload in workloads:
                measured = asyncio.run(calibrate(workload, urls))
                capacity = sum(measured.values())
                capacities.append(f"- `{workload}`: " + ", ".join(f"{n} {r * SPEED:.2f}" for n, r in measured.items())
                                  + f" requests per emulated second; fleet {capacity * SPEED:.2f}")
                print(capacities[-1], flush=True)
                for level in levels:
                    cell = Cell(workload, level, level * capacity, {n: r / capacity for n, r in measured.items()})
                    chosen = {k: v for k, v in arms.items() if k != "sluice-2rep" or (workload == "system"
                                                                                      and level >= 0.9)}
                    if workload == "control":
                        chosen = {k: v for k, v in chosen.items() if k in CONTROL_ARMS}
                    run_cell(cell, chosen, urls, warm, window * (CONTROL_WINDOW_FACTOR if workload == "control" else 1),
                             replica_ports, rounds)
                    cells.append(cell)
            configs.append(_epp_note(epp))
    elapsed = time.monotonic() - started
    summary = []
    misses = 0
    for cell in cells:
        for what, ok, detail in verdicts(cell):
            misses += not ok
            summary.append(f"| {cell.workload} | {cell.level:.0%} | {what} | {'PASS' if ok else '**MISS**'} | {detail} |")
    doc = (__doc__ or "").format(SPEED=f"{SPEED:g}", OUT_MEDIAN=OUT_MEDIAN, MAX_TOKENS=MAX_TOKENS, GROUPS=GROUPS,
                                 SYSTEM_TOKENS=SYSTEM_TOKENS, QUESTION_TOKENS=QUESTION_TOKENS, DOC_TOKENS=DOC_TOKENS,
                                 TURNS=TURNS, THINK_S=THINK_S, CAL_S=CAL_S, CAL_WARM_S=CAL_WARM_S, WARM_S=warm,
                                 CONTROL_WINDOW_FACTOR=CONTROL_WINDOW_FACTOR,
                                 WINDOW_S=window,
                                 LEVELS=" and ".join(f"{x:.0%}" for x in levels))
    body = f"""{doc}
Run: {'`--quick`: ' if quick else ''}{rounds} round(s) per cell, the arms' order rotated each round, each round on its own
seeded arrivals (the same for every arm of the round), figures pooled over the rounds with each round's beside them;
{warm:g} + {window:g} s of arrivals (wall) per round of a cell and arm; simulator speed x{SPEED:g}; sluice
with its defaults{'' if not admission else ' except admission ' + ', '.join(f'`{k}: {v}`' for k, v in admission.items())}. This machine (2 cores) is shared with other work: load average {load_before} at the start,
{_loadavg()} at the end; {elapsed / 60:.1f} min.

## Measured capacity (ideal placement, see above)

{chr(10).join(capacities)}

## Targets

| workload | load | target | met | figures |
|---|---|---|---|---|
{chr(10).join(summary)}

{len(summary) - misses} of {len(summary)} targets met.

## Cells

TTFT in emulated seconds; hit rate from the responses' `cached_tokens` (in brackets: the engines' own
`prefix_cache_hits / prefix_cache_queries`, which also count a preempted request's second lookup).

{chr(10).join(_table(c) for c in cells)}
## The plain Envoy arms and the EPP arm

Each plain Envoy runs `envoy/bench-plain.yaml` with these clusters (ports are this run's):

{chr(10).join(configs)}
"""
    full = (workloads, levels) == (list(WORKLOADS), list(LEVELS)) and not quick and not admission
    # A partial run never overwrites the full report, nor another workload's partial one.
    name = "prefix" if full else "-".join(["prefix-quick", *(w for w in workloads if workloads != ["system"])])
    path = write_report(name, "sluice bench prefix: prefix-cache-aware routing against cache-blind and cache-keyed "
                        "routing", body)
    print(body[body.index("## Targets"):body.index("## Cells")])
    print(f"report: {path}")
    return 0 if not misses else 1

KV_DOC = """Prefixes under KV pressure (issue 38 item 5): engines whose KV holds only two or three of the shared system
prompts, so where a group's requests go decides whether its prompt is still cached there.

Fleet: ``spark-a``, ``spark-b`` (prefill 4,000 tok/s, decode 49 / 88 tok/s aggregate at 1 / 2 streams) and ``thor-a``,
``thor-b`` (1,500 tok/s, 18 / 51 tok/s), 2 slots each, simulator speed x{SPEED}, each started with ``sluice sim
--num-gpu-blocks {KV_BLOCKS}``: {KV_TOKENS:,} KV tokens per engine. Automatic prefix caching as vLLM V1 does it
(enginesim/prefixcache.py: 16-token blocks, a finished request's blocks kept until their memory is needed, the least
recently freed evicted first). Tokenizer and engine model: the simulator's defaults (3.3 characters a token, 5
template tokens a message, chunked prefill of 2,048 tokens a step, decode slower as contexts grow: enginesim/profiles.py),
which differ from the estimator's priors; sluice learns the prompt rule from the answers' usage (the bench asks for it).

Client mix: {KV_GROUPS} groups, each with its own {KV_SYSTEM_TOKENS:,}-token system prompt ({KV_GROUPS} x
{KV_SYSTEM_TOKENS:,} = {KV_ALL:,} tokens, {KV_RATIO:.1f}x one engine's KV); each request is one group's system prompt
(group drawn uniformly) and a fresh ~{QUESTION_TOKENS}-token question, streamed, ``max_tokens`` {MAX_TOKENS}, no TTFT
deadline, no session, no priority. Output-length model: each request's natural length is drawn from a lognormal with
median {OUT_MEDIAN} tokens, sigma 0.5 (at most ``max_tokens``), and sent as ``sim_output_tokens``: the engine stops
there (end of sequence); sluice does not see it and estimates from the answers' running mean. Arrivals: Poisson at
{KV_LEVEL_PCT} of the capacity measured below, one seed, the same arrival times, groups, questions and lengths for every
arm. Each arm first sends every group's prompt once through itself (not measured), then {WARM_S:g} s (wall) of arrivals
before the measured window of {WINDOW_S:g} s; the figures are those of the requests arriving in the window. Each arm's
prompts carry their own salt, so no arm finds what an earlier arm left in the caches. A 408/409/429/5xx is retried
twice after its Retry-After as the openai client does; TTFT counts from the first attempt.

Capacity: every engine saturated alone (closed loop, slots + 1 clients, {CAL_S:g} s after {CAL_WARM_S:g} s) on its
pinned groups (every fourth), its prompts cached: what the fleet serves when every group is cached where it goes.

Arms (the same engines, one after another):

- ``sluice``: ``sluice up`` with its defaults: capacity-aware prefix affinity (``admission.prefix_eviction_charge`` 1)
  and a prefix kept on as many engines as its share of the traffic needs (``admission.prefix_load_headroom`` 2).
- ``sluice-before``: the same with ``prefix_eviction_charge: 0``: the eviction charge off (since fdeee82 the limit on
  how many engines a prefix occupies, ``prefix_load_headroom``, is on in both arms).
- ``pin``: the hit-rate reference, an oracle that pins groups to engines, {KV_PINNED} groups to each (group ``g`` to
  engine ``g mod 4``: as many as each KV holds beside two running requests) and sends each request straight to its
  group's engine (no Envoy hop), queueing there however busy it is. Its hit rate is about the best any placement
  reaches here (every group on one engine whose KV holds it); its TTFT is no reference (it ignores load: the thors get
  as many groups as the sparks).
- ``LR+w+cap``: plain Envoy ``LEAST_REQUEST`` (two random choices, Envoy's default), each engine weighted by its
  measured capacity and capped at its slots (per-host ``max_connections``, one Envoy worker): the strongest cache-blind
  arm ``bench steady`` has.
- ``ring``: plain Envoy ``RING_HASH`` on a header the client sets to a hash of the system prompt: a group always goes
  to one engine, whichever the ring gives it (the strongest Envoy baseline for shared prefixes, issue 41).
- ``EPP``: the Gateway API Inference Extension's default endpoint picker reimplemented (as in ``sluice bench prefix``):
  queue, KV use and its approximate prefix index (an LRU of {KV_BLOCKS} blocks per engine here, from the engines'
  ``vllm:cache_config_info``) weighted 2 / 2 / 3.

Figures as in ``sluice bench prefix`` (hit rate: the responses' ``cached_tokens`` over their prompt tokens); TTFT p50 /
p90 count a request that failed after its retries as never answered; "same engine" is the share of a group's requests
that went where its previous one went, "engines per group" how many engines a group's requests used in the window.

Targets (issue 38 item 5, issue 41): sluice's hit rate at least 0.9x the pinning oracle's; its TTFT p50 no worse than
``sluice-before``'s (at most 1.1x, the noise ``control`` allows); and, against the strongest baseline arm of the same
run (``LR+w+cap``, ``ring`` or ``EPP``, each target its own best), TTFT p50 at most and hit rate at least that arm's.
"""


def run_kv_pressure(quick: bool = False, levels: list[float] | None = None,
                    admission: dict[str, Any] | None = None, rounds: int = ROUNDS) -> int:
    """The ``kv-pressure`` scenario (``KV_DOC``); writes ``bench/results/prefix-kv-pressure.md`` (``--quick``:
    ``prefix-kv-pressure-quick.md``). Returns 1 when a target is missed."""
    warm, window = (QUICK_WARM_S, QUICK_WINDOW_S) if quick else (WARM_S, WINDOW_S)
    levels = levels or [KV_LEVEL]
    started = time.monotonic()
    cells: list[Cell] = []
    settings = dict(admission or {})
    with _sims(("--num-gpu-blocks", str(KV_BLOCKS))) as urls:
        ports = [int(u.rsplit(":", 1)[1]) for u in urls.values()]
        engines = [{"name": n, "url": u, "max_num_seqs": PROFILES[p].max_num_seqs} for (n, p), u in
                   zip(ENGINES, urls.values())]
        measured = asyncio.run(calibrate(KV_WORKLOAD, urls))
        capacity = sum(measured.values())
        calibration = (", ".join(f"{n} {r * SPEED:.2f}" for n, r in measured.items())
                       + f" requests per emulated second; fleet {capacity * SPEED:.2f}")
        print(f"- `{KV_WORKLOAD}`: {calibration}", flush=True)
        weights = [max(1, round(100 * r / capacity)) for r in measured.values()]
        slots = [PROFILES[p].max_num_seqs for _, p in ENGINES]
        with gateway([dict(e) for e in engines], admission=settings) as sluice, \
                gateway([dict(e) for e in engines], admission={**settings, **KV_OFF}) as before, \
                plain_envoy_arm(ports, "LEAST_REQUEST", weights, slots, concurrency=1) as lrw, \
                plain_envoy_arm(ports, "RING_HASH", hash_header=HASH_HEADER) as ring, \
                epp_arm(urls, seed=SEED) as epp:
            arms = {
                "sluice": Arm("sluice", sluice["base_url"] + "/v1"),
                "sluice-before": Arm("sluice-before", before["base_url"] + "/v1"),
                "pin": Arm("pin", engines=dict(urls), pinned=True),
                "LR+w+cap": Arm("LR+w+cap", lrw.base + "/v1"),
                "ring": Arm("ring", ring.base + "/v1", hashed=True),
                EPP: Arm(EPP, epp.base + "/v1"),
            }
            configs = [f"`{name}` (`envoy --concurrency {envoy.concurrency}`):\n\n```yaml\n"
                       f"{envoy.bootstrap[envoy.bootstrap.index('    - name: engine'):]}```\n"
                       f"route: `{_route_line(envoy.bootstrap)}`\n"
                       for name, envoy in (("LR+w+cap", lrw), ("ring", ring))]
            for level in levels:
                cell = Cell(KV_WORKLOAD, level, level * capacity, {n: r / capacity for n, r in measured.items()})
                run_cell(cell, arms, urls, warm, window, [], rounds)
                cells.append(cell)
            configs.append(_epp_note(epp))
    elapsed = time.monotonic() - started
    summary, misses = [], 0
    for cell in cells:
        for what, ok, detail in verdicts(cell):
            misses += not ok
            summary.append(f"| {cell.level:.0%} | {what} | {'met' if ok else '**missed**'} | {detail} |")
    doc = KV_DOC.format(SPEED=f"{SPEED:g}", KV_BLOCKS=KV_BLOCKS, KV_TOKENS=KV_BLOCKS * 16, KV_GROUPS=KV_GROUPS,
                        KV_SYSTEM_TOKENS=KV_SYSTEM_TOKENS, KV_ALL=KV_GROUPS * KV_SYSTEM_TOKENS,
                        KV_RATIO=KV_GROUPS * KV_SYSTEM_TOKENS / (KV_BLOCKS * 16), QUESTION_TOKENS=QUESTION_TOKENS,
                        MAX_TOKENS=MAX_TOKENS, OUT_MEDIAN=OUT_MEDIAN,
                        KV_LEVEL_PCT=" and ".join(f"{x:.0%}" for x in levels),
                        WARM_S=warm, WINDOW_S=window, CAL_S=CAL_S, CAL_WARM_S=CAL_WARM_S,
                        KV_PINNED=KV_GROUPS // len(ENGINES))
    body = f"""{doc}
Run: {'`--quick`: ' if quick else ''}{rounds} round(s), the arms' order rotated each round, each on its own seeded
arrivals, figures pooled with each round's beside them; {warm:g} + {window:g} s of arrivals (wall) per round and arm; sluice with its defaults{
        '' if not admission else ' except admission ' + ', '.join(f'`{k}: {v}`' for k, v in admission.items())}; {
        elapsed / 60:.1f} min.

## Measured capacity

{calibration}

## Targets

| load | target | verdict | figures |
|---|---|---|---|
{chr(10).join(summary)}

{len(summary) - misses} of {len(summary)} targets met.

## Cells

TTFT in emulated seconds, completed requests (the targets above count failures as never answered); hit rate from the
responses' `cached_tokens` (in brackets: the engines' own `prefix_cache_hits / prefix_cache_queries`).

{chr(10).join(_table(c) for c in cells)}
## The plain Envoy arms and the EPP arm

{chr(10).join(configs)}
"""
    name = f"prefix-{KV_WORKLOAD}" + ("-quick" if quick else "") + ("-partial" if admission or levels != [KV_LEVEL]
                                                                    else "")
    path = write_report(name, "sluice bench prefix: shared prefixes under KV pressure", body)
    print(body[body.index("## Targets"):body.index("## Cells")])
    print(f"report: {path}")
    return 0 if not misses else 1


def _epp_note(epp: EppArm) -> str:
    """The EPP-like arm's configuration and what it did over the run (requests per engine, measured scrape period)."""
    stats = epp.stats()
    period = stats["period_ms"]
    routed = ", ".join(f"{e} {n}" for e, n in sorted(stats["routed"].items()))
    return (f"{describe()}. Over the run: requests routed {routed or 'none'} (priming included); scrape period p50 "
            f"{period['p50']:.0f} ms, p90 {period['p90']:.0f} ms, max {period['max']:.0f} ms over {stats['scrapes']} "
            f"scrapes; index entries at the end "
            f"{' / '.join(str(n) for n in stats['index_blocks'].values())} blocks.\n")


def _route_line(bootstrap: str) -> str:
    return next(line.strip() for line in bootstrap.splitlines() if "route: {cluster" in line)


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"
