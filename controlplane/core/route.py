"""Choosing among engines where a request can run: finish-soonest, TTFT deadlines, the satisficing band, session affinity.

Pure. For engine ``e`` and request ``r`` (``load`` and ``cap`` as in fit.py)::

    n            = min(cap, load + 1) while the fleet has room; cap under pressure (a candidate is full or requests
                   are parked: whatever starts now will share its engine with a full batch) and when r must wait
    prefill_rate = trusted (model, chip class) median, else e's last measured rate, else e's configured anchor,
                   else the policy anchor
    decode_rate  = e's trusted per-request decode median at batch n (or the nearest batch measured), else its last
                   measured rate, else its configured anchor, else the policy default
    out          = expected output tokens: the model's mean over recent completed requests (output_length.py, trusted
                   after 20), else ``default_expected_output_tokens``; at most r.max_tokens. Time only: KV still reserves
                   max_tokens (or ``default_max_tokens``), the worst case
    cached       = prompt tokens e is expected to hold in its prefix cache (core/prefix.py; 0 without a match), at most
                   r.prompt_tokens - 1 (an engine always computes the last prompt token)
    prefill      = (r.prompt_tokens - cached) / prefill_rate
    service      = prefill + out / decode_rate                               (one request of r's shape at batch n)
    k            = load - cap + 1 + ahead + behind, where ``ahead`` counts the parked requests ahead of r that wait for this
                   engine in particular (passed over while they do: admission.py; uncounted, a second request waits for
                   the very slot the first will take), and ``behind`` the parked requests queued after r: waiting for a
                   busy engine is only worth it if that engine could also absorb the backlog, else the whole queue
                   idles behind r (fleet scale). Neither counts for an engine expected to hold r's prefix (cached > 0): the
                   backlog's requests are placed by their own prefixes, mostly elsewhere, and r's wait for it stays
                   bounded by work conservation (below); counted, it made a busy holder look a backlog away, and under
                   load requests went cold to whichever slot freed (``sluice bench prefix``: bench/results/README.md;
                   counting ``ahead`` there too, session 8, sent 10 of 99 requests of its shared system prompts cold at
                   90% load, hit rate 98.9% -> 87.6%, throughput 165 -> 120 tok/s: a cold 8,000-token prefill costs
                   the fleet seconds of an engine that waiting does not)
    slot_wait    = 0 if load < cap; else, with D = e's open tickets' expected finishes (soonest first):
                   D[k] - now when k <= |D|, else max(0, D[-1] - now) + ceil((k - |D|) / cap) x service
                   (the engine drains a backlog deeper than its tickets in waves of cap: no clamp)
    ttft(e)      = slot_wait + prefill + 1 / decode_rate                          (the first token is one step)
    finish(e)    = ttft(e) + out / decode_rate

Without a deadline the request goes where ``finish`` is soonest, which may mean parking for a busy fast engine rather than
taking a free slot on a slow one (reason ``waiting_for_faster``). Pricing free slots at the full-batch rate under pressure is
what makes this split a burst the way the best assignment does (seed 000: 2/2 for four requests, Spark 6 / Thor 2 for eight).
``wait_for_faster_margin`` (default 0) optionally prefers a free slot whose ``finish`` is within that fraction of the best.

**Work conservation.** While some engine has a free slot, r waits for a busy faster one only if (a) that engine's ``finish``
beats every free slot's by more than ``wait_for_faster_margin`` and (b) its ``slot_wait`` is at most
``max_wait_for_faster_services`` (default 0.5) of r's service time there; otherwise r takes the free slot that finishes soonest
(reason ``work_conserving``); when the busy engine holds more of the prompt in its prefix cache, the bound grows by the
prefill the free slot would redo (``waits_too_long``). Why: estimates err (outputs are guessed, probes lag) and a wait
long compared with the work itself is where an error costs most; and a waiting head holds the FIFO queue behind it, so a wait that gains the head a
little costs everyone behind it its full length. Issue 9 (4 req/s of 30-token answers to Thor + Spark, ~87% load) replayed
through the core (tests/unit/test_wait_estimates.py): bound 1 gives TTFT p50 0.45 s / p90 0.64 s, bound 0.5 gives 0.18 s /
0.33 s and a lower mean end-to-end time too; before this rule and the unclamped waits, Spark took 115 of 120 while Thor
idled. Failure mode: an engine much slower than the rest (more than about
``1 + max_wait_for_faster_services`` times slower in service time) gets work whenever the fast ones are a wave deep, and
those requests finish later than waiting would have; keep such an engine out with the model's decode floor (band and quality
cap), a larger bound, or drain it. With bound 0 the router never waits while a slot is free.

**Near ties** (``near_tie_fraction``, default 0.05, decide._near_tie). The free slots whose ``finish`` is within that
fraction of the soonest free slot's are equally good: the one expected to hold the most of the prompt takes the request,
then the one with the fewest recent admissions (the band's decayed serve counts) per unit of ``capacity_throughput``,
then the soonest. Two engines of one kind measure
rates a percent or two apart, so finish-soonest alone gave all light load to whichever measured faster (``bench prefix``
at 50%: spark-a 59 requests, spark-b 37); a 2.7x slower engine is no tie and stays out of light load. Failure mode: a
request may finish up to that fraction later than on the soonest slot.

**Warm near ties** (``near_tie_max_engines``, default 8; ``near_tie_warm_seconds``, 4). When more free slots than that
are near ties (after the prompt-cache preference: a large, mostly idle fleet), the engines admitted to within the warm
time take the request, or, none being warm, the first ``near_tie_max_engines`` by name; the fewest serves per unit of
capacity then chooses among them. Taking turns round hundreds of idle engines gave each a request once in a long
while, so nearly every request opened a connection (engines close a kept-alive connection after 5 s idle, uvicorn's
default that vLLM and SGLang keep, and each Envoy worker keeps its own pool) and found a cold prompt cache: ``bench
scale`` at 1000 engines opened a connection for about one request in ten, and those were half of its slowest 2%. A
fleet of at most that many engines of a kind is unchanged. Failure mode: at light load the rest of a large fleet idles
while a few engines take every request (each within the near-tie fraction of the soonest, so no request finishes later
than that for it); 0 turns it off.

**Fair-share spread** (``max_share_over_capacity``, off by default, decide._spread). Without a deadline, an engine whose
recent admissions are ``over_share`` (at least ``1 + ratio x total x its part of the candidates' capacity_throughput``)
is set aside, unless it is expected to hold part of the prompt or no engine left can start the request now. It uses
slower engines at light load, where requests finish later: ``bench steady`` thor+spark at 50% with ratio 1.3 put 4 of 27
requests on thor and lost its TTFT p90 to a plain weighted Envoy (0.06 against 0.05 s; 0.04 without it). An admission
finishing later than a set-aside free slot reports ``fair_share``.

With a deadline (``x-sluice-max-ttft-ms`` or the model's default) only engines whose ``ttft`` meets it count. None: shed
``ttft_unmeetable`` when even an idle engine's prefill misses it, or when a slot is free and no engine meets it even
without its wait (parking would idle that slot until the park limit sheds anyway); else park while a release might still
come in time (waits are uncertain, real releases decide). The **satisficing band** (seed 002) is every engine that can start now with ``ttft`` at least
``band_margin_ms`` inside the deadline and a decode rate at or above the model's floor; the pick inside the band is weighted
by ``band_weight``: ``c / (1 + recent serves / c)`` with ``c`` the member's ``capacity_throughput`` over the band's largest
(serves decay with a 5-minute half-life), times ``(quickest ttft + g) / (this member's ttft + g)`` with ``g`` the
``band_ttft_grain_fraction`` (1%) of the deadline (ttft_factor, weighted_pick: a difference of a millisecond against a
10 s deadline is no preference; session 12 narrowed it from 5%, which let a slow prefill take as many of the band's
requests as its capacity said and cost the TTFT p90 at low load). Load
spreads over every engine that is good enough, in proportion to its capacity, instead of piling onto the fastest; and a
long prompt mostly goes where it prefills fast, so a slow engine mostly gets the requests it is least slow at. Seed 002's
``1 / (1 + recent serves)`` (what equal members still get) evened the counts out, so a slow engine took as many deadline
requests as a fast one, long prompts included (``bench steady`` mixed6 at 50%: TTFT p90 0.31 s against a weighted
Envoy's 0.20; with capacity alone 0.26 against 0.18; with the TTFT factor too 0.09 against 0.14). A session (``x-sluice-session``) keeps its engine while that engine is in the band
(prefix-cache affinity); without a deadline, while the engine is within the work-conserving margin of the best.

**Prefix cache.** An expected cache hit is prefill the engine skips, so it enters ``ttft`` and ``finish`` above and nothing
else: a hit on a slow or busy engine competes with a cold fast one on time, and the work conservation bound, deadlines and
the band read the same estimates. Inside the band (every member good enough), the members expected to hold the longest
prefix are preferred, after the session's engine: sending the prompt where it is cached spends no prefill capacity, and
the band's spreading still applies among equals. A hot prefix whose engines are full spills to another engine when that
finishes sooner (or, with a deadline, when the holders leave the band), and that engine then holds it too;
``prefix_max_replicas`` caps how many engines may (decide.py). An admission whose chosen engine was credited with a hit
reports ``prefix_cache``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.core.fit import effective_load
from controlplane.core.model import EngineView, Fleet, InferenceRequest
from controlplane.core.output_length import MEMORYLESS
from controlplane.core.policy import Policy
from controlplane.core.sharedmap import SharedMap


@dataclass(frozen=True, slots=True)
class Estimate:
    engine: EngineView
    can_start: bool
    """A slot is free now (the engine fits); otherwise the request would wait for one."""
    slot_wait_s: float
    ttft_s: float
    finish_s: float
    decode_rate: float
    cached_tokens: int = 0
    """Prompt tokens the engine is expected to hold in its prefix cache (its prefill here left them out)."""
    prefill_rate: float = 0.0
    """Prompt tokens per second this estimate prefilled at."""


def decode_rate(engine: EngineView, batch: int, fleet: Fleet, policy: Policy) -> float:
    measured = fleet.rates.decode_by_batch.get(engine.name)
    if measured:
        return measured.nearest(batch)
    if engine.rates is not None and engine.rates.decode_tokens_per_s_each:
        return engine.rates.decode_tokens_per_s_each  # one interval's measurement beats any guess
    return engine.anchor_decode_tokens_per_s or policy.default_decode_tokens_per_s


def decode_rate_known(engine: EngineView, fleet: Fleet) -> bool:
    """Whether ``decode_rate`` for ``engine`` rests on a measurement or an anchor rather than the policy's default."""
    return bool(fleet.rates.decode_by_batch.get(engine.name) or engine.anchor_decode_tokens_per_s
                or (engine.rates is not None and engine.rates.decode_tokens_per_s_each))


