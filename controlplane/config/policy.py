"""The reloadable sections the decision core's types are built from, as the file spells them: ``admission`` (``Policy``),
``models.<id>`` (``ModelPolicy``), ``boxes[]`` (``Box``), ``fairness`` (``FairShare``), ``adapters`` (``AdapterPolicy``)
and ``tenants.<name>`` (``Tenant``).

The core owns these defaults: each default here is read from the core type's own (``_POLICY``, ...), never written
again. A key becomes the core field ``core_field`` names (same name, or ``_seconds`` spelled ``_s``). A unit test keeps
``AdmissionConfig`` and ``Policy`` field for field equal, so no knob of the policy is unreachable from the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from controlplane.config.setting import core_field, setting
from controlplane.core.adapters import AdapterPolicy
from controlplane.core.fairshare import FairMode, FairShare
from controlplane.core.model import Priority
from controlplane.core.policy import ModelPolicy, Policy
from controlplane.core.tenants import Tenant

_POLICY = Policy()
_MODEL = ModelPolicy()
_FAIR = FairShare()
_ADAPTERS = AdapterPolicy()
_TENANT = Tenant("", ())


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """How requests are admitted, parked, routed and shed (``Policy``; "Decision core" in docs/architecture.md)."""

    kv_high_watermark: float = field(default=_POLICY.kv_high_watermark, metadata=setting(minimum=0.05, maximum=1.0))
    """No new request to an engine at or above this KV usage; the share of KV sluice commits."""
    default_max_tokens: int = field(default=_POLICY.default_max_tokens, metadata=setting(minimum=1))
    """Tokens reserved when a request names no ``max_tokens`` (KV only: time estimates use the expected length)."""
    default_expected_output_tokens: int = field(default=_POLICY.default_expected_output_tokens,
                                                metadata=setting(minimum=1))
    """Expected answer length for time estimates until a model has learned its own from completed requests (KV still
    reserves ``max_tokens`` or ``default_max_tokens``)."""
    chars_per_token: float = field(default=_POLICY.chars_per_token, metadata=setting(minimum=0.5))
    """Prompt token estimate = characters / this, until the engines' own counts replace it."""
    prompt_tokens_min_samples: int = field(default=_POLICY.prompt_tokens_min_samples, metadata=setting(minimum=0))
    """Samples a (model, engine) needs before its learned characters per token and template tokens per message replace
    the prior: served requests with the engine's ``usage.prompt_tokens``, and windows of the engine's prompt-token
    counter between idle probes (an average request each); 0: never learn (decision 0002)."""
    tokenize_above_chars: int = field(default=_POLICY.tokenize_above_chars, metadata=setting(minimum=0))
    """A prompt of at least this many characters is counted by an engine's own tokenize endpoint before the Check
    decides (vLLM ``/tokenize``; llama.cpp ``/apply-template`` and ``/tokenize``), where an estimate's error would cost
    most KV: one HTTP call to an engine serving the model, its count then stands for the request (KV reservation, TTFT,
    rate-limit pre-charge) and is a sample of the learned rule. 0 (the default): never."""
    tokenize_timeout_ms: int = field(default=_POLICY.tokenize_timeout_ms, metadata=setting(minimum=1))
    """How long a Check waits for that count; past it, or on any failure, it decides on the learned estimate."""
    max_park_seconds: float = field(default=_POLICY.max_park_s, metadata=setting(minimum=0))
    """Longest a request may wait parked: one expected to start later is refused at once (or inside its decision window)
    503 ``park_timeout``; a committed request still parked this long is shed ``park_timeout`` too (the backstop). At most
    ``envoy.stream_idle_timeout_seconds`` - 20."""
    max_queue_depth: int = field(default=_POLICY.max_queue_depth, metadata=setting(minimum=0))
    """Parked requests per model (all priority classes together); beyond it 503 ``queue_full``."""
    retry_after_min_seconds: int = field(default=_POLICY.retry_after_min_s, metadata=setting(minimum=0))
    """The least Retry-After any refusal computes."""
    retry_after_max_seconds: int = field(default=_POLICY.retry_after_max_s, metadata=setting(minimum=1))
    """The most Retry-After any refusal computes (at least ``retry_after_min_seconds``)."""
    quality_overcommit: float = field(default=_POLICY.quality_overcommit, metadata=setting(minimum=0.1))
    """Quality cap = floor(solo decode rate x this / the model's decode floor): batching raises aggregate throughput."""
    default_decode_tokens_per_s: float = field(default=_POLICY.default_decode_tokens_per_s,
                                               metadata=setting(minimum=0.01))
    """A request's decode rate until an engine measured its own (expected finish times)."""
    default_prefill_tokens_per_s: float = field(default=_POLICY.default_prefill_tokens_per_s,
                                                metadata=setting(minimum=0.01))
    """Prefill anchor until an engine measured its own."""
    wait_for_faster_margin: float = field(default=_POLICY.wait_for_faster_margin, metadata=setting(minimum=0))
    """A free slot finishing within this fraction of the best (busy) engine's finish is taken rather than waited out."""
    max_wait_for_faster_services: float = field(default=_POLICY.max_wait_for_faster_services,
                                                metadata=setting(minimum=0))
    """Work conservation: wait for a busy faster engine while a slot is free only when its slot wait is at most this many
    of the request's service times there; 0: never wait while a slot is free (decision 0009)."""
    near_tie_fraction: float = field(default=_POLICY.near_tie_fraction, metadata=setting(minimum=0))
    """Near ties: without a deadline, free slots finishing within this fraction of the soonest are equally good, and the
    least served per unit of capacity takes the request; 0: the soonest always (decision 0004)."""
    near_tie_max_engines: int = field(default=_POLICY.near_tie_max_engines, metadata=setting(minimum=0))
    """Warm near ties: of more near ties than this, the engines admitted to within ``near_tie_warm_seconds`` take the
    request (none: the first this many by name); 0: always round every tied engine (decision 0005)."""
    near_tie_warm_seconds: float = field(default=_POLICY.near_tie_warm_seconds, metadata=setting(minimum=0))
    """How recently an engine was admitted to for it to count as warm (under the engines' 5 s keep-alive)."""
    band_ttft_grain_fraction: float = field(default=_POLICY.band_ttft_grain_fraction, metadata=setting(minimum=0))
    """With a deadline, the band's TTFT preference counts differences at this fraction ``g`` of the deadline:
    ``(quickest + g) / (ttft + g)``; 0: capacity and serves only (decision 0007)."""
    max_share_over_capacity: float = field(default=_POLICY.max_share_over_capacity, metadata=setting(minimum=0))
    """Fair-share spread: without a deadline, an engine past this many times its part of the capacity in recent
    admissions takes a request only for a cached prefix or when nothing under its share can start it now (reason
    ``fair_share``); 0: off (decision 0006)."""
    ttft_correction_gain: float = field(default=_POLICY.ttft_correction_gain, metadata=setting(minimum=0, maximum=1))
    """TTFT feedback: each served request moves its engine's correction by its measured TTFT over the estimate to this
    power; 0: no correction."""
    ttft_correction_max: float = field(default=_POLICY.ttft_correction_max, metadata=setting(minimum=1))
    """The largest TTFT correction (an engine's prefill and first-token estimate is never multiplied by more)."""
    ttft_correction_min: float = field(default=_POLICY.ttft_correction_min, metadata=setting(minimum=0.05, maximum=1))
    """The smallest TTFT correction: an engine whose first tokens come sooner than estimated is judged faster, never by
    more than this factor; 1: correct upward only."""
    ttft_correction_half_life_seconds: float = field(default=_POLICY.ttft_correction_half_life_s,
                                                     metadata=setting(minimum=0))
    """A TTFT correction holds this long after its engine's last measured request, then decays toward 1, halving (in log
    space) every this long; 0: never."""
    band_margin_ms: float = field(default=_POLICY.band_margin_ms, metadata=setting(minimum=0))
    """Satisficing band: estimated TTFT at least this far inside the deadline."""
    ttft_headroom_fraction: float = field(default=_POLICY.ttft_headroom_fraction, metadata=setting(minimum=0, maximum=0.9))
    """A TTFT deadline is planned this fraction early: admitted, parked and shed against (1 - fraction) x the deadline,
    the rest left for what no estimate sees (the Check's answer, Envoy, the path to the client, a loaded host); 0: plan
    for the deadline itself."""
    serve_half_life_seconds: float = field(default=_POLICY.serve_half_life_s, metadata=setting(minimum=1))
    """Half-life of the recent-serves count weighting the band and breaking near ties."""
    backfill: bool = _POLICY.backfill
    """Let a parked request start past a blocked head when it will finish before the head could start (why it is off:
    bench/results/steady-backfill.md)."""
    backfill_scan: int = field(default=_POLICY.backfill_scan, metadata=setting(minimum=1))
    """How many parked requests behind a blocked head backfill considers; also how many heads with a deadline no free
    slot can meet a wake passes over."""
    prefix_routing: bool = _POLICY.prefix_routing
    """Count the prompt tokens an engine probably holds in its prefix cache as prefill it skips (estimates, the band,
    ``prefix_cache``); off: every prompt estimated cold, nothing indexed."""
    prefix_block_chars: int = field(default=_POLICY.prefix_block_chars, metadata=setting(minimum=16))
    """Characters per block of the prefix index (a match counts whole blocks)."""
    prefix_max_blocks: int = field(default=_POLICY.prefix_max_blocks, metadata=setting(minimum=1, maximum=4096))
    """Blocks of a prompt hashed and matched (bounds a Check's hashing and a store event's size; the rest of a longer
    prompt never counts as cached)."""
    prefix_max_replicas: int = field(default=_POLICY.prefix_max_replicas, metadata=setting(minimum=0))
    """Once this many candidate engines hold a request's prefix, only they are candidates (it waits for one); 0: as many
    as its load needs (``prefix_load_headroom``)."""
    prefix_load_headroom: float = field(default=_POLICY.prefix_load_headroom, metadata=setting(minimum=0.0))
    """With ``prefix_max_replicas`` 0, a prefix may occupy engines until their capacity (tokens/s with the batch full)
    covers its share of recent arrivals x headroom of the candidates' (at least one engine; on equal engines
    ``ceil(share x candidates x headroom)``); the headroom beyond 1 only while an engine not holding it could cache it
    without evicting another prompt (under KV pressure a prefix keeps to the engines its load needs); 0: no limit
    (decision 0016)."""
    prefix_demand_slack: float = field(default=_POLICY.prefix_demand_slack, metadata=setting(minimum=0.0))
    """A prefix stays with the engines holding it only while the recent arrivals of every prefix they hold (each split
    among its holders) are at most this many times their part of the capacity; beyond, it may spread (a slow engine
    homing more prompts than it can serve sheds some of them); 0 (the default): off, since under KV pressure the
    spreading cost more cache hits than the tail it saved (decision 0016; 1.25 was measured)."""
    prefix_eviction_charge: float = field(default=_POLICY.prefix_eviction_charge, metadata=setting(minimum=0))
    """Capacity-aware prefix affinity: for a request whose prefix some engine holds, an engine that would evict other
    prompts' blocks to cache it is compared as if it finished this many times the prefill of what it evicts later; 0: off
    (the plain finish time decides)."""

    prefix_index_blocks: int = field(default=_POLICY.prefix_index_blocks, metadata=setting(minimum=0))
    """Bound on the prefix index's entries (engine, block) over all engines, an even share each (about 240 bytes an
    entry)."""
    lifo_after_ms: float = field(default=_POLICY.lifo_after_ms, metadata=setting(minimum=0))
    """About the TTFT clients count as good. While a class's line stands (holds a committed request), a request without a
    TTFT deadline is kept only if expected to start within this of parking (or two of the model's service times, if
    longer), else refused 503 ``overloaded`` + Retry-After inside its decision window. Adaptive LIFO: once a class's
    oldest parked request has waited longer than this (or ``lifo_deadline_fraction`` of its own TTFT deadline) and none
    of it is committed, wakes serve its newest first. 0: strict FIFO and no standing-line bound."""
    lifo_deadline_fraction: float = field(default=_POLICY.lifo_deadline_fraction, metadata=setting(minimum=0))
    """Adaptive LIFO also once a class's oldest parked request has waited this fraction of its own TTFT deadline (none of
    the class committed); 0: only ``lifo_after_ms`` (decision 0013)."""
    overload_shed_after_ms: float = field(default=_POLICY.overload_shed_after_ms, metadata=setting(minimum=0))
    """The overload bound: a request without a TTFT deadline expected to start later than this after parking (or
    ``overload_shed_services`` of its model's service times, if longer) is refused 503 ``overloaded`` + Retry-After at
    once or inside its decision window, never after; 0: off (``max_park_seconds`` alone)."""
    overload_shed_services: float = field(default=_POLICY.overload_shed_services, metadata=setting(minimum=0))
    """The overload bound is at least this many of the model's recent service times (admission to release, averaged;
    the engines' estimate until one is measured): slow answers get a longer bound; 0: the fixed bound alone (and
    ``lifo_after_ms`` alone for a standing line)."""
    shed_decision_seconds: float = field(default=_POLICY.shed_decision_s, metadata=setting(minimum=0))
    """The decision window: a parked request may be shed for its bound (``ttft_unmeetable``, ``overloaded``,
    ``park_timeout``) only within this long of parking (less the answer's way back), at arrival or when its start
    estimate passes its bound; past it, it is committed: served in its turn, before every request that parked after it,
    even past its TTFT deadline. 0: decided at arrival only."""
    overload_burst_seconds: float = field(default=_POLICY.overload_burst_s, metadata=setting(minimum=0))
    """A line younger than this sheds nobody ``overloaded``: a burst that finds its line empty (an agent's fan-out of
    sub-requests sent at once) parks whole and is served in turn, refused only past ``max_park_seconds``
    (``park_timeout``); a line that has stood longer is judged by the overload bound. 0: off (decision 0032)."""

