"""What a request is and what is decided for it: the request as the core reads it, the decision, the ticket, the
request parked and the outcome the admission core answers.

Everything here is a frozen dataclass or an enum. Times are seconds on the control plane's monotonic clock, always
passed in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controlplane.core.engines import ServedModel


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
    """A woken head picked by tenant fair share with ``fairness.across_replicas`` off: no higher class may be parked; its
    place within its class is its replica's lot's to decide (each replica fair among the requests it holds)."""
    FAIR = "fair"
    """A woken head picked by tenant fair share (core/fairshare.py), the store's: no higher class may be parked, and it
    must be the fair pick (``fairshare.fair_pick``) among every replica's parked requests of its class, by the
    counters the store holds (decision 0025)."""
    FAIR_NEWEST = "fair_newest"
    """``FAIR`` under adaptive LIFO: the pick is its tenant's newest."""


class Priority(enum.StrEnum):
    """A request's class (``x-sluice-priority``): critical parks ahead of standard; sheddable is shed, never parked."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


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
    PREEMPTING = "preempting"
    """A critical request that would have been shed early waits for sheddable streams being ended for it
    (``fairness.preempt_sheddable``, core/preempt.py)."""
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
    on_index: bool = False
    """Decided on the fleet index (``indexed.decide_indexed``) rather than by the full scan of every candidate."""


@dataclass(frozen=True, slots=True)
class Parked:
    """A request waiting in the parking lot (admission.py)."""

    request_id: str
    request: InferenceRequest
    parked_at: float
    deadline: float
    ttft_bound: bool = False
    """The deadline comes from the request's TTFT deadline, not ``max_park_s``."""
    seq: int = 0
    """Its place in the lot's order (parking order), which ``restore`` puts it back at: arrival times can tie."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the admission core answers for one request: its decision, and for an admission its ticket."""

    request_id: str
    decision: Decision
    ticket: Ticket | None = None
    parked_for: float = 0.0
    """Seconds the request waited in the parking lot before this outcome."""
    rule: QueueRule = QueueRule.ARRIVAL
    """An admission's place against the line, which the shared store checks (a woken head: OLDEST or NEWEST; a
    backfill: NONE)."""
    parked: Parked | None = None
    """The request's entry in the lot when it was parked: what ``restore`` puts back if the store refuses a woken
    request's admission, and what leaves the shared line when the lot answers it without one (a wake's refusal or shed,
    ``expire_parked``). Every outcome for a parked request carries it."""
    noted: tuple[int, ...] = ()
    """Prompt blocks this admission added to the prefix index for its engine (``retract`` takes them back)."""