def prefill_rate(engine: EngineView, model: str, fleet: Fleet, policy: Policy) -> float:
    trusted = fleet.rates.prefill_median.get((model, engine.chip_class))
    if trusted:
        return trusted
    if engine.rates is not None and engine.rates.prefill_tokens_per_s:
        return engine.rates.prefill_tokens_per_s
    return engine.anchor_prefill_tokens_per_s or policy.default_prefill_tokens_per_s


def expected_output_tokens(request: InferenceRequest, fleet: Fleet, policy: Policy) -> float:
    """Tokens ``request`` is expected to generate: its model's learned mean, else the policy default, never more than its
    ``max_tokens``. For time only; KV reserves ``max_tokens`` (or ``default_max_tokens``), the worst case."""
    assert request.model is not None
    typical = fleet.expected_output.get(request.model) or float(policy.default_expected_output_tokens)
    return min(typical, float(request.max_tokens)) if request.max_tokens else typical


def expected_frees(engine: str, fleet: Fleet, now: float) -> tuple[float, ...]:
    """When each of ``engine``'s open tickets is expected to free its slot, soonest first. A ticket still inside its
    expected time frees at its expected finish, stretched by the tail of its model's lengths: a request that has
    produced a fraction ``y`` of the typical answer has ``E[x - y | x > y]`` of it left (output_length.OutputTail), which
    for a long tail is more than ``1 - y`` and for a ticket already past its expected finish is far from zero. Without a
    learned tail (fewer than ``min_samples`` completions of the model) the tail is memoryless. A ledger view without
    progress (``running``: hand-built views in tools and tests) gives the expected finishes, overdue ones at ``now``."""
    ledger = fleet.of(engine)
    if not ledger.running:
        return tuple(max(now, d) for d in ledger.expected_done)
    frees = []
    for first_token_at, done_at, model in ledger.running:
        tail = fleet.output_tails.get(model, MEMORYLESS)
        decode_s = done_at - first_token_at
        if decode_s <= 0:
            frees.append(max(now, done_at))
            continue
        if now <= first_token_at:  # still waiting for its first token: the whole expected answer is ahead
            frees.append(done_at)
            continue
        frees.append(now + decode_s * tail.remaining((now - first_token_at) / decode_s))
    return tuple(sorted(frees))