def admission_values(policy: Policy) -> dict[str, Any]:
    """The ``admission`` section a ``Policy`` holds, key -> value as the core holds it."""
    return {f.name: getattr(policy, core_field(Policy, f.name)) for f in fields(AdmissionConfig)}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Settings of one model, keyed by its id."""

    decode_floor_tokens_per_s: float | None = field(default=_MODEL.decode_floor_tokens_per_s,
                                                    metadata=setting(minimum=0.001))
    """Each request of the model keeps at least this decode rate (the quality cap)."""
    solo_decode_tokens_per_s: float | None = field(default=_MODEL.solo_decode_tokens_per_s,
                                                   metadata=setting(minimum=0.001))
    """Seed for the model's solo decode rate until measured."""
    kv_bytes_per_token: int | None = field(default=_MODEL.kv_bytes_per_token, metadata=setting(minimum=1))
    """KV bytes one token of the model costs; makes box pools byte-aware."""
    max_ttft_ms: int | None = field(default=_MODEL.max_ttft_ms, metadata=setting(minimum=1))
    """Default TTFT deadline for the model's requests."""


@dataclass(frozen=True, slots=True)
class BoxConfig:
    """Engines sharing one machine's KV memory: a pool no pair of them may double-spend (``kv_budget_tokens`` and/or
    ``kv_budget_bytes`` needed)."""

    engines: tuple[str, ...]
    """Names of the engines in the box (each in one box at most)."""
    name: str | None = field(default=None, metadata=setting(default="`box<i>`, i its index"))
    """The box's name."""
    kv_budget_tokens: int | None = field(default=None, metadata=setting(minimum=1))
    """The machine's KV, in tokens."""
    kv_budget_bytes: int | None = field(default=None, metadata=setting(minimum=1))
    """The machine's KV, in bytes (needs ``models.<id>.kv_bytes_per_token`` for at least one model)."""


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    """Fair share within each parking class (core/fairshare.py, decision 0015)."""

    enabled: FairMode = _FAIR.mode
    """``auto``: on when a tenant is configured; ``true`` (or ``on``), ``false`` (or ``off``: FIFO exactly)."""
    prompt_weight: float = field(default=_FAIR.prompt_weight, metadata=setting(minimum=0.001))
    """What a prompt token adds to its tenant's counter (the VTC paper's weights, with ``output_weight``)."""
    output_weight: float = field(default=_FAIR.output_weight, metadata=setting(minimum=0))
    """What an output token adds to its tenant's counter."""
    default_weight: float = field(default=_FAIR.default_weight, metadata=setting(minimum=0.001))
    """The weight of a tenant without its own, and of requests without a tenant."""
    lift_credit_requests: float = field(default=_FAIR.lift_credit_requests, metadata=setting(minimum=0, maximum=1000))
    """A tenant that parks with none of its requests parked is lifted to the lowest counter among the backlogged
    tenants less this many of its own requests' cost (never below its own counter): a tenant back from idle may have
    that many requests served ahead of a backlogged flood before the two alternate (decision 0031). 0: lifted exactly to
    the minimum, as the VTC paper lifts."""
    preempt_sheddable: bool = _FAIR.preempt_sheddable
    """A critical request whose expected start is past its bound (shed early would refuse it) may end running
    sheddable streams on an engine where their end lets it start: the least work lost first (core/preempt.py,
    decision 0028). Each one's client gets 503 ``preempted`` with a Retry-After (mid-stream: an SSE error event, then
    the stream ends); the engine stops it. While on, sheddable streams pass through Envoy's ext_proc filter (one
    round trip to the control plane per response chunk); critical and standard traffic never does."""
    preempt_max_per_minute: int = field(default=_FAIR.preempt_max_per_minute, metadata=setting(minimum=1))
    """Preemptions allowed in any 60 s, all models together; past it critical requests are shed early as usual."""
    preempt_grace_ms: int = field(default=_FAIR.preempt_grace_ms, metadata=setting(minimum=1, maximum=60_000))
    """How long a preempted stream that already answered 200 waits for its next chunk, which is replaced by the SSE
    error event before the stream is reset; past it (an engine still prefilling) the stream is reset without the
    event (the client sees the connection end)."""
    across_replicas: bool = _FAIR.across_replicas
    """With several replicas on one store, ``true``: a woken request is admitted only if it is the fair pick among every
    replica's parked requests of its class, by counters the store keeps, charged in the admission's own atomic step
    (two replicas decide as one would; decision 0025). ``false``: each replica is fair among the requests it holds, by
    counters of its own (the per-replica fair queue of other gateways, kept to measure against)."""


