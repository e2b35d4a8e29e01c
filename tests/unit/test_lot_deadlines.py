"""A parked request with a TTFT deadline that no free slot can meet does not hold the line (core/admission.py wake):
issue 9's ``bench steady`` deadline mix at 110% ran its engines at 59% while heads that could not use a free slot in
time waited there to be shed."""

from __future__ import annotations

from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.model import QueueRule, Reason, Verdict
from controlplane.core.policy import Policy
from tests.unit.coreinputs import chat, engine

POLICY = Policy(band_margin_ms=0)
VIEWS = [engine("fast", seqs=1, prefill=10_000.0, decode=50.0), engine("slow", seqs=1, prefill=500.0, decode=20.0)]


def test_a_head_that_cannot_use_the_free_slot_in_time_is_passed_over() -> None:
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    holder = core.check("holder", chat(prompt=100, max_tokens=40), core.fleet(VIEWS[:1], 0.0), 0.0)
    assert holder.ticket is not None and holder.ticket.engine == "fast"  # fast is expected busy for about 0.8 s
    # 1000 prompt tokens within 1.5 s: 2 s of prefill on slow (free), 0.1 s on fast once its slot frees (expected in
    # time: it parks rather than being refused at once).
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
    # LIFO reorders only requests inside their decision window (none is committed): a window of 5 s here.
    core = AdmissionCore(Policy(band_margin_ms=0, lifo_after_ms=2000, lifo_deadline_fraction=0.5, shed_decision_s=5),
                         Ledger(lease_seconds=600))
    # Short answers (0.8 s for the holder, 0.4 s each after): every request is expected to start within its deadline.
    assert core.check("holder", chat(prompt=100, max_tokens=40), core.fleet(views, 0.0), 0.0).ticket is not None
    for rid, at in (("older", 0.1), ("newer", 0.6)):
        parked = core.check(rid, chat(prompt=100, max_tokens=20, ttft_ms=2000), core.fleet(views, at), at)
        assert parked.decision.verdict is Verdict.PARK
    core.release("holder", 0.9)  # the oldest has waited 0.8 s of its 2 s: FIFO still
    assert [o.request_id for o in core.wake(core.fleet(views, 0.9), 0.9)] == ["older"]
    newest = core.check("newest", chat(prompt=100, max_tokens=20, ttft_ms=2000), core.fleet(views, 1.0), 1.0)
    assert newest.decision.verdict is Verdict.PARK
    core.release("older", 1.7)  # "newer" has waited 1.1 s, over half its deadline: newest first
    assert [o.request_id for o in core.wake(core.fleet(views, 1.7), 1.7)] == ["newest"]


def test_a_committed_request_whose_deadline_passes_is_served_late_not_shed() -> None:
    """"Shed early": a request with a TTFT deadline is refused only inside its decision window. This one is expected to
    start in time (the holder's 40 tokens take 0.8 s), so it parks; the holder runs on past its deadline. The sweep
    never sheds it once it is committed (1 s), and when the slot frees at 3 s it is admitted, late, rather than
    answered 503 after a 2.9 s wait. A request whose deadline passes inside its window is still shed then."""
    views = [engine("only", seqs=1, prefill=10_000.0, decode=50.0)]
    core = AdmissionCore(POLICY, Ledger(lease_seconds=600))
    assert core.check("holder", chat(prompt=100, max_tokens=40), core.fleet(views, 0.0), 0.0).ticket is not None
    hurried = core.check("hurried", chat(prompt=100, max_tokens=20, ttft_ms=1000), core.fleet(views, 0.05), 0.05)
    patient = core.check("patient", chat(prompt=100, max_tokens=20, ttft_ms=2000), core.fleet(views, 0.1), 0.1)
    assert hurried.decision.verdict is patient.decision.verdict is Verdict.PARK
    shed = []
    for tick in range(2, 30):
        shed += core.expire_parked(core.fleet(views, tick / 10), tick / 10)
    assert [(o.request_id, o.decision.reason) for o in shed] == [("hurried", Reason.TTFT_UNMEETABLE)]
    assert shed[0].parked_for < POLICY.shed_decision_s
    core.release("holder", 3.0)
    woken = core.wake(core.fleet(views, 3.0), 3.0)
    assert [(o.request_id, o.ticket is not None) for o in woken] == [("patient", True)]
    assert woken[0].parked_for > 2.0  # past its 2 s deadline: served late