def slot_wait(engine: EngineView, position: int, service_s: float, fleet: Fleet, now: float) -> float:
    """Seconds until the ``position``-th slot (1-based, soonest first) frees on a full engine. Within its open tickets it is
    that ticket's expected free time (``expected_frees``); beyond them the engine drains the rest in waves of ``cap``
    requests, each wave one ``service_s`` after the last known finish (no clamp: a backlog deeper than the batch costs
    its waves)."""
    done = expected_frees(engine.name, fleet, now)
    position = max(1, position)
    if position <= len(done):
        return max(0.0, done[position - 1] - now)
    last_known = max(0.0, done[-1] - now) if done else 0.0
    parallel = engine.cap or max(1, len(done))
    return last_known + math.ceil((position - len(done)) / parallel) * service_s


def estimate(engine: EngineView, request: InferenceRequest, fits: bool, fleet: Fleet, policy: Policy,
             now: float, pressure: bool = False, behind: int = 0, cached_tokens: int = 0, ahead: int = 0) -> Estimate:
    """``ahead``: parked requests ahead of this one in line that wait for this engine in particular (passed over while
    they wait for it, admission.py): each takes one of its slots first."""
    assert request.model is not None
    cached_tokens = min(cached_tokens, max(0, request.prompt_tokens - 1))
    load = effective_load(engine, fleet)
    cap = engine.cap
    batch = int(load) + 1
    if cap is not None:
        batch = cap if pressure or not fits else min(cap, batch)
    rate = decode_rate(engine, max(1, batch), fleet, policy)
    rate_in = prefill_rate(engine, request.model, fleet, policy)
    prefill_s = (request.prompt_tokens - cached_tokens) / rate_in
    decode_s = expected_output_tokens(request, fleet, policy) / rate
    wait = 0.0
    if not fits:
        # Everyone queued for this engine ahead of r, r itself, and the parked requests behind r (unless this engine
        # holds r's prefix: see the docstring): each costs one service of r's shape at the full-batch rate (the best
        # guess for requests whose own lengths sluice cannot know).
        position = (int(load - cap + 1) if cap is not None else 1) + (0 if cached_tokens else behind + ahead)
        wait = slot_wait(engine, position, prefill_s + decode_s, fleet, now)
    ttft = wait + (prefill_s + 1.0 / rate) * engine.ttft_correction
    return Estimate(engine, fits, wait, ttft, ttft + decode_s, rate, cached_tokens, rate_in)