@dataclass(frozen=True, slots=True)
class AdaptersConfig:
    """LoRA adapters ("LoRA adapters" in docs/architecture.md): discovered from each engine's ``/v1/models`` and vLLM's
    ``lora_requests_info``; this section names the base of adapters an engine lists without one, the swap prior,
    placement by traffic share and dynamic loading."""

    swap_seconds: float = field(default=_ADAPTERS.swap_s, metadata=setting(minimum=0, maximum=600))
    """What loading an adapter into an engine's slot adds to a request's TTFT estimate on an engine not expected to hold
    it: the prior, until the engine has its own measurements."""
    swap_min_samples: int = field(default=_ADAPTERS.swap_min_samples, metadata=setting(minimum=1))
    """Adapter requests an engine needs timed (streamed first tokens), of each kind (cold: admitted with a swap priced;
    warm: without), before its measured swap replaces the prior."""
    load_headroom: float = field(default=_ADAPTERS.load_headroom, metadata=setting(minimum=0, maximum=100))
    """Placement by traffic share (core/adapterhomes.py, decision 0026): an adapter's requests keep to ``ceil(share x
    candidates x headroom)`` engines (at least one; its homes, planned from the shares and the engines' capacity),
    ``share`` its part of its base model's recent adapter admissions; a load that evicts an adapter is charged ``min(1,
    its share x candidates x headroom)`` swaps. 0: off (every eviction a whole swap, no narrowing)."""
    home_margin: float = field(default=_ADAPTERS.home_margin, metadata=setting(minimum=0, maximum=100))
    """An adapter's homes stay its only candidates unless the soonest of them would finish later than ``1 + margin``
    times the soonest other candidate, the swap there included."""
    dynamic_loading: bool = _ADAPTERS.dynamic_loading
    """Load an adapter no engine lists (one with a base in ``models`` and a path in ``paths``) on the engine where a
    request for it would finish soonest, swap included, among those with ``engines[].runtime_lora_updating`` (vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``POST /v1/load_lora_adapter``); with as many adapters listed there as it has
    slots, the least recently used one sluice loaded is unloaded first (``/v1/unload_lora_adapter``). The request's
    Check waits for the load (at most ``load_timeout_seconds``). Each replica loads on its own (two may load one adapter
    on two engines, and the rate limit is per replica)."""
    loads_per_minute: int = field(default=_ADAPTERS.loads_per_minute, metadata=setting(minimum=1, maximum=10_000))
    """Dynamic loads sent to one engine in any 60 s; beyond it the engine is not chosen for a load."""
    load_timeout_seconds: float = field(default=_ADAPTERS.load_timeout_s, metadata=setting(minimum=0.1, maximum=600))
    """How long a dynamic load (the unload that makes room, then the load) may take before it counts as failed: the
    longest a Check waits for it. With dynamic loading on, at least 20 s below ``envoy.stream_idle_timeout_seconds``."""
    paths: Mapping[str, str] = field(default_factory=dict, metadata=setting(placeholder="<adapter>"))
    """LoRA adapter -> the path an engine loads it from (vLLM's ``lora_path``), for dynamic loading; each needs its base
    in ``models``."""
    models: Mapping[str, str] = field(default_factory=dict, metadata=setting(placeholder="<adapter>"))
    """LoRA adapter -> its base model, for engines whose ``/v1/models`` names no ``parent`` (discovery wins where it does);
    an adapter is neither its own base nor another adapter's."""


