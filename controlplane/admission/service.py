"""The admission service: the asyncio shell around ``AdmissionCore`` that holds parked Checks and wakes them.

A parked request keeps its Check open: the handler awaits a future this service resolves when a wake admits the request
or its park deadline sheds it. Wakes follow everything that can free capacity: a released ticket (access log), a probe, a
reaped ticket, a drain lifted, a reload, a store event. Two background tasks sweep park deadlines (with the line audit)
and ticket leases. Every ticket event goes through the core (``check``, ``release``, ``note_probe``,
``expire_leases``): nothing here writes to the ledger. It is the port the ext_authz servicer (``CheckPort``) and the
access-log servicer (``CompletionPort``) use.

Each admission is written to the shared store (``replication.py``; its rules in ``mirror.py``): a refusal undoes it and
the request is decided again, at most ``store.reserve_attempts`` times before it parks, and a parked request enters the
shared line. Under fair share a refused admission leaves no claim (the store admits claims in the line's parking order):
the store checks a fair wake's pick against every replica's parked requests by the counters it keeps (``QueueRule.FAIR``;
decision 0025), or with ``fairness.across_replicas`` off only against higher classes (``QueueRule.CLASS``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from controlplane.config import Config
from controlplane.core.admission import AdmissionCore
from controlplane.core.model import Decision, InferenceRequest, Outcome, Reason, Ticket, Verdict
from controlplane.core.waits import shed
from controlplane.core.feedback import FirstToken, RecentTtfts, TtftSummary, end_to_end_error
from controlplane.core.prompt_tokens import PromptShape, PromptTokenRules
from controlplane.core.tenants import Usage
from controlplane.core.engines import EngineView
from controlplane.metrics import NO_TENANT_LABEL, SluiceMetrics
from controlplane.observe.adapterloader import AdapterLoader
from controlplane.observe.tokenizer import PromptTokenizer
from controlplane.observe.observation import Observation
from controlplane.ports import CheckSettings, Ending
from controlplane.store.base import Claim, Refusal, Store
from controlplane.store.memory import MemoryStore
from controlplane.admission.replication import Replication
from controlplane.admission.watch import DecisionEvent, DecisionFeed

log = logging.getLogger("sluice.admission")

PARK_SWEEP_S = 0.1
"""How often park deadlines are checked (a shed comes at most this late)."""
LINE_AUDIT_S = 5.0
"""How often this replica's members of the shared lines are checked against its lot (``Replication.audit_lines``)."""


