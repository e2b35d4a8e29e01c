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
    """Default TTFT deadline for this model's requests (routing, issue 5)."""


@dataclass(frozen=True, slots=True)
class Box:
    """Several engines sharing one machine's KV memory (seed 002): a pool no pair of them may double-spend."""

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
    """Served requests whose engine reported ``usage.prompt_tokens`` a (model, engine) needs before its learned
    characters per token and template tokens per message replace the prior (core/prompt_tokens.py). 0: never learn."""
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
    """Near ties (route.py): without a deadline, the free slots whose expected finish is within this fraction of the
    soonest one's are equally good, and the one with the fewest recent admissions per unit of its capacity takes the
    request. 0: the soonest always. Why: docs/decisions/0004-near-ties.md."""
    near_tie_max_engines: int = 8
    """Warm near ties on a large fleet (route.py): when more free slots than this are near ties (after the prompt-cache
    preference), the engines admitted to within ``near_tie_warm_seconds`` take the request, or, none being, the first
    this many by name, so light load keeps Envoy's connections and the engines' prompt caches warm. 0: near ties always
    go round every tied engine. Why: docs/decisions/0005-warm-near-ties.md."""
    near_tie_warm_seconds: float = 4.0
    """An engine admitted to this recently is warm for ``near_tie_max_engines`` (under the engines' 5 s keep-alive)."""
    band_ttft_grain_fraction: float = 0.01
    """The satisficing band's TTFT preference (route.py ``ttft_factor``): a member's weight is multiplied by
    ``(quickest ttft + g) / (its ttft + g)`` with ``g`` this fraction of the deadline, so differences well below ``g``
    are no preference. 0: only capacity and serves weigh. Why: docs/decisions/0007-band-weights.md."""
    max_share_over_capacity: float = 0.0
    """Fair-share spread (route.py), off by default: without a deadline, an engine whose recent admissions
    (``serve_half_life_s``) exceed this many times its part of the candidates' capacity (cap x decode rate at cap) takes
    a request only when it is expected to hold part of its prompt, or when no engine under its share can start it now.
    It sends light load to slower engines, where it finishes later; near ties (above) spread equal engines at no such
    cost. For an operator who wants every engine used at light load (e.g. to keep its measured rates fresh). 0: off.
    Why off: docs/decisions/0006-fair-share-spread-off.md."""
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
    """A request with a TTFT deadline is planned to have its first token this fraction of the deadline early: admitted,
    parked and shed against (1 - fraction) x its deadline. The rest is for what no estimate sees: the Check's answer
    reaching Envoy, Envoy's forwarding, the path back to the client, a loaded host. Without it a queue under overload
    fills until each head waits its whole deadline less the estimated prefill, and any of that unseen time makes it late
    (bench steady, mixed6 deadline mix at 110%: parked p50 1.67 s, TTFT p50 1.88 s against a 2 s SLO, 114 of 478 served
    late). Failure mode: a deadline within the fraction of the estimate is shed though it would have been met. 0: plan
    for the deadline itself."""
    serve_half_life_s: float = 300.0
    """Half-life of the recent-serves count that weights the band and breaks near ties."""
    backfill: bool = False
    """Off: strict FIFO within a class. On: a parked request behind a blocked head may start now if it is expected to
    finish before the head could start (EASY backfilling), so the head is not delayed. Off by default, decided by
    measurement twice (bench/results/README.md): it helps ``bench cag4`` a little (8k TTFT p50 6.0 against 6.9 s on
    2026-12-01, 6.0 against 6.5 s on 12-02, no preemptions either way) and changes nothing in ``bench steady``'s open and
    capped mixes, but costs its deadline mix at overload (goodput at 110% 4.80 against 5.12 req/s on 12-01; 5.17
    against 5.42, with 29 sheds against 20, on 12-02 after the estimates and the shared line were fixed; equal at 95%)."""
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
    """With ``prefix_max_replicas`` 0, a prefix may occupy ``ceil(share x candidates x headroom)`` engines (at least one),
    ``share`` being its part of the recent arrivals (prefix.py, ``share``): a system prompt one request in 32
    carries stays on one engine of four, one that every request carries spreads over all of them. 0: no limit, the
    estimates alone decide when spilling to a cold engine pays."""
    prefix_eviction_charge: float = 1.0
    """Capacity-aware prefix affinity (core/affinity.py): for a request whose prefix some engine holds, an engine that
    would evict other prompts' blocks to cache it is compared as if it finished this many times the prefill of what it
    evicts later (that prefill is redone by the requests that would have hit them). Keeps a shared prefix on as few
    engines as its load needs when KV is short. 0: off (the plain finish time decides)."""
    prefix_index_blocks: int = 250_000
    """Bound on the prefix index's entries (engine, block) over all engines, each engine getting an even share (an entry
    is about 240 bytes: the default is some 60 MB)."""
    lifo_after_ms: float = 2000.0
    """Adaptive LIFO: once a class's oldest parked request has waited longer than this, its wake tries the newest parked
    request first (fresh requests meet their latency; the old ones, already late, wait for capacity or ``max_park_s``).
    0: strict FIFO always."""
    lifo_deadline_fraction: float = 0.0
    """Adaptive LIFO also once the oldest parked request has waited this fraction of its own TTFT deadline (deadlines
    at or below ``lifo_after_ms`` otherwise keep the lot FIFO for good). 0: only ``lifo_after_ms``. Why off:
    docs/decisions/0013-deadline-lifo-off.md."""
    overload_shed_after_ms: float = 4000.0
    """Under sustained overload (a class in adaptive LIFO while requests keep joining it: one parked within the last
    quarter of the bound), a request without a TTFT deadline that has waited this long, or ``overload_shed_services``
    of its model's service times if that is longer, is shed ``overloaded`` with a Retry-After instead of waiting behind
    fresher requests until ``max_park_s``. 0: off (core/admission.py)."""
    overload_shed_services: float = 4.0
    """The overload bound is at least this many of the model's recent service times (admission to release, averaged
    over the last releases): where one answer takes seconds, 4 s is one or two of them, a queue's normal wait at 90%
    load and not an overload (``bench prefix`` at speed x1 shed 17 of 99). 0: the fixed bound alone."""
    shed_decision_s: float = 1.0
    """The decision window (``admission.shed_decision_seconds``): a parked request may be shed for its bound only
    within this long of parking (less ``ANSWER_MARGIN_S``), at arrival or when the estimate of its start says it would
    start too late (core/admission.py, "Shed early"); past it the request is committed: served in its turn, before
    every request that parked after it. 0: decided at arrival only."""
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
        return self.models.get(model_id, _NO_MODEL_POLICY)  # (not a new ModelPolicy per call: every Check asks)

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
