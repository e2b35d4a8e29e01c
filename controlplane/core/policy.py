"""The admission policy the decision core reads: frozen, built from the ``admission``, ``models``, ``version_floors`` and
``boxes`` sections of the config (controlplane/config.py validates them)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from controlplane.core.adapters import AdapterPolicy
from controlplane.core.fairshare import FairShare

@dataclass(frozen=True, slots=True)
class ModelPolicy:
    decode_floor_tokens_per_s: float | None = None
    """Each admitted request of this model should keep at least this decode rate (the quality cap); None = no floor."""
    solo_decode_tokens_per_s: float | None = None
    """Seed for the model's solo decode rate until enough solo samples are measured (per chip class)."""
    kv_bytes_per_token: int | None = None
    """KV bytes one token of this model costs; makes box pools byte-aware across co-resident models."""
    max_ttft_ms: int | None = None
    """Default TTFT deadline for this model's requests."""


@dataclass(frozen=True, slots=True)
class Box:
    """Several engines sharing one machine's KV memory: a pool no pair of them may double-spend."""

    name: str
    engines: tuple[str, ...]
    kv_budget_tokens: int | None = None
    kv_budget_bytes: int | None = None


_NO_MODEL_POLICY = ModelPolicy()
"""What a model without its own settings gets."""


