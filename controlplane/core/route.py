"""Per-engine estimates for a request, and the weights the choice among engines reads (choose.py). Pure.

For engine ``e`` and request ``r`` (``load``, ``cap`` as in fit.py; ``cached``: prompt tokens ``e`` is expected to hold,
prefix.py; ``out``: ``expected_output_tokens``; ``swap``: a LoRA adapter's load where it is not resident, adapters.py,
whose stall of the batch enters the choice among engines with prefix affinity's eviction charge, affinity.py)::

    n         = min(cap, load + 1); cap under pressure (a candidate is full, or requests are parked) or when r waits
    prefill   = (r.prompt_tokens - cached) / prefill_rate(e)
    service   = prefill + out / decode_rate(e, n)                          (one request of r's shape at batch n)
    k         = load - cap + 1 + ahead + behind          (ahead, behind: parked requests; 0 when cached > 0: decision 0008)
    slot_wait = 0 if load < cap; else with D = expected_frees(e): D[k] - now when k <= |D|,
                else max(0, D[-1] - now) + ceil((k - |D|) / cap) x service
    ttft      = slot_wait + swap + (prefill + 1 / decode_rate) x e.ttft_correction       (feedback.py)
    finish    = ttft + out / decode_rate
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from controlplane.core import adapters
from controlplane.core.fit import effective_load
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.core.model import InferenceRequest
from controlplane.core.output_length import MEMORYLESS
from controlplane.core.policy import Policy
from controlplane.core.sharedmap import SharedMap

NONE_NAMED: Mapping[str, int] = MappingProxyType({})
"""An engine-keyed figure (``cached``, ``waiting``, ``displaced``) that names no engine."""
TINY = 1e-12
"""A floor under a capacity or a service time divided by (an engine that measured no decode at all)."""


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
    swap_s: float = 0.0
    """Seconds of LoRA adapter load the estimate includes (core/adapters.py): 0 where the adapter is expected loaded."""
    stall_s: float = 0.0
    """What that load costs beyond this request, charged in the choice only (``stall`` in the module docstring)."""
    displaced_s: float = 0.0
    """Prefix affinity's charge (affinity.py): seconds of prefill the fleet would redo for the cached prompt blocks this
    placement evicts, times ``prefix_eviction_charge``. Only the choice among engines adds it; ``ttft_s`` and
    ``finish_s`` leave it out."""


def decode_rate(engine: EngineView, batch: int, fleet: Fleet, policy: Policy) -> float:
    """Per-request decode tokens/s at ``batch``: the engine's trusted median at the nearest measured batch, else its
    last measured rate, else its anchor, else the policy's default."""
    measured = fleet.rates.decode_by_batch.get(engine.name)
    if measured:
        return measured.nearest(batch)
    if engine.rates is not None and engine.rates.decode_tokens_per_s_each:
        return engine.rates.decode_tokens_per_s_each
    return engine.anchor_decode_tokens_per_s or policy.default_decode_tokens_per_s


def decode_rate_known(engine: EngineView, fleet: Fleet) -> bool:
    """Whether ``decode_rate`` for ``engine`` rests on a measurement or an anchor rather than the policy's default."""
    return bool(fleet.rates.decode_by_batch.get(engine.name) or engine.anchor_decode_tokens_per_s
                or (engine.rates is not None and engine.rates.decode_tokens_per_s_each))


def prefill_rate(engine: EngineView, model: str, fleet: Fleet, policy: Policy) -> float:
    """Prefill tokens/s: the trusted (model, chip class) median, else the engine's last measured rate, else its anchor,
    else the policy's default."""
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
             now: float, pressure: bool = False, behind: int = 0, cached_tokens: int = 0, ahead: int = 0,
             displaced_tokens: int = 0) -> Estimate:
    """The module docstring's estimate of ``request`` on ``engine``. ``ahead``: parked requests ahead of it that wait
    for this engine in particular (each takes one of its slots first); ``displaced_tokens``: prompt tokens of other
    prefixes the engine would evict to cache this prompt (affinity.py). With a swap, ``stall = swap x min(load, cap)``:
    every request already there is that much later (what the adapter it evicts costs is adapterhomes.py's charge)."""
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
        # Each request queued for this engine before r, and r, costs one service of r's shape (their own lengths are
        # unknown).
        position = (int(load - cap + 1) if cap is not None else 1) + (0 if cached_tokens else behind + ahead)
        wait = slot_wait(engine, position, prefill_s + decode_s, fleet, now)
    known = adapters.known_adapters(fleet, policy.adapters)
    swap = adapters.swap_s(engine, request.model, fleet, policy.adapters, known) if request.model in known else 0.0
    ttft = wait + swap + (prefill_s + 1.0 / rate) * engine.ttft_correction
    stall = swap * (min(load, cap) if cap is not None else load)
    return Estimate(engine, fits, wait, ttft, ttft + decode_s, rate, cached_tokens, rate_in, swap, stall,
                    policy.prefix_eviction_charge * displaced_tokens / rate_in)


