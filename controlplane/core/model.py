"""The data the decision core works on: immutable views of engines, requests and decisions.

Everything here is a frozen dataclass, and a mapping one holds is a read-only ``MappingProxyType`` or ``FrozenMap`` (``frozen_map``).
Times are seconds on the control plane's monotonic clock, always passed in.
"""

from __future__ import annotations

import bisect
import enum
import operator
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, TypeVar

from controlplane.core.output_length import OutputTail
from controlplane.core.sharedmap import FrozenMap

_K = TypeVar("_K")
_V = TypeVar("_V")


_READ_ONLY = (MappingProxyType, FrozenMap)
"""Mapping types taken as they are (never changed by anyone after they are handed over)."""


def frozen_map(mapping: Mapping[_K, _V]) -> Mapping[_K, _V]:
    """A read-only mapping for a frozen dataclass. A ``MappingProxyType`` is taken as it is (whoever built it handed over
    a fresh dict and keeps no reference: the hot path builds one per Check and must not copy it twice), and so is a
    ``FrozenMap`` (a SharedMap's snapshot, which never changes); anything else is copied first, so a caller's dict changing
    later cannot change the dataclass."""
    return mapping if type(mapping) in _READ_ONLY else MappingProxyType(dict(mapping))


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


_C = TypeVar("_C", bound=type)


def pickled_by_fields(cls: _C) -> _C:
    """Pickle instances of a frozen dataclass as a call of its constructor with its fields in order. The probe worker
    sends every probe's view through a pipe (observe/worker.py): dataclasses' own ``__setstate__`` looks the fields up
    and sets them one by one per object, twice the cost of this on each side (at 1000 engines, a view a millisecond)."""
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


@dataclass(frozen=True, slots=True)
class Ticket:
    ticket_id: str
    engine: str
    model: str
    admitted_at: float
    lease_deadline: float
    """After this the ticket is reaped even if its access-log entry never arrives."""
    reserved_tokens: int = 0
    """KV the request may grow to: estimated prompt tokens + max_tokens."""
    expected_done_at: float = 0.0
    """When the ledger expects the request to finish (for Retry-After)."""
    expected_ttft_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    """The per-request decode rate the admission's estimate used (its end-to-end estimate, given the answer's length:
    ``expected_ttft_s + (tokens - 1) / decode_tokens_per_s``). Only this replica's own admissions carry it: the store
    does not, so a ticket another replica admitted (or one loaded at start-up) has 0."""


class QueueRule(enum.StrEnum):
    """Where an admission stands against the parking line, which the shared store checks before it writes a ticket
    (controlplane/store/): with several control-plane replicas the line is theirs together."""

    NONE = "none"
    """No check (backfill: a request admitted past the line because it finishes before the head could start)."""
    ARRIVAL = "arrival"
    """A new request: nobody of its class or a higher one may be parked, on any replica (else it parks behind them)."""
    OLDEST = "oldest"
    """A woken head in FIFO order: it must be the oldest of its class everywhere, and no higher class may be parked."""
    NEWEST = "newest"
    """A woken head under adaptive LIFO: it must be the newest of its class, and no higher class may be parked."""
    CLASS = "class"
    """A woken head picked by tenant fair share (core/fairshare.py): no higher class may be parked; its place within its
    class is its replica's lot's to decide (the shared line keeps parking order, which fair share does not follow)."""


class Priority(enum.StrEnum):
    """A request's class (``x-sluice-priority``): critical parks ahead of standard; sheddable is shed, never parked."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


class Flavor(enum.StrEnum):
    """An engine's metric dialect (detected from its ``/metrics``, or configured)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    TGI = "tgi"


class Verdict(enum.Enum):
    ADMIT = "admit"
    PARK = "park"
    """Nothing fits now: hold the Check until capacity frees (bounded in time and depth)."""
    SHED = "shed"
    REJECT = "reject"
    """The request itself is wrong (4xx); it never costs an engine anything."""
    ANSWER = "answer"
    """The control plane answers itself (``GET /v1/models``)."""


