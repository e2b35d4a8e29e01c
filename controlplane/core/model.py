"""The data the decision core works on: immutable views of engines, requests and decisions.

Everything here is a frozen dataclass. Times are seconds on the control plane's monotonic clock, always passed in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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

    @property
    def queue(self) -> float | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


@dataclass(frozen=True, slots=True)
class ServedModel:
    model_id: str
    max_model_len: int | None = None
    parent: str | None = None
    """Base model of a LoRA adapter."""


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
    flavor: str | None = None
    chip_class: str = ""
    discovered_capacity_tokens: int | None = None
    discovered_concurrency: int | None = None
    """The engine's own cap when it reports one (SGLang max_running_requests, llama.cpp total_slots)."""
    rates: EngineRates | None = None
    degraded: tuple[str, ...] = ()
    """Load gauges its flavour needs that the engine does not expose (empty = healthy observation)."""

    def serves(self, model: str) -> bool:
        return any(m.model_id == model for m in self.models)

    @property
    def ready(self) -> bool:
        return not self.stale and bool(self.models)

    @property
    def cap(self) -> int | None:
        """Concurrency cap: configured, else what the engine reports, else unknown."""
        return self.max_num_seqs or self.discovered_concurrency

    @property
    def kv_capacity_tokens(self) -> int | None:
        from_metrics = self.sample.kv_capacity_tokens if self.sample is not None else None
        return from_metrics or self.discovered_capacity_tokens


@dataclass(frozen=True, slots=True)
class Ticket:
    ticket_id: str
    engine: str
    model: str
    admitted_at: float
    lease_deadline: float
    """After this the ticket is reaped even if its access-log entry never arrives."""


class Verdict(enum.Enum):
    ADMIT = "admit"
    SHED = "shed"
    REJECT = "reject"
    """The request itself is wrong (4xx); it never costs an engine anything."""
    ANSWER = "answer"
    """The control plane answers itself (``GET /v1/models``)."""


class Reason(enum.Enum):
    LEAST_LOADED = "least_loaded"
    STALE_FAIL_OPEN = "stale_fail_open"
    MODEL_LIST = "model_list"
    MALFORMED_JSON = "malformed_json"
    MISSING_MODEL = "missing_model"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_PATH = "unknown_path"
    NO_READY_ENGINE = "no_ready_engine"


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    method: str
    path: str
    model: str | None
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: Reason
    engine: str | None = None
    status: int = 200
    retry_after_s: int | None = None
    detail: str = ""
    body: bytes = b""
    """The response body for non-admit verdicts (an OpenAI-shaped error, or the model list)."""


@dataclass(frozen=True, slots=True)
class Fleet:
    engines: tuple[EngineView, ...]
    unseen_load: dict[str, int] = field(default_factory=dict)
    """Per engine: tickets the last probe cannot have counted (admitted after it, minus released after it)."""
    admit_stale: bool = True
    """Policy ``observe.on_stale``: open (True) still admits to a stale engine when no fresh one serves the model."""
