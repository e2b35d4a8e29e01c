"""Waking the parking lot: admit the parked requests that fit now, in their turn, and shed those that can no longer
wait. Sans-I/O, time passed in.

A wake first serves the tenants owed reserved slots (``_wake_reserved``), then each model's classes, critical before
standard: the class's head (turns.py's order) is decided; a head that does not fit stops its model's wake, except one
that declines a free slot (``Decision.idle_slot``: it finishes sooner on a busy engine, or no free engine meets its
deadline), which is passed over, at most ``backfill_scan`` a wake. With ``policy.backfill`` a blocked head lets later
requests that finish before it could start go first (EASY backfilling). **Adaptive LIFO** (``lifo_after_ms``): a class
whose oldest request waited longer than that, none of it committed, is served newest first. A woken head's TTFT
deadline counts from its arrival; a committed head whose deadline passed is decided without it (served late, not shed).
A head the fleet can no longer serve (drained, a raised floor, the model gone) is answered at once. ``expire_parked``
sheds every request ``due`` and every one still inside its decision window that ``_too_late`` says would start too late.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import replace

from controlplane.core import reserve
from controlplane.core.explain import earliest_fit
from controlplane.core.fleet import Fleet
from controlplane.core.lot import PARK_CLASSES, tenant_of
from controlplane.core.model import InferenceRequest, Outcome, Parked, Priority, QueueRule, Reason, Verdict
from controlplane.core.turns import Turns
from controlplane.core.waits import retry_after, shed


class Waking(Turns):
    def wake(self, fleet: Fleet, now: float, models: Iterable[str] | None = None) -> list[Outcome]:
        """Admit parked heads that fit ``fleet`` now, in order (the core refreshes the fleet after each admission)."""
        current = [fleet]

        def fleet_of() -> Fleet:
            return current[0]

        def refresh() -> None:
            current[0] = self.refreshed(current[0], now)

        out: list[Outcome] = []
        for model in list(models) if models is not None else self.lot.models():
            queues = self.lot.queues(model)
            if not queues:
                continue
            skipped: set[str] = set()  # owed tenants whose next request decide did not admit: they hold nothing now
            if self.policy.fairness.reserved:
                out.extend(self._wake_reserved(model, queues, fleet_of, refresh, now, skipped))
            for klass in PARK_CLASSES:
                queue = queues[klass]
                blocked = False
                # The mode holds for the whole wake: one class's admissions are all oldest-first or all newest-first.
                lifo = self._lifo(queue, now) and not any(self._committed(p, now) for p in queue)
                passed = 0  # heads that will not take a free slot: left parked, passed over
                passed_ids: set[str] = set()
                waiting: Counter[str] = Counter()  # the engines the passed heads wait for (each takes a slot there first)
                fair = self.policy.fairness.enabled
                while passed < len(queue):
                    order: list[Parked] | None = None
                    if fair:  # the order moves with every admission's charge
                        order = [p for p in self._order(model, queue, lifo) if p.request_id not in passed_ids]
                        head = order[0]
                    else:
                        head = queue[len(queue) - 1 - passed if lifo else passed]
                    committed = self._committed(head, now)
                    request = _as_woken(head, now, committed)
                    behind = self.depth(model) - 1 - passed  # every other parked request but the heads passed over
                    decision = self._decide(request, fleet_of(), now, behind=behind, waiting=waiting)
                    if committed and decision.reason is Reason.TTFT_UNMEETABLE:
                        request = _without_deadline(request)
                        decision = self._decide(request, fleet_of(), now, behind=behind, waiting=waiting)
                    if decision.verdict is Verdict.PARK and decision.idle_slot and passed < self.policy.backfill_scan:
                        self.lot.note_passable(head.request_id, self._frees, decision.waits_for)
                        if decision.waits_for is not None:
                            waiting[decision.waits_for] += 1
                        passed += 1
                        passed_ids.add(head.request_id)
                        continue
                    self.lot.forget_passable(head.request_id)
                    if decision.verdict is Verdict.ADMIT and not self._may_take(head.request, fleet_of(), now,
                                                                                skipped):
                        decision = self._held(head.request, model)
                    if decision.verdict is Verdict.PARK:
                        blocked = True
                        if self.policy.backfill:
                            out.extend(self._backfill(model, klass, head, fleet_of, refresh, now, lifo,
                                                      None if order is None else order[1:]))
                        break
                    self.lot.take(head)
                    if decision.verdict is Verdict.ADMIT:
                        # Past a passed-over head the line is not the store's to check (as backfill): that head stays.
                        rule = QueueRule.NONE if passed else self._fair_rule(lifo) if fair else \
                            QueueRule.NEWEST if lifo else QueueRule.OLDEST
                        out.append(self._admit(head.request_id, head.request, decision, now, now - head.parked_at,
                                               rule, head))
                        refresh()
                    else:  # answered without a place; ``parked`` takes it out of the shared line too
                        out.append(Outcome(head.request_id, decision, parked_for=now - head.parked_at, parked=head))
                if blocked:
                    break  # critical before standard: a blocked critical head holds the standard class too
        return out

    def _fair_rule(self, lifo: bool) -> QueueRule:
        """A fair wake's check against the shared line: the store's fair pick (``FAIR``, newest-first under adaptive
        LIFO), or with ``fairness.across_replicas`` off higher classes only (``CLASS``: the lot's order stands)."""
        if not self.policy.fairness.across_replicas:
            return QueueRule.CLASS
        return QueueRule.FAIR_NEWEST if lifo else QueueRule.FAIR

    def _wake_reserved(self, model: str, queues: dict[Priority, deque[Parked]], fleet_of: Callable[[], Fleet],
                       refresh: Callable[[], None], now: float, skipped: set[str]) -> list[Outcome]:
        """A wake's first pass (reserve.py): while a slot is free and a tenant is owed slots, its next request (the
        owed tenants' highest class first, then the class's order) is admitted if ``decide`` admits it, passing the
        line (``QueueRule.NONE``); a tenant whose request is not admitted joins ``skipped``."""
        out: list[Outcome] = []
        while True:
            fleet = fleet_of()
            owed = self.owed(model, fleet, now, skipped)
            if not owed or reserve.slots(fleet, model)[1] <= 0:
                return out
            head = next(p for k in PARK_CLASSES for p in self._order(model, queues[k]) if tenant_of(p.request) in owed)
            request = _as_woken(head, now, self._committed(head, now))
            decision = self._decide(request, fleet, now)
            if decision.verdict is not Verdict.ADMIT:
                skipped.add(tenant_of(head.request))
                if decision.verdict is Verdict.PARK and decision.idle_slot:  # as the wake notes a head it passes
                    self.lot.note_passable(head.request_id, self._frees, decision.waits_for)
                continue
            self.lot.take(head)
            out.append(self._admit(head.request_id, head.request, decision, now, now - head.parked_at,
                                   QueueRule.NONE, head))
            refresh()

    def _backfill(self, model: str, klass: Priority, head: Parked, fleet_of: Callable[[], Fleet],
                  refresh: Callable[[], None], now: float, lifo: bool = False,
                  behind: list[Parked] | None = None) -> list[Outcome]:
        """EASY backfilling behind a blocked head: admit a later request of the class that fits now and is expected to
        finish before the head could start (under adaptive LIFO "later" means older; under fair share, ``behind``: the
        requests after the head in the fair order)."""
        head_start = earliest_fit(head.request, fleet_of(), self.policy, now)
        if head_start is None:
            return []
        out = []
        queue = self.lot.line(model, klass)
        order = (list(reversed(queue)) if lifo else list(queue))[1:] if behind is None else behind
        for parked in order[:self.policy.backfill_scan]:
            decision = self._decide(parked.request, fleet_of(), now)
            if decision.verdict is Verdict.ADMIT and decision.expected_done_at <= head_start \
                    and self._may_take(parked.request, fleet_of(), now):
                self.lot.take(parked)
                out.append(self._admit(parked.request_id, parked.request, decision, now, now - parked.parked_at,
                                       QueueRule.NONE, parked))
                refresh()
        return out

    def _lifo(self, queue: deque[Parked], now: float) -> bool:
        """Whether a wake serves ``queue`` newest first: its oldest request has waited longer than ``lifo_after_ms``, or
        longer than ``lifo_deadline_fraction`` of its own TTFT deadline (decision 0013)."""
        limit = self.policy.lifo_after_ms
        if limit <= 0 or not queue:
            return False
        oldest = queue[0]
        waited_ms = (now - oldest.parked_at) * 1000
        deadline_ms = oldest.request.max_ttft_ms
        fraction = self.policy.lifo_deadline_fraction
        return waited_ms > limit or bool(deadline_ms and fraction and waited_ms > deadline_ms * fraction)

    def expire_parked(self, fleet: Fleet, now: float) -> list[Outcome]:
        """The park sweep: shed every parked request ``due`` now (``ttft_unmeetable`` or ``park_timeout``), and every
        request still inside its decision window that ``_too_late`` sheds. Each outcome carries its ``parked`` entry,
        for the shell to take it out of the shared line."""
        out = []
        due = {p.request_id for p in self.due(now)}
        for model in self.lot.models():
            queues = self.lot.queues(model)
            assert queues is not None
            ahead = 0
            for klass in PARK_CLASSES:
                for parked in self._order(model, queues[klass]):
                    decision = None
                    if parked.request_id in due:
                        candidates = [e for e in fleet.engines if e.serves(model)]
                        wait = retry_after(candidates, fleet, self.policy, now, ahead)
                        if parked.ttft_bound and not self._committed(parked, now):
                            decision = shed(Reason.TTFT_UNMEETABLE, f"no slot for {model} in time to meet "
                                            f"{parked.request.max_ttft_ms} ms", wait)
                        else:
                            decision = shed(Reason.PARK_TIMEOUT,
                                            f"no capacity for {model} within {self.policy.max_park_s:g} s", wait)
                    elif not self._committed(parked, now):
                        decision = self._too_late(parked, ahead, fleet, now)
                        if decision is not None and self._preempting(parked, decision, fleet, now) is not None:
                            decision = None
                    if decision is None:
                        ahead += 1
                        continue
                    self.cancel(parked.request_id)
                    out.append(Outcome(parked.request_id, decision, parked_for=now - parked.parked_at, parked=parked))
        return out


def _as_woken(head: Parked, now: float, committed: bool) -> InferenceRequest:
    """A parked request as a wake decides it: the deadline counts from arrival, so what is left of it is what the wake
    can still promise (at least 1 ms); a committed request whose deadline has passed has none."""
    request = head.request
    if request.max_ttft_ms:
        left = request.max_ttft_ms - int((now - head.parked_at) * 1000)
        request = replace(request, max_ttft_ms=max(1, left))
        if committed and left <= 0:
            request = _without_deadline(request)
    return request


def _without_deadline(request: InferenceRequest) -> InferenceRequest:
    """``request`` as if it had no TTFT deadline (a committed request whose deadline passed)."""
    return replace(request, max_ttft_ms=None, ttft_headroom_ms=0)