@dataclass(frozen=True, slots=True)
class TenantPriority:
    """A tenant's classes (``x-sluice-priority``)."""

    default: Priority = _TENANT.default_priority
    """The class of a request without ``x-sluice-priority``."""
    max: Priority | None = field(default=None, metadata=setting(default="`default`"))
    """The highest class its requests may ask for (above it: lowered to it)."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A budget (``ratelimit/``); a unit test keeps these keys equal to ``ratelimit.config.LIMIT_FIELDS``."""

    requests_per_minute: int | None = field(default=None, metadata=setting(minimum=1))
    """Requests a minute."""
    tokens_per_minute: int | None = field(default=None, metadata=setting(minimum=1))
    """Tokens a minute (prompt + output)."""
    concurrent_requests: int | None = field(default=None, metadata=setting(minimum=1))
    """Requests running at once."""


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant, keyed by its name (``[A-Za-z0-9][A-Za-z0-9_.-]*``: it labels metrics and names a budget). No tenant:
    authentication and fair share are off."""

    keys: tuple[str, ...]
    """SHA-256 hex digests of the tenant's API keys (``printf %s KEY | sha256sum``), each belonging to one tenant."""
    priority: TenantPriority = TenantPriority()
    """The tenant's classes."""
    limits: TenantLimits = TenantLimits()
    """The tenant's own budget."""
    models: Mapping[str, TenantLimits] = field(default_factory=dict, metadata=setting(placeholder="<model>"))
    """The tenant's share of a model: the same limits, charged together with its own."""
    models_allowed: tuple[str, ...] | None = field(default=None, metadata=setting(default="every model"))
    """The models it may use; other models are refused 403 ``model_not_allowed``."""
    weight: float | None = field(default=None, metadata=setting(minimum=0.001, default="`fairness.default_weight`"))
    """Its weight in fair share: while both wait, a tenant of weight 2 is served twice the tokens of one of weight 1."""
    reserved_share: float = field(default=_TENANT.reserved_share, metadata=setting(minimum=0, maximum=1))
    """Its guaranteed fraction of each model's sequence slots (core/reserve.py): ``floor(share x slots)`` held back from
    other tenants while it has a fitting request parked and runs fewer, lent out while it has none; all tenants' shares
    add up to at most 1 (more: the config is refused; decision 0020)."""
