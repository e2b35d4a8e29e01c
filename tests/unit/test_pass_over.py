"""A parked request waiting for a busy engine that finishes it sooner does not hold the line for the free slot it will not
take (core/admission.py, ``check`` and ``wake``): ``bench prefix``'s shared system prompts at 90% load had heads waiting
for the engine holding their prompt while every request behind them waited too, with other engines idle."""

from __future__ import annotations

from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.model import QueueRule, Reason, Verdict
from controlplane.core.policy import Policy
from tests.unit.coreinputs import FAST_AND_SLOW, busy_fast, chat


def test_an_arrival_takes_the_slot_a_waiting_head_refused() -> None:
    core = AdmissionCore(Policy(), Ledger(lease_seconds=600))
    busy_fast(core)
    head = core.check("head", chat(prompt=1000, max_tokens=200), core.fleet(FAST_AND_SLOW, 0.05), 0.05)
    assert (head.decision.verdict, head.decision.reason) == (Verdict.PARK, Reason.WAITING_FOR_FASTER)
    assert head.decision.idle_slot  # slow is free, and the head will not take it
    short = core.check("short", chat(prompt=10, max_tokens=20), core.fleet(FAST_AND_SLOW, 0.1), 0.1)
    assert (short.ticket.engine if short.ticket else None, short.rule) == ("slow", QueueRule.NONE)
    core.release("holder", 0.2)
    woken = core.wake(core.fleet(FAST_AND_SLOW, 0.2), 0.2)
    assert [(o.request_id, o.ticket.engine if o.ticket else None) for o in woken] == [("head", "fast")]


def test_a_request_passing_counts_the_heads_waiting_for_the_same_engine() -> None:
    """A second request like the head: fast frees in 0.15 s but the head takes it next for 4 s, so waiting for fast
    costs the second more than half its service there, and it takes slow's free slot instead (counted as first in
    line, it would have waited for fast too)."""
    core = AdmissionCore(Policy(), Ledger(lease_seconds=600))
    busy_fast(core)
    core.check("head", chat(prompt=1000, max_tokens=200), core.fleet(FAST_AND_SLOW, 0.05), 0.05)
    twin = core.check("twin", chat(prompt=1000, max_tokens=200), core.fleet(FAST_AND_SLOW, 0.06), 0.06)
    assert (twin.decision.reason, twin.ticket.engine if twin.ticket else None) == (Reason.WORK_CONSERVING, "slow")


def test_nobody_passes_a_head_between_a_release_and_the_wake_that_decides_it_again() -> None:
    """The slot just freed may be the one the head waits for: an arrival before the wake parks behind it."""
    core = AdmissionCore(Policy(), Ledger(lease_seconds=600))
    busy_fast(core)
    core.check("head", chat(prompt=1000, max_tokens=200), core.fleet(FAST_AND_SLOW, 0.05), 0.05)
    core.release("holder", 0.2)
    late = core.check("late", chat(prompt=1000, max_tokens=200), core.fleet(FAST_AND_SLOW, 0.21), 0.21)
    assert (late.decision.verdict, late.decision.reason) == (Verdict.PARK, Reason.QUEUED_BEHIND)
    woken = core.wake(core.fleet(FAST_AND_SLOW, 0.22), 0.22)
    assert [(o.request_id, o.ticket.engine if o.ticket else None) for o in woken][0] == ("head", "fast")


def test_a_head_blocked_by_a_full_fleet_still_holds_the_line() -> None:
    core = AdmissionCore(Policy(), Ledger(lease_seconds=600))
    # Holders of 150 tokens (3 s on fast): both parked requests are expected to start within the 4 s overload bound.
    for rid in ("a", "b"):
        assert core.check(rid, chat(prompt=10, max_tokens=150), core.fleet(FAST_AND_SLOW, 0.0), 0.0).ticket is not None
    first = core.check("first", chat(prompt=10, max_tokens=20), core.fleet(FAST_AND_SLOW, 0.1), 0.1)
    assert first.decision.verdict is Verdict.PARK and not first.decision.idle_slot  # nothing is free
    second = core.check("second", chat(prompt=10, max_tokens=20), core.fleet(FAST_AND_SLOW, 0.2), 0.2)
    assert second.decision.reason is Reason.QUEUED_BEHIND
