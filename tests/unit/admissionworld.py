"""The admission state machine under random steps, for the property tests: ``World`` applies the steps ``op`` draws
(bursts of requests of every priority, with and without a TTFT deadline, some sticky; releases, probes, cancellations
and ticks) to one ``AdmissionCore`` over three engines (one below the version floor) and checks the admission rules after
each step; ``run_and_drain`` applies a list of steps, checks that every request was answered once or is still parked,
then releases until the lot is empty."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from controlplane.core.admission import AdmissionCore
from controlplane.core.model import InferenceRequest, Outcome, Priority, Reason, Verdict
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import Fleet
from controlplane.core.policy import Policy
from controlplane.core.shedearly import ANSWER_MARGIN_S, committed as is_committed

CAPACITY = 20_000
ENGINES = (
    ("a", 2, "0.10.1"),
    ("b", 3, "0.11.0"),
    ("old", 4, "0.8.0"),  # below the floor: must never get a ticket
)
POLICY = Policy(kv_high_watermark=0.9, default_max_tokens=500, max_park_s=30, max_queue_depth=6,
                version_floors=(("cortex", "0.10"),), lifo_after_ms=5000)
"""Ticks of 0.1-40 s put a class's oldest parked request on both sides of the adaptive-LIFO threshold."""

op = st.one_of(
    # A burst of n identical requests: saturation (caps, KV, parking) needs several arrivals between releases.
    # With the default prefill anchor (1000 tokens/s) a prompt's idle TTFT is 0.1, 0.8, 3 or 9 s: the deadlines below are
    # met at once, met only after a slot frees, or never.
    st.tuples(st.just("submit"), st.sampled_from([100, 800, 3_000, 9_000]), st.sampled_from(list(Priority)),
              st.integers(1, 8), st.sampled_from([None, None, 500, 2_500, 10_000, 60_000]),
              st.sampled_from([None, None, "s1", "s2"])),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("probe"), st.sampled_from([e[0] for e in ENGINES])),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.floats(0.1, 40.0)),
)


