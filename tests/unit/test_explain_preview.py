"""``sluice admin explain`` previews a Check (``AdmissionCore.preview``, decision 0019): for a state with requests
parked ahead, the preview's verdict is what a Check then decides, and the preview changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from controlplane.app import ControlPlane
from controlplane.config import parse_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fairshare import FairShare
from controlplane.core.fleet import Fleet
from controlplane.core.ledger import Ledger
from controlplane.core.model import InferenceRequest, Priority, Reason, Verdict
from controlplane.core.policy import Policy


def engine(name: str, cap: int, prefill: float, decode: float, kv: int = 1_000_000) -> EngineView:
    return EngineView(name=name, url="", max_num_seqs=cap, models=(ServedModel("m", 131_072),), version="1",
                      sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=kv),
                      last_ok_at=0.0, stale=False, chip_class=name, anchor_prefill_tokens_per_s=prefill,
                      anchor_decode_tokens_per_s=decode)


def chat(prompt: int, max_tokens: int, tenant: str | None = None,
         priority: Priority = Priority.STANDARD) -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=prompt, max_tokens=max_tokens,
                            tenant=tenant, priority=priority)


KV_BOUND = [engine("v100", 4, 10_000, 100, kv=100_000)]
"""One engine whose KV holds a 59k-token request and a 39k one, not both."""
FAST_AND_SLOW = [engine("fast", 1, 10_000, 50), engine("slow", 1, 500, 20)]


class Scenario:
    """A core, the engines its fleet is made of, and the request about to arrive at ``now``."""

    def __init__(self, policy: Policy, views: list[EngineView]) -> None:
        self.draws = 0

        def draw() -> float:
            self.draws += 1
            return 0.5
        self.core = AdmissionCore(policy, Ledger(lease_seconds=3600), draw=draw)
        self.views = views
        self.now = 0.0
        self.arrival = chat(10, 10)

    def fleet(self) -> Fleet:
        return self.core.fleet(self.views, self.now)

    def check(self, request_id: str, request: InferenceRequest, at: float) -> Verdict:
        self.now = at
        return self.core.check(request_id, request, self.fleet(), at).decision.verdict

    def state(self) -> tuple[Any, ...]:
        core = self.core
        return (core.depth(), [(p.request_id, p.seq) for p in core.parked()], sorted(t.ticket_id for t in core.tickets()),
                core.tenant_shares(), core.lines(), self.draws, len(core.sessions))


def behind_a_blocked_head(backfill: bool) -> Scenario:
    """A 59k-token request runs; a 39k one parks for KV; a short one arrives behind it."""
    s = Scenario(Policy(backfill=backfill), KV_BOUND)
    assert s.check("running", chat(59_000, 1_000), 0.0) is Verdict.ADMIT
    assert s.check("head", chat(39_000, 1_000), 0.1) is Verdict.PARK
    s.now, s.arrival = 1.0, chat(4_000, 1_000)
    return s


def behind_a_head_waiting_for_a_faster_engine() -> Scenario:
    """fast is busy; the head waits for it although slow is free: the arrival is decided as if first."""
    s = Scenario(Policy(), FAST_AND_SLOW)
    assert s.check("holder", chat(10, 10), 0.0) is Verdict.ADMIT
    assert s.check("head", chat(1_000, 200), 0.05) is Verdict.PARK
    s.now, s.arrival = 0.1, chat(10, 20)
    return s


def behind_a_full_lot() -> Scenario:
    s = Scenario(Policy(max_queue_depth=1), KV_BOUND)
    assert s.check("running", chat(59_000, 1_000), 0.0) is Verdict.ADMIT
    assert s.check("head", chat(39_000, 1_000), 0.1) is Verdict.PARK
    s.now, s.arrival = 1.0, chat(4_000, 1_000)
    return s


def behind_a_long_line() -> Scenario:
    """One slot, each request 1.5 s: the third in line would start 4.5 s from now, past the overload bound (4 s; the
    line's first second judged like the rest: ``overload_burst_s`` 0)."""
    s = Scenario(Policy(overload_shed_services=0, overload_burst_s=0.0), [engine("one", 1, 10_000, 100)])
    assert s.check("running", chat(10, 150), 0.0) is Verdict.ADMIT
    for n in range(2):
        assert s.check(f"p{n}", chat(10, 150), 0.01 * (n + 1)) is Verdict.PARK
    s.now, s.arrival = 0.1, chat(10, 150)
    return s


def beside_a_reserved_share() -> Scenario:
    """b (half the slots reserved) has two requests parked and two slots just freed: a's critical arrival, nobody
    ahead in its class, may not take them."""
    policy = Policy(fairness=FairShare(reserved={"b": 0.5}), shed_decision_s=1000.0, overload_shed_after_ms=0,
                    max_park_s=1000.0, lifo_after_ms=0, default_expected_output_tokens=100, default_max_tokens=100)
    s = Scenario(policy, [engine("e", 4, 10_000, 100)])
    ids = [f"a{n}" for n in range(4)]
    for n, rid in enumerate(ids):
        assert s.check(rid, chat(100, 100, "a"), 0.001 * n) is Verdict.ADMIT
    assert s.check("b1", chat(100, 100, "b"), 0.01) is Verdict.PARK
    assert s.check("b2", chat(100, 100, "b"), 0.02) is Verdict.PARK
    for rid in ids[:2]:
        s.core.release(rid, 0.03)  # not woken yet
    s.now, s.arrival = 0.04, chat(100, 100, "a", Priority.CRITICAL)
    return s


SCENARIOS: dict[str, tuple[Callable[[], Scenario], Verdict, Reason]] = {
    "strict-fifo": (lambda: behind_a_blocked_head(False), Verdict.PARK, Reason.QUEUED_BEHIND),
    "backfill": (lambda: behind_a_blocked_head(True), Verdict.ADMIT, Reason.FINISH_SOONEST),
    "passing": (behind_a_head_waiting_for_a_faster_engine, Verdict.ADMIT, Reason.WORK_CONSERVING),
    "queue-full": (behind_a_full_lot, Verdict.SHED, Reason.QUEUE_FULL),
    "shed-early": (behind_a_long_line, Verdict.SHED, Reason.OVERLOADED),
    "reserved-share": (beside_a_reserved_share, Verdict.PARK, Reason.RESERVED_SHARE),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_preview_is_what_the_check_then_decides(name: str) -> None:
    build, verdict, reason = SCENARIOS[name]
    s = build()
    before = s.state()
    preview = s.core.preview(s.arrival, s.fleet(), s.now)
    assert s.state() == before, "the preview changed the core"
    checked = s.core.check("arrival", s.arrival, s.fleet(), s.now).decision
    assert (preview.verdict, preview.reason) == (checked.verdict, checked.reason) == (verdict, reason)
    assert (preview.engine, preview.retry_after_s) == (checked.engine, checked.retry_after_s)


def plane_with(monkeypatch: pytest.MonkeyPatch, admission: dict[str, Any]) -> ControlPlane:
    """A control plane that is never started, its fleet ``KV_BOUND``'s engine serving ``m``."""
    plane = ControlPlane(parse_config({"engines": [{"name": "v100", "url": "http://127.0.0.1:9"}],
                                       "admission": admission}))

    def fleet(now: float) -> Fleet:
        return plane.admission.fleet(KV_BOUND, now)

    monkeypatch.setattr(plane.observation, "fleet", fleet)
    return plane


def test_explain_counts_the_line_as_a_check_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """With backfill on, a short request behind a head blocked on KV starts at once: explain says so (a ``decide``
    given only the count of requests parked ahead would have said it parks behind them)."""
    plane = plane_with(monkeypatch, {"backfill": True})
    core = plane.admission
    assert core.check("running", chat(59_000, 1_000), plane.observation.fleet(0.0), 0.0).ticket is not None
    assert core.check("head", chat(39_000, 1_000), plane.observation.fleet(0.1), 0.1).decision.verdict is Verdict.PARK
    short = chat(4_000, 1_000)
    decision, ahead = plane.admin.decide_for(short, 1.0)
    checked = core.check("short", short, plane.observation.fleet(1.0), 1.0).decision
    assert ahead == 1
    assert (decision.verdict, decision.reason, decision.engine) == (checked.verdict, checked.reason, checked.engine)
    assert decision.verdict is Verdict.ADMIT
