"""The ledger mirror's rules alone (controlplane/admission/mirror.py): no store, no event loop. What a replica sends to
the shared store, and what the store's answers and events change here, as plain calls with time passed in."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

from controlplane.admission.mirror import LINE_BATCH, LedgerMirror, LineQueue, Settlement
from controlplane.config import Config, StoreOnFailure, load_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import Fleet
from controlplane.core.ledger import Ledger
from controlplane.core.model import InferenceRequest, Outcome, QueueRule, Ticket, Verdict
from controlplane.store.base import Claim, EventKind, LineChange, Refusal, Reserved, SharedClock, StoreEvent

ENGINE = EngineView(name="e", url="", max_num_seqs=1, models=(ServedModel("m", 32_768),), version="1.0",
                    sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000),
                    last_ok_at=0.0, stale=False, chip_class="e")
"""One engine (one slot unless a test says otherwise: a second request parks)."""

REQUEST = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=10, max_tokens=10)
SHARED = SharedClock(offset=1_000.0)


class Views:
    def __init__(self, core: AdmissionCore, cap: int) -> None:
        self.core = core
        self.engine = replace(ENGINE, max_num_seqs=cap)

    def view_of(self, engine: str, now: float) -> EngineView | None:
        return self.engine if engine == self.engine.name else None

    def fleet(self, now: float) -> Fleet:
        return self.core.fleet([self.engine], now)


def mirror(on_failure: StoreOnFailure = StoreOnFailure.OPEN, cap: int = 1) -> LedgerMirror:
    base = load_config(None)
    config: Config = replace(base, policy=replace(base.policy, lifo_after_ms=0, backfill=False),
                             store=replace(base.store, on_failure=on_failure))
    core = AdmissionCore(config.policy, Ledger(lease_seconds=600))
    return LedgerMirror(config, core, Views(core, cap), "here", SHARED)


def admit(m: LedgerMirror, request_id: str, now: float) -> Outcome:
    outcome = m.core.check(request_id, REQUEST, m.views.fleet(now), now)
    assert outcome.ticket is not None, outcome.decision
    return outcome


def park(m: LedgerMirror, request_id: str, now: float, ahead_elsewhere: int = 0) -> None:
    outcome = m.core.check(request_id, REQUEST, m.views.fleet(now), now, ahead_elsewhere)
    assert outcome.decision.verdict is Verdict.PARK


def elsewhere(ticket_id: str, now: float) -> Ticket:
    """Another replica's ticket on the engine, in shared time."""
    return Ticket(ticket_id, ENGINE.name, "m", SHARED.offset + now, SHARED.offset + now + 600, 20,
                  SHARED.offset + now + 1, 0.1)


def change(request_id: str) -> LineChange:
    return LineChange("m", 1, request_id, 0.0)


def test_parks_asked_while_a_batch_is_out_go_in_the_next_batch_in_their_order() -> None:
    lines: LineQueue[str] = LineQueue()
    lines.ask(change("a"), "a")
    assert [w for _, w in lines.next_batch()] == ["a"]  # on its way
    assert not lines
    for rid in ("b", "c", "d"):
        lines.ask(change(rid), rid)
    assert [c.request_id for c, _ in lines.next_batch()] == ["b", "c", "d"]
    for i in range(LINE_BATCH + 3):
        lines.ask(change(f"q{i}"), f"q{i}")
    first, second = lines.next_batch(), lines.next_batch()
    assert [w for _, w in first + second] == [f"q{i}" for i in range(LINE_BATCH + 3)]
    assert len(first) == LINE_BATCH and not lines


def test_a_store_event_for_a_released_ticket_frees_its_slot_and_wakes_its_model() -> None:
    m = mirror()
    heard = m.heard(StoreEvent(EventKind.ADMITTED, "other", "t", elsewhere("t", 0.0), model="m"), 0.0)
    assert m.core.ledger.get("t") is not None and heard.wake == ()  # nothing parked here: nothing to wake
    park(m, "p", 0.1)  # the engine's one slot is the other replica's
    heard = m.heard(StoreEvent(EventKind.RELEASED, "other", "t", model="m"), 0.2)
    assert m.core.ledger.get("t") is None and heard.wake == ("m",)
    assert [o.request_id for o in m.core.wake(m.views.fleet(0.3), 0.3) if o.ticket is not None] == ["p"]


def test_a_ticket_released_here_never_comes_back_from_a_late_event_or_a_refusal() -> None:
    m = mirror()
    admitted = admit(m, "t", 0.0)
    assert admitted.ticket is not None
    m.core.release("t", 0.1)
    assert m.release("t")  # the store is told
    shared = SHARED.to_shared(admitted.ticket)
    m.heard(StoreEvent(EventKind.ADMITTED, "other", "t", shared, model="m"), 0.2)  # its own event, read late
    m.learn_held(Reserved(Refusal.CAP, (shared,)), 0.2)  # a refusal decided before the release, read after it
    assert m.core.ledger.get("t") is None
    m.release_landed("t", sent=True)
    m.learn_held(Reserved(Refusal.CAP, (shared,)), 0.3)
    assert m.core.ledger.get("t") is None


