"""A parked request with a TTFT deadline that no free slot can meet does not hold the line (core/admission.py wake):
issue 9's ``bench steady`` deadline mix at 110% ran its engines at 59% while heads that could not use a free slot in
time waited there to be shed."""

from __future__ import annotations

from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.model import QueueRule, Reason, Verdict
from controlplane.core.policy import Policy
from tests.unit.test_route import chat, engine

POLICY = Policy(band_margin_ms=0)
VIEWS = [engine("fast", seqs=1, prefill=10_000.0, decode=50.0), engine("slow", seqs=1, prefill=500.0, decode=20.0)]


def test_a_head_that_cannot_use_the_free_slot_in_time_is_passed_over() -> None:
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    holder = core.check("holder", chat(prompt=100, max_tokens=200), core.fleet(VIEWS[:1], 0.0), 0.0)
    assert holder.ticket is not None and holder.ticket.engine == "fast"  # fast is busy for about 4 s
    # 1000 prompt tokens within 1.5 s: 2 s of prefill on slow (free), 0.1 s on fast once its slot frees.
    hurried = core.check("hurried", chat(prompt=1000, max_tokens=50, ttft_ms=1500), core.fleet(VIEWS, 0.1), 0.1)
    assert hurried.decision.verdict is Verdict.PARK and hurried.decision.idle_slot
    # The request without a deadline takes slow's free slot at once, past the hurried one, which still waits for fast
    # within its deadline.
    patient = core.check("patient", chat(prompt=100, max_tokens=50), core.fleet(VIEWS, 0.2), 0.2)
    assert (patient.ticket.engine if patient.ticket else None, patient.rule) == ("slow", QueueRule.NONE)
    assert [p.request_id for p in core.parked()] == ["hurried"]
    core.release("holder", 0.5)
    assert [(o.request_id, o.ticket.engine if o.ticket else None)
            for o in core.wake(core.fleet(VIEWS, 0.5), 0.5)] == [("hurried", "fast")]


def test_a_head_that_only_lacks_a_slot_still_holds_the_line() -> None:
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    for rid in ("a", "b"):
        assert core.check(rid, chat(prompt=100, max_tokens=200), core.fleet(VIEWS, 0.0), 0.0).ticket is not None
    first = core.check("first", chat(prompt=100, max_tokens=50, ttft_ms=60_000), core.fleet(VIEWS, 0.1), 0.1)
    assert first.decision.verdict is Verdict.PARK and not first.decision.idle_slot  # nothing is free
    core.check("second", chat(prompt=100, max_tokens=50), core.fleet(VIEWS, 0.2), 0.2)
    core.release("b", 1.0)
    assert [o.request_id for o in core.wake(core.fleet(VIEWS, 1.0), 1.0)] == ["first"]  # FIFO as ever


def test_deadline_traffic_turns_newest_first_past_half_the_deadline() -> None:
    """2 s deadlines are shed before ``lifo_after_ms`` (2 s) could ever pass: with ``lifo_deadline_fraction`` 0.5 (off
    by default) the lot turns LIFO once its oldest has used half its deadline, so a free slot goes to the request with the
    most time left, not the one about to expire."""
    views = [engine("only", seqs=1, prefill=10_000.0, decode=50.0)]
    core = AdmissionCore(Policy(band_margin_ms=0, lifo_after_ms=2000, lifo_deadline_fraction=0.5),
                         Ledger(lease_seconds=600))
    assert core.check("holder", chat(prompt=100, max_tokens=200), core.fleet(views, 0.0), 0.0).ticket is not None
    for rid, at in (("older", 0.1), ("newer", 0.6)):
        core.check(rid, chat(prompt=100, max_tokens=50, ttft_ms=2000), core.fleet(views, at), at)
    core.release("holder", 0.9)  # the oldest has waited 0.8 s of its 2 s: FIFO still
    assert [o.request_id for o in core.wake(core.fleet(views, 0.9), 0.9)] == ["older"]
    core.check("newest", chat(prompt=100, max_tokens=50, ttft_ms=2000), core.fleet(views, 1.0), 1.0)
    core.release("older", 1.7)  # "newer" has waited 1.1 s, over half its deadline: newest first
    assert [o.request_id for o in core.wake(core.fleet(views, 1.7), 1.7)] == ["newest"]
