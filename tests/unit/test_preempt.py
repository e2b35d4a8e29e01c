"""Preemption of sheddable work (core/preempt.py, decision 0028): a critical request that shed early would refuse ends
running sheddable streams instead, the least work lost first, when the option is on, within the rate bound, and only
streams the shell can end (attached). Never critical or standard work, never with the option off."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane.config import ConfigError, parse_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.fairshare import FairShare
from controlplane.core.ledger import Ledger
from controlplane.core.model import Reason, Ticket, Verdict
from controlplane.core.policy import Policy
from controlplane.core.eventwindow import EventWindow
from controlplane.core.preempt import choose_victims, work_lost
from tests.unit.coreinputs import chat, engine

ON = Policy(fairness=FairShare(preempt_sheddable=True, preempt_max_per_minute=2))
VIEWS = [engine("e", seqs=2)]
LONG = 2000
"""Output tokens of each running stream: 100 s at 20 tokens/s, far past any deadline here."""


def running(core: AdmissionCore, priorities: tuple[str, ...] = ("sheddable", "sheddable"), attach: bool = True,
            at: tuple[float, ...] = (0.0, 1.0), prefix: str = "s") -> list[Ticket]:
    """Fill ``e``'s two slots with long streams (admitted at ``at``), their streams attached when ``attach``."""
    tickets = []
    for i, (priority, when) in enumerate(zip(priorities, at)):
        outcome = core.check(f"{prefix}{i}", chat(max_tokens=LONG, priority=priority), core.fleet(VIEWS, when), when)
        assert outcome.ticket is not None, outcome.decision
        tickets.append(outcome.ticket)
        if attach:
            core.preemptible.attach(outcome.ticket.ticket_id)
    return tickets


def urgent(core: AdmissionCore, now: float, name: str = "c", priority: str = "critical") -> Verdict:
    return core.check(name, chat(ttft_ms=500, priority=priority), core.fleet(VIEWS, now), now).decision.verdict


@pytest.mark.parametrize(("policy", "priorities", "attach", "asked", "preempts"), [
    (ON, ("sheddable", "sheddable"), True, "critical", True),
    (Policy(), ("sheddable", "sheddable"), True, "critical", False),
    (ON, ("standard", "standard"), True, "critical", False),
    (ON, ("critical", "sheddable"), False, "critical", False),
    (ON, ("sheddable", "sheddable"), True, "standard", False),
], ids=["on-sheddable-running", "option-off", "standard-running", "streams-not-attached", "standard-asks"])
def test_when_a_critical_request_preempts(policy: Policy, priorities: tuple[str, ...], attach: bool, asked: str,
                                          preempts: bool) -> None:
    core = AdmissionCore(policy, Ledger(lease_seconds=600))
    tickets = running(core, priorities, attach)
    verdict = urgent(core, 2.0, priority=asked)
    done = core.take_preemptions()
    if preempts:
        assert verdict is Verdict.PARK and [p.victims for p in done] == [(tickets[1],)]  # the younger: least work lost
        assert done[0].engine == "e" and done[0].request_id == "c" and done[0].retry_after_s >= 1
    else:
        assert verdict is Verdict.SHED and done == []


def test_a_critical_request_takes_the_slot_its_victim_frees() -> None:
    core = AdmissionCore(ON, Ledger(lease_seconds=600))
    running(core)
    outcome = core.check("c", chat(ttft_ms=500, priority="critical"), core.fleet(VIEWS, 2.0), 2.0)
    assert outcome.decision.reason is Reason.PREEMPTING
    victim = core.take_preemptions()[0].victims[0]
    # The sweep does not shed it early while its victim ends (shed early alone would).
    assert core.expire_parked(core.fleet(VIEWS, 2.1), 2.1) == [] and core.take_preemptions() == []
    core.release(victim.ticket_id, 2.2)
    woken = core.wake(core.fleet(VIEWS, 2.2), 2.2)
    assert [(o.request_id, o.decision.verdict, o.decision.engine) for o in woken] == [("c", Verdict.ADMIT, "e")]


def test_preemptions_are_rate_bounded() -> None:
    core = AdmissionCore(replace(ON, fairness=replace(ON.fairness, preempt_max_per_minute=1)), Ledger(600))
    running(core)
    assert urgent(core, 2.0, "c1") is Verdict.PARK and len(core.take_preemptions()) == 1
    core.release("s1", 2.1)
    assert core.wake(core.fleet(VIEWS, 2.1), 2.1)[0].request_id == "c1"
    core.release("c1", 2.5)
    running(core, ("sheddable",), at=(3.0,), prefix="t")  # the slot is sheddable's again
    assert urgent(core, 30.0, "c2") is Verdict.SHED and core.take_preemptions() == []  # one a minute: spent at 2 s
    assert urgent(core, 62.5, "c3") is Verdict.PARK and len(core.take_preemptions()) == 1