def test_with_the_store_unreachable_open_keeps_the_admission_and_closed_undoes_it() -> None:
    kept = mirror(StoreOnFailure.OPEN)
    outcome = admit(kept, "t", 0.0)
    assert kept.reserved(outcome, None, 0.0, 0.0).ok and kept.core.ledger.get("t") is not None
    assert not kept.release("t")  # the store never had it: nothing to send
    undone = mirror(StoreOnFailure.CLOSED)
    outcome = admit(undone, "t", 0.0)
    assert undone.reserved(outcome, None, 0.0, 0.0).refusal is Refusal.UNAVAILABLE
    assert undone.core.ledger.get("t") is None


def claimed(m: LedgerMirror, request_id: str, now: float) -> Claim:
    """``request_id`` parked behind another replica's request with the claim it would have first in line (the engine
    has room), and that park landed."""
    park(m, request_id, now, ahead_elsewhere=1)
    queued = m.claim_behind(request_id, REQUEST, m.views.fleet(now), now)
    assert queued is not None
    m.park(request_id, REQUEST, now, SHARED.offset + now, queued, behind=False)
    m.park_landed(request_id, "m")
    return queued[1]


def test_an_admission_on_a_claim_answers_the_check_with_the_decision_the_claim_stands_for() -> None:
    m = mirror()
    claim = claimed(m, "p", 1.0)
    heard = m.heard(StoreEvent(EventKind.CLAIMED, "here", "p", claim.ticket, model="m"), 1.5)
    [answer] = heard.answers
    assert answer.request_id == "p" and answer.ticket is not None and answer.decision.engine == "e"
    assert answer.parked_for == 0.5 and heard.wake == ("m",)
    assert m.core.where("p") is None and m.core.ledger.get("p") is not None


def test_a_claim_admitted_after_its_check_was_answered_is_released() -> None:
    m = mirror()
    claim = claimed(m, "p", 1.0)
    m.core.cancel("p")  # its client left: answered, its unpark on its way
    m.forget_claim("p")
    heard = m.heard(StoreEvent(EventKind.CLAIMED, "here", "p", claim.ticket, model="m"), 1.5)
    assert heard.answers == () and heard.releases == ("p",)


def woken_pair(m: LedgerMirror) -> tuple[Outcome, Outcome]:
    """Two requests parked behind two running ones on a two-slot engine, both admitted by the wake that follows."""
    for rid in ("r1", "r2"):
        admit(m, rid, 0.0)
    for i, rid in enumerate(("p1", "p2")):
        park(m, rid, 0.1 + i / 10)
    for rid in ("r1", "r2"):
        m.core.release(rid, 1.0)
    first, second = m.core.wake(m.views.fleet(1.0), 1.0)
    assert first.request_id == "p1" and second.request_id == "p2" and second.ticket is not None
    return first, second


def test_after_a_refusal_for_the_engine_a_wakes_later_admissions_go_back_in_their_order() -> None:
    m = mirror(cap=2)
    first, second = woken_pair(m)
    settlement = Settlement(m, 1.0)
    assert first.parked is not None and second.parked is not None
    assert settlement.to_write(first, first.parked, "m") is not None
    m.reserved(first, Reserved(Refusal.CAP), 1.0, 1.0)  # another replica took the slot first
    settlement.refused(first, first.parked, "m", Refusal.CAP)
    assert settlement.to_write(second, second.parked, "m") is None  # not written: the line's order holds
    assert [p.request_id for p in m.core.parked()] == ["p1", "p2"] and not m.core.tickets()
    assert settlement.again == {"m"}  # decided again once the mirror knows the engine's tickets


def test_after_a_refusal_for_the_line_alone_the_later_heads_leave_claims() -> None:
    m = mirror(cap=2)
    first, second = woken_pair(m)
    settlement = Settlement(m, 1.0)
    assert first.parked is not None and second.parked is not None and first.rule is QueueRule.OLDEST
    assert settlement.to_write(first, first.parked, "m") is not None
    m.reserved(first, Reserved(Refusal.QUEUED), 1.0, 1.0)  # another replica's request heads the line
    settlement.refused(first, first.parked, "m", Refusal.QUEUED)
    assert settlement.to_write(second, second.parked, "m") is None
    [(outcome, _, claim)] = settlement.behind[("m", 1)]
    assert outcome.request_id == "p2" and claim.ticket.engine == "e" and claim.fresh_s > 0
    assert m.line_shared(1.5) and not m.line_shared(1.0 + 2.0)


def test_the_mirror_awaits_nothing_and_reads_no_clock() -> None:
    source = Path(__file__).resolve().parents[2] / "controlplane" / "admission" / "mirror.py"
    tree = ast.parse(source.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    io = {"asyncio", "time", "socket", "redis", "controlplane.store.memory", "controlplane.store.valkey"}
    assert not imported & io
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.AsyncFunctionDef, ast.Await))]
