"""The admission service: the asyncio shell around ``AdmissionCore`` that holds parked Checks and keeps the shared store.

A parked request keeps its Check open: the handler awaits a future this service resolves when a wake admits the request
or its park deadline sheds it. Wakes follow everything that can free capacity: a released ticket (access log), a probe, a
reaped ticket, a drain lifted, a reload. Two background tasks sweep park deadlines (every 0.1 s) and ticket leases. Every
ticket event goes through the core (``check``, ``release``, ``note_probe``, ``expire_leases``): nothing here writes to the
ledger. It is the port the ext_authz servicer (``CheckPort``) and the access-log servicer (``CompletionPort``) use.

**The store** (controlplane/store/). The core decides on its own ledger, which mirrors the shared store: every admission
is then written by ``Store.reserve``, which checks the engine's cap, its KV and the line across replicas atomically. A
refusal undoes the local admission (``retract``; a woken request goes back to its place, ``restore``), teaches the mirror
what the store holds (the engine's tickets), and the request is decided again, at most ``store.reserve_attempts`` times
before it parks. Other replicas' admissions and releases arrive as ``StoreEvent``s (``_heard``): the mirror follows, and a
release wakes the parking lot. Releases reach the store in the background; until the store confirms one, a refusal's list
of the engine's tickets never brings that ticket back (``_releasing``).

The shared line must order this replica's parked requests as its lot does, or each would wait for a head the other never
offers: parks and unparks reach the store in the order they were made, those asked for while one batch is on its way
together in the next (``_in_line``; concurrent calls would travel on different connections and land in any order), and
a wake does not admit a request whose park has not landed yet (it is woken again when it lands; a shed meanwhile waits
for its Check in ``_early``).

**Fair share** (core/fairshare.py, decision 0015). With ``fairness`` on, a wake admits with ``QueueRule.CLASS``: the
store checks only that no higher class is parked on any replica; the order within a class is this replica's lot's (its
tenants' counters), so with several replicas each is fair among the requests it holds. No claims are left then (they
would be admitted in the line's parking order).

**Claims** (store/base.py). An admission the store refuses only because others are ahead in line (``QUEUED``) is left
with the request's member: an arrival's goes with its ``park``, a woken head's stays from the refused ``reserve``, the
heads a wake decided behind that one leave theirs in one call (``_leave_claims``), and, while another replica holds
members of the line, a request parked behind this replica's own gets the admission it would have first in line
(``_claim_behind``), which is first offered to the line as it is, in its turn (``_enter_line``: the requests ahead may
all have gone on their claims, their answers one event hop away). The store admits a claim once its request heads the
line, if it still fits and is fresh (``store.claim_seconds``), in the same step that moved the line, so heads held by
different replicas follow each other without an event hop between each. This replica hears the ``CLAIMED`` event and
answers the Check with that ticket and the decision it had made (``_own_claimed``; ``_claims`` keeps them); a claimed
request that had meanwhile been answered otherwise (shed, cancelled: its unpark came too late) has its ticket released.
A wake that reaches a request the store admitted on its claim while the wake's own ``reserve`` was out takes its
admission back (``_claimed_done``). A woken admission is answered from the event stream too, at its own admission event
(``Store.expect_admission``, asked before its ``reserve``), so every parked request is answered in the store's order of
admissions.

**Liveness** (store/base.py). The store renews this replica's heartbeat from a thread (``store.heartbeat_seconds``,
dead after ``store.dead_after_beats`` of them) and removes dead replicas: their members leave the lines at once (a
``DEAD`` event wakes every model here). If a renewal finds this replica's own heartbeat had lapsed (its beats were held
up), it puts its lot back in line, in order, at the back (``_put_back_in_line``).

With the memory store (one replica) the store agrees with the mirror by construction, no call suspends, and the port
costs a few dictionary writes per admission. When the store cannot be reached, ``store.on_failure`` decides: ``open``
keeps the admission on this replica's ledger (``_unsynced``: written back when the store returns), ``closed`` answers
503 ``store_unavailable``. Each time the store's event stream (re)connects, the replica resynchronises: releases it
could not send are sent, its own tickets the store lacks are restored, and every ticket the store holds is learned.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from controlplane.config import Config, StoreOnFailure
from controlplane.core.admission import AdmissionCore
from controlplane.core.lot import PARK_CLASSES
from controlplane.core.model import Decision, InferenceRequest, Outcome, Parked, QueueRule, Reason, Ticket, Verdict
from controlplane.core.decide import decide
from controlplane.core.waits import shed
from controlplane.core.feedback import FirstToken, RecentTtfts, TtftSummary, end_to_end_error
from controlplane.core.prompt_tokens import PromptShape, PromptTokenRules
from controlplane.core.tenants import Usage
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.metrics import NO_TENANT_LABEL, SluiceMetrics
from controlplane.observe.observation import Observation
from controlplane.ports import CheckSettings
from controlplane.store.base import (
    LINE_CLASSES, Claim, EventKind, Landed, LineChange, Refusal, Reserved, SharedClock, Store, StoreEvent,
    StoreUnavailable,
)
from controlplane.store.memory import MemoryStore
from controlplane.admission.watch import DecisionEvent, DecisionFeed

_T = TypeVar("_T")

log = logging.getLogger("sluice.admission")

RECENT_RELEASES = 100_000
"""How many released ticket ids a replica remembers so that a late copy of a ticket never re-enters its mirror."""

PARK_SWEEP_S = 0.1
"""How often park deadlines are checked (a shed comes at most this late)."""
LINE_AUDIT_S = 5.0
"""How often this replica's members of the shared lines are checked against its lot (``_audit_lines``)."""
STORE_UPKEEP_S = 0.5
"""How often the store's lease sweep runs here, which also tells whether the store answers (``_upkeep``)."""

LINE_SHARED_S = 1.0
"""How long after a refusal for the line requests parked behind this replica's own are given claims (``_claim_behind``:
a decision each, which a replica alone in its lines does not need: its wakes admit its heads in order)."""

