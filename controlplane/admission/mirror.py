"""The ledger's mirror of the shared store, sans I/O: what this replica sends to the store, and what the store's answers
and events change in the core's ledger (the core decides on its own ledger; the store holds the shared one).

No method awaits or calls the store; time is passed in (this replica's monotonic seconds; ``shared`` converts to the
store's). The asyncio shell (``replication.py``) makes the store calls and feeds their answers back here. Invariants:

- a ticket released here, or heard released, never re-enters the ledger from a refusal's list, a late event or a load
  (``releasing``, ``recently_released``); a release of a ticket the store never had (``unsynced``) is not sent;
- line changes reach the store in the order they were asked for, those asked while a batch is out together in the next
  (``LineQueue``); a wake does not admit a request whose park has not landed (``parking``);
- after a refusal in a wake, every later admission of that model goes back to its place (``Settlement``);
- a request the store admits on its claim is answered with the decision the claim stands for (``claims``); one answered
  otherwise meanwhile has its ticket released;
- with fair share in the store (``shared_fair``) every admission carries its charge and every park its tenant; a fair
  wake refused for the line learns the store's counters once the wake's admissions are settled (``counters``).

The rules behind these: docs/architecture.md, "Replicas and the shared store".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from controlplane.config import Config, StoreOnFailure
from controlplane.core.fairshare import FairCounters
from controlplane.core.lot import PARK_CLASSES, tenant_of
from controlplane.core.admission import AdmissionCore
from controlplane.core.model import Decision, InferenceRequest, Outcome, Parked, QueueRule, Ticket, Verdict
from controlplane.core.decide import decide
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.store.base import (
    LINE_CLASSES, Claim, EventKind, FairCharge, LineChange, Refusal, Reserved, SharedClock, StoreEvent, StoreState,
)

RECENT_RELEASES = 100_000
"""How many released ticket ids a replica remembers so that a late copy of a ticket never re-enters its mirror."""

LINE_SHARED_S = 1.0
"""How long after a refusal for the line requests parked behind this replica's own are given claims (``claim_behind``:
a decision each, which a replica alone in its lines does not need: its wakes admit its heads in order)."""

LINE_BATCH = 256
"""At most this many parks and unparks go to the store in one call."""

assert len(PARK_CLASSES) == LINE_CLASSES, "the store keeps a line per parking class"

W = TypeVar("W")


class Views(Protocol):
    """What the mirror reads of observation: an engine's cap and KV capacity go with each admission it writes."""

    def view_of(self, engine: str, now: float) -> EngineView | None: ...
    def fleet(self, now: float) -> Fleet: ...


@dataclass(frozen=True, slots=True)
class PendingClaim:
    """A parked request of this replica that may have a claim in the store: when it parked here (local time), and the
    admission each claim it left stands for, by the claim's ticket's ``admitted_at`` (shared time)."""

    parked_at: float
    decisions: dict[float, Decision]


@dataclass(frozen=True, slots=True)
class Heard:
    """What a store event changes beyond the ledger: the Checks it answers, tickets to release in the store (admitted on
    claims after their Checks were answered otherwise), and the models to wake (empty: none; None: every model)."""

    answers: tuple[Outcome, ...] = ()
    releases: tuple[str, ...] = ()
    wake: tuple[str, ...] | None = ()


class LineQueue(Generic[W]):
    """Line changes waiting for the store, each with its waiter, in the order they were asked for. A batch takes the
    oldest ``LINE_BATCH`` of them, so changes asked for while a batch is out go in the next one, in order."""

    def __init__(self) -> None:
        self._waiting: list[tuple[LineChange, W]] = []

    def ask(self, change: LineChange, waiter: W) -> None:
        self._waiting.append((change, waiter))

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def next_batch(self) -> list[tuple[LineChange, W]]:
        batch, self._waiting = self._waiting[:LINE_BATCH], self._waiting[LINE_BATCH:]
        return batch

    def waiting(self) -> list[tuple[LineChange, W]]:
        return list(self._waiting)