class Reason(enum.Enum):
    """Low-cardinality outcome codes (metrics labels, ``x-sluice-route-reason``), one per meaning; detail goes elsewhere.

    A refusal's reason is also its error: the HTTP edge (``controlplane/edge.py``) maps every reason to a status, an OpenAI
    error type and code, so a reason means one thing to clients as well as to metrics."""

    # admitted
    FINISH_SOONEST = "finish_soonest"
    SATISFICING_BAND = "satisficing_band"
    SESSION_AFFINITY = "session_affinity"
    STALE_FAIL_OPEN = "stale_fail_open"
    WORK_CONSERVING = "work_conserving"
    FAIR_SHARE = "fair_share"
    """A free slot taken although a busy engine would finish sooner: its slot wait exceeded the work-conserving bound."""
    PREFIX_CACHE = "prefix_cache"
    """The chosen engine is expected to hold the start of the prompt in its prefix cache, and the estimate that chose it
    skipped that prefill (instead of ``finish_soonest`` or ``satisficing_band``)."""
    MODEL_LIST = "model_list"
    # refused: the request itself (one reason per error code)
    INVALID_JSON = "invalid_json"
    """The body is not a JSON object (undecodable, truncated, an unterminated string, not an object)."""
    JSON_TOO_DEEP = "json_too_deep"
    """The body nests arrays/objects deeper than ``MAX_JSON_DEPTH`` (found before it is parsed)."""
    MISSING_MODEL = "missing_model"
    INVALID_MAX_TOKENS = "invalid_max_tokens"
    INVALID_PRIORITY = "invalid_priority"
    INVALID_MAX_TTFT_MS = "invalid_max_ttft_ms"
    INVALID_SESSION = "invalid_session"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_PATH = "unknown_path"
    CONTEXT_LENGTH = "context_length_exceeded"
    # refused: who asks, and their budget (tenants, controlplane/core/tenants.py)
    INVALID_API_KEY = "invalid_api_key"
    """Tenants are configured and the request's bearer key is missing or belongs to none of them."""
    MODEL_NOT_ALLOWED = "model_not_allowed"
    """The tenant's ``models_allowed`` does not list the request's model."""
    RATE_LIMITED = "rate_limit_exceeded"
    """The tenant's budget (requests, tokens or concurrent requests, its own or its share of the model) has no room:
    shed with the retry-after the limiter computed, or refused without one when the request exceeds a whole budget."""
    # why an engine does not fit (the fit rules, fit.py; park while they last)
    CAP = "cap"
    """The engine runs its concurrency cap."""
    KV_WATERMARK = "kv_watermark"
    KV_NEED = "kv_need"
    BOX_POOL = "box_pool"
    QUALITY_CAP = "quality_cap"
    ADAPTER_SLOTS = "adapter_slots"
    """Every LoRA adapter slot of the engine is held by open tickets of other adapters (core/adapters.py)."""
    # why a request waits although something may fit
    QUEUED_BEHIND = "queued_behind"
    WAITING_FOR_FASTER = "waiting_for_faster"
    TTFT_DEADLINE = "ttft_deadline"
    """No engine's TTFT estimate meets the deadline now, but one would after a slot frees (parked until the park limit)."""
    RESERVED_SHARE = "reserved_share"
    """The free slots are held back for other tenants' reserved shares while they have work (core/reserve.py)."""
    # shed
    NO_READY_ENGINE = "no_ready_engine"
    VERSION_FLOOR = "version_floor"
    SATURATED = "saturated"
    QUEUE_FULL = "queue_full"
    PARK_TIMEOUT = "park_timeout"
    OVERLOADED = "overloaded"
    """Overload: within its decision window (``shed_decision_seconds``) the request's expected start was past its bound
    (``overload_shed_after_ms``, or ``overload_shed_services`` of its model's service times; tighter while its line
    holds a committed request), so it is refused at once with that wait as Retry-After (core/admission.py)."""
    TTFT_UNMEETABLE = "ttft_unmeetable"
    STORE_UNAVAILABLE = "store_unavailable"
    """The shared store cannot be reached and ``store.on_failure`` is ``closed`` (controlplane/store/)."""
    RATELIMIT_UNAVAILABLE = "ratelimit_unavailable"
    """The tenants' limiter cannot reach its store and ``ratelimit.on_failure`` is ``closed`` (controlplane/admission/quota.py)."""


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    method: str
    path: str
    model: str | None
    stream: bool = False
    prompt_tokens: int = 0
    """Estimated from the prompt's characters and messages (core/prompt_tokens.py: learned from the engines' counts,
    the policy's ``chars_per_token`` before)."""
    prompt_chars: int = 0
    """Characters of prompt text the Check counted."""
    prompt_messages: int = 0
    """Chat messages (0 for a completion's prompt)."""
    max_tokens: int | None = None
    """As the client asked; None = the policy default is reserved."""
    priority: Priority = Priority.STANDARD
    """``x-sluice-priority``."""
    max_ttft_ms: int | None = None
    """TTFT deadline (``x-sluice-max-ttft-ms``, else the model's default); None = no deadline. A parked request's wake
    passes what is left of it."""
    ttft_headroom_ms: int = 0
    """Planned into the deadline and kept however much of it is left (policy ``ttft_headroom_fraction`` of the
    deadline at arrival): decisions plan for ``max_ttft_ms - ttft_headroom_ms`` (``planned_ttft_s``)."""
    session: str | None = None
    """Affinity key (``x-sluice-session``)."""
    prefix_blocks: tuple[int, ...] = ()
    """Chained hashes of the canonically rendered prompt's blocks (core/prefix.py); empty when prefix routing is off."""
    tenant: str | None = None
    """The configured tenant whose key sent it (core/tenants.py); None: no tenant (one tenant for fair share)."""

    def planned_ttft_s(self) -> float | None:
        """The deadline decisions plan for, in seconds (the deadline less its headroom); None without a deadline."""
        if not self.max_ttft_ms:
            return None
        return max(1, self.max_ttft_ms - self.ttft_headroom_ms) / 1000


