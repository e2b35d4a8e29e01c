"""What the control plane knows of each engine: a probe's sample, the rates between probes and the view decisions read.

Every class is a frozen dataclass pickled by its fields (the probe worker sends views through a pipe). A gauge an engine
did not report is ``None``, never 0. Times are seconds on the control plane's monotonic clock, always passed in.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

_C = TypeVar("_C", bound=type)


def pickled_by_fields(cls: _C) -> _C:
    """Pickle instances of a frozen dataclass as a call of its constructor with its fields in order: the probe worker
    sends every probe's view through a pipe (observe/worker.py), and this costs half of dataclasses' own way."""
    names = tuple(f.name for f in fields(cls))
    get = operator.attrgetter(*names)
    values: Callable[[Any], tuple[Any, ...]] = get if len(names) > 1 else lambda obj: (get(obj),)

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, values(self)

    setattr(cls, "__reduce__", __reduce__)
    return cls


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class EngineSample:
    """One probe of an engine's ``/metrics``, normalised across engine flavours. ``None`` means the engine did not say."""

    taken_at: float
    """When the probe was sent (a ticket admitted before this may already be counted in the gauges)."""
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    """Fraction of the KV cache in use, 0..1."""
    kv_used_tokens: float | None = None
    kv_capacity_tokens: int | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    decode_seconds_total: float | None = None
    """Cumulative per-request decode time (a per-token latency histogram's ``_sum``, or llama.cpp's counter)."""
    decode_tokens_total: float | None = None
    """Tokens that ``decode_seconds_total`` covers (the histogram's ``_count``)."""
    prefill_seconds_total: float | None = None
    prefill_tokens_total: float | None = None
    finished_requests_total: float | None = None
    """Requests the engine finished (its per-request output-length histogram's ``_count``)."""
    finished_output_tokens_total: float | None = None
    """Tokens those finished requests generated (the same histogram's ``_sum``)."""
    finished_length_buckets: tuple[tuple[float, float], ...] | None = None
    """The same histogram's buckets: (upper bound ``le``, cumulative count), ascending, summed over label sets."""
    prefill_counts_cached: bool = False
    """``prefill_tokens_total`` counts prompt tokens the prefix cache served too (vLLM's per-request prompt-token
    histogram, read when its newer computed-tokens histogram is absent): rates take the cache's share out."""
    prefix_cache_queries_total: float | None = None
    """Prompt tokens the engine looked up in its prefix cache (vLLM ``prefix_cache_queries``, SGLang prompt tokens)."""
    prefix_cache_hits_total: float | None = None
    """Prompt tokens it found there and did not prefill (vLLM ``prefix_cache_hits``, SGLang ``cached_tokens``)."""
    lora_max: int | None = None
    """Adapter slots the engine reports (vLLM ``lora_requests_info``'s ``max_lora``: its ``--max-loras``)."""
    lora_running: tuple[str, ...] | None = None
    """Adapters of the requests it runs, as of its last recorded step (None: it reports no LoRA state)."""
    lora_waiting: tuple[str, ...] | None = None
    """Adapters of the requests queued inside it."""

    @property
    def queue(self) -> float | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class ServedModel:
    model_id: str
    max_model_len: int | None = None
    parent: str | None = None
    """Base model of a LoRA adapter."""


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class EngineRates:
    """Rates between two consecutive probes (see ``controlplane/observe/rates.py`` for the formulas)."""

    interval_s: float
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s_each: float | None = None
    solo: bool = False
    """The decode rate was measured with exactly one request running (and none queued) for the whole interval."""
    batch: int | None = None
    """Requests running at both ends of the interval when that count did not change (the decode rate's batch size)."""
    finished_requests: int = 0
    """Requests that finished in the interval."""
    mean_output_tokens: float | None = None
    """Their mean output length (what the engine really generated, end of sequence included)."""
    finished_by_length: tuple[tuple[float, float, int], ...] = ()
    """How those requests' lengths fell into the histogram's buckets: (lower bound, upper bound, count) for every bucket
    that gained any (empty when the engine exposes no buckets or they were reset)."""


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class EngineView:
    """What the control plane knows about one engine at one instant."""

    name: str
    url: str
    max_num_seqs: int | None
    """Configured concurrency cap (vLLM exposes none)."""
    models: tuple[ServedModel, ...] = ()
    version: str | None = None
    sample: EngineSample | None = None
    last_ok_at: float | None = None
    last_error: str = ""
    stale: bool = True
    """No good probe within the stale window (or never)."""
    flavor: Flavor | None = None
    chip_class: str = ""
    discovered_capacity_tokens: int | None = None
    discovered_concurrency: int | None = None
    """The engine's own cap when it reports one (SGLang max_running_requests, llama.cpp total_slots)."""
    rates: EngineRates | None = None
    degraded: tuple[str, ...] = ()
    """Load gauges its flavour needs that the engine does not expose (empty = healthy observation)."""
    drained: bool = False
    """An operator drained it: no new admissions, no fallback weight; running requests finish."""
    anchor_prefill_tokens_per_s: float | None = None
    """Configured prefill rate until one is measured."""
    anchor_decode_tokens_per_s: float | None = None
    """Configured per-request decode rate until one is measured."""
    ttft_correction: float = 1.0
    """What the engine's own part of a TTFT estimate (prefill and first token) is multiplied by: its measured TTFTs
    against the estimates (core/feedback.py; the core sets it, 1 until the access log shows the engine slower)."""
    max_loras: int | None = None
    """Configured adapter slots (``engines[].max_loras``; vLLM's ``--max-loras``); None: what the engine reports."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters the engine lists as loaded outside its model list (llama.cpp's ``/lora-adapters``: each file's
    name, a request picks them by id and scale, not by model name); shown, not routed on."""

    def serves(self, model: str) -> bool:
        return any(m.model_id == model for m in self.models)

    @property
    def ready(self) -> bool:
        return not self.stale and bool(self.models)

    @property
    def adapter_slots(self) -> int | None:
        """LoRA adapter slots: configured, else the ``max_lora`` the engine reports, else unknown (no slot rule)."""
        if self.max_loras is not None:
            return self.max_loras
        return self.sample.lora_max if self.sample is not None else None

    @property
    def cap(self) -> int | None:
        """Concurrency cap: configured, else what the engine reports, else unknown."""
        return self.max_num_seqs or self.discovered_concurrency

    @property
    def kv_capacity_tokens(self) -> int | None:
        from_metrics = self.sample.kv_capacity_tokens if self.sample is not None else None
        return from_metrics or self.discovered_capacity_tokens


class Flavor(enum.StrEnum):
    """An engine's metric dialect (detected from its ``/metrics``, or configured)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    TGI = "tgi"