class LedgerMirror:
    """This replica's side of the shared ledger: the core's ledger plus what is on its way to or from the store."""

    def __init__(self, config: Config, core: AdmissionCore, views: Views, replica_id: str, shared: SharedClock) -> None:
        self.config = config
        self.core = core
        self.views = views
        self.replica_id = replica_id
        self.shared = shared
        self.releasing: set[str] = set()
        """Releases sent and not yet confirmed."""
        self.recently_released: dict[str, None] = {}
        """Ticket ids released in the store lately, by any replica (insertion-ordered, at most ``RECENT_RELEASES``): a
        refusal's list of an engine's tickets, read after the release though the store made it before, never brings one
        back into the mirror."""
        self.release_backlog: set[str] = set()
        """Releases the store could not take (it was unreachable): sent when it is back."""
        self.owned: set[str] = set()
        """Open tickets this replica wrote: restored to a store that lost them."""
        self.unsynced: dict[str, Ticket] = {}
        """Tickets admitted while the store was unreachable (``on_failure: open``)."""
        self.parking: set[str] = set()
        """Parked requests whose place in the shared line is not written yet (their park is on its way)."""
        self.parks_awaited: set[str] = set()
        """Models whose wake stopped at a request in ``parking``: woken again when its park lands."""
        self.unparking: set[str] = set()
        """Requests whose unpark is on its way."""
        self.settling: set[str] = set()
        """Woken requests out of the lot while their admissions are written: a refused one goes back, in the line all
        along (the line audit must not take it out)."""
        self.claims: dict[str, PendingClaim] = {}
        """Parked requests that left a claim in the store, until they are answered."""
        self.claimed_done: set[str] = set()
        """Woken requests (``settling``) the store admitted on their claims meanwhile: answered already; the wake takes
        its own admission of them back."""
        self.rejoin = False
        """This replica was found dead while alive: its lot goes back in line at the wake loop's next turn."""
        self.line_shared_until = -math.inf
        """Until when another replica is taken to hold members of this replica's lines (a refusal for the line said so
        lately): meanwhile requests parked behind this replica's own get claims too (``claim_behind``)."""
        self.counters: dict[str, FairCounters] = {}
        """The store's counters, by model, from fair admissions it refused for the line: learned by the lot once the
        wake's admissions are settled (``learn_counters``), so that none of their retractions applies to them."""

    # -- releases ----------------------------------------------------------------------------------------------------
    def released_lately(self, ticket_id: str) -> bool:
        return ticket_id in self.releasing or ticket_id in self.recently_released

    def release(self, ticket_id: str) -> bool:
        """The ledger closed ``ticket_id``: whether the store must be told (not a ticket it never had)."""
        self.owned.discard(ticket_id)
        if self.unsynced.pop(ticket_id, None) is not None:
            return False
        self.releasing.add(ticket_id)
        return True

    def release_landed(self, ticket_id: str, sent: bool | None) -> None:
        """A release's call ended: taken by the store (``sent``), not reached (sent at the next resync), or cancelled
        (None)."""
        if sent:
            self.remember_released(ticket_id)
        elif sent is not None:
            self.release_backlog.add(ticket_id)
        self.releasing.discard(ticket_id)

    def remember_released(self, ticket_id: str) -> None:
        self.recently_released[ticket_id] = None
        while len(self.recently_released) > RECENT_RELEASES:
            del self.recently_released[next(iter(self.recently_released))]

    def learn_held(self, refused: Reserved, now: float) -> None:
        """A CAP, KV or ADAPTER_SLOTS refusal's list of the engine's tickets, into the ledger, except tickets released
        lately."""
        for held in refused.engine_tickets:
            if not self.released_lately(held.ticket_id):
                self.core.learn(self.shared.to_local(held), None, now)

    def lease_expired(self, ticket: Ticket, now: float) -> None:
        """The store's lease sweep closed ``ticket`` (this replica's sweep was first): closed here, not completed."""
        self.core.release(ticket.ticket_id, now, completed=False)

    def to_restore(self) -> list[Ticket]:
        """Tickets this replica wrote or kept unsynced, for a store that may have lost them (shared time)."""
        return [self.shared.to_shared(t) for t in self.core.tickets()
                if t.ticket_id in self.owned or t.ticket_id in self.unsynced]

    def restored(self) -> None:
        self.owned.update(self.unsynced)
        self.unsynced.clear()

    # -- admissions --------------------------------------------------------------------------------------------------
    def claim(self, outcome: Outcome, request: InferenceRequest, now: float, fleet: Fleet | None = None) -> Claim:
        """An admission the core made, as the store checks and writes it (and keeps it, as a claim, if refused for the
        line alone)."""
        ticket = outcome.ticket
        assert ticket is not None
        view = self.views.view_of(ticket.engine, now) or next(
            e for e in (fleet or self.views.fleet(now)).engines if e.name == ticket.engine)
        capacity = view.kv_capacity_tokens
        policy = self.core.policy
        slots = view.adapter_slots if self.core.is_adapter(ticket.model) else None
        plain = tuple(m.model_id for m in view.models if not self.core.is_adapter(m.model_id)) \
            if slots is not None else ()
        return Claim(self.shared.to_shared(ticket), view.cap,
                     math.floor(capacity * policy.kv_high_watermark) if capacity else None,
                     request.session, outcome.rule, self.core.class_index(request), request.prefix_blocks,
                     fresh_s=self.fresh_s(request), serve_half_life_s=policy.serve_half_life_s,
                     charge=self._charge(ticket.ticket_id), adapter_slots=slots, plain_models=plain)

    # -- fair share in the store (decision 0025) ---------------------------------------------------------------------
    @property
    def shared_fair(self) -> bool:
        """Whether the store keeps the counters and decides the fair line (``fairness.across_replicas``)."""
        fairness = self.core.policy.fairness
        return fairness.enabled and fairness.across_replicas

    def _charge(self, ticket_id: str) -> FairCharge | None:
        """The charge the core made for this admission, as the store adds it to the tenant's counter."""
        charged = self.core.fair.charged(ticket_id) if self.shared_fair else None
        if charged is None:
            return None
        tenant, cost = charged
        fairness = self.core.policy.fairness
        return FairCharge(tenant, cost, fairness.prompt_weight, fairness.output_weight, fairness.weight(tenant))

    def line_tenant(self, request: InferenceRequest) -> str | None:
        """The tenant a park counts for in the store (None: fair share is not the store's)."""
        return tenant_of(request) if self.shared_fair else None

    def learn_counters(self) -> set[str]:
        """The store's counters from this wake's refusals replace the lot's; returns the models whose counters
        differed (their wake runs again: its order may have changed)."""
        changed = {model for model, held in self.counters.items() if self.core.fair.adopt(held)}
        self.counters.clear()
        return changed

    def reserved(self, outcome: Outcome, answer: Reserved | None, decided_at: float, now: float) -> Reserved:
        """The store's answer to ``outcome``'s admission (None: unreachable), as it stands: written, the ticket is this
        replica's; refused, the admission is undone and the engine's tickets the refusal lists are learned; unreachable,
        it is kept unsynced (``on_failure: open``) or undone (``UNAVAILABLE``)."""
        ticket = outcome.ticket
        assert ticket is not None
        if answer is None:
            if self.config.store.on_failure is StoreOnFailure.OPEN:
                self.unsynced[ticket.ticket_id] = ticket
                return Reserved()
            self.core.retract(outcome, decided_at)
            return Reserved(Refusal.UNAVAILABLE)
        if answer.ok:
            self.owned.add(ticket.ticket_id)
            return answer
        self.core.retract(outcome, decided_at)
        self.learn_held(answer, now)
        if answer.counters is not None:
            self.counters[answer.counters.model] = answer.counters
        return answer

    # -- claims ------------------------------------------------------------------------------------------------------
    def line_shared(self, now: float) -> bool:
        return now < self.line_shared_until

    def share_line(self, now: float) -> None:
        """A refusal for the line: another replica holds members of this replica's lines for ``LINE_SHARED_S``."""
        self.line_shared_until = now + LINE_SHARED_S

    def claim_behind(self, request_id: str, request: InferenceRequest, fleet: Fleet,
                     now: float) -> tuple[Decision, Claim] | None:
        """A claim for a request the core parked behind others (in its lot or the shared line) without deciding where it
        would go: the admission it would get first in line (``decide``; nothing is written), so the store can admit it
        as soon as it heads the line. None when it would not be admitted even then. Its engine is chosen as if the
        requests ahead took no slot: the store's check of the cap stops the line at it if they took the last one."""
        core = self.core
        decision = decide(request, fleet, core.policy, now, 0, core.sessions.get(request.session), core.draw(),
                          arriving=True, cached=core.expected_cached(request),
                          prefix_share=core.prefix_share(request), prefix_demand=core.prefix_demand())
        if decision.verdict is not Verdict.ADMIT or decision.engine is None or request.model is None:
            return None
        ticket = Ticket(request_id, decision.engine, request.model, now, now + core.ledger.lease_seconds,
                        decision.reserved_tokens, decision.expected_done_at or now, decision.expected_ttft_s)
        return decision, self.claim(Outcome(request_id, decision, ticket, rule=QueueRule.OLDEST), request, now, fleet)

    def fresh_s(self, request: InferenceRequest) -> float:
        """How long a claim of ``request`` may be admitted on: ``store.claim_seconds``, never past the age at which its
        class would turn newest-first (the store admits claims oldest first)."""
        policy = self.core.policy
        fresh = self.config.store.claim_seconds
        if policy.lifo_after_ms > 0:
            fresh = min(fresh, policy.lifo_after_ms / 1000)
        if policy.lifo_deadline_fraction > 0 and request.max_ttft_ms:
            fresh = min(fresh, policy.lifo_deadline_fraction * request.max_ttft_ms / 1000)
        return fresh

    def note_claim(self, request_id: str, parked_at: float, claim: Claim, decision: Decision) -> None:
        """``claim`` may be left in the store for ``request_id``: remember what it stands for (claims older than twice
        their freshness are forgotten: the store no longer admits on them)."""
        pending = self.claims.get(request_id)
        if pending is None:
            self.claims[request_id] = PendingClaim(parked_at, {claim.ticket.admitted_at: decision})
            return
        stale = claim.ticket.admitted_at - 2 * claim.fresh_s
        for at in [at for at in pending.decisions if at < stale]:
            del pending.decisions[at]
        pending.decisions[claim.ticket.admitted_at] = decision

    def forget_claim(self, request_id: str) -> None:
        self.claims.pop(request_id, None)

    def own_claimed(self, event: StoreEvent, now: float) -> Heard:
        """The store admitted a request parked here on its claim: its Check is answered with that ticket and the decision
        the claim stands for; one answered meanwhile (shed, cancelled: its unpark came too late) has its ticket
        released."""
        request_id, shared = event.ticket_id, event.ticket
        assert shared is not None
        pending = self.claims.pop(request_id, None)
        in_lot = self.core.where(request_id) is not None
        if pending is None or not (in_lot or request_id in self.settling):
            return Heard(releases=(request_id,))
        ticket = self.shared.to_local(shared)
        if in_lot:
            self.core.cancel(request_id)
        else:  # a wake holds it: its own admission is taken back when its turn comes (``Settlement``)
            self.claimed_done.add(request_id)
        self.core.learn(ticket, event.session, now, event.prefix_blocks)
        self.owned.add(ticket.ticket_id)
        decision = pending.decisions.get(shared.admitted_at)
        if decision is None:  # not expected: every claim is noted before it is sent
            latest = pending.decisions[max(pending.decisions)]
            decision = replace(latest, engine=ticket.engine, reserved_tokens=ticket.reserved_tokens,
                               expected_done_at=ticket.expected_done_at, expected_ttft_s=ticket.expected_ttft_s)
        return Heard(answers=(Outcome(request_id, decision, ticket, max(0.0, now - pending.parked_at)),))

    # -- the line ----------------------------------------------------------------------------------------------------
    def park(self, request_id: str, request: InferenceRequest, parked_at: float, at: float,
             queued: tuple[Decision, Claim] | None, behind: bool) -> LineChange:
        """The line change for a request the core just parked (at ``parked_at``; ``at``: now in shared time), with
        ``queued``'s claim when the store refused its admission for the line alone; ``behind`` (parked only behind this
        replica's own requests), it is first offered to the line as an arrival. Until it lands it is ``parking``."""
        model = request.model
        assert model is not None
        claim = None
        if queued is not None and queued[1].fresh_s > 0 and self.core.where(request_id) is not None:
            decision, claim = queued
            self.claims[request_id] = PendingClaim(parked_at, {claim.ticket.admitted_at: decision})
        offer = replace(queued[1], queue=QueueRule.ARRIVAL) if behind and queued is not None else None
        self.parking.add(request_id)
        return LineChange(model, self.core.class_index(request), request_id, at, claim, offer,
                          tenant=self.line_tenant(request), lift_credit=self.core.lift_credit(request))

    def park_landed(self, request_id: str, model: str) -> bool:
        """A park's call ended (or its Check left): whether a wake stopped at it and must run again."""
        self.parking.discard(request_id)
        if model in self.parks_awaited:
            self.parks_awaited.discard(model)
            return True
        return False

    def offer_landed(self, request_id: str, request: InferenceRequest, decision: Decision, offer: Claim,
                     offered: Reserved, now: float) -> Outcome | None:
        """A park offered as an arrival came back: admitted, the request leaves the lot and its admission is returned;
        refused for the engine (CAP, KV), the engine's tickets are learned."""
        if not offered.ok:
            self.learn_held(offered, now)
            return None
        self.claims.pop(request_id, None)
        if not self.core.cancel(request_id) and request_id in self.settling:
            self.claimed_done.add(request_id)  # a wake holds it: its own admission of it is taken back
        ticket = self.shared.to_local(offer.ticket)
        self.core.learn(ticket, request.session, now, request.prefix_blocks)
        self.owned.add(request_id)
        return Outcome(request_id, decision, ticket)

    def offer_admitted_without_client(self, request: InferenceRequest, offer: Claim, now: float) -> Ticket:
        """An offered park admitted after its client left: the ticket, in the ledger, for the caller to release."""
        ticket = self.shared.to_local(offer.ticket)
        self.core.learn(ticket, request.session, now, request.prefix_blocks)
        self.owned.add(ticket.ticket_id)
        return ticket

    def keep_first_park(self, request_id: str, parked_at: float) -> bool:
        """A request whose Check Envoy asked again after the replica holding it went away keeps the time it first parked
        (``parked_at``, local time): its park deadline and parked time count from then. Its place stays the back of its
        class, in the lot and the line alike. False when it was answered meanwhile or parked here first after all."""
        entry = next((p for p in self.core.parked() if p.request_id == request_id), None)
        if entry is None or parked_at >= entry.parked_at:
            return False
        self.core.cancel(request_id)
        self.core.restore(replace(entry, parked_at=parked_at, deadline=entry.deadline - (entry.parked_at - parked_at)))
        pending = self.claims.get(request_id)
        if pending is not None:
            self.claims[request_id] = replace(pending, parked_at=parked_at)
        return True

    def strays(self, held: Sequence[str]) -> list[str]:
        """Of this replica's members of a line, those its lot no longer holds and nothing is on its way for."""
        return [r for r in held if self.core.where(r) is None and r not in self.parking
                and r not in self.settling and r not in self.unparking]

    def back_in_lot(self, parked: Parked) -> None:
        """A woken request whose admission was not written goes back to its place, unless the store admitted it on its
        claim meanwhile (answered already)."""
        if parked.request_id in self.claimed_done:
            self.claimed_done.discard(parked.request_id)
        else:
            self.core.restore(parked)

    # -- events ------------------------------------------------------------------------------------------------------
    def heard(self, event: StoreEvent, now: float) -> Heard:
        """Another replica's admission, release or unpark, an admission on a claim, a dead replica: the ledger follows;
        freed capacity or a shorter line wakes."""
        model = event.model
        if event.kind is EventKind.CLAIMED and event.replica == self.replica_id and event.ticket is not None:
            return replace(self.own_claimed(event, now), wake=(model,))
        if event.kind in (EventKind.ADMITTED, EventKind.CLAIMED) and event.ticket is not None:
            # ... unless its access-log entry reached this replica before this event did: released here already.
            if not self.released_lately(event.ticket_id):
                self.core.learn(self.shared.to_local(event.ticket), event.session, now, event.prefix_blocks)
            return Heard(wake=(model,) if self.core.depth(model) else ())  # its line's head may have held ours back
        if event.kind is EventKind.RELEASED:
            self.remember_released(event.ticket_id)
            freed = self.core.release(event.ticket_id, now) is not None
            return Heard(wake=(model,) if freed or self.core.depth(model) else ())
        if event.kind is EventKind.UNPARKED:
            return Heard(wake=(model,))
        if event.kind is EventKind.DEAD:
            return Heard(wake=None)
        return Heard()

    def own_claims(self, state: StoreState) -> list[StoreEvent]:
        """This replica's requests the store admitted on their claims while it was not listening, as their events."""
        return [StoreEvent(EventKind.CLAIMED, owner, ticket.ticket_id, ticket, model=ticket.model)
                for ticket, owner in state.tickets if owner == self.replica_id and ticket.ticket_id in self.claims]

    def loaded(self, state: StoreState, now: float) -> None:
        """Everything the store holds, into the ledger: serve counts, tickets (this replica's own owned again),
        sessions; a ticket closed elsewhere while this replica was not listening is closed here."""
        core = self.core
        for engine, (count, at) in state.serves.items():
            if core.serves.merge(engine, count, at - self.shared.offset):
                core.index.note_serve(engine)
        for ticket, owner in state.tickets:
            if core.learn(self.shared.to_local(ticket), None, now) and owner == self.replica_id:
                self.owned.add(ticket.ticket_id)
        for session, engine in state.sessions.items():
            core.sessions.set(session, engine)
        held = {t.ticket_id for t, _ in state.tickets}
        for ticket in core.tickets():
            if ticket.ticket_id not in held and ticket.ticket_id not in self.owned:
                core.release(ticket.ticket_id, now, completed=False)