@dataclass(frozen=True, slots=True)
class Decision:
    """What happens to one request: a verdict, its reason and a human-readable detail, plus the data behind them.

    No HTTP here: the edge (``controlplane/edge.py``) turns a verdict and reason into a status, headers and a body, the
    same way for every caller (the Check, the admin API's explanation)."""

    verdict: Verdict
    reason: Reason
    engine: str | None = None
    retry_after_s: int | None = None
    detail: str = ""
    """Why, in words: a refusal's or a shed's error message, an admission's estimates, what a park waits for."""
    models: tuple[ServedModel, ...] = ()
    """ANSWER (``GET /v1/models``): every model an admissible engine serves, once, sorted by id."""
    reserved_tokens: int = 0
    """KV reserved for an admitted request (prompt estimate + max_tokens)."""
    expected_done_at: float = 0.0
    expected_ttft_s: float = 0.0
    """The TTFT the decision expected (compared with the access log's)."""
    decode_tokens_per_s: float = 0.0
    """ADMIT: the per-request decode rate the estimate used on the chosen engine."""
    rates_measured: bool = True
    """ADMIT: the chosen engine's decode rate was measured or configured (False: the policy's default, a guess)."""
    park_limit_s: float | None = None
    """PARK with a TTFT deadline: the longest the request may wait and still prefill in time."""
    idle_slot: bool = False
    """PARK although a slot is free now, which this request will not take: it waits for a busy engine that finishes it
    sooner (``waiting_for_faster``), or no free engine meets its TTFT deadline (a deadline only shrinks, so it could
    never use that slot). Such a request does not hold the line for the free slot: requests behind it may take it
    (AdmissionCore.wake and check)."""
    cached_tokens: int = 0
    """ADMIT: prompt tokens the chosen engine is expected to find in its prefix cache (its prefill was estimated without
    them)."""
    waits_for: str | None = None
    """PARK ``waiting_for_faster``: the busy engine the request waits for (requests passing it count it ahead there)."""
    swap_s: float = 0.0
    """ADMIT: the LoRA adapter swap the estimate priced on the chosen engine (0: expected loaded, or a base model)."""