def waits_too_long(busy: Estimate, policy: Policy, free: Estimate | None = None) -> bool:
    """Work conservation: waiting for ``busy`` (a faster engine without a free slot) is only allowed while its slot wait is
    at most ``max_wait_for_faster_services`` of the request's own service time there (``finish - slot_wait``), plus the
    prefill ``free`` (the free slot it would take instead) would redo because ``busy`` holds more of the prompt in its
    prefix cache: ``(busy.cached - free.cached) / free's prefill rate``. Waiting that much longer idles the free slot no
    longer than the cold prefill would occupy it, and spares an engine's prefill capacity besides."""
    redo_s = 0.0
    if free is not None and busy.cached_tokens > free.cached_tokens and free.prefill_rate > 0:
        redo_s = (busy.cached_tokens - free.cached_tokens) / free.prefill_rate
    return busy.slot_wait_s > policy.max_wait_for_faster_services * (busy.finish_s - busy.slot_wait_s) + redo_s


def cached_tokens(engine: str, request: InferenceRequest, cached: Mapping[str, int]) -> int:
    """Prompt tokens ``engine`` is expected to hold (``cached``: the prefix index's figures for this request), at most
    all but the prompt's last token."""
    return min(cached.get(engine, 0), max(0, request.prompt_tokens - 1))


def capacity_throughput(engine: EngineView, fleet: Fleet, policy: Policy) -> float:
    """Tokens/s ``engine`` generates with its batch full (cap x per-request decode rate at cap; one stream without a
    cap): its part of the fleet's capacity, for the fallback weights and the fair-share spread."""
    batch = engine.cap or 1
    return batch * decode_rate(engine, batch, fleet, policy)


def over_share(serves: float, throughput: float, total_serves: float, total_throughput: float, ratio: float) -> bool:
    """Fair-share spread: ``serves`` (an engine's recent admissions) is above ``ratio`` times its part of the candidates'
    capacity (``throughput / total_throughput``) of ``total_serves``, with one admission of slack so that the first few
    requests of a quiet period are not spread by chance."""
    if ratio <= 0 or total_throughput <= 0:
        return False
    return serves >= 1.0 + ratio * total_serves * throughput / total_throughput