def waits_too_long(busy: Estimate, policy: Policy, free: Estimate | None = None) -> bool:
    """Work conservation (decision 0009): a request waits for ``busy`` (a faster engine without a free slot) only while
    ``busy.slot_wait <= max_wait_for_faster_services x (busy.finish - busy.slot_wait) + redo``, ``redo`` the prefill
    ``free`` (the free slot it would take instead) would redo because ``busy`` holds more of the prompt,
    ``(busy.cached - free.cached) / free's prefill rate``, plus ``free``'s eviction charge (affinity.py)."""
    redo_s = 0.0
    if free is not None and busy.cached_tokens > free.cached_tokens and free.prefill_rate > 0:
        redo_s = (busy.cached_tokens - free.cached_tokens) / free.prefill_rate + free.displaced_s
    return busy.slot_wait_s > policy.max_wait_for_faster_services * (busy.finish_s - busy.slot_wait_s) + redo_s


def cached_tokens(engine: str, request: InferenceRequest, cached: Mapping[str, int]) -> int:
    """Prompt tokens ``engine`` is expected to hold (``cached``: the prefix index's figures for this request), at most
    all but the prompt's last token."""
    return min(cached.get(engine, 0), max(0, request.prompt_tokens - 1))


def capacity_throughput(engine: EngineView, fleet: Fleet, policy: Policy) -> float:
    """Tokens/s ``engine`` generates with its batch full (cap x per-request decode rate at cap; one stream without a
    cap): its part of the fleet's capacity (the fallback weights, the band, near ties, the fair-share spread)."""
    batch = engine.cap or 1
    return batch * decode_rate(engine, batch, fleet, policy)


def over_share(serves: float, throughput: float, total_serves: float, total_throughput: float, ratio: float) -> bool:
    """Fair-share spread (decision 0006): ``serves >= 1 + ratio x total_serves x throughput / total_throughput``, an
    engine's recent admissions against its part of the candidates' capacity (one admission of slack)."""
    if ratio <= 0 or total_throughput <= 0:
        return False
    return serves >= 1.0 + ratio * total_serves * throughput / total_throughput


def band_weight(serves: float, capacity: float) -> float:
    """The satisficing band's weight for a member with ``serves`` recent admissions and ``capacity`` its throughput over
    the band's largest (0 < capacity <= 1): ``c / (1 + s / c)``. Members settle at shares proportional to their
    capacity (with ``s`` proportional to the share ``p``, ``p ~ c / (1 + p N / c)`` gives ``p ~ c`` for large counts
    ``N``); decision 0007."""
    return capacity / (1.0 + serves / capacity)


def ttft_factor(ttft_s: float, quickest_s: float, grain_s: float) -> float:
    """How much the band prefers a member for starting sooner: ``(quickest + grain) / (ttft + grain)``, ``grain`` the
    ``band_ttft_grain_fraction`` of the deadline: twice as slow to start, both well above the grain, is about half the
    weight; differences well inside the grain hardly count (decision 0007)."""
    return (quickest_s + grain_s) / (ttft_s + grain_s)


def weighted_pick(estimates: list[Estimate], serves: Mapping[str, float], pick: float,
                  throughput: Mapping[str, float], grain_s: float) -> Estimate:
    """The satisficing band's weighted choice: ``band_weight`` (``throughput``: each member's ``capacity_throughput``)
    times ``ttft_factor``; ``pick`` in [0, 1) is the caller's random draw, ``grain_s`` the TTFT difference that counts."""
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
        self._values: SharedMap[str, tuple[float, float]] = SharedMap()

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
        ``engine`` keeps the larger of the two, both decayed to the later of their times. True if this changed."""
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

    def peek(self, session: str | None) -> str | None:
        """``get`` without making ``session`` the most recently used."""
        return self._map.get(session) if session else None

    def set(self, session: str | None, engine: str) -> None:
        if not session:
            return
        self._map[session] = engine
        self._map.move_to_end(session)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)
