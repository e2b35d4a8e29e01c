"""Whose turn it is in the parking lot: the order of a class, reserved shares and the bounds of a parked request's wait.
Sans-I/O, time passed in.

**Order.** A class is served in parking order, or with fair share on (``policy.fairness``, fairshare.py) in the order
of its tenants' counters: ``_order`` projects it by charging each pick its estimate in turn; "ahead" and "head" mean
that order. A request that parks while its tenant has nothing parked is lifted to the backlogged minimum first.
**Reserved shares** (``policy.fairness.reserved``, reserve.py): an admission of a tenant's request must leave the
slots held for the tenants owed them (``owed``; else it parks ``reserved_share``); a tenant whose next request last
declined a free slot, with no slot freed since, holds none. **Shed early** (shedearly.py): ``_too_late`` sheds a request
inside its decision window whose place in line makes it start past its bound; ``due`` lists those past their deadline.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable

from controlplane.core import reserve
from controlplane.core.explain import earliest_fit
from controlplane.core.fairshare import FairStanding, TenantAhead, TenantShare, service_order
from controlplane.core.fleet import Fleet
from controlplane.core.fleetstate import FleetState
from controlplane.core.ledger import Ledger
from controlplane.core.lot import PARK_CLASSES, ParkingLot, class_of, tenant_of
from controlplane.core.model import Decision, InferenceRequest, Parked, Priority, Reason, Verdict
from controlplane.core.policy import Policy
from controlplane.core.eventwindow import EventWindow
from controlplane.core.preempt import Preemption, choose_victims
from controlplane.core.shedearly import committed, overload_bound_s, too_late
from controlplane.core.waits import retry_after

Rank = Callable[[str], tuple[float, float]]


class Turns(FleetState):
    def __init__(self, policy: Policy, ledger: Ledger, admit_stale: bool = True,
                 draw: Callable[[], float] = lambda: 0.5) -> None:
        super().__init__(policy, ledger, admit_stale, draw)
        self.lot = ParkingLot()
        self._preempt_budget = EventWindow()
        self._preemptions: list[Preemption] = []

    # -- the lot -------------------------------------------------------------------------------------------------------
    def depth(self, model: str | None = None) -> int:
        return self.lot.depth(model)

    def queued_ahead(self, model: str, priority: Priority) -> int:
        return self.lot.queued_ahead(model, priority)

    def parked(self) -> list[Parked]:
        return list(self.lot)

    def where(self, request_id: str) -> tuple[str, int] | None:
        return self.lot.where(request_id)

    def lines(self) -> list[tuple[str, int]]:
        return self.lot.lines()

    def class_index(self, request: InferenceRequest) -> int:
        """The request's parking class as an index into ``PARK_CLASSES`` (how the shared store names its line)."""
        return PARK_CLASSES.index(class_of(request))

    def cancel(self, request_id: str) -> bool:
        """The client went away while parked: drop it; it holds nothing. False if it was not parked."""
        return self.lot.cancel(request_id)

    def restore(self, parked: Parked) -> None:
        """Put a woken request back in its place in the lot (its parking sequence number: the lot's order)."""
        self.lot.restore(parked)

    # -- the order (fairshare.py) --------------------------------------------------------------------------------------
    def _order(self, model: str, queue: Iterable[Parked], newest_first: bool = False,
               rank: Rank | None = None) -> list[Parked]:
        """The order ``queue`` (one class of ``model``, in parking order) is served in: parking order (``newest_first``:
        adaptive LIFO's), or with fair share on the tenants' counters' (``rank``: the tenants' standing, their counters
        by default)."""
        entries = list(queue)
        if not self.policy.fairness.enabled:
            return entries[::-1] if newest_first else entries
        return service_order(entries, lambda p: tenant_of(p.request), rank or (lambda t: self.fair.rank(model, t)),
                             self._cost, newest_first)

    def lift_credit(self, request: InferenceRequest) -> float:
        """How far below the backlogged minimum a lift may leave ``request``'s tenant: ``lift_credit_requests`` times
        the request's expected cost (fairshare.py)."""
        return self.policy.fairness.lift_credit_requests * self._request_cost(request)

    def _cost(self, parked: Parked) -> float:
        """What serving ``parked`` is expected to add to its tenant's counter."""
        return self._request_cost(parked.request)

    def _request_cost(self, request: InferenceRequest) -> float:
        return self.policy.fairness.cost(tenant_of(request), *self._expected_tokens(request))

    def _parking_rank(self, model: str, request: InferenceRequest) -> tuple[float, Rank]:
        """The counter of ``request``'s tenant if it parked now (lifted when none of its requests is parked), and the
        tenants' standing with it."""
        tenant = tenant_of(request)
        backlogged = self.lot.backlogged(model)
        lifted = self.fair.counter(model, tenant) if tenant in backlogged else \
            self.fair.lifted(model, tenant, backlogged, self.lift_credit(request))

        def rank(t: str) -> tuple[float, float]:
            counter, raw = self.fair.rank(model, t)
            return (lifted, raw) if t == tenant else (counter, raw)
        return lifted, rank

    def _ahead_at_park(self, model: str, klass: Priority, entry: Parked, rank: Rank) -> int:
        """Requests served before ``entry`` if it parked now: every one of a higher class, and those of its class
        before it in the class's order."""
        higher = self.lot.higher(model, klass)
        queue = list(self.lot.line(model, klass))
        if not self.policy.fairness.enabled:
            return higher + len(queue)
        return higher + next(i for i, p in enumerate(self._order(model, [*queue, entry], rank=rank)) if p is entry)

    def fair_standing(self, request: InferenceRequest, fleet: Fleet, now: float) -> FairStanding:
        """Where ``request`` would stand if it parked now, nothing changed (``sluice admin explain``): its tenant's
        counter as it would park, the requests of higher classes, those of its class served before it, by tenant, and
        the slots held for other tenants' reserved shares. Fair share off: every request of its class parked before it
        is ahead (the counters are still shown)."""
        model = request.model
        assert model is not None
        klass, tenant = class_of(request), tenant_of(request)
        lifted, rank = self._parking_rank(model, request)
        queue = list(self.lot.line(model, klass))
        entry = Parked("", request, 0.0, 0.0, seq=max((p.seq for p in queue), default=0) + 1)
        order = self._order(model, [*queue, entry], rank=rank)
        at = next(i for i, p in enumerate(order) if p is entry)
        before = Counter(tenant_of(p.request) for p in order[:at])
        ahead = tuple(sorted((TenantAhead(t, lifted if t == tenant else self.fair.counter(model, t), n)
                              for t, n in before.items()), key=lambda a: (a.counter, a.tenant)))
        held = {t: n for t, n in self.owed(model, fleet, now).items() if t != tenant}
        return FairStanding(tenant, lifted, lifted > self.fair.counter(model, tenant), sum(before.values()),
                            self.lot.higher(model, klass), ahead, held)

    def tenant_shares(self) -> list[TenantShare]:
        """Every tenant's counter, served tokens and parked requests, per model (admin, metrics)."""
        return self.fair.shares(self.lot.waiting())

    # -- reserved shares (reserve.py) ----------------------------------------------------------------------------------
    def owed(self, model: str, fleet: Fleet, now: float, skipped: Iterable[str] = ()) -> dict[str, int]:
        """Slots held back now for each tenant with a reserved share (``reserve.owed``): those with a request of
        ``model`` parked whose next one fits some engine now, running fewer than their reserved slots. ``skipped``
        tenants (a wake found ``decide`` would not admit them) and those whose next request is passable hold none."""
        shares = self.policy.fairness.reserved
        queues = self.lot.queues(model)
        if not shares or not queues:
            return {}
        running = self.fair.running(model)
        total, _ = reserve.slots(fleet, model)
        parked = Counter(tenant_of(p.request) for q in queues.values() for p in q)
        holding = {}
        for tenant in set(parked) - set(skipped):
            if reserve.reserved_slots(shares.get(tenant, 0.0), total) <= running.get(tenant, 0):
                continue
            head = self.lot.next_of(model, tenant)
            if head is None or self.lot.passable(head.request_id, self._frees):
                continue
            if earliest_fit(head.request, fleet, self.policy, now) == now:
                holding[tenant] = parked[tenant]
        return reserve.owed(shares, total, running, holding)

    def _may_take(self, request: InferenceRequest, fleet: Fleet, now: float, skipped: Iterable[str] = ()) -> bool:
        """Whether ``request`` may take a free slot under the reserved shares (``reserve.may_take``)."""
        if not self.policy.fairness.reserved or request.model is None:
            return True
        held = self.owed(request.model, fleet, now, skipped)
        if not held:
            return True
        return reserve.may_take(tenant_of(request), reserve.slots(fleet, request.model)[1], held)

    @staticmethod
    def _held(request: InferenceRequest, model: str) -> Decision:
        """The park for a request the reserved shares keep from the free slots."""
        return Decision(Verdict.PARK, Reason.RESERVED_SHARE,
                        detail=f"the free slots of {model} are held for other tenants' reserved shares",
                        park_limit_s=request.planned_ttft_s())

    # -- shed early (shedearly.py) -------------------------------------------------------------------------------------
    def _committed(self, parked: Parked, now: float) -> bool:
        return committed(parked, now, self.policy)

    def _too_late(self, parked: Parked, ahead: int, fleet: Fleet, now: float) -> Decision | None:
        """The shed for ``parked`` (not committed, ``ahead`` requests in line before it) if it would start past its
        bound (``shedearly.too_late``), or None."""
        model = parked.request.model
        assert model is not None
        line: deque[Parked] = self.lot.line(model, class_of(parked.request))
        return too_late(parked, ahead, fleet, now, self.policy, self.expected_cached(parked.request),
                        self.service_times.get(model), lambda: any(self._committed(p, now) for p in line),
                        line[0].parked_at if line else parked.parked_at)

    # -- preemption (preempt.py) ---------------------------------------------------------------------------------------
    def _preempting(self, parked: Parked, early: Decision, fleet: Fleet, now: float,
                    preview: bool = False) -> Decision | None:
        """Instead of shedding critical ``parked`` early (``early``), the park it keeps while sheddable streams end for
        it: those already ended for it (until every one is closed), or new victims (preempt.py's rule, within the rate
        bound), queued for the shell (``take_preemptions``). None: shed it. ``preview``: what it would be, nothing
        marked, spent or queued."""
        fairness = self.policy.fairness
        request = parked.request
        if not fairness.preempt_sheddable or request.priority is not Priority.CRITICAL or request.model is None:
            return None
        model = request.model
        waiting = Decision(Verdict.PARK, Reason.PREEMPTING, detail=f"sheddable streams of {model} are being ended "
                           f"for it (instead of: {early.detail})", park_limit_s=request.planned_ttft_s())
        if self.preemptible.awaiting(parked.request_id):
            return waiting
        if not self._preempt_budget.allows(now, fairness.preempt_max_per_minute):
            return None
        running = self.preemptible.candidates(self.ledger.get(t) for t in self.preemptible.attached)
        found = choose_victims(request, fleet, self.policy, now, running)
        if found is None or preview:
            return None if found is None else waiting
        engine, victims = found
        self._preempt_budget.note(now)
        self.preemptible.mark(parked.request_id, victims)
        candidates = [e for e in fleet.engines if e.serves(model)]
        self._preemptions.append(Preemption(parked.request_id, model, engine, victims,
                                            retry_after(candidates, fleet, self.policy, now, self.depth(model))))
        return waiting

    def take_preemptions(self) -> list[Preemption]:
        """The preemptions decided since the last call, for the shell to carry out (each once)."""
        out, self._preemptions = self._preemptions, []
        return out

    def overload_bound_s(self, model: str, estimated_s: float = 0.0) -> float:
        """The overload bound of ``model`` (shedearly.py; ``estimated_s``: the engines' expected service, until a
        request of the model has been released)."""
        measured = self.service_times.get(model)
        return overload_bound_s(self.policy, estimated_s if measured is None else measured)

    def due(self, now: float) -> list[Parked]:
        """The parked requests ``expire_parked`` sheds at ``now`` whatever the estimates say: inside its decision
        window, one whose deadline has passed (its TTFT deadline, or ``max_park_s``); past it, one that has waited
        ``max_park_s`` (the backstop: its Check must be answered before Envoy's times out)."""
        return [p for p in self.lot
                if (p.deadline <= now and not self._committed(p, now)) or now - p.parked_at >= self.policy.max_park_s]
