"""Admission as a sans-I/O state machine: ``AdmissionCore``, the ledger, the parking lot and ``decide`` in one place, time
passed in.

The shell calls ``check`` for every request and gets back an ``Outcome``: admitted (with its ticket), parked (the shell
holds the Check open until ``wake`` or ``expire_parked`` returns an outcome for that id, or the client leaves and the
shell calls ``cancel``), or answered (refused, shed, the model list). ``preview`` is what ``check`` would decide now,
committing nothing (``sluice admin explain``). An arrival with requests of its class or a higher one parked ahead parks
behind them (``queued_behind``), unless every one of them declined a free slot with no slot freed since: it is then
decided as if first, taking a slot they refused or parking at the back. A park is bounded: beyond ``max_queue_depth``
per model it is shed ``queue_full``, and shed early when its place in line makes it start past its bound
(shedearly.py). What frees capacity (``release``, ``expire_leases``, probes) is followed by a ``wake`` (waking.py);
the order of the lot, fair share and reserved shares are turns.py's, the recorded state fleetstate.py's. Decision
0019 says why the preview exists.
"""

from __future__ import annotations

from controlplane.core.explain import earliest_fit
from controlplane.core.fleet import Fleet
from controlplane.core.lot import PARK_CLASSES, class_of, tenant_of
from controlplane.core.model import Decision, InferenceRequest, Outcome, Parked, QueueRule, Reason, Verdict
from controlplane.core.waits import retry_after, shed
from controlplane.core.waking import Waking