class AdmissionService:
    def __init__(self, config: Config, core: AdmissionCore, observation: Observation, metrics: SluiceMetrics,
                 clock: Callable[[], float], store: Store | None = None) -> None:
        self.core = core
        self.observation = observation
        self.metrics = metrics
        self.clock = clock
        self.replication = Replication(config, core, observation, metrics, clock, store or MemoryStore(), self)
        self.mirror = self.replication.mirror
        self.adapter_loader = AdapterLoader(config, core, observation, metrics, clock)
        """Dynamic LoRA loading (``adapters.dynamic_loading``): a Check for an adapter no engine lists waits for its
        load."""
        self.tokenizer = PromptTokenizer(core, observation, metrics, clock)
        """Long prompts counted by an engine's tokenizer before the Check decides (``admission.tokenize_above_chars``)."""
        self.config = config
        self._parked: dict[str, asyncio.Future[Outcome]] = {}
        self._early: dict[str, Outcome] = {}
        """Answers (a shed) given to a parked request before its Check reached ``wait_parked``."""
        self.feed = DecisionFeed(metrics)
        """Every final answer, for the admin API's ``WatchDecisions`` (bounded per watcher)."""
        self.recent_ttfts = RecentTtfts()
        """Each engine's last served requests' first tokens (``sluice admin engines``)."""
        self.trace_outcome: Callable[[str | None, Outcome, InferenceRequest | None], None] | None = None
        """Set when tracing is on (``CheckTracing.record``): every final answer also goes on its Check's span."""
        self._tasks: list[asyncio.Task[None]] = []
        self._wake_models: set[str] | None = set()
        """Models a scheduled wake will look at (None: all); empty with no wake scheduled."""
        self._wake_task: asyncio.Task[None] | None = None
        self._endings: dict[str, Ending] = {}
        """Attached preemptible streams (ticket -> its end), while their ext_proc stream lasts."""
        self._decision_counters: dict[tuple[str, str, str], Any] = {}
        """``sluice_admission_decisions`` children by (model label, verdict, reason): looked up once, not per Check
        (prometheus_client's ``labels`` validates and locks, about 10 us)."""

    # -- CheckPort ---------------------------------------------------------------------------------------------------
    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """Start-up and reloads: the settings a Check reads are built here once, not per Check."""
        self._config = config
        self.replication.config = config
        self.adapter_loader.config = config
        cp = config.controlplane
        self.settings = CheckSettings(config.policy, config.authz_timeout_s, cp.max_check_queue_ms,
                                      cp.overload_retry_after_seconds, config.tenants)

    async def counted_prompt(self, request: InferenceRequest, body: bytes) -> InferenceRequest:
        """``request`` with its prompt counted by an engine's tokenizer when it is long enough to ask (observe/tokenizer.py),
        else as parsed."""
        return await self.tokenizer.counted(request, body)

    async def check(self, request_id: str, request: InferenceRequest) -> Outcome:
        """Decide on the ledger, then write the admission to the store; decide again when another replica was first."""
        mirror = self.mirror
        ahead_elsewhere = 0
        queued: tuple[Decision, Claim] | None = None  # the last admission the store refused for the line alone
        if request.model is not None and self.core.policy.adapters.dynamic_loading:
            await self.adapter_loader.ensure(request.model)
        for attempt in range(self.config.store.reserve_attempts + 1):
            now = self.clock()
            fleet = self.observation.fleet(now)
            if attempt == self.config.store.reserve_attempts:  # other replicas won every race: wait in line
                outcome = self.core.force_park(request_id, request, fleet, now)
            else:
                outcome = self.core.check(request_id, request, fleet, now, ahead_elsewhere)
            self._preempt()
            if outcome.decision.verdict is Verdict.PARK:
                behind = False
                if queued is None and outcome.decision.reason is Reason.QUEUED_BEHIND and mirror.line_shared(now):
                    queued = mirror.claim_behind(request_id, request, fleet, now)
                    behind = queued is not None and not mirror.rejoin
                admitted = await self.replication.enter_line(request_id, request, now, queued, behind)
                if admitted is not None:
                    self._early.pop(request_id, None)  # an answer a sweep gave it meanwhile: the admission wins
                    return admitted
                self.metrics.admission_parked.labels(self.model_label(request.model)).inc()
                return outcome
            if outcome.ticket is None:
                return outcome
            claim = mirror.claim(outcome, request, now, fleet)
            refusal = (await self.replication.commit(outcome, claim, now)).refusal
            if refusal is None:
                return outcome
            fair = self.core.policy.fairness.enabled
            queued = (outcome.decision, claim) if refusal is Refusal.QUEUED and not fair else None
            if refusal is Refusal.QUEUED and not fair:
                mirror.share_line(now)
            if request.model is not None:  # the retracted admission freed its slot here: the line's head may fit now
                self.wake([request.model])
            if refusal is Refusal.QUEUED:
                ahead_elsewhere = 1
            elif refusal in (Refusal.CAP, Refusal.KV, Refusal.ADAPTER_SLOTS):
                await self.replication.releases_sent()
            elif refusal is Refusal.UNAVAILABLE:
                return Outcome(request_id, shed(Reason.STORE_UNAVAILABLE, "the shared ledger cannot be reached",
                                                self.config.controlplane.overload_retry_after_seconds))
        raise AssertionError("unreachable: the last attempt parks")

    async def wait_parked(self, request_id: str) -> Outcome:
        """Hold a parked Check until a wake admits it or its deadline sheds it; a cancelled Check leaves nothing."""
        early = self._early.pop(request_id, None)
        if early is not None:  # shed while its park was on its way
            return early
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._parked[request_id] = future
        self.metrics.parked_now.set(self.core.depth())
        try:
            return await future
        except asyncio.CancelledError:
            self._parked.pop(request_id, None)
            if not self.withdraw(request_id, client_left=True) and future.done() and not future.cancelled():
                ticket = future.result().ticket
                if ticket is not None:
                    # Admitted in the same instant the client left: Envoy never forwards it, so no log entry will come.
                    self.release_ticket(ticket.ticket_id)
            self.metrics.parked_now.set(self.core.depth())
            raise

    def withdraw(self, request_id: str, client_left: bool) -> bool:
        """Take a request out of the lot (and, once its park has landed, out of the line), with any answer or claim held
        for it: its client left (``client_left``: counted as a cancelled park) or its Check failed. False when the lot
        no longer held it (an admission or a shed got there first)."""
        self._early.pop(request_id, None)
        self.mirror.forget_claim(request_id)
        where = self.core.where(request_id)
        if not self.core.cancel(request_id):
            return False
        if client_left:
            self.metrics.park_cancelled.inc()
        self.metrics.parked_now.set(self.core.depth())
        self.replication.unpark(where, request_id)
        return True

    def give_back(self, request_id: str, outcome: Outcome | None) -> None:
        """A Check failed inside the control plane: whatever it holds (a place in the lot, a ticket) is returned."""
        self.withdraw(request_id, client_left=False)
        if outcome is not None and outcome.ticket is not None:
            self.release_ticket(outcome.ticket.ticket_id)

    def record_outcome(self, model: str | None, outcome: Outcome, request: InferenceRequest | None = None,
                       tenant: str = "") -> None:
        d = outcome.decision
        m = self.metrics
        key = (self.model_label(model), d.verdict.value, d.reason.value)
        counter = self._decision_counters.get(key)
        if counter is None:
            counter = self._decision_counters[key] = m.admission_decisions.labels(*key)
        counter.inc()
        if d.verdict in (Verdict.SHED, Verdict.REJECT):
            m.admission_rejected.labels(d.reason.value).inc()
        elif d.verdict is Verdict.ADMIT and request is not None:
            m.prefix_prompt_tokens.inc(request.prompt_tokens)
            m.prefix_cached_tokens.inc(d.cached_tokens)
        if outcome.parked_for > 0:
            m.park_seconds.observe(outcome.parked_for)
        if d.verdict is Verdict.ADMIT or outcome.parked_for > 0:  # each tenant's wait for fair share (0: at once)
            m.tenant_park_seconds.labels(tenant or NO_TENANT_LABEL).observe(outcome.parked_for)
        if self.trace_outcome is not None:
            self.trace_outcome(model, outcome, request)
        if self.feed.watchers:
            self.feed.publish(DecisionEvent(
                time.time(), outcome.request_id, d.verdict.value, d.reason.value, d.engine or "", model or "", tenant,
                round(outcome.parked_for * 1000, 1), d.expected_ttft_s, d.retry_after_s or 0,
                str(getattr(request.priority, "value", request.priority)) if request is not None else ""))

    def model_label(self, model: str | None) -> str:
        return self.observation.model_label(model)

    # -- CompletionPort ----------------------------------------------------------------------------------------------
    def release_ticket(self, ticket_id: str) -> Ticket | None:
        """Close a ticket (the access log, the retry redirector): at once here, in the store in the background."""
        ticket = self.core.release(ticket_id, self.clock())
        if ticket is not None:
            self.metrics.engine(ticket.engine).tickets_released.inc()
            # An adapter's slot freed may be what requests for other adapters of its engine wait for: wake them all.
            self.wake(None if self.core.is_adapter(ticket.model) else [ticket.model])
        self.replication.release(ticket_id)
        return ticket

    def note_engine_failure(self, engine: str, why: str) -> None:
        self.observation.note_failure(engine, why)

    def knows_engine(self, engine: str) -> bool:
        return self.observation.knows(engine)

    def note_first_token(self, ticket: Ticket, timing: FirstToken) -> None:
        """A served request's first token (the access log): the engine's TTFT as clients saw it and the gateway's part
        are reported; a stream's TTFT over the decision's estimate is reported and fed back (feedback.py); so is, where
        the answer's length is known, its time at the engine over the estimate for that length (``end_to_end_error``:
        reported, not fed back)."""
        series = self.metrics.engine(ticket.engine)
        series.ttft_seconds.observe(timing.engine_s)
        self.metrics.gateway_seconds.observe(timing.gateway_s)
        measured = timing.streamed and ticket.expected_ttft_s > 0 and timing.engine_s > 0
        if measured:
            self.core.observe_first_token(ticket.ticket_id, timing.engine_s)
        ratio = timing.engine_s / ticket.expected_ttft_s if measured else None
        whole = end_to_end_error(timing, ticket.expected_ttft_s, ticket.decode_tokens_per_s)
        self.recent_ttfts.record(ticket.engine, timing.engine_s, ratio, whole)
        if whole is not None:
            series.end_to_end_error.observe(whole)
        if ratio is None:
            return
        series.ttft_error.observe(ratio)
        self.core.observe_ttft(ticket.engine, ratio, self.clock())
        series.ttft_correction.set(self.core.ttft.factor(ticket.engine))

    def ticket_open(self, ticket_id: str) -> bool:
        """Whether this replica's ledger (which mirrors the store's) holds an open ticket of that id."""
        return self.core.ledger.get(ticket_id) is not None

    @property
    def prompt_rules(self) -> PromptTokenRules:
        """How the Check estimates a prompt's tokens now (learned from the engines: core/prompt_tokens.py)."""
        return self.core.prompt_tokens.rules

    def note_served_prompt(self, ticket: Ticket, shape: PromptShape, estimated: int, ok: bool) -> None:
        """What the Check counted of a released request's prompt (the access log), usage or not: its engine's
        prompt-token counter window accounts for it (core/prompt_counters.py)."""
        self.core.observe_served_prompt(ticket, shape, estimated, ok)

    def note_prompt_tokens(self, ticket: Ticket, shape: PromptShape, estimated: int, counted: int) -> None:
        """A served request's prompt as its engine counted it (the access log): the estimate's error is reported and
        the model's rule learns."""
        if estimated > 0 and counted > 0:
            self.metrics.prompt_tokens_error.labels(ticket.model).observe(counted / estimated)
        self.core.observe_prompt_tokens(ticket.model, ticket.engine, shape, counted, estimated)

    def settle_usage(self, ticket_id: str, usage: Usage) -> None:
        """A finished request's real usage (the access log): its tenant's fair-share counter is corrected, here and, with
        fair share in the store, there."""
        self.core.settle_usage(ticket_id, usage.prompt_tokens, usage.completion_tokens)
        self.replication.settle_charge(ticket_id, usage.prompt_tokens, usage.completion_tokens)

    def ttft_summary(self, engine: str) -> TtftSummary:
        """What ``engine``'s recent requests' first tokens took (``sluice admin engines``)."""
        return replace(self.recent_ttfts.summary(engine), correction=self.core.ttft.factor(engine))

    def decay_corrections(self) -> None:
        """TTFT corrections held past their half-life without a request decay (feedback.py); the gauges follow, and a
        parked request that a lower correction lets in is woken."""
        changed = self.core.decay_corrections(self.clock())
        for engine in changed:
            self.metrics.engine(engine).ttft_correction.set(self.core.ttft.factor(engine))
        if changed:
            self.wake()

    # -- PreemptPort (decision 0028) ------------------------------------------------------------------------------------
    def attach(self, ticket_id: str, ending: Ending) -> bool:
        if not self.core.preemptible.attach(ticket_id):
            return False
        self._endings[ticket_id] = ending
        return True

    def detach(self, ticket_id: str) -> None:
        self._endings.pop(ticket_id, None)
        self.core.preemptible.detach(ticket_id)

    @property
    def grace_s(self) -> float:
        return self.core.policy.fairness.preempt_grace_ms / 1000

    def _preempt(self) -> None:
        """Carry out the preemptions the core decided: each victim counted, logged and its stream asked to end."""
        for preemption in self.core.take_preemptions():
            for victim in preemption.victims:
                self.metrics.preempted.labels(self.model_label(preemption.model), preemption.engine).inc()
                ending = self._endings.get(victim.ticket_id)
                log.info("preempted %s on %s for critical %s (%s): sheddable stream ended, retry-after %d s%s",
                         victim.ticket_id, preemption.engine, preemption.request_id, preemption.model,
                         preemption.retry_after_s, "" if ending is not None else " (its stream had just ended)",
                         extra={"request_id": victim.ticket_id})
                if ending is not None:
                    ending.end(preemption.retry_after_s, f"This sheddable request was ended to make room for a "
                               f"critical request to {preemption.model}")

    # -- capacity events ---------------------------------------------------------------------------------------------
    def wake(self, models: list[str] | None = None) -> None:
        """Capacity may have freed: admit whatever parked requests now fit, in order (on the next turn of the loop, one
        wake at a time, its admissions written to the store in order)."""
        if not self.core.depth():
            return
        if models is not None:
            models = [m for m in models if self.core.depth(m)]  # a probe of an engine whose models have no queue
            if not models:
                return
        if models is None or self._wake_models is None:
            self._wake_models = None
        else:
            self._wake_models.update(models)
        if self._wake_task is None or self._wake_task.done():
            self._wake_task = asyncio.get_running_loop().create_task(self._wake_loop(), name="wake")

    async def _wake_loop(self) -> None:
        replication = self.replication
        while self._wake_models is None or self._wake_models:
            await replication.before_wake()
            models, self._wake_models = self._wake_models, set()
            now = self.clock()
            outcomes = self.core.wake(self.observation.fleet(now), now, None if models is None else list(models))
            again = await replication.settle(outcomes, now)
            if again:
                await replication.releases_sent()
                if self._wake_models is not None:
                    self._wake_models.update(again)

    def answer(self, outcomes: list[Outcome]) -> None:
        """Final answers for parked requests: each Check waiting in ``wait_parked`` gets its own; one whose Check has not
        reached it yet (its park on its way) finds it there; an admission nobody waits for any more is released."""
        for outcome in outcomes:
            self.mirror.forget_claim(outcome.request_id)
            future = self._parked.pop(outcome.request_id, None)
            if future is not None and not future.done():
                future.set_result(outcome)
            elif outcome.request_id in self.mirror.parking:  # its Check has not reached wait_parked yet
                self._early[outcome.request_id] = outcome
            elif outcome.ticket is not None:
                self.release_ticket(outcome.ticket.ticket_id)
        if outcomes:
            self.metrics.parked_now.set(self.core.depth())

    def _expired(self, tickets: list[Ticket], why: str) -> None:
        """Tickets closed without their access-log entry (counted in sluice_tickets_expired_total)."""
        for ticket in tickets:
            log.warning("ticket %s on %s reaped (%s): its access-log entry never arrived", ticket.ticket_id,
                        ticket.engine, why)
            self.metrics.engine(ticket.engine).tickets_expired.inc()
            self.replication.release(ticket.ticket_id)
        if tickets:
            self.wake()

    def on_probe(self, view: EngineView) -> None:
        """A good probe: tickets of an engine seen idle lost their log entry (reaped at once), then wake its models."""
        sample = view.sample
        if sample is not None:
            idle = sample.running == 0 and sample.waiting == 0
            reaped = self.core.note_probe(view.name, sample.taken_at, idle,
                                          self.config.tickets.idle_reap_grace_seconds)
            self._expired(reaped, "its engine is idle")
        self.wake([model.model_id for model in view.models])

    # -- lifecycle -------------------------------------------------------------------------------------------------------
    async def open_store(self) -> None:
        """Before any Check: join the store and learn every ticket it holds (a restart picks up the ledger)."""
        await self.replication.open()

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._sweep_park_deadlines(), name="park-deadlines"))
        self._tasks.append(asyncio.create_task(self._reap_leases(), name="lease-reaper"))
        self.replication.start()

    async def stop(self) -> None:
        await self.adapter_loader.stop()
        await self.tokenizer.stop()
        await self.replication.stop(*self._tasks)
        self._tasks.clear()

    async def _sweep_park_deadlines(self) -> None:
        audit_at = self.clock() + LINE_AUDIT_S
        while True:
            await asyncio.sleep(PARK_SWEEP_S)
            if self.clock() >= audit_at:
                audit_at = self.clock() + LINE_AUDIT_S
                await self.replication.audit_lines()
            if self.core.depth():
                now = self.clock()
                expired = self.core.expire_parked(self.observation.fleet(now), now)
                self._preempt()
                for outcome in expired:
                    self.replication.left_lot(outcome)
                self.answer(expired)

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.tickets.reap_interval_seconds)
            self._expired(self.core.expire_leases(self.clock()), "its lease ran out")