class World:
    def __init__(self, policy: Policy = POLICY) -> None:
        self.now = 0.0
        self.core = AdmissionCore(policy, Ledger(lease_seconds=100))
        self.views = {
            name: EngineView(name=name, url="", max_num_seqs=cap, models=(ServedModel("cortex", 32_768),),
                             version=version, sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0,
                                                                  kv_capacity_tokens=CAPACITY),
                             last_ok_at=0.0, stale=False, chip_class=name,
                             # The policy's default rates, as anchors: estimates the core may act on (shed early).
                             anchor_prefill_tokens_per_s=1000.0, anchor_decode_tokens_per_s=20.0)
            for name, cap, version in ENGINES
        }
        self.tickets: dict[str, tuple[str, int]] = {}  # open ticket -> (engine, prompt tokens it really uses)
        self.parked_order: dict[Priority, list[str]] = {Priority.CRITICAL: [], Priority.STANDARD: []}
        self.admitted_from_park: dict[Priority, list[str]] = {Priority.CRITICAL: [], Priority.STANDARD: []}
        self.requests: dict[str, InferenceRequest] = {}
        self.answered: set[str] = set()
        self.seq = 0

    def fleet(self) -> Fleet:
        return self.core.fleet(self.views.values(), self.now)

    def wake(self) -> list[Outcome]:
        """``core.wake``, checking each class's order: while its oldest parked request has waited no longer than
        ``lifo_after_ms`` (nor ``lifo_deadline_fraction`` of its own TTFT deadline), or any of its requests is committed
        (``shedearly.committed``: parked past its decision window less the answer margin), the wake answers the oldest
        first (FIFO); else the newest first (adaptive LIFO)."""
        before: dict[Priority, list[str]] = {Priority.CRITICAL: [], Priority.STANDARD: []}
        oldest: dict[Priority, tuple[float, int | None]] = {}
        committed: set[Priority] = set()
        for p in self.core.parked():  # per class, in parking order
            before[p.request.priority].append(p.request_id)
            oldest.setdefault(p.request.priority, (p.parked_at, p.request.max_ttft_ms))
            if is_committed(p, self.now, self.core.policy):  # its window less the answer margin (shedearly.py)
                committed.add(p.request.priority)
        outcomes = self.core.wake(self.fleet(), self.now)
        if not self.core.policy.backfill:  # backfill reorders on purpose
            limit, fraction = self.core.policy.lifo_after_ms, self.core.policy.lifo_deadline_fraction
            # A head passed over (a TTFT deadline no free slot can meet, or it waits for a busy engine that finishes it
            # sooner, e.g. its prefix's holders) stays parked (wake): the order holds among the others.
            still = {p.request_id for p in self.core.parked()
                     if p.request.max_ttft_ms or self.core.passed_over(p.request_id)}
            for klass, order in before.items():
                answered = [o.request_id for o in outcomes if o.request_id in order]
                waited_ms = (self.now - oldest[klass][0]) * 1000 if klass in oldest else 0.0
                deadline_ms = oldest[klass][1] if klass in oldest else None
                lifo = limit > 0 and klass in oldest and klass not in committed and (
                    waited_ms > limit or bool(deadline_ms and fraction and waited_ms > deadline_ms * fraction))
                expected = [r for r in (order[::-1] if lifo else order) if r not in still][:len(answered)]
                assert answered == expected, f"{klass} {'LIFO' if lifo else 'FIFO'} order broken"
        return outcomes

    def settle(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            assert o.request_id not in self.answered, "one request, one answer"
            self.answered.add(o.request_id)
            window = self.core.policy.shed_decision_s
            if o.ticket is not None:
                self.tickets[o.ticket.ticket_id] = (o.ticket.engine, o.ticket.reserved_tokens - 500)
                request = self.requests[o.request_id]
                if o.parked_for > 0 and request.priority in self.admitted_from_park:
                    self.admitted_from_park[request.priority].append(o.request_id)
                if request.max_ttft_ms is not None and o.parked_for < window - ANSWER_MARGIN_S:
                    # Admitted only with an estimated TTFT inside what is left of the deadline (whole milliseconds). A
                    # committed request (parked past its window less the answer margin, shedearly.committed) that can
                    # no longer meet its deadline is served late rather than shed.
                    assert o.parked_for + o.decision.expected_ttft_s <= request.max_ttft_ms / 1000 + 0.001, \
                        f"{o.request_id} admitted past its {request.max_ttft_ms} ms deadline"
            elif o.decision.verdict is Verdict.SHED:
                if o.decision.reason is Reason.TTFT_UNMEETABLE:
                    assert self.requests[o.request_id].max_ttft_ms is not None, "ttft_unmeetable without a deadline"
                # Shed early: inside its decision window, or at max_park_s (the backstop), never in between.
                assert o.parked_for < window or (o.decision.reason is Reason.PARK_TIMEOUT
                                                 and o.parked_for >= self.core.policy.max_park_s), \
                    f"{o.request_id} shed {o.decision.reason.value} after {o.parked_for:.2f} s parked"
        self.check_invariants()

    def check_invariants(self) -> None:
        ledger = self.core.ledger
        for name, cap, _ in ENGINES:
            view = ledger.view(name)
            assert view.open_tickets <= cap, f"{name} over its cap"
            assert view.committed_tokens <= CAPACITY * POLICY.kv_high_watermark, f"{name} KV double-spent"
        assert ledger.view("old").open_tickets == 0, "a below-floor engine got a ticket"
        assert self.core.depth("cortex") <= POLICY.max_queue_depth, "parking lot deeper than its bound"
        assert ledger.admitted_total == ledger.open_tickets() + ledger.released_total + ledger.expired_total
        assert ledger.open_tickets() == len([t for t in self.tickets if ledger.get(t)])

    def submit(self, prompt_tokens: int, priority: Priority, max_ttft_ms: int | None, session: str | None) -> None:
        self.now += 0.001  # the control plane's clock is monotonic: no two events share an instant
        self.seq += 1
        rid = f"r{self.seq}"
        request = InferenceRequest("POST", "/v1/chat/completions", "cortex", prompt_tokens=prompt_tokens,
                                   max_tokens=500, priority=priority, max_ttft_ms=max_ttft_ms, session=session,
                                   prefix_blocks=self.blocks(prompt_tokens, session))
        self.requests[rid] = request
        outcome = self.core.check(rid, request, self.fleet(), self.now)
        if outcome.decision.verdict is Verdict.PARK:
            assert priority is not Priority.SHEDDABLE, "sheddable requests are shed, never parked"
            self.parked_order[priority].append(rid)
            self.check_invariants()
        else:
            self.settle([outcome])

    def blocks(self, prompt_tokens: int, session: str | None) -> tuple[int, ...]:
        """The prompt's prefix blocks (none here: see test_prefix_properties.py)."""
        return ()

    def apply(self, step: tuple[Any, ...]) -> None:
        self.now += 0.001
        kind = step[0]
        if kind == "submit":
            for _ in range(step[3]):
                self.submit(step[1], step[2], step[4], step[5])
        elif kind == "release":
            open_ids = [t for t in self.tickets if self.core.ledger.get(t)]
            if open_ids:
                ticket = open_ids[step[1] % len(open_ids)]
                self.core.release(ticket, self.now)
                self.settle(self.wake())
        elif kind == "probe":
            name = step[1]
            held = [(e, used) for t, (e, used) in self.tickets.items() if e == name and self.core.ledger.get(t)]
            sample = EngineSample(self.now, running=len(held), waiting=0, kv_usage=sum(u for _, u in held) / CAPACITY,
                                  kv_capacity_tokens=CAPACITY)
            self.views[name] = replace(self.views[name], sample=sample, last_ok_at=self.now)
            self.core.note_probe(name, self.now, idle=False, idle_grace_s=0.0)
            self.settle(self.wake())
        elif kind == "cancel":
            parked = self.core.parked()
            if parked:
                victim = parked[step[1] % len(parked)].request_id
                assert self.core.cancel(victim)
                self.answered.add(victim)
                for order in self.parked_order.values():
                    if victim in order:
                        order.remove(victim)
                self.check_invariants()
        else:
            self.now += step[1]
            self.core.expire_leases(self.now)
            for name in self.views:  # keep probes fresh so staleness does not mask the rules under test
                self.views[name] = replace(self.views[name], last_ok_at=self.now)
            expired = self.core.expire_parked(self.fleet(), self.now)
            for o in expired:
                assert o.decision.verdict is Verdict.SHED and 1 <= (o.decision.retry_after_s or 0) <= 60
                for order in self.parked_order.values():
                    if o.request_id in order:
                        order.remove(o.request_id)
            self.settle(expired)
            self.settle(self.wake())


def run_and_drain(world: World, steps: list[tuple[Any, ...]]) -> World:
    for step in steps:
        world.apply(step)
    # Every request is answered exactly once or still parked; nothing is both.
    parked_now = {p.request_id for p in world.core.parked()}
    assert not parked_now & world.answered
    assert len(parked_now) + len(world.answered) == world.seq
    # Drain: finish every request, repeatedly, until the lot is empty. Every parked request fits an idle fleet.
    for _ in range(world.seq + 1):
        for ticket in [t for t in world.tickets if world.core.ledger.get(t)]:
            world.now += 0.001
            world.core.release(ticket, world.now)
        world.now += 0.001
        world.settle(world.wake())
    assert not world.core.parked(), "a parked request was never admitted although the fleet went idle"
    return world