class Settlement:
    """A wake's admissions, decided in order as they are written to the store (``Replication.settle``): after a refusal
    every later admission of that model goes back to its place (the line's order holds); after one for the line alone,
    later heads of that model leave their admissions as claims (``behind``: one store call per line)."""

    def __init__(self, mirror: LedgerMirror, now: float) -> None:
        self.mirror = mirror
        self.now = now
        self.blocked: set[str] = set()
        self.queued: set[str] = set()
        """Models whose first refusal here was for the line alone: their later woken heads leave claims."""
        self.behind: dict[tuple[str, int], list[tuple[Outcome, Parked, Claim]]] = {}
        self.again: set[str] = set()
        """Models to wake again: the mirror learned tickets it lacked."""

    def taken_back(self, outcome: Outcome) -> bool:
        """The store admitted it on its claim while the wake was deciding: answered already, this admission undone."""
        mirror = self.mirror
        if outcome.request_id not in mirror.claimed_done:
            return False
        mirror.claimed_done.discard(outcome.request_id)
        mirror.core.retract(outcome, self.now)
        return True

    def to_write(self, outcome: Outcome, parked: Parked, model: str) -> Claim | None:
        """The admission of a woken request to write to the store now, or None: it went back to its place (its model is
        blocked, or its park has not landed), perhaps leaving a claim (``behind``)."""
        mirror, core, request_id = self.mirror, self.mirror.core, outcome.request_id
        if model in self.blocked:
            core.retract(outcome, self.now)
            if model in self.queued and outcome.rule is QueueRule.OLDEST and request_id not in mirror.parking:
                claim = mirror.claim(outcome, parked.request, self.now)
                if claim.fresh_s > 0:
                    self.behind.setdefault((model, claim.klass), []).append((outcome, parked, claim))
                    return None
            core.restore(parked)
            return None
        if request_id in mirror.parking:  # not in the shared line yet: it waits for its park to land
            core.retract(outcome, self.now)
            mirror.parks_awaited.add(model)
            self.refused(outcome, parked, model, Refusal.QUEUED)
            return None
        claim = mirror.claim(outcome, parked.request, self.now)
        if claim.queue is QueueRule.OLDEST and claim.fresh_s > 0:  # a refusal for the line leaves it a claim
            mirror.note_claim(request_id, parked.parked_at, claim, outcome.decision)
        return claim

    def refused(self, outcome: Outcome, parked: Parked, model: str, refusal: Refusal) -> None:
        """A woken admission not written: it goes back to its place (unless admitted on its claim meanwhile: answered),
        and its model is blocked for the rest of this wake."""
        mirror, request_id = self.mirror, outcome.request_id
        if request_id in mirror.claimed_done:  # refused 'exists': admitted on its claim meanwhile, and answered
            mirror.claimed_done.discard(request_id)
            return
        self.blocked.add(model)
        if refusal is Refusal.QUEUED and outcome.rule is QueueRule.OLDEST and request_id not in mirror.parking:
            self.queued.add(model)
            mirror.share_line(self.now)
        mirror.core.restore(parked)
        if refusal in (Refusal.CAP, Refusal.KV, Refusal.ADAPTER_SLOTS):
            self.again.add(model)
