"""The narrow ports the servicers receive: each sees only what it needs, never the whole control plane, so each is tested
alone with a fake and no module imports ``app.py`` (the wiring) — not even for types."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from controlplane.core.model import Decision, InferenceRequest, Outcome, Ticket
from controlplane.core.fairshare import FairStanding, TenantShare
from controlplane.core.feedback import FirstToken, TtftSummary
from controlplane.core.prompt_tokens import PromptShape, PromptTokenRules, PromptTokenSummary
from controlplane.core.fleet import Fleet
from controlplane.core.policy import Policy
from controlplane.core.tenants import Tenant, Tenants, Usage
from controlplane.metrics import SluiceMetrics
from controlplane.admission.quota import Charged, Refused, TenantUsage
from controlplane.admission.watch import Watcher


@dataclass(frozen=True, slots=True)
class CheckSettings:
    """What the ext_authz servicer reads from the config (rebuilt when a reload changes the config)."""

    policy: Policy
    authz_timeout_s: float
    max_check_queue_ms: float
    overload_retry_after_s: int
    tenants: Tenants = Tenants()
    """None configured: authentication off, nothing charged."""


@dataclass(frozen=True, slots=True)
class XdsTypeStatus:
    type_url: str
    current_version: str
    acked_versions: dict[str, str]


@dataclass(frozen=True, slots=True)
class StatusFacts:
    """What ``GetStatus`` reports."""

    version: str
    uptime_s: float
    open_tickets: int
    tickets_admitted_total: int
    tickets_released_total: int
    tickets_expired_total: int
    xds_nacks_total: int
    xds: tuple[XdsTypeStatus, ...]
    envoy_streams: int


@dataclass(frozen=True, slots=True)
class FloorResult:
    applied: bool
    problems: tuple[str, ...]
    before: str
    after: str


@dataclass(frozen=True, slots=True)
class ReloadResult:
    applied: bool
    problems: tuple[str, ...]
    changed: tuple[str, ...]
    source: str


class CheckPort(Protocol):
    """ext_authz ``Check``: admit, park and wait, answer; give back what a failed Check held."""

    @property
    def settings(self) -> CheckSettings: ...
    @property
    def metrics(self) -> SluiceMetrics: ...
    @property
    def prompt_rules(self) -> PromptTokenRules: ...
    async def counted_prompt(self, request: InferenceRequest, body: bytes) -> InferenceRequest: ...
    async def check(self, request_id: str, request: InferenceRequest) -> Outcome: ...
    async def wait_parked(self, request_id: str) -> Outcome: ...
    def record_outcome(self, model: str | None, outcome: Outcome, request: InferenceRequest | None = None,
                       tenant: str = "") -> None: ...
    def give_back(self, request_id: str, outcome: Outcome | None) -> None: ...
    def release_ticket(self, ticket_id: str) -> Ticket | None: ...
    def ticket_open(self, ticket_id: str) -> bool: ...


class QuotaPort(Protocol):
    """Tenants' budgets (controlplane/admission/quota.py): the Check charges and gives back, the access log settles, the retry
    redirector gives back before the retry's own charge."""

    async def charge(self, tenant: Tenant, request: InferenceRequest, charge_id: str) -> Charged | Refused: ...
    def refund(self, charge_id: str) -> None: ...
    async def refund_now(self, charge_id: str) -> None: ...
    def settle(self, tenant: str, charge_id: str | None, usage: Usage) -> None: ...


class CompletionPort(Protocol):
    """The access log and the retry redirector: a request finished (or failed) on an engine."""

    @property
    def metrics(self) -> SluiceMetrics: ...
    def release_ticket(self, ticket_id: str) -> Ticket | None: ...
    def note_engine_failure(self, engine: str, why: str) -> None: ...
    def knows_engine(self, engine: str) -> bool: ...
    def note_first_token(self, ticket: Ticket, timing: FirstToken) -> None: ...
    def note_prompt_tokens(self, ticket: Ticket, shape: PromptShape, estimated: int, counted: int) -> None: ...
    def note_served_prompt(self, ticket: Ticket, shape: PromptShape, estimated: int, ok: bool) -> None: ...
    def settle_usage(self, ticket_id: str, usage: Usage) -> None: ...


class AdminPort(Protocol):
    """The operators' API: read the fleet and the control plane, drain, explain, reload."""

    @property
    def policy(self) -> Policy: ...
    def now(self) -> float: ...
    def fleet(self, now: float) -> Fleet: ...
    def status(self, now: float) -> StatusFacts: ...
    def open_tickets(self, engine: str) -> int: ...
    def medians(self, model: str, chip_class: str) -> tuple[float | None, float | None]: ...
    def ttft_summary(self, engine: str) -> TtftSummary: ...
    def prompt_summary(self, model: str, engine: str) -> PromptTokenSummary: ...
    def swap_samples(self, engine: str) -> int: ...
    @property
    def prompt_rules(self) -> PromptTokenRules: ...
    async def set_drained(self, name: str, drained: bool) -> bool: ...
    def decide_for(self, request: InferenceRequest, now: float) -> tuple[Decision, int]: ...
    def expected_cached(self, request: InferenceRequest) -> Mapping[str, int]: ...
    async def reload(self, path: str | None) -> ReloadResult: ...
    @property
    def config_source(self) -> str: ...
    async def set_version_floor(self, pattern: str, version: str) -> FloorResult: ...
    def watch(self, model: str | None) -> Watcher: ...
    def unwatch(self, watcher: Watcher) -> None: ...
    async def tenant_usage(self) -> tuple[TenantUsage, ...]: ...
    def tenant_shares(self) -> list[TenantShare]: ...
    def fair_standing(self, request: InferenceRequest, now: float) -> FairStanding: ...


class Ending:
    """One attached stream's end, asked for at most once (``end``) and awaited by its ext_proc handler."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.retry_after_s = 0
        self.message = ""

    def end(self, retry_after_s: int, message: str) -> None:
        if not self.asked.is_set():
            self.retry_after_s, self.message = retry_after_s, message
            self.asked.set()


class PreemptPort(Protocol):
    """The admission service as the ext_proc servicer sees it."""

    def attach(self, ticket_id: str, ending: Ending) -> bool:
        """A preemptible stream's ext_proc stream opened; False: it is no (open) sheddable admission here."""
        ...

    def detach(self, ticket_id: str) -> None: ...

    @property
    def grace_s(self) -> float: ...
