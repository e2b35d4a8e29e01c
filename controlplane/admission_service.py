"""The admission service: the asyncio shell around ``AdmissionCore`` that holds parked Checks.

A parked request keeps its Check open: the handler awaits a future this service resolves when a wake admits the request
or its park deadline sheds it. Wakes follow everything that can free capacity: a released ticket (access log), a probe, a
reaped ticket, a drain lifted, a reload. Two background tasks sweep park deadlines (every 0.1 s) and ticket leases. Every
ticket event goes through the core (``check``, ``release``, ``note_probe``, ``expire_leases``): nothing here writes to the
ledger. It is the port the ext_authz servicer (``CheckPort``) and the access-log servicer (``CompletionPort``) use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from controlplane.config import Config
from controlplane.core.admission import AdmissionCore, Outcome
from controlplane.core.model import EngineView, InferenceRequest, Ticket, Verdict
from controlplane.metrics import SluiceMetrics
from controlplane.observation import Observation
from controlplane.ports import CheckSettings
from controlplane.watch import DecisionEvent, DecisionFeed

log = logging.getLogger("sluice.admission")

PARK_SWEEP_S = 0.1
"""How often park deadlines are checked (a shed comes at most this late)."""


class AdmissionService:
    def __init__(self, config: Config, core: AdmissionCore, observation: Observation, metrics: SluiceMetrics,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.core = core
        self.observation = observation
        self.metrics = metrics
        self.clock = clock
        self._parked: dict[str, asyncio.Future[Outcome]] = {}
        self.feed = DecisionFeed(metrics)
        """Every final answer, for the admin API's ``WatchDecisions`` (bounded per watcher)."""
        self.trace_outcome: Callable[[str | None, Outcome, InferenceRequest | None], None] | None = None
        """Set when tracing is on (``CheckTracing.record``): every final answer also goes on its Check's span."""
        self._tasks: list[asyncio.Task[None]] = []

    # -- CheckPort ---------------------------------------------------------------------------------------------------
    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """Start-up and reloads: the settings a Check reads are built here once, not per Check."""
        self._config = config
        cp = config.controlplane
        self.settings = CheckSettings(config.policy, config.authz_timeout_s, cp.max_check_queue_ms,
                                      cp.overload_retry_after_seconds)

    def check(self, request_id: str, request: InferenceRequest) -> Outcome:
        now = self.clock()
        outcome = self.core.check(request_id, request, self.observation.fleet(now), now)
        if outcome.decision.verdict is Verdict.PARK:
            self.metrics.admission_parked.labels(self.model_label(request.model)).inc()
        return outcome

    async def wait_parked(self, request_id: str) -> Outcome:
        """Hold a parked Check until a wake admits it or its deadline sheds it; a cancelled Check leaves nothing."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._parked[request_id] = future
        self.metrics.parked_now.set(self.core.depth())
        try:
            return await future
        except asyncio.CancelledError:
            self._parked.pop(request_id, None)
            if self.core.cancel(request_id):
                self.metrics.park_cancelled.inc()
            elif future.done() and not future.cancelled():
                ticket = future.result().ticket
                if ticket is not None:
                    # Admitted in the same instant the client left: Envoy never forwards it, so no log entry will come.
                    self.release_ticket(ticket.ticket_id)
            self.metrics.parked_now.set(self.core.depth())
            raise

    def give_back(self, request_id: str, outcome: Outcome | None) -> None:
        """A Check failed inside the control plane: whatever it holds (a place in the lot, a ticket) is returned."""
        if self.core.cancel(request_id):
            self.metrics.parked_now.set(self.core.depth())
        if outcome is not None and outcome.ticket is not None:
            self.release_ticket(outcome.ticket.ticket_id)

    def record_outcome(self, model: str | None, outcome: Outcome, request: InferenceRequest | None = None) -> None:
        d = outcome.decision
        m = self.metrics
        m.admission_decisions.labels(self.model_label(model), d.verdict.value, d.reason.value).inc()
        if d.verdict in (Verdict.SHED, Verdict.REJECT):
            m.admission_rejected.labels(d.reason.value).inc()
        if outcome.parked_for > 0:
            m.park_seconds.observe(outcome.parked_for)
        if self.trace_outcome is not None:
            self.trace_outcome(model, outcome, request)
        if self.feed.watchers:
            self.feed.publish(DecisionEvent(
                time.time(), outcome.request_id, d.verdict.value, d.reason.value, d.engine or "", model or "", "",
                round(outcome.parked_for * 1000, 1), d.expected_ttft_s, d.retry_after_s or 0,
                str(getattr(request.priority, "value", request.priority)) if request is not None else ""))

    def model_label(self, model: str | None) -> str:
        return self.observation.model_label(model)

    # -- CompletionPort ----------------------------------------------------------------------------------------------
    def release_ticket(self, ticket_id: str) -> Ticket | None:
        ticket = self.core.release(ticket_id, self.clock())
        if ticket is not None:
            self.metrics.tickets_released.labels(ticket.engine).inc()
            self.wake([ticket.model])
        return ticket

    def note_engine_failure(self, engine: str, why: str) -> None:
        self.observation.note_failure(engine, why)

    def knows_engine(self, engine: str) -> bool:
        return self.observation.knows(engine)

    # -- capacity events ---------------------------------------------------------------------------------------------
    def wake(self, models: list[str] | None = None) -> None:
        """Capacity may have freed: admit whatever parked requests now fit, in order."""
        if not self.core.depth():
            return
        if models is not None:
            models = [m for m in models if self.core.depth(m)]  # a probe of an engine whose models have no queue
            if not models:
                return
        now = self.clock()
        self._resolve(self.core.wake(self.observation.fleet(now), now, models))

    def on_probe(self, view: EngineView) -> None:
        """A good probe: tickets of an engine seen idle lost their log entry (reaped at once), then wake its models."""
        sample = view.sample
        if sample is not None:
            idle = sample.running == 0 and sample.waiting == 0
            reaped = self.core.note_probe(view.name, sample.taken_at, idle,
                                          self.config.tickets.idle_reap_grace_seconds)
            self._expired(reaped, "its engine is idle")
        self.wake([model.model_id for model in view.models])

    def _resolve(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            future = self._parked.pop(outcome.request_id, None)
            if future is not None and not future.done():
                future.set_result(outcome)
            elif outcome.ticket is not None:
                self.release_ticket(outcome.ticket.ticket_id)
        if outcomes:
            self.metrics.parked_now.set(self.core.depth())

    def _expired(self, tickets: list[Ticket], why: str) -> None:
        """Tickets closed without their access-log entry (counted in sluice_tickets_expired_total)."""
        for ticket in tickets:
            log.warning("ticket %s on %s reaped (%s): its access-log entry never arrived", ticket.ticket_id,
                        ticket.engine, why)
            self.metrics.tickets_expired.labels(ticket.engine).inc()
        if tickets:
            self.wake()

    # -- lifecycle -------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._sweep_park_deadlines(), name="park-deadlines"))
        self._tasks.append(asyncio.create_task(self._reap_leases(), name="lease-reaper"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _sweep_park_deadlines(self) -> None:
        while True:
            await asyncio.sleep(PARK_SWEEP_S)
            if self.core.depth():
                now = self.clock()
                self._resolve(self.core.expire_parked(self.observation.fleet(now), now))

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.tickets.reap_interval_seconds)
            self._expired(self.core.expire_leases(self.clock()), "its lease ran out")