class AdmissionCore(Waking):
    def check(self, request_id: str, request: InferenceRequest, fleet: Fleet, now: float,
              ahead_elsewhere: int = 0) -> Outcome:
        """A new request. ``Outcome.decision.verdict`` PARK means it is now in the lot under ``request_id``.
        ``ahead_elsewhere``: requests the shared store says are parked ahead of it on other replicas."""
        if request.prefix_blocks and self.policy.prefix_routing:
            self.prefixes.arrived(request.prefix_blocks)
        decision, rule = self._arrival(request, fleet, now, ahead_elsewhere)
        if decision.verdict is Verdict.ADMIT:
            return self._admit(request_id, request, decision, now, parked_for=0.0, rule=rule)
        if decision.verdict is not Verdict.PARK:
            return Outcome(request_id, decision)
        return self._park(request_id, request, decision, fleet, now, ahead_elsewhere)

    def preview(self, request: InferenceRequest, fleet: Fleet, now: float) -> Decision:
        """What ``check`` would decide for ``request`` now, on this replica, changing nothing: no ticket, no park, no
        counter, no draw (the band draws ``PREVIEW_PICK``, so its engine may differ from a Check's; its verdict does
        not). Requests parked ahead, the lot's passing rule, backfill, reserved shares, the depth bound, shed early and
        preemption (a park ``preempting``, no stream marked) all apply as in ``check``."""
        decision, _ = self._arrival(request, fleet, now, preview=True)
        if decision.verdict is not Verdict.PARK:
            return decision
        verdict, entry = self._park_verdict("", request, decision, fleet, now)
        if verdict.verdict is Verdict.PARK or entry is None:
            return verdict
        return self._preempting(entry, verdict, fleet, now, preview=True) or verdict

    def passed_over(self, request_id: str) -> bool:
        """Whether parked ``request_id`` was last decided to wait although a slot was free (``Decision.idle_slot``: it
        waits for a busy engine that finishes it sooner, or no free engine meets its deadline) and no slot has freed
        since: requests behind it may pass it, in a wake or on arrival."""
        return self.lot.passable(request_id, self._frees)

    def _arrival(self, request: InferenceRequest, fleet: Fleet, now: float, ahead_elsewhere: int = 0,
                 preview: bool = False) -> tuple[Decision, QueueRule]:
        """The decision for an arrival and its place against the shared line, changing nothing (``preview``: counting
        the request as arrived, as ``check`` does first)."""
        model = request.model
        ahead = (self.queued_ahead(model, request.priority) if model else 0) + ahead_elsewhere
        waiting = self.lot.passing(model, request, self._frees) if ahead and not ahead_elsewhere and model is not None \
            else None
        passing = waiting is not None
        decision = self._decide(request, fleet, now, 0 if passing else ahead, arriving=True, waiting=waiting,
                                preview=preview)
        rule = QueueRule.NONE if passing else QueueRule.ARRIVAL
        if decision.verdict is Verdict.PARK and ahead and not passing and self.policy.backfill and model is not None:
            decision = self._backfill_arrival(request, model, fleet, now, decision, preview)
            rule = QueueRule.NONE
        if decision.verdict is Verdict.ADMIT and model is not None and not self._may_take(request, fleet, now):
            decision = self._held(request, model)
        return decision, rule

    def _backfill_arrival(self, request: InferenceRequest, model: str, fleet: Fleet, now: float, parked: Decision,
                          preview: bool = False) -> Decision:
        """A new arrival behind parked requests may start at once if it finishes before every head ahead of it could."""
        heads = [self._order(model, q)[0] for k, q in (self.lot.queues(model) or {}).items()
                 if q and PARK_CLASSES.index(k) <= PARK_CLASSES.index(class_of(request))]
        starts = [earliest_fit(h.request, fleet, self.policy, now) for h in heads]
        if not starts or any(s is None for s in starts):
            return parked
        decision = self._decide(request, fleet, now, preview=preview)
        if decision.verdict is Verdict.ADMIT and decision.expected_done_at <= min(s for s in starts if s is not None):
            return decision
        return parked

    def _park_verdict(self, request_id: str, request: InferenceRequest, decision: Decision, fleet: Fleet, now: float,
                      ahead_elsewhere: int = 0) -> tuple[Decision, Parked | None]:
        """What parking ``request`` (``decision``: a PARK) comes to, changing nothing: ``queue_full`` (no entry), a shed
        early, or ``decision`` itself, with the entry it parks (or would have parked) as."""
        model = request.model
        assert model is not None
        if self.depth(model) >= self.policy.max_queue_depth:
            candidates = [e for e in fleet.engines if e.serves(model)]
            wait = retry_after(candidates, fleet, self.policy, now, self.depth(model))
            return shed(Reason.QUEUE_FULL, f"{self.depth(model)} requests already parked for {model}", wait), None
        limit = decision.park_limit_s
        ttft_bound = limit is not None and limit < self.policy.max_park_s
        longest = limit if ttft_bound and limit is not None else self.policy.max_park_s
        entry = Parked(request_id, request, now, now + longest, ttft_bound, self.lot.next_seq())
        _, rank = self._parking_rank(model, request)
        ahead = self._ahead_at_park(model, class_of(request), entry, rank) + ahead_elsewhere
        early = self._too_late(entry, ahead, fleet, now)
        return (decision if early is None else early), entry

    def _park(self, request_id: str, request: InferenceRequest, decision: Decision, fleet: Fleet,
              now: float, ahead_elsewhere: int = 0) -> Outcome:
        verdict, entry = self._park_verdict(request_id, request, decision, fleet, now, ahead_elsewhere)
        if entry is None:
            return Outcome(request_id, verdict)
        model, tenant = entry.request.model, tenant_of(request)
        assert model is not None
        self.lot.take_seq()
        if verdict.verdict is not Verdict.PARK:  # it would start past its bound: told now, unless it preempts
            preempting = self._preempting(entry, verdict, fleet, now)
            if preempting is None:
                return Outcome(request_id, verdict)
            decision = preempting
        backlogged = self.lot.backlogged(model)
        if tenant not in backlogged:  # none of its requests waited: lifted, idle time banked up to the credit
            self.fair.lift(model, tenant, backlogged, self.lift_credit(request))
        self.lot.park(entry)
        if decision.idle_slot:
            self.lot.note_passable(request_id, self._frees, decision.waits_for)
        return Outcome(request_id, decision)

    def force_park(self, request_id: str, request: InferenceRequest, fleet: Fleet, now: float) -> Outcome:
        """Park a request whose admissions the shared store kept refusing (other replicas took each slot first): it
        waits in line like any other, until ``max_park_s`` or its TTFT deadline."""
        decision = Decision(Verdict.PARK, Reason.QUEUED_BEHIND, detail="slots taken by other control-plane replicas",
                            park_limit_s=request.planned_ttft_s())
        return self._park(request_id, request, decision, fleet, now)