def test_a_stream_is_ended_for_one_request_only() -> None:
    core = AdmissionCore(ON, Ledger(lease_seconds=600))
    tickets = running(core)
    assert urgent(core, 2.0, "c1") is Verdict.PARK and urgent(core, 2.0, "c2") is Verdict.PARK
    assert [p.victims for p in core.take_preemptions()] == [(tickets[1],), (tickets[0],)]


def test_released_and_detached_streams_are_never_victims() -> None:
    core = AdmissionCore(ON, Ledger(lease_seconds=600))
    tickets = running(core)
    core.preemptible.detach(tickets[1].ticket_id)
    assert urgent(core, 2.0, "c1") is Verdict.PARK
    assert [p.victims for p in core.take_preemptions()] == [(tickets[0],)]
    assert core.preemptible.attach(tickets[0].ticket_id)
    core.release(tickets[0].ticket_id, 2.1)
    assert not core.preemptible.attach(tickets[0].ticket_id)  # closed: its stream can no longer be attached


@pytest.mark.parametrize(("admitted_at", "expected_ttft_s", "rate", "now", "lost"), [
    (0.0, 0.5, 20.0, 10.0, 190.0),
    (0.0, 0.5, 20.0, 0.2, 0.0),
    (4.0, 0.0, 0.0, 10.0, 6.0),
], ids=["decoding", "still-prefilling", "no-rate-elapsed"])
def test_work_lost(admitted_at: float, expected_ttft_s: float, rate: float, now: float, lost: float) -> None:
    ticket = Ticket("t", "e", "cortex", admitted_at, 600.0, expected_ttft_s=expected_ttft_s, decode_tokens_per_s=rate)
    assert work_lost(ticket, now) == pytest.approx(lost)


def test_victims_are_added_until_the_kv_fits() -> None:
    """Slots free, KV full: ending one small stream is not enough for a large request, two are."""
    view = engine("e", seqs=8)
    core = AdmissionCore(ON, Ledger(lease_seconds=600))
    for i, tokens in enumerate((40_000, 20_000, 20_000)):
        core.ledger.admit(f"s{i}", "e", "cortex", float(i), reserved_tokens=tokens)
    fleet = core.fleet([view], 5.0)
    request = chat(prompt=10, max_tokens=40_000, priority="critical")
    tickets = sorted(core.ledger.tickets(), key=lambda t: t.ticket_id)
    found = choose_victims(request, fleet, ON, 5.0, tickets)
    assert found is not None and found[0] == "e"
    assert [t.ticket_id for t in found[1]] == ["s2", "s1"]  # the youngest first, both needed (held 80k, need 40k)


def test_the_budget_counts_a_sliding_minute() -> None:
    budget = EventWindow()
    for at in (0.0, 10.0):
        assert budget.allows(at, 2)
        budget.note(at)
    assert not budget.allows(59.9, 2) and budget.allows(60.0, 2) and budget.allows(70.1, 1)


def test_the_preview_says_preempting_and_ends_nothing() -> None:
    core = AdmissionCore(replace(ON, fairness=replace(ON.fairness, preempt_max_per_minute=1)), Ledger(600))
    running(core)
    seen = core.preview(chat(ttft_ms=500, priority="critical"), core.fleet(VIEWS, 2.0), 2.0)
    assert (seen.verdict, seen.reason) == (Verdict.PARK, Reason.PREEMPTING) and core.take_preemptions() == []
    assert urgent(core, 2.0) is Verdict.PARK and len(core.take_preemptions()) == 1  # the budget was not spent


def test_the_settings_are_read_and_bounded() -> None:
    engines = [{"name": "e", "url": "http://127.0.0.1:9"}]
    assert not parse_config({"engines": engines}).policy.fairness.preempt_sheddable  # off by default
    fairness = parse_config({"engines": engines, "fairness": {"preempt_sheddable": True, "preempt_max_per_minute": 3,
                                                              "preempt_grace_ms": 250}}).policy.fairness
    assert (fairness.preempt_sheddable, fairness.preempt_max_per_minute, fairness.preempt_grace_ms) == (True, 3, 250)
    with pytest.raises(ConfigError) as caught:
        parse_config({"engines": engines, "fairness": {"preempt_max_per_minute": 0, "preempt_grace_ms": 0}})
    assert {p.split(":")[0] for p in caught.value.problems} >= {"fairness.preempt_max_per_minute",
                                                                "fairness.preempt_grace_ms"}