def band_weight(serves: float, capacity: float) -> float:
    """The satisficing band's weight for a member with ``serves`` recent admissions and ``capacity`` its throughput over
    the band's largest (0 < capacity <= 1): ``c / (1 + s / c)``. Equal members get seed 002's ``1 / (1 + s)``; unequal
    ones settle at shares proportional to their capacity (with ``s`` proportional to the share ``p``, ``p ~ c / (1 +
    p N / c)`` gives ``p ~ c`` once the counts ``N`` are large), where an even spread would load a slow engine as much
    as a fast one."""
    return capacity / (1.0 + serves / capacity)


def ttft_factor(ttft_s: float, quickest_s: float, grain_s: float) -> float:
    """How much the band prefers a member for starting sooner: ``(quickest + grain) / (ttft + grain)``, with ``grain``
    the near-tie fraction of the deadline. A member twice as slow to start as the quickest, with both well above the
    grain, gets about half the weight; differences well inside the grain hardly count. Without the grain a plain ratio
    ``quickest / ttft`` made 2 ms against 51 ms (a measured engine against one still on the default rates, with a 10 s
    deadline) a 25x preference: every request went to the one measured engine and the others were never measured."""
    return (quickest_s + grain_s) / (ttft_s + grain_s)


def weighted_pick(estimates: list[Estimate], serves: Mapping[str, float], pick: float,
                  throughput: Mapping[str, float], grain_s: float) -> Estimate:
    """The satisficing band's weighted choice: ``band_weight`` (``throughput``: each member's ``capacity_throughput``)
    times ``ttft_factor``, so that a long prompt mostly goes where it prefills fast and a slow engine mostly gets the
    requests it is least slow at; ``pick`` in [0, 1) is the caller's random draw, ``grain_s`` the TTFT difference that
    counts (``ttft_factor``)."""
    largest = max(throughput[e.engine.name] for e in estimates)
    quickest = min(e.ttft_s for e in estimates)
    weights = [band_weight(serves.get(e.engine.name, 0.0), throughput[e.engine.name] / largest if largest > 0 else 1.0)
               * ttft_factor(e.ttft_s, quickest, grain_s) for e in estimates]
    target = pick * sum(weights)
    for estimate_, weight in zip(estimates, weights):
        if target < weight:
            return estimate_
        target -= weight
    return estimates[-1]


class ServeCounter:
    """Per-engine count of recent admissions, decaying exponentially (``half_life_s``); pure, time passed in."""

    def __init__(self, half_life_s: float = 300.0) -> None:
        self.half_life_s = half_life_s
        self._values: SharedMap[str, tuple[float, float]] = SharedMap()  # a snapshot per Check copies no entry

    def _decayed(self, engine: str, now: float) -> float:
        value, at = self._values.get(engine, (0.0, now))
        return value * math.pow(0.5, max(0.0, now - at) / self.half_life_s)

    def add(self, engine: str, now: float) -> None:
        self._values[engine] = (self._decayed(engine, now) + 1.0, now)

    def remove(self, engine: str, now: float) -> None:
        """Take back one ``add`` (an admission the shared store refused)."""
        self._values[engine] = (max(0.0, self._decayed(engine, now) - 1.0), now)

    def merge(self, engine: str, count: float, at: float) -> bool:
        """Another count of the same admissions (the shared store's, read by a replica that starts or missed events):
        ``engine`` keeps the larger of the two, both decayed to the later of their times (warm near ties agree across
        replicas). True if this counter changed."""
        value, since = self._values.get(engine, (0.0, at))
        later = max(since, at)
        mine = value * math.pow(0.5, (later - since) / self.half_life_s)
        theirs = count * math.pow(0.5, (later - at) / self.half_life_s)
        if theirs <= mine:
            return False
        self._values[engine] = (theirs, later)
        return True

    def snapshot(self, now: float) -> dict[str, float]:
        return {engine: self._decayed(engine, now) for engine in self._values}

    def values(self) -> SharedMap[str, tuple[float, float]]:
        """engine -> (count, when it was last added): decayed by the reader (fleetindex.DecayedServes)."""
        return self._values


class SessionMap:
    """Session key -> the engine that served it last; least recently used keys are forgotten past ``capacity``."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str | None) -> str | None:
        if not session or session not in self._map:
            return None
        self._map.move_to_end(session)
        return self._map[session]

    def set(self, session: str | None, engine: str) -> None:
        if not session:
            return
        self._map[session] = engine
        self._map.move_to_end(session)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)