@dataclass(frozen=True, slots=True)
class EngineLedger:
    """What the ticket ledger knows about one engine, as the decision core reads it."""

    open_tickets: int = 0
    unseen_load: int = 0
    """Tickets admitted since the probe, minus tickets admitted before it and released since."""
    committed_tokens: int = 0
    """KV every open ticket may grow to (sum of reserved tokens)."""
    unseen_reserved_tokens: int = 0
    """Reserved tokens of tickets the last probe cannot have seen."""
    released_since_probe_tokens: int = 0
    """Reserved tokens of tickets the probe saw that have finished since: KV the probe still counts as held."""
    open_by_model: tuple[tuple[str, int], ...] = ()
    expected_done: tuple[float, ...] = ()
    """Expected finish times of open tickets, soonest first."""
    running: tuple[tuple[float, float, str], ...] = ()
    """(expected first token, expected finish, model) of each open ticket, by expected finish: how far along each is
    (route.expected_frees)."""
    finishing: tuple[tuple[float, int], ...] = ()
    """(expected finish time, reserved tokens) of open tickets, soonest first (for backfill's what-if)."""
    guessed_tickets: int = 0
    """Open tickets admitted here while the engine's decode rate was the policy's default (not measured, no anchor):
    their expected finishes may be off by any factor until they close."""

    def open_for(self, model: str) -> int:
        return dict(self.open_by_model).get(model, 0)


_NO_TICKETS = EngineLedger()


class BatchRates(Mapping[int, float]):
    """One engine's per-request decode rate by batch size (running requests), read-only, its batch sizes kept sorted:
    the rate at the nearest measured batch is a bisection, not a pass over every batch the engine ever ran (an engine
    with ``--max-num-seqs 256`` can have hundreds, read three times per index row and once per estimate)."""

    __slots__ = ("_rates", "_batches")

    def __init__(self, rates: Mapping[int, float]) -> None:
        self._batches = tuple(sorted(rates))
        self._rates = {batch: rates[batch] for batch in self._batches}

    def __getitem__(self, batch: int) -> float:
        return self._rates[batch]

    def __iter__(self) -> Iterator[int]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def __repr__(self) -> str:
        return f"BatchRates({self._rates!r})"

    def nearest(self, batch: int) -> float:
        """The rate at the measured batch size nearest ``batch`` (the smaller of two as near)."""
        batches = self._batches
        i = bisect.bisect_left(batches, batch)
        if i == len(batches):
            return self._rates[batches[-1]]
        if i == 0 or batches[i] - batch < batch - batches[i - 1]:
            return self._rates[batches[i]]
        return self._rates[batches[i - 1]]


class ClassChangeLog:
    """Which (model, chip class) medians changed in each of the last ``keep`` class tables a ``RateBook`` built, by the
    tables' ``class_serial``. A holder of per-class arrays derived from one table (``FleetIndex._per_chip``) redoes only
    those classes for a newer one: without chip classes configured every engine is its own class, and redoing all of
    them per Check cost 0.4 ms at 1000 engines. Append-only; asked about a serial older than it keeps, it answers None
    (redo every class)."""

    __slots__ = ("_log",)

    def __init__(self, keep: int = 256) -> None:
        self._log: deque[tuple[int, frozenset[tuple[str, str]]]] = deque(maxlen=keep)

    def append(self, serial: int, changed: frozenset[tuple[str, str]]) -> None:
        self._log.append((serial, changed))

    def since(self, serial: int, newest: int) -> set[tuple[str, str]] | None:
        """The classes that changed after table ``serial`` up to table ``newest``, or None when some are forgotten."""
        changed: set[tuple[str, str]] = set()
        if newest <= serial:
            return changed
        for at, keys in reversed(self._log):
            if at <= serial:
                return changed
            if at <= newest:
                changed |= keys
        return changed if self._log and self._log[0][0] == serial + 1 else None