LINE_BATCH = 256
"""At most this many parks and unparks go to the store in one call (``_write_lines``)."""

assert len(PARK_CLASSES) == LINE_CLASSES, "the store keeps a line per parking class"


@dataclass(frozen=True, slots=True)
class _Pending:
    """A parked request of this replica that may have a claim in the store: when it parked here (local time), and the
    admission each claim it left stands for, by the claim's ticket's ``admitted_at`` (shared time)."""

    parked_at: float
    decisions: dict[float, Decision]


class AdmissionService:
    def __init__(self, config: Config, core: AdmissionCore, observation: Observation, metrics: SluiceMetrics,
                 clock: Callable[[], float], store: Store | None = None) -> None:
        self.config = config
        self.core = core
        self.observation = observation
        self.metrics = metrics
        self.clock = clock
        self.store: Store = store or MemoryStore()
        self.shared = SharedClock.here(clock)
        self._parked: dict[str, asyncio.Future[Outcome]] = {}
        self.feed = DecisionFeed(metrics)
        """Every final answer, for the admin API's ``WatchDecisions`` (bounded per watcher)."""
        self.recent_ttfts = RecentTtfts()
        """Each engine's last served requests' first tokens (``sluice admin engines``)."""
        self.trace_outcome: Callable[[str | None, Outcome, InferenceRequest | None], None] | None = None
        """Set when tracing is on (``CheckTracing.record``): every final answer also goes on its Check's span."""
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._wake_models: set[str] | None = set()
        """Models a scheduled wake will look at (None: all); empty with no wake scheduled."""
        self._wake_task: asyncio.Task[None] | None = None
        self._releasing: set[str] = set()
        self._release_tasks: set[asyncio.Task[None]] = set()
        self._store_timers: dict[str, Any] = {}
        self._decision_counters: dict[tuple[str, str, str], Any] = {}
        """``sluice_admission_decisions`` children by (model label, verdict, reason): looked up once, not per Check
        (prometheus_client's ``labels`` validates and locks, about 10 us)."""
        self._recently_released: dict[str, None] = {}
        """Ticket ids released in the store lately, by any replica (insertion-ordered, bounded by ``RECENT_RELEASES``): a
        refusal's list of an engine's tickets, read after the release though the store made it before, never brings one
        back into the mirror."""
        self._release_backlog: set[str] = set()
        """Releases the store could not take (it was unreachable): sent when it is back."""
        self._owned: set[str] = set()
        """Open tickets this replica wrote: restored to a store that lost them."""
        self._unsynced: dict[str, Ticket] = {}
        """Tickets admitted while the store was unreachable (``on_failure: open``)."""
        self.store_up = True
        self._line_lock = asyncio.Lock()
        """Held while a batch of line changes is on its way (``_write_lines``), and by whatever must not overlap one."""
        self._line_changes: list[tuple[LineChange, asyncio.Future[Landed | None]]] = []
        """Parks and unparks waiting for the next batch, in the order they were asked for (``_in_line``)."""
        self._line_writer: asyncio.Task[None] | None = None
        self._parking: set[str] = set()
        """Parked requests whose place in the shared line is not written yet (their ``park`` call is on its way)."""
        self._parks_awaited: set[str] = set()
        """Models whose wake stopped at a request in ``_parking``: woken again when its park lands."""
        self._early: dict[str, Outcome] = {}
        """Answers (a shed) given to a parked request before its Check reached ``wait_parked``."""
        self._unparking: set[str] = set()
        """Requests whose ``unpark`` is on its way (queued behind the line lock, perhaps)."""
        self._settling: set[str] = set()
        """Woken requests out of the lot while ``_settle`` writes their admissions: a refused one goes back, in the line
        all along (the line audit must not take it out)."""
        self._claims: dict[str, _Pending] = {}
        """Parked requests that left a claim in the store (module docstring, Claims), until they are answered."""
        self._claimed_done: set[str] = set()
        """Woken requests (``_settling``) the store admitted on their claims meanwhile: answered already; the wake takes
        its own admission of them back."""
        self._rejoin = False
        """This replica was found dead while alive: its lot goes back in line at the wake loop's next turn."""
        self._line_shared_until = -math.inf
        """Until when another replica is taken to hold members of this replica's lines (a refusal for the line said so
        lately): meanwhile requests parked behind this replica's own get claims too (``_claim_behind``)."""

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
                                      cp.overload_retry_after_seconds, config.tenants)

    async def check(self, request_id: str, request: InferenceRequest) -> Outcome:
        """Decide on the mirror, then write the admission to the store; decide again when another replica was first."""
        ahead_elsewhere = 0
        queued: tuple[Decision, Claim] | None = None  # the last admission the store refused for the line alone
        for attempt in range(self.config.store.reserve_attempts + 1):
            now = self.clock()
            fleet = self.observation.fleet(now)
            if attempt == self.config.store.reserve_attempts:  # other replicas won every race: wait in line
                outcome = self.core.force_park(request_id, request, fleet, now)
            else:
                outcome = self.core.check(request_id, request, fleet, now, ahead_elsewhere)
            if outcome.decision.verdict is Verdict.PARK:
                behind = False
                if queued is None and outcome.decision.reason is Reason.QUEUED_BEHIND and now < self._line_shared_until:
                    queued = self._claim_behind(request_id, request, fleet, now)
                    behind = queued is not None and not self._rejoin
                admitted = await self._enter_line(request_id, request, now, queued, behind)
                if admitted is not None:
                    return admitted
                self.metrics.admission_parked.labels(self.model_label(request.model)).inc()
                return outcome
            if outcome.ticket is None:
                return outcome
            claim = self._claim(outcome, request, now, fleet)
            refusal = (await self._commit(outcome, claim, now)).refusal
            if refusal is None:
                return outcome
            # Under fair share no claim is left: the store admits claims in the line's parking order, and each replica
            # orders its own parked requests by its tenants' counters (``QueueRule.CLASS``; decision 0015).
            fair = self.core.policy.fairness.enabled
            queued = (outcome.decision, claim) if refusal is Refusal.QUEUED and not fair else None
            if refusal is Refusal.QUEUED and not fair:
                self._line_shared_until = now + LINE_SHARED_S
            if request.model is not None:
                # The retracted admission freed its slot in the mirror: the line's head may fit now. Without this wake a
                # burst whose first admissions lost the race to the first parks (the store's line already had a head)
                # parked everything and stood still until the next probe (no probe at all in a test: park_timeout).
                self.wake([request.model])
            if refusal is Refusal.QUEUED:
                ahead_elsewhere = 1
            elif refusal in (Refusal.CAP, Refusal.KV):
                await self._releases_sent()
            elif refusal is Refusal.UNAVAILABLE:
                return Outcome(request_id, shed(Reason.STORE_UNAVAILABLE, "the shared ledger cannot be reached",
                                                self.config.controlplane.overload_retry_after_seconds))
        raise AssertionError("unreachable: the last attempt parks")

    def _claim(self, outcome: Outcome, request: InferenceRequest, now: float, fleet: Fleet | None = None) -> Claim:
        """An admission the core made, as the store checks and writes it (and keeps it, as a claim, if refused for the
        line alone)."""
        ticket = outcome.ticket
        assert ticket is not None
        view = self.observation.view_of(ticket.engine, now) or next(
            e for e in (fleet or self.observation.fleet(now)).engines if e.name == ticket.engine)
        capacity = view.kv_capacity_tokens
        policy = self.core.policy
        return Claim(self.shared.to_shared(ticket), view.cap,
                     math.floor(capacity * policy.kv_high_watermark) if capacity else None,
                     request.session, outcome.rule, self.core.class_index(request), request.prefix_blocks,
                     fresh_s=self._fresh_s(request), serve_half_life_s=policy.serve_half_life_s)

    def _claim_behind(self, request_id: str, request: InferenceRequest, fleet: Fleet,
                      now: float) -> tuple[Decision, Claim] | None:
        """A claim for a request the core parked behind others (in its lot or the shared line) without deciding where it
        would go: the admission it would get first in line (``decide``; nothing is written), so the store can admit it
        as soon as it heads the line (Claims), without waiting for this replica's next wake. None when it would not be
        admitted even then. Its engine is chosen as if the requests ahead took no slot: the store's check of the cap
        stops the line at it if they took the last one, and this replica's wake then decides it again."""
        core = self.core
        decision = decide(request, fleet, core.policy, now, 0, core.sessions.get(request.session), core.draw(),
                          arriving=True, cached=core.expected_cached(request),
                          prefix_share=core.prefix_share(request))
        if decision.verdict is not Verdict.ADMIT or decision.engine is None or request.model is None:
            return None
        ticket = Ticket(request_id, decision.engine, request.model, now, now + core.ledger.lease_seconds,
                        decision.reserved_tokens, decision.expected_done_at or now, decision.expected_ttft_s)
        return decision, self._claim(Outcome(request_id, decision, ticket, rule=QueueRule.OLDEST), request, now, fleet)

    def _fresh_s(self, request: InferenceRequest) -> float:
        """How long a claim of ``request`` may be admitted on: ``store.claim_seconds``, never past the age at which its
        class would turn newest-first (``lifo_after_ms``, or ``lifo_deadline_fraction`` of its TTFT deadline): the
        store admits claims oldest first, and a head whose claim is fresh has waited less than that."""
        policy = self.core.policy
        fresh = self.config.store.claim_seconds
        if policy.lifo_after_ms > 0:
            fresh = min(fresh, policy.lifo_after_ms / 1000)
        if policy.lifo_deadline_fraction > 0 and request.max_ttft_ms:
            fresh = min(fresh, policy.lifo_deadline_fraction * request.max_ttft_ms / 1000)
        return fresh

    async def _commit(self, outcome: Outcome, claim: Claim, now: float) -> Reserved:
        """Write an admission the core made to the store; on a refusal it is undone here (an admission written, or kept
        on this replica's ledger with the store unreachable and ``on_failure: open``, is ``ok``)."""
        ticket = outcome.ticket
        assert ticket is not None
        try:
            reserved = await self._timed("reserve", self.store.reserve(claim))
        except StoreUnavailable:
            if self.config.store.on_failure is StoreOnFailure.OPEN:
                self.metrics.store_fail_open.inc()
                self._unsynced[ticket.ticket_id] = ticket
                return Reserved()
            self.core.retract(outcome, now)
            return Reserved(Refusal.UNAVAILABLE)
        if reserved.ok:
            self._owned.add(ticket.ticket_id)
            return reserved
        assert reserved.refusal is not None
        self.metrics.store_refusals.labels(reserved.refusal.value).inc()
        self.core.retract(outcome, now)
        self._learn_held(reserved)  # the mirror catches up with what the store holds for that engine
        return reserved

    async def _enter_line(self, request_id: str, request: InferenceRequest, parked_at: float,
                          queued: tuple[Decision, Claim] | None, behind: bool = False) -> Outcome | None:
        """Write a request the core just parked (at ``parked_at``) into the shared line, with ``queued``'s claim when
        the store had refused its admission for the line alone. Until that write lands, a wake does not admit it
        (``_settle``): the store's line would not know it, and its late ``park`` would leave a member nobody removes at
        the line's head. A client gone meanwhile takes the request out of the lot and, after its park, out of the line
        (an offer admitted as it left gives its ticket back). A request the store says parked earlier on another
        replica keeps that time (``_keep_first_park``).

        ``behind``: the core parked it only behind this replica's own requests, which may all have gone on their claims
        or their own offers already, their answers one event hop away (``queued``: the admission it would have first in
        line). Its park is then first offered to the line as an arrival (``LineChange.offer``: the store admits on
        claims first, then checks the line, atomically), in its turn for the line, so the line still takes this
        replica's requests in the lot's order: admitted (returned) if nobody is ahead any more, parked (with its claim)
        if refused for the line, parked without one if refused for the engine."""
        model = request.model
        assert model is not None
        klass = self.core.class_index(request)
        at = self.shared.offset + self.clock()
        claim = None
        if queued is not None and queued[1].fresh_s > 0 and self.core.where(request_id) is not None:
            decision, claim = queued
            self._claims[request_id] = _Pending(parked_at, {claim.ticket.admitted_at: decision})
        offer = replace(queued[1], queue=QueueRule.ARRIVAL) if behind and queued is not None else None
        self._parking.add(request_id)
        landing = self._in_line(LineChange(model, klass, request_id, at, claim, offer))
        try:
            landed = await asyncio.shield(landing)
        except asyncio.CancelledError:
            self._withdraw(request_id, client_left=True)
            if offer is not None:  # the change lands all the same: an offer admitted meanwhile is given back
                landing.add_done_callback(lambda f: self._offer_landed_without_client(request, offer, f))
            raise
        finally:
            self._parking.discard(request_id)
            if model in self._parks_awaited:
                self._parks_awaited.discard(model)
                self.wake([model])
        if landed is None:  # the store did not answer: parked here as it would have been
            return None
        if landed.offered is not None and queued is not None:
            admitted = self._offer_landed(request_id, request, queued[0], offer, landed.offered)
            if admitted is not None:
                return admitted
        first = landed.first_parked_at
        if first is not None and first < at:
            self._keep_first_park(request_id, first - self.shared.offset)
        return None

    def _offer_landed(self, request_id: str, request: InferenceRequest, decision: Decision, offer: Claim | None,
                      offered: Reserved) -> Outcome | None:
        """A park offered as an arrival came back (``_enter_line``): admitted, the request leaves the lot and its
        admission is returned (an answer a sweep gave it meanwhile, waiting in ``_early``, is dropped: the admission
        wins); refused for the engine (CAP, KV), the mirror learns the engine's tickets, as ``_commit``'s refusals
        teach it."""
        assert offer is not None
        if not offered.ok:
            assert offered.refusal is not None
            self.metrics.store_refusals.labels(offered.refusal.value).inc()
            self._learn_held(offered)
            return None
        self._early.pop(request_id, None)
        self._claims.pop(request_id, None)
        if not self.core.cancel(request_id) and request_id in self._settling:
            self._claimed_done.add(request_id)  # a wake holds it: its own admission of it is taken back
        ticket = self.shared.to_local(offer.ticket)
        self.core.learn(ticket, request.session, self.clock(), request.prefix_blocks)
        self._owned.add(request_id)
        self.metrics.parked_now.set(self.core.depth())
        return Outcome(request_id, decision, ticket)

    def _offer_landed_without_client(self, request: InferenceRequest, offer: Claim,
                                     landing: asyncio.Future[Landed | None]) -> None:
        """An offered park whose client left before it landed: an admission it got is closed at once."""
        landed = None if landing.cancelled() else landing.result()
        if landed is None or landed.offered is None or not landed.offered.ok:
            return
        ticket = self.shared.to_local(offer.ticket)
        self.core.learn(ticket, request.session, self.clock(), request.prefix_blocks)
        self._owned.add(ticket.ticket_id)
        self.release_ticket(ticket.ticket_id)

    def _learn_held(self, refused: Reserved) -> None:
        """A CAP or KV refusal's list of the engine's tickets, into the mirror, except tickets released lately: this
        replica's own (in flight or confirmed) or another's it heard of (the refusal may be read after the release
        although the store decided before it: a ticket learned again would hold a slot here until the idle probe or
        its lease reaps it)."""
        now = self.clock()
        for held in refused.engine_tickets:
            if held.ticket_id not in self._releasing and held.ticket_id not in self._recently_released:
                self.core.learn(self.shared.to_local(held), None, now)

    def _keep_first_park(self, request_id: str, parked_at: float) -> None:
        """A request parked here whose Check Envoy asked again after the replica holding it went away (resources.py
        ``_check_retry``; the store took that replica's member out of the line) keeps the time it first parked
        (``parked_at``, this service's clock): its park deadline, a TTFT deadline's remainder and its
        ``x-sluice-parked-ms`` count from then, so a retried Check is answered before Envoy's Check timeout as any other
        is. Its place stays the back of its class, in the lot and in the shared line alike: a wake admits the lot's
        head only if it heads the line too, and the lot's order is its own parking order, which has no place for an
        earlier arrival; the line's order follows the lot's."""
        entry = next((p for p in self.core.parked() if p.request_id == request_id), None)
        if entry is None or parked_at >= entry.parked_at:  # answered meanwhile, or parked here first after all
            return
        self.core.cancel(request_id)
        self.core.restore(replace(entry, parked_at=parked_at, deadline=entry.deadline - (entry.parked_at - parked_at)))
        pending = self._claims.get(request_id)
        if pending is not None:
            self._claims[request_id] = replace(pending, parked_at=parked_at)
        log.debug("request %s parked again here after its replica went away; it first parked %.1f s ago", request_id,
                  self.clock() - parked_at)

    def _in_line(self, change: LineChange) -> asyncio.Future[Landed | None]:
        """A park or unpark for the shared line; the future is what it did (None: the store did not answer; the first
        failure says so at once, and later changes are skipped until the upkeep loop finds the store back). Changes
        land in the order they were asked for: concurrent calls would travel on different connections of the store's
        client and land in any order, and the shared line would then disagree with this replica's lot about who is
        first (each waiting for a head the other never offers). Every change asked for while a batch is on its way
        goes in the next one, in one round trip (``Store.change_lines``): a burst of parks costs one wait, not one
        each, so requests parked behind each other do not queue for the store one at a time."""
        future: asyncio.Future[Landed | None] = asyncio.get_running_loop().create_future()
        self._line_changes.append((change, future))
        if self._line_writer is None or self._line_writer.done():
            self._line_writer = self._spawn(self._write_lines())
        return future

    async def _write_lines(self) -> None:
        """Send the waiting line changes, at most ``LINE_BATCH`` a call, until none waits (under the line lock, which
        the lot's put-back and the line audit hold too)."""
        batch: list[tuple[LineChange, asyncio.Future[Landed | None]]] = []
        try:
            while self._line_changes:
                async with self._line_lock:
                    batch, self._line_changes = (self._line_changes[:LINE_BATCH], self._line_changes[LINE_BATCH:])
                    landed: list[Landed | None] = [None] * len(batch)
                    if self.store_up:
                        try:
                            landed = list(await self._timed("line", self.store.change_lines([c for c, _ in batch])))
                        except StoreUnavailable as exc:
                            log.error("the shared store does not answer (%s); store.on_failure: %s", exc,
                                      self.config.store.on_failure.value)
                            self.store_up = False
                            self.metrics.store_up.set(0)
                for (_, future), result in zip(batch, landed):
                    if not future.done():
                        future.set_result(result)
                batch = []
        finally:  # stopping: whoever still waits is told the store did not answer
            for _, future in batch + self._line_changes:
                if not future.done():
                    future.set_result(None)

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
            if not self._withdraw(request_id, client_left=True) and future.done() and not future.cancelled():
                ticket = future.result().ticket
                if ticket is not None:
                    # Admitted in the same instant the client left: Envoy never forwards it, so no log entry will come.
                    self.release_ticket(ticket.ticket_id)
            self.metrics.parked_now.set(self.core.depth())
            raise

    def _withdraw(self, request_id: str, client_left: bool) -> bool:
        """Take a request out of the lot (and, once its park has landed, out of the line), with any answer or claim held
        for it: its client left (``client_left``: counted as a cancelled park) or its Check failed. False when the lot
        no longer held it (an admission or a shed got there first)."""
        self._early.pop(request_id, None)
        self._claims.pop(request_id, None)
        where = self.core.where(request_id)
        if not self.core.cancel(request_id):
            return False
        if client_left:
            self.metrics.park_cancelled.inc()
        self.metrics.parked_now.set(self.core.depth())
        self._unpark_later(where, request_id)
        return True

    def give_back(self, request_id: str, outcome: Outcome | None) -> None:
        """A Check failed inside the control plane: whatever it holds (a place in the lot, a ticket) is returned."""
        self._withdraw(request_id, client_left=False)
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
        self._release_in_store(ticket_id)
        return ticket

    def _release_in_store(self, ticket_id: str) -> None:
        self._owned.discard(ticket_id)
        if self._unsynced.pop(ticket_id, None) is not None:
            return  # the store never had it
        self._releasing.add(ticket_id)

        async def release() -> None:
            try:
                await self._timed("release", self.store.release(ticket_id))
                self._remember_released(ticket_id)
            except StoreUnavailable:
                self._release_backlog.add(ticket_id)
            finally:
                self._releasing.discard(ticket_id)
        self._release_tasks.add(self._spawn(release()))

    async def _releases_sent(self) -> None:
        """Wait for the releases in flight: a refusal may have counted one of them, so deciding again before they land
        would only be refused again."""
        if self._release_tasks:
            await asyncio.gather(*self._release_tasks, return_exceptions=True)
        else:
            await asyncio.sleep(0)

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

    def note_prompt_tokens(self, ticket: Ticket, shape: PromptShape, estimated: int, counted: int) -> None:
        """A served request's prompt as its engine counted it (the access log): the estimate's error is reported and
        the model's rule learns."""
        if estimated > 0 and counted > 0:
            self.metrics.prompt_tokens_error.labels(ticket.model).observe(counted / estimated)
        self.core.observe_prompt_tokens(ticket.model, ticket.engine, shape, counted, estimated)

    def settle_usage(self, ticket_id: str, usage: Usage) -> None:
        """A finished request's real usage (the access log): its tenant's fair-share counter is corrected."""
        self.core.settle_usage(ticket_id, usage.prompt_tokens, usage.completion_tokens)

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
        while self._wake_models is None or self._wake_models:
            if self._rejoin:
                self._rejoin = False
                await self._put_back_in_line()
            if self._release_tasks:  # the releases that woke this wake reach the store before its admissions do
                await self._releases_sent()
            models, self._wake_models = self._wake_models, set()
            now = self.clock()
            outcomes = self.core.wake(self.observation.fleet(now), now, None if models is None else list(models))
            again = await self._settle(outcomes, now)
            if again:
                await self._releases_sent()
                if self._wake_models is not None:
                    self._wake_models.update(again)

    async def _settle(self, outcomes: list[Outcome], now: float) -> set[str]:
        """Write a wake's admissions to the store in order and answer them. After a refusal every later admission of
        that model goes back to its place too (its line order must hold). Returns models to wake again (the mirror
        learned tickets it lacked)."""
        woken = {o.request_id for o in outcomes if o.parked is not None}
        self._settling |= woken
        try:
            return await self._settle_in_order(outcomes, now)
        finally:
            self._settling -= woken
            self._claimed_done -= woken

    async def _settle_in_order(self, outcomes: list[Outcome], now: float) -> set[str]:
        blocked: set[str] = set()
        queued: set[str] = set()
        """Models whose first refusal here was for the line alone: their later woken heads leave claims (``behind``)."""
        behind: dict[tuple[str, int], list[tuple[Outcome, Parked, Claim]]] = {}
        again: set[str] = set()
        for outcome in outcomes:
            parked = outcome.parked
            model = parked.request.model if parked is not None else None
            request_id = outcome.request_id
            if request_id in self._claimed_done:  # the store admitted it on its claim: answered (``_own_claimed``)
                self._claimed_done.discard(request_id)
                self.core.retract(outcome, now)
                continue
            if outcome.ticket is None:
                self._left_lot(outcome)
                self._resolve([outcome])
                continue
            if parked is None or model is None:
                self._resolve([outcome])
                continue
            refusal: Refusal | None = Refusal.QUEUED
            if model in blocked:
                self.core.retract(outcome, now)
                if model in queued and outcome.rule is QueueRule.OLDEST and request_id not in self._parking:
                    claim = self._claim(outcome, parked.request, now)
                    if claim.fresh_s > 0:
                        behind.setdefault((model, claim.klass), []).append((outcome, parked, claim))
                        continue
                self.core.restore(parked)
                continue
            if request_id in self._parking:  # not in the shared line yet: it waits for its park to land
                self.core.retract(outcome, now)
                self._parks_awaited.add(model)
            else:
                claim = self._claim(outcome, parked.request, now)
                if claim.queue is QueueRule.OLDEST and claim.fresh_s > 0:  # a refusal for the line leaves it a claim
                    self._note_claim(request_id, parked.parked_at, claim, outcome.decision)
                # Answered from the event stream, at this admission's own event: requests the store admitted on their
                # claims before it (in line order), answered from the stream too, are answered first.
                self.store.expect_admission(request_id, self._answer_later(outcome))
                reserved = await self._commit(outcome, claim, now)
                refusal = reserved.refusal
                written = reserved.ok and request_id not in self._unsynced
                self.store.admission_settled(request_id, written)
                if reserved.ok and not written:  # kept on this replica's ledger (the store unreachable): no event
                    self._resolve([outcome])
                    continue
            if refusal is None:
                continue
            if request_id in self._claimed_done:  # refused 'exists': admitted on its claim meanwhile, and answered
                self._claimed_done.discard(request_id)
                continue
            blocked.add(model)
            if refusal is Refusal.QUEUED and outcome.rule is QueueRule.OLDEST and request_id not in self._parking:
                queued.add(model)
                self._line_shared_until = now + LINE_SHARED_S
            self.core.restore(parked)
            if refusal in (Refusal.CAP, Refusal.KV):
                again.add(model)
        for (model, klass), held in behind.items():
            await self._leave_claims(model, klass, held)
        return again

    async def _leave_claims(self, model: str, klass: int, held: list[tuple[Outcome, Parked, Claim]]) -> None:
        """The wake's admissions of heads behind one the store refused for the line (retracted here): each is left
        with its member as a claim, in one store call, and the requests go back to their places in the lot (one the
        store admitted on its claim meanwhile is answered already)."""
        for outcome, parked, claim in held:
            self._note_claim(outcome.request_id, parked.parked_at, claim, outcome.decision)
        try:
            await self._timed("claim", self.store.claim(model, klass, [(o.request_id, c) for o, _, c in held]))
        except StoreUnavailable:
            pass  # they wait for a wake as without claims; the upkeep loop notices the store
        for outcome, parked, _ in held:
            if outcome.request_id in self._claimed_done:
                self._claimed_done.discard(outcome.request_id)
            else:
                self.core.restore(parked)

    def _answer_later(self, outcome: Outcome) -> Callable[[], None]:
        return lambda: self._resolve([outcome])

    def _note_claim(self, request_id: str, parked_at: float, claim: Claim, decision: Decision) -> None:
        """``claim`` may be left in the store for ``request_id``: remember what it stands for (claims older than twice
        their freshness are forgotten: the store no longer admits on them)."""
        pending = self._claims.get(request_id)
        if pending is None:
            self._claims[request_id] = _Pending(parked_at, {claim.ticket.admitted_at: decision})
            return
        stale = claim.ticket.admitted_at - 2 * claim.fresh_s
        for at in [at for at in pending.decisions if at < stale]:
            del pending.decisions[at]
        pending.decisions[claim.ticket.admitted_at] = decision

    def _own_claimed(self, event: StoreEvent) -> None:
        """The store admitted a request parked here on its claim (module docstring, Claims): its Check is answered with
        that ticket and the decision the claim stands for. One answered meanwhile (shed, cancelled: its unpark came
        too late) leaves a ticket nobody will use: it is released."""
        request_id, shared = event.ticket_id, event.ticket
        assert shared is not None
        pending = self._claims.pop(request_id, None)
        in_lot = self.core.where(request_id) is not None
        if pending is None or not (in_lot or request_id in self._settling):
            log.debug("request %s admitted on its claim after it was answered; its ticket is released", request_id)
            self._release_in_store(request_id)
            return
        now = self.clock()
        ticket = self.shared.to_local(shared)
        if in_lot:
            self.core.cancel(request_id)
        else:  # a wake holds it: its own admission is taken back when its turn comes (``_settle_in_order``)
            self._claimed_done.add(request_id)
        self.core.learn(ticket, event.session, now, event.prefix_blocks)
        self._owned.add(ticket.ticket_id)
        decision = pending.decisions.get(shared.admitted_at)
        if decision is None:  # not expected: every claim is noted before it is sent
            latest = pending.decisions[max(pending.decisions)]
            decision = replace(latest, engine=ticket.engine, reserved_tokens=ticket.reserved_tokens,
                               expected_done_at=ticket.expected_done_at, expected_ttft_s=ticket.expected_ttft_s)
        self._resolve([Outcome(request_id, decision, ticket, max(0.0, now - pending.parked_at))])

    def on_probe(self, view: EngineView) -> None:
        """A good probe: tickets of an engine seen idle lost their log entry (reaped at once), then wake its models."""
        sample = view.sample
        if sample is not None:
            idle = sample.running == 0 and sample.waiting == 0
            reaped = self.core.note_probe(view.name, sample.taken_at, idle,
                                          self.config.tickets.idle_reap_grace_seconds)
            self._expired(reaped, "its engine is idle")
        self.wake([model.model_id for model in view.models])

    def _left_lot(self, outcome: Outcome) -> None:
        """A parked request the core answered without an admission (a wake's refusal or shed, a sweep's shed: its
        ``Outcome.parked``) leaves the shared line too."""
        parked = outcome.parked
        if parked is not None and parked.request.model is not None:
            self._unpark_later((parked.request.model, self.core.class_index(parked.request)), outcome.request_id)

    def _unpark_later(self, where: tuple[str, int] | None, request_id: str) -> None:
        """A request left the lot without an admission (cancelled, shed): it leaves the shared line too."""
        if where is not None:
            model, klass = where
            self._unparking.add(request_id)

            async def unpark() -> None:
                try:
                    await self._in_line(LineChange(model, klass, request_id, unpark=True))
                finally:
                    self._unparking.discard(request_id)
            self._spawn(unpark())

    def _resolve(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            self._claims.pop(outcome.request_id, None)
            future = self._parked.pop(outcome.request_id, None)
            if future is not None and not future.done():
                future.set_result(outcome)
            elif outcome.request_id in self._parking:  # its Check has not reached wait_parked yet
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
            self._release_in_store(ticket.ticket_id)
        if tickets:
            self.wake()

    # -- lifecycle -------------------------------------------------------------------------------------------------------
    async def open_store(self) -> None:
        """Before any Check: join the store and learn every ticket it holds (a restart picks up the ledger)."""
        try:
            await self._timed("heartbeat", self.store.open())
        except StoreUnavailable as exc:  # serve per store.on_failure; the upkeep loop resyncs once it answers
            log.error("the shared store does not answer at start-up (%s); store.on_failure: %s", exc,
                      self.config.store.on_failure.value)
            self.store_up = False
        connected = asyncio.Event()

        def on_connected() -> None:
            if connected.is_set():  # a reconnection: events may have been missed meanwhile
                self._spawn(self._resync())
            connected.set()
        self._tasks.append(asyncio.create_task(self.store.listen(self._heard, on_connected), name="store-events"))
        if self.store_up:
            await self._resync()
        self.metrics.store_up.set(1 if self.store_up else 0)
        try:
            await asyncio.wait_for(connected.wait(), self.config.store.timeout_seconds * 4)
        except asyncio.TimeoutError:
            log.warning("the store's event stream is not connected yet; other replicas' admissions arrive once it is")

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._sweep_park_deadlines(), name="park-deadlines"))
        self._tasks.append(asyncio.create_task(self._reap_leases(), name="lease-reaper"))
        self._tasks.append(asyncio.create_task(self._upkeep(), name="store-upkeep"))
        loop = asyncio.get_running_loop()
        st = self.config.store

        def lapsed() -> None:  # called from the store's liveness thread
            try:
                loop.call_soon_threadsafe(self._lapsed)
            except RuntimeError:  # the loop is closed: this replica is stopping
                pass
        self.store.start_liveness(st.heartbeat_seconds, st.heartbeat_seconds * st.dead_after_beats, lapsed)

    async def stop(self) -> None:
        for task in [*self._tasks, *self._background]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self._tasks.clear()
        await self.store.close()

    def _heard(self, event: StoreEvent) -> None:
        """Another replica's admission, release or unpark, an admission on a claim, a dead replica: the mirror follows;
        freed capacity or a shorter line wakes."""
        now = self.clock()
        if event.kind is EventKind.CLAIMED and event.replica == self.store.replica_id and event.ticket is not None:
            self._own_claimed(event)
            self.wake([event.model])
        elif event.kind in (EventKind.ADMITTED, EventKind.CLAIMED) and event.ticket is not None:
            # ... unless its access-log entry reached this replica before this event did: released here already.
            if event.ticket_id not in self._releasing and event.ticket_id not in self._recently_released:
                self.core.learn(self.shared.to_local(event.ticket), event.session, now, event.prefix_blocks)
            if self.core.depth(event.model):  # it may have been the line's head that held ours back
                self.wake([event.model])
        elif event.kind is EventKind.RELEASED:
            self._remember_released(event.ticket_id)
            if self.core.release(event.ticket_id, now) is not None or self.core.depth(event.model):
                self.wake([event.model])
        elif event.kind is EventKind.UNPARKED:
            self.wake([event.model])
        elif event.kind is EventKind.DEAD:
            if event.replica != self.store.replica_id:  # this one's own: see _lapsed
                log.warning("replica %s was found dead: its parked requests left the shared lines", event.replica)
            self.wake()

    def _lapsed(self) -> None:
        """This replica's heartbeat had lapsed although it is alive (its beats were held up; the store restarted empty):
        the store may have taken its members out of every line; they go back (``_put_back_in_line``). Called once the
        heartbeat is renewed (``Store.start_liveness``), so the store cannot take them out again for the same lapse
        (it removes a replica only while its heartbeat is lapsed, atomically)."""
        if self.core.depth():
            log.warning("this replica's heartbeat lapsed (held up past %.2f s): its %d parked request(s) go back in "
                        "line, at the back", self.config.store.heartbeat_seconds * self.config.store.dead_after_beats,
                        self.core.depth())
        self._rejoin = True
        self.wake()

    async def _put_back_in_line(self) -> None:
        """Every request the lot holds goes back into its shared line, in the lot's order, at the back, without a
        claim. Under the line lock, so every park and unpark asked for before has landed; a member the store still held
        moves to the back with the others (the line keeps the lot's order)."""
        async with self._line_lock:
            for entry in self.core.parked():
                model = entry.request.model
                if model is None or self.core.where(entry.request_id) is None or not self.store_up:
                    continue
                try:
                    await self._timed("park", self.store.park(model, self.core.class_index(entry.request),
                                                              entry.request_id, self.shared.offset + entry.parked_at))
                except StoreUnavailable:
                    return  # the store lost everything or is down: its return resynchronises and lapses again

    def _remember_released(self, ticket_id: str) -> None:
        self._recently_released[ticket_id] = None
        while len(self._recently_released) > RECENT_RELEASES:
            del self._recently_released[next(iter(self._recently_released))]

    async def _resync(self) -> None:
        """Bring the store and the mirror together: backlogged releases, tickets the store lost, tickets it holds."""
        try:
            for ticket_id in list(self._release_backlog):
                await self._timed("release", self.store.release(ticket_id))
                self._release_backlog.discard(ticket_id)
            mine = [self.shared.to_shared(t) for t in self.core.tickets()
                    if t.ticket_id in self._owned or t.ticket_id in self._unsynced]
            restored = await self._timed("restore", self.store.restore(mine))
            self._owned.update(self._unsynced)
            self._unsynced.clear()
            state = await self._timed("load", self.store.load())
        except StoreUnavailable as exc:
            log.warning("store resync failed (%s); retried when it is back", exc)
            return
        now = self.clock()
        held = {t.ticket_id for t, _ in state.tickets}
        for ticket, owner in state.tickets:  # admitted on their claims while this replica was not listening
            if owner == self.store.replica_id and ticket.ticket_id in self._claims:
                self._own_claimed(StoreEvent(EventKind.CLAIMED, owner, ticket.ticket_id, ticket, model=ticket.model))
        for engine, (count, at) in state.serves.items():  # warm near ties: the engines every replica admitted to
            if self.core.serves.merge(engine, count, at - self.shared.offset):
                self.core.index.note_serve(engine)
        for ticket, owner in state.tickets:
            if self.core.learn(self.shared.to_local(ticket), None, now) and owner == self.store.replica_id:
                self._owned.add(ticket.ticket_id)
        for session, engine in state.sessions.items():
            self.core.sessions.set(session, engine)
        for ticket in self.core.tickets():  # closed elsewhere while this replica was not listening
            if ticket.ticket_id not in held and ticket.ticket_id not in self._owned:
                self.core.release(ticket.ticket_id, now, completed=False)
        if restored:
            log.warning("restored %d tickets the store had lost", restored)
        self.wake()

    async def _upkeep(self) -> None:
        """The store's lease sweep, every ``STORE_UPKEEP_S``; whether it answers is the store's state here (a store
        back after an outage is resynchronised). The heartbeat is renewed elsewhere (``Store.start_liveness``)."""
        while True:
            try:
                expired = await self._timed("expire", self.store.expire(self.shared.offset + self.clock()))
                for ticket in expired:  # any replica's sweep closes a lapsed lease once; this one was first
                    self.core.release(ticket.ticket_id, self.clock(), completed=False)
                if not self.store_up:
                    log.warning("the shared store answers again")
                    self._spawn(self._resync())
                self.store_up = True
            except StoreUnavailable as exc:
                if self.store_up:
                    log.error("the shared store does not answer (%s); store.on_failure: %s", exc,
                              self.config.store.on_failure.value)
                self.store_up = False
            self.metrics.store_up.set(1 if self.store_up else 0)
            await asyncio.sleep(STORE_UPKEEP_S)

    async def _timed(self, op: str, call: Awaitable[_T]) -> _T:
        """One store call, timed. A task cancelled during the call is cancelled when it returns, whatever it returned:
        redis-py can swallow a cancellation that arrives inside a call (a loop that went on would never stop)."""
        started = time.perf_counter()
        try:  # bounded by the store's own client timeout (store.timeout_seconds); no task per call
            result = await call
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError()
            return result
        except StoreUnavailable as exc:
            self.metrics.store_errors.labels(op).inc()
            raise StoreUnavailable(f"{op}: {exc}") from exc
        finally:
            timer = self._store_timers.get(op)
            if timer is None:  # a labelled child looked up once per op, not per call
                timer = self._store_timers[op] = self.metrics.store_seconds.labels(op)
            timer.observe(time.perf_counter() - started)

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        """Run ``work`` in the background, tracked until done. A task cancelled before its first step (the service
        stopping) closes ``work`` too, so a coroutine that never ran is not left unawaited."""
        async def run() -> None:
            await work
        task = asyncio.get_running_loop().create_task(run())
        if isinstance(work, Coroutine):
            task.add_done_callback(lambda _: work.close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(self._release_tasks.discard)
        return task

    async def _sweep_park_deadlines(self) -> None:
        audit_at = self.clock() + LINE_AUDIT_S
        while True:
            await asyncio.sleep(PARK_SWEEP_S)
            if self.clock() >= audit_at:
                audit_at = self.clock() + LINE_AUDIT_S
                await self._audit_lines()
            if self.core.depth():
                now = self.clock()
                expired = self.core.expire_parked(self.observation.fleet(now), now)
                for outcome in expired:
                    self._left_lot(outcome)
                self._resolve(expired)

    async def _audit_lines(self) -> None:
        """Take out of the shared lines every member of this replica that its lot no longer holds. Every way out of the
        lot unparks its request, so this finds nothing; it is the backstop for one that does not: a stray member heads
        its line for good, and every later admission of its model, on every replica, is refused ``queued`` while the
        engines idle. Under the line lock, so every park and unpark asked
        for before has landed and none lands meanwhile; a request in ``_parking`` (its park still to come),
        ``_settling`` (woken, perhaps going back) or ``_unparking`` (its unpark on its way) is no stray. Counted in
        ``sluice_line_strays_removed_total``."""
        for model, klass in self.core.lines():
            strays: list[str] = []
            async with self._line_lock:
                if not self.store_up:
                    return
                try:
                    held = await self._timed("members", self.store.members(model, klass))
                    candidates = [r for r in held if self.core.where(r) is None and r not in self._parking
                                  and r not in self._settling and r not in self._unparking]
                    # unpark says whether it removed anything: a request admitted while ``members`` was read is gone
                    strays = [r for r in candidates if await self._timed("unpark", self.store.unpark(model, klass, r))]
                except StoreUnavailable:
                    return  # the upkeep loop notices; the next audit tries again
            if strays:
                log.warning("%d request(s) of %s were in the shared line but no longer parked here; taken out: %s",
                            len(strays), model, ", ".join(strays[:5]))
                self.metrics.line_strays_removed.inc(len(strays))
                self.wake([model])

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.tickets.reap_interval_seconds)
            self._expired(self.core.expire_leases(self.clock()), "its lease ran out")