@dataclass(frozen=True, slots=True)
class Policy:
    kv_high_watermark: float = 0.90
    """An engine whose KV usage is at or above this fraction takes nothing new; also the share of KV sluice commits."""
    default_max_tokens: int = 1024
    """Tokens reserved for a request that names no ``max_tokens`` (KV only: time estimates use the expected length)."""
    default_expected_output_tokens: int = 256
    """Tokens a request is expected to generate until its model has learned a length from completed requests (never
    more than the request's ``max_tokens``). Time estimates only: slot waits, finish-soonest, expected finish times."""
    chars_per_token: float = 4.0
    """Prompt tokens are estimated as characters / this until the engines' own counts replace it
    (``prompt_tokens_min_samples``; core/prompt_tokens.py)."""
    prompt_tokens_min_samples: int = 20
    """Samples a (model, engine) needs before its learned characters per token and template tokens per message replace
    the prior: served requests whose engine reported ``usage.prompt_tokens``, and windows of the engine's prompt-token
    counter between idle probes (core/prompt_tokens.py, core/prompt_counters.py). 0: never learn."""
    tokenize_above_chars: int = 0
    """A prompt of at least this many characters is counted by an engine's own tokenizer before the Check decides
    (observe/tokenizer.py), where an estimate's error would cost most KV; 0: never (the learned estimate only)."""
    tokenize_timeout_ms: int = 100
    """How long a Check waits for that count; past it (or on any failure) it decides on the estimate."""
    max_park_s: float = 120.0
    """Longest a request waits parked (``admission.max_park_seconds``)."""
    max_queue_depth: int = 64
    """Parked requests per model (all priority classes together)."""
    retry_after_min_s: int = 1
    retry_after_max_s: int = 60
    quality_overcommit: float = 2.0
    """quality_cap = floor(solo_decode_rate x overcommit / decode_floor): batching raises aggregate throughput."""
    default_decode_tokens_per_s: float = 20.0
    """A request's decode rate when an engine has measured none (used to predict when tickets finish)."""
    default_prefill_tokens_per_s: float = 1000.0
    """Prefill anchor until an engine has measured its own."""
    wait_for_faster_margin: float = 0.0
    """A free slot finishing within this fraction of the best (busy) engine's finish is taken rather than waited out."""
    max_wait_for_faster_services: float = 0.5
    """Work conservation: a request waits for a busy faster engine while a free slot is idle only if that engine's slot
    wait is at most this many of the request's service times on it (0: never wait while a slot is free)."""
    near_tie_fraction: float = 0.05
    """Near ties (choose.py): without a deadline, the free slots whose expected finish is within this fraction of the
    soonest one's are equally good (decision 0004). 0: the soonest always."""
    near_tie_max_engines: int = 8
    """Warm near ties (decision 0005): when more free slots than this are near ties, only the engines admitted to
    within ``near_tie_warm_seconds`` stay tied (none: the first this many by name). 0: every tied engine."""
    near_tie_warm_seconds: float = 4.0
    """An engine admitted to this recently is warm for ``near_tie_max_engines`` (under the engines' 5 s keep-alive)."""
    band_ttft_grain_fraction: float = 0.01
    """The satisficing band's TTFT preference (route.ttft_factor, decision 0007): ``g``, this fraction of the deadline,
    in ``(quickest ttft + g) / (its ttft + g)``. 0: only capacity and serves weigh."""
    max_share_over_capacity: float = 0.0
    """Fair-share spread (route.over_share; off by default, decision 0006): without a deadline, an engine whose recent
    admissions exceed this many times its part of the candidates' capacity takes a request only when it is expected to
    hold part of its prompt, or when no engine under its share can start it now. 0: off."""
    ttft_correction_gain: float = 0.1
    """TTFT feedback (core/feedback.py): each served request moves its engine's correction by its measured TTFT over the
    estimate to this power (0.1: about ten requests to follow a lasting change). 0: no correction."""
    ttft_correction_max: float = 4.0
    """The largest TTFT correction (an engine's estimates are never multiplied by more; 1: no correction)."""
    ttft_correction_min: float = 0.5
    """The smallest TTFT correction: an engine whose first tokens come sooner than estimated is judged faster, but never
    by more than this factor of what its measured rates say (1: correct upward only)."""
    ttft_correction_half_life_s: float = 60.0
    """A TTFT correction holds this long after its engine's last measured request, then decays toward 1, halving (in log
    space) every this long (core/feedback.py): an engine once slow is tried again instead of idling for good. 0: never."""
    band_margin_ms: float = 1000.0
    """Satisficing band: estimated TTFT at least this far inside the deadline."""
    ttft_headroom_fraction: float = 0.1
    """A request with a TTFT deadline is admitted, parked and shed against (1 - fraction) x its deadline: the rest is
    for what no estimate sees (the answer reaching Envoy and the client, a loaded host; bench/results/README.md). A
    deadline within the fraction of the estimate is shed though it could have been met. 0: the deadline itself."""
    serve_half_life_s: float = 300.0
    """Half-life of the recent-serves count that weights the band and breaks near ties."""
    backfill: bool = False
    """Off: strict FIFO within a class. On: a parked request behind a blocked head may start now if it is expected to
    finish before the head could start (EASY backfilling). Off by default, by measurement (bench/results/README.md)."""
    backfill_scan: int = 16
    """How far behind a blocked head backfill looks; also how many heads with a deadline no free slot can meet a wake
    passes over (AdmissionCore.wake)."""
    prefix_routing: bool = True
    """Count the prompt tokens an engine probably has in its prefix cache as prefill it skips (core/prefix.py): in the
    TTFT and finish estimates, the band's choice and ``x-sluice-route-reason: prefix_cache``. Off: every prompt is
    estimated cold and nothing is indexed."""
    prefix_block_chars: int = 256
    """Characters per block of the prefix index (a match counts whole blocks; 256 = 64 tokens at 4 characters a token)."""
    prefix_max_blocks: int = 256
    """Blocks of a prompt that are hashed and matched (the rest of a longer prompt is never counted as cached): the bound on
    a Check's hashing work and on the size of a store event."""
    prefix_max_replicas: int = 0
    """How many engines a prefix may occupy: once this many candidates hold a request's prefix, only they are candidates
    (the request waits for one rather than prefilling it on yet another engine). 0: as many as its load needs
    (``prefix_load_headroom``)."""
    prefix_load_headroom: float = 2.0
    """With ``prefix_max_replicas`` 0, a prefix may occupy engines until their capacity covers ``share x headroom`` of
    the candidates' (at least one; on equal engines ``ceil(share x candidates x headroom)``), ``share`` its part of the
    recent arrivals (prefix.py; decision 0016); the headroom beyond 1 applies only while a candidate not holding the
    prefix could cache it without evicting another prompt (choose.holders_suffice). 0: no limit, the estimates alone
    decide."""
    prefix_demand_slack: float = 0.0
    """With ``prefix_max_replicas`` 0 and this > 0 (1.25 was measured), a prefix stays with its holders only while what
    the prefixes they hold ask of them (``PrefixIndex.demand``: their share of the recent arrivals) is at most this many
    times their part of the candidates' capacity: a slow engine holding more prefixes than it can serve lets them
    spread (choose.holders_suffice). 0 (the default): off; under KV pressure the spreading cost more hits than the tail
    it saved (decision 0016)."""
    prefix_eviction_charge: float = 1.0
    """Capacity-aware prefix affinity (affinity.py, decision 0018): an engine that would evict other prompts' blocks to
    cache a held prefix is compared as if it finished this many times the prefill of what it evicts later. 0: off."""
    prefix_index_blocks: int = 250_000
    """Bound on the prefix index's entries (engine, block) over all engines, each engine getting an even share (an entry
    is about 240 bytes: the default is some 60 MB)."""
    lifo_after_ms: float = 2000.0
    """Adaptive LIFO: once a class's oldest parked request has waited longer than this, its wake tries the newest parked
    request first (fresh requests meet their latency; the old ones, already late, wait for capacity or ``max_park_s``).
    0: strict FIFO always."""
    lifo_deadline_fraction: float = 0.0
    """Adaptive LIFO also once the oldest parked request has waited this fraction of its own TTFT deadline. 0: only
    ``lifo_after_ms`` (decision 0013)."""
    overload_shed_after_ms: float = 4000.0
    """The overload bound (shedearly.py): a request without a TTFT deadline expected to wait longer than this, or than
    ``overload_shed_services`` of its model's service times if that is longer, is shed ``overloaded`` within its
    decision window. 0: off (only ``max_park_s``)."""
    overload_shed_services: float = 4.0
    """The overload bound is at least this many of the model's recent service times (admission to release, averaged):
    where one answer takes seconds, a fixed bound is a queue's normal wait. 0: the fixed bound alone."""
    shed_decision_s: float = 1.0
    """The decision window (shedearly.py): a parked request may be shed for its bound only within this long of parking;
    past it the request is committed, served in its turn. 0: decided at arrival only."""
    overload_burst_s: float = 1.0
    """A line younger than this (its oldest parked request parked less long ago) sheds nobody ``overloaded``: a burst
    that finds the line empty (a fan-out of sub-requests sent at once) is committed whole and served in turn, up to
    ``max_park_s`` (shedearly.py, decision 0032). 0: off (a burst's tail past the overload bound is refused at once)."""
    models: Mapping[str, ModelPolicy] = field(default_factory=lambda: MappingProxyType({}))
    """Per-model settings (read-only: a copy of what the constructor was given)."""
    version_floors: tuple[tuple[str, str], ...] = ()
    """(pattern, minimum version): a model whose id contains ``pattern`` (case-insensitive) needs engines at or above it."""
    boxes: tuple[Box, ...] = ()
    fairness: FairShare = field(default_factory=FairShare)
    """How a parking class is shared among tenants (core/fairshare.py; the ``fairness`` section and each tenant's
    ``weight``). Off: the lot's order is FIFO (adaptive LIFO aside)."""
    adapters: AdapterPolicy = field(default_factory=AdapterPolicy)
    """LoRA adapters (the ``adapters`` section; core/adapters.py): their base models and the swap prior."""

    def __post_init__(self) -> None:
        if type(self.models) is not MappingProxyType:
            object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def model(self, model_id: str) -> ModelPolicy:
        return self.models.get(model_id, _NO_MODEL_POLICY)

    def floor_for(self, model_id: str, base: str | None = None) -> str | None:
        """The strictest floor among patterns matching ``model_id`` or, for an adapter, its ``base`` model (a floor on
        the base covers its adapters); None: no floor."""
        ids = [model_id.lower()] + ([base.lower()] if base else [])
        matches = [v for pattern, v in self.version_floors if any(pattern.lower() in i for i in ids)]
        return max(matches, key=version_key) if matches else None

    def box_of(self, engine: str) -> Box | None:
        return next((b for b in self.boxes if engine in b.engines), None)


_NUMBER = re.compile(r"\d+")


def version_key(version: str) -> tuple[int, ...]:
    """Numeric components in order: ``0.10.1`` -> (0, 10, 1); llama.cpp's ``b6500-abc`` -> (6500,). A pre-release
    (``0.11.0rc1``) sorts with its numbers, so a floor of 0.11.0 admits it: floors guard against old engines, not RCs."""
    head = version.split("+", 1)[0]
    return tuple(int(n) for n in _NUMBER.findall(head.split("-", 1)[0] if not head.startswith("b") else head[1:]))


def meets_floor(version: str | None, floor: str | None) -> bool:
    """An engine meets a floor when its version is known and not below it; an unknown version never meets one."""
    if floor is None:
        return True
    if not version:
        return False
    have, need = version_key(version), version_key(floor)
    if not have:
        return False
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))