@dataclass(frozen=True, slots=True)
class RateTables:
    """Trusted medians the observation layer has learned (empty until enough samples)."""

    solo_decode: Mapping[tuple[str, str], float] = field(default_factory=_empty)
    """(model, chip class) -> solo decode tokens/s."""
    prefill_median: Mapping[tuple[str, str], float] = field(default_factory=_empty)
    """(model, chip class) -> prefill tokens/s."""
    decode_by_batch: Mapping[str, BatchRates] = field(default_factory=_empty)
    """engine -> running requests -> per-request decode tokens/s."""
    class_serial: int = field(default=0, compare=False)
    """Counts the class tables (``solo_decode``, ``prefill_median``) its book built; 0 outside a book."""
    class_changes: ClassChangeLog | None = field(default=None, compare=False)
    """The book's log of which classes each of its class tables changed (``ClassChangeLog``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "solo_decode", frozen_map(self.solo_decode))
        object.__setattr__(self, "prefill_median", frozen_map(self.prefill_median))
        if type(self.decode_by_batch) not in _READ_ONLY:
            object.__setattr__(self, "decode_by_batch", MappingProxyType(
                {k: v if type(v) is BatchRates else BatchRates(v) for k, v in self.decode_by_batch.items()}))


@dataclass(frozen=True, slots=True)
class Fleet:
    engines: tuple[EngineView, ...]
    ledger: Mapping[str, EngineLedger] = field(default_factory=_empty)
    admit_stale: bool = True
    """Policy ``observe.on_stale``: open (True) still admits to a stale engine when no fresh one serves the model."""
    rates: RateTables = field(default_factory=RateTables)
    recent_serves: Mapping[str, float] = field(default_factory=_empty)
    """Admissions per engine, decayed (satisficing band weights)."""
    expected_output: Mapping[str, float] = field(default_factory=_empty)
    """model -> tokens its requests are expected to generate, learned from completed requests (output_length.py); a
    model missing here uses ``Policy.default_expected_output_tokens``."""
    output_tails: Mapping[str, OutputTail] = field(default_factory=_empty)
    """model -> its recorded lengths' shape (output_length.py): how much longer a running request is expected to run."""
    index: Any = None
    """A ``fleetindex.IndexSnapshot`` describing exactly these engines and ledger views per model (the control plane's
    fleets carry one; ``decide`` then chooses among hundreds of candidates without estimating each). None: full scan."""
    last_served: Mapping[str, float] = field(default_factory=_empty)
    """engine -> when it was last admitted to (warm near ties, ``Policy.near_tie_max_engines``); missing: never."""
    adapters: Mapping[str, str] = field(default_factory=_empty)
    """LoRA adapter -> its base model, as the engines' model lists name them (core/adapters.py)."""
    adapter_recent: Mapping[str, tuple[str, ...]] = field(default_factory=_empty)
    """engine -> the adapters sluice admitted there, most recent first (what its slots probably hold)."""
    adapter_swap_s: Mapping[str, float] = field(default_factory=_empty)
    """engine -> its learned adapter swap in seconds (core/adapters.py, ``SwapBook``); missing: the policy's prior."""

    def __post_init__(self) -> None:
        # Two type checks when the caller handed over proxies (every Fleet the control plane builds per Check does).
        if type(self.ledger) not in _READ_ONLY:
            object.__setattr__(self, "ledger", MappingProxyType(dict(self.ledger)))
        if type(self.expected_output) is not MappingProxyType:
            object.__setattr__(self, "expected_output", MappingProxyType(dict(self.expected_output)))

    def of(self, engine: str) -> EngineLedger:
        return self.ledger.get(engine, _NO_TICKETS)
