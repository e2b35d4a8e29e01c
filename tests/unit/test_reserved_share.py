"""Reserved shares (core/reserve.py): slots held back for a tenant while it has work, lent out while it has none; a
config whose shares add up to more than the fleet is refused."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.config import ConfigError, parse_config
from controlplane.core import reserve
from controlplane.core.admission import AdmissionCore
from controlplane.core.fairshare import FairShare
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import Fleet
from controlplane.core.model import InferenceRequest, Priority, Reason, Verdict
from controlplane.core.policy import Policy


def engine(name: str = "e", cap: int | None = 4, drained: bool = False, stale: bool = False,
           model: str = "m") -> EngineView:
    return EngineView(name=name, url="", max_num_seqs=cap, models=(ServedModel(model, 131_072),), version="1",
                      sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=1_000_000),
                      last_ok_at=0.0, stale=stale, drained=drained, chip_class="c",
                      anchor_prefill_tokens_per_s=10_000, anchor_decode_tokens_per_s=100)


# -- the pure rule ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("engines", "admit_stale", "want"), [
    ([engine("a", 4), engine("b", 2)], True, (6, 6)),
    ([engine("a", 4), engine("b", 2, drained=True)], True, (4, 4)),
    ([engine("a", 4), engine("b", None)], True, (4, 4)),
    ([engine("a", 4), engine("b", 2, stale=True)], False, (4, 4)),
    ([engine("a", 4), engine("b", 2, model="other")], True, (4, 4)),
], ids=["two", "drained-left-out", "no-cap-left-out", "stale-left-out-when-closed", "other-model"])
def test_slots_count_the_models_capped_candidates(engines: list[EngineView], admit_stale: bool,
                                                  want: tuple[int, int]) -> None:
    core = AdmissionCore(Policy(), Ledger(lease_seconds=3600), admit_stale=admit_stale)
    assert reserve.slots(core.fleet(engines, 0.0), "m") == want


@pytest.mark.parametrize(("share", "total", "want"), [
    (0.5, 4, 2), (0.3, 4, 1), (0.25, 3, 0), (1.0, 7, 7), (0.1, 10, 1), (0.0, 10, 0),
], ids=["half", "floor", "rounds-to-none", "all", "exact-tenth", "none"])
def test_reserved_slots_round_down(share: float, total: int, want: int) -> None:
    assert reserve.reserved_slots(share, total) == want


@pytest.mark.parametrize(("running", "holding", "want"), [
    ({}, {"b": 5, "c": 5}, {"b": 2, "c": 1}),
    ({"b": 1}, {"b": 5, "c": 5}, {"b": 1, "c": 1}),
    ({}, {"b": 1}, {"b": 1}),
    ({"b": 3}, {"b": 5}, {}),
    ({}, {}, {}),
    ({}, {"a": 5}, {}),
], ids=["both-idle-slots", "partly-running", "no-more-than-parked", "at-or-over-its-share", "no-work-lent-out",
        "no-share"])
def test_owed(running: dict[str, int], holding: dict[str, int], want: dict[str, int]) -> None:
    assert reserve.owed({"b": 0.5, "c": 0.25}, 4, running, holding) == want


@pytest.mark.parametrize(("tenant", "free", "held", "ok"), [
    ("a", 3, {"b": 2}, True), ("a", 2, {"b": 2}, False), ("b", 1, {"b": 2}, True), ("a", 1, {}, True),
    ("a", 0, {}, False), ("c", 4, {"b": 2, "a": 2}, False), ("b", 3, {"b": 2, "c": 2}, True),
], ids=["room-left", "held", "its-own", "nothing-held", "nothing-free", "two-held", "own-excluded"])
def test_may_take(tenant: str, free: int, held: dict[str, int], ok: bool) -> None:
    assert reserve.may_take(tenant, free, held) is ok


ONE = {"engines": [{"name": "a", "url": "http://127.0.0.1:1"}]}


@pytest.mark.parametrize(("shares", "problem"), [
    ({"x": 0.5, "y": 0.5}, None),
    ({"x": 0.6, "y": 0.5}, "tenants: tenants' reserved_share add up to 1.1, more than the whole fleet (1): x 0.6, y 0.5"),
    ({"x": 1.5}, "tenants.x.reserved_share: must be >= 0 and <= 1, got 1.5"),
    ({"x": -0.1}, "tenants.x.reserved_share: must be >= 0 and <= 1, got -0.1"),
    ({"x": "half"}, "tenants.x.reserved_share: must be a number, got 'half'"),
], ids=["adds-to-one", "oversubscribed", "above-one", "negative", "not-a-number"])
def test_config_refuses_shares_past_the_fleet(shares: dict[str, object], problem: str | None) -> None:
    raw: dict[str, object] = dict(ONE)
    raw["tenants"] = {name: {"keys": [str(i) * 64], "reserved_share": share}
                      for i, (name, share) in enumerate(shares.items(), start=1)}
    if problem is None:
        assert dict(parse_config(raw).policy.fairness.reserved) == shares
        return
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert any(p.startswith(problem) for p in error.value.problems), error.value.problems


def test_config_default_reserves_nothing() -> None:
    raw: dict[str, object] = dict(ONE)
    raw["tenants"] = {"x": {"keys": ["1" * 64]}}
    assert dict(parse_config(raw).policy.fairness.reserved) == {}


# -- in the parking lot -------------------------------------------------------------------------------------------------

class Fleet4:
    """One engine of ``slots`` slots; every release wakes the lot. Tracks who runs what."""

    def __init__(self, reserved: dict[str, float], fair: bool = False, slots: int = 4, kv: int = 1_000_000,
                 lease_s: float = 3600) -> None:
        p = Policy(fairness=FairShare(enabled=fair, reserved=reserved), shed_decision_s=1000.0,
                   overload_shed_after_ms=0, max_park_s=1000.0, max_queue_depth=10_000, lifo_after_ms=0,
                   default_expected_output_tokens=100, default_max_tokens=100)
        self.core = AdmissionCore(p, Ledger(lease_seconds=lease_s))
        self.engine = EngineView(name="e", url="", max_num_seqs=slots, models=(ServedModel("m", 131_072),),
                                 version="1", sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0,
                                                                  kv_capacity_tokens=kv),
                                 last_ok_at=0.0, stale=False, chip_class="c", anchor_prefill_tokens_per_s=10_000,
                                 anchor_decode_tokens_per_s=100)
        self.now = 0.0
        self.n = 0
        self.running: dict[str, str] = {}
        """request id -> tenant"""
        self.admitted: list[str] = []
        """Tenants in admission order."""
        self.reasons: dict[str, Reason] = {}

    def fleet(self) -> Fleet:
        return self.core.fleet([self.engine], self.now)

    def submit(self, tenant: str, priority: Priority = Priority.STANDARD, prompt: int = 100) -> str:
        self.n += 1
        self.now += 0.001
        rid = f"{tenant}-{self.n}"
        request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=prompt, max_tokens=100,
                                   priority=priority, tenant=tenant)
        outcome = self.core.check(rid, request, self.fleet(), self.now)
        self.reasons[rid] = outcome.decision.reason
        if outcome.ticket is not None:
            self._ran(rid, tenant)
        else:
            assert outcome.decision.verdict is Verdict.PARK, outcome.decision
        return rid

    def release(self, rid: str) -> list[str]:
        """``rid`` finishes; returns the tenants the wake admitted."""
        self.now += 0.001
        self.core.release(rid, self.now)
        del self.running[rid]
        started = []
        for outcome in self.core.wake(self.fleet(), self.now):
            if outcome.ticket is not None:
                tenant = outcome.request_id.rsplit("-", 1)[0]
                self._ran(outcome.request_id, tenant)
                started.append(tenant)
        return started

    def _ran(self, rid: str, tenant: str) -> None:
        self.running[rid] = tenant
        self.admitted.append(tenant)

    def of(self, tenant: str) -> list[str]:
        return [r for r, t in self.running.items() if t == tenant]

    def free(self) -> int:
        return reserve.slots(self.fleet(), "m")[1]


def test_reserved_slots_go_to_their_tenant_first_and_hold_against_every_class() -> None:
    """FIFO order (fair share off): b's requests park behind a's ten, a critical one of a's among them; with half
    the fleet reserved, the next two slots that free go to b all the same."""
    w = Fleet4({"b": 0.5})
    for _ in range(4):
        w.submit("a")
    for _ in range(9):
        w.submit("a")
    w.submit("a", Priority.CRITICAL)
    b1, b2, b3 = w.submit("b"), w.submit("b"), w.submit("b")
    assert w.free() == 0 and w.reasons[b1] is Reason.QUEUED_BEHIND
    assert w.release(w.of("a")[0]) == ["b"]
    assert w.release(w.of("a")[0]) == ["b"]
    assert sorted(w.of("b")) == sorted([b1, b2])
    assert w.release(w.of("a")[0]) == ["a"]  # b holds its 2 of 4: the rest in the lot's order (a's critical first)
    assert b3 not in w.running


def test_without_a_reservation_the_same_load_is_fifo() -> None:
    w = Fleet4({})
    for _ in range(14):
        w.submit("a")
    w.submit("b")
    assert [w.release(w.of("a")[0]) for _ in range(3)] == [["a"], ["a"], ["a"]]


def test_an_idle_tenants_slots_are_lent_out() -> None:
    """b (half reserved) has no work: a runs on all 4 slots and its fifth parks for the cap, not for b's share."""
    w = Fleet4({"b": 0.5})
    for _ in range(4):
        w.submit("a")
    assert len(w.of("a")) == 4 and w.free() == 0
    fifth = w.submit("a")
    assert w.reasons[fifth] is Reason.CAP


def test_a_tenant_whose_work_fits_no_engine_holds_nothing() -> None:
    """b's parked request needs more KV than the engine has room for while a runs: it holds no slot, and a's critical
    arrivals (nobody parked ahead of them) take the free ones."""
    w = Fleet4({"b": 0.5}, kv=2000)
    w.submit("a")  # 200 of the 1800 KV tokens that fit (0.9 watermark)
    big = w.submit("b", prompt=1_550)  # 1650 more: over the watermark
    assert w.reasons[big] is Reason.KV_NEED
    assert w.core.owed("m", w.fleet(), w.now) == {}
    for _ in range(2):
        w.submit("a", Priority.CRITICAL)
    assert len(w.of("a")) == 3


def test_a_free_slot_held_for_a_tenant_parks_an_arrival_with_its_reason() -> None:
    """The arrival gate: b (half reserved) has two fitting requests parked and two slots free (the lot was not woken
    since they freed, as between a release and its wake): a's critical arrival (nobody ahead in its class) may not
    take them."""
    w = Fleet4({"b": 0.5})
    ids = [w.submit("a") for _ in range(4)]
    parked = w.submit("b")
    w.submit("b")
    for rid in ids[:2]:  # released without a wake
        w.core.release(rid, w.now)
        del w.running[rid]
    assert w.core.owed("m", w.fleet(), w.now) == {"b": 2}
    held = w.submit("a", Priority.CRITICAL)
    assert w.reasons[held] is Reason.RESERVED_SHARE and held not in w.running
    assert [o.request_id for o in w.core.wake(w.fleet(), w.now) if o.ticket is not None][0] == parked


def test_a_lapsed_lease_or_a_reaped_ticket_no_longer_runs() -> None:
    """Tickets closed without their access-log entry (lease run out, reaped by an idle probe) leave the tenant's running
    count: its reserved slots are owed again while it has work waiting."""
    w = Fleet4({"b": 0.5}, lease_s=10)
    first, second = w.submit("b"), w.submit("b")
    assert dict(w.core.fair.running("m")) == {"b": 2}
    w.now = 11.0
    assert {t.ticket_id for t in w.core.expire_leases(w.now)} == {first, second}
    assert dict(w.core.fair.running("m")) == {}
    third = w.submit("b")
    w.now = 12.0
    assert [t.ticket_id for t in w.core.note_probe("e", w.now, idle=True, idle_grace_s=0.5)] == [third]
    assert dict(w.core.fair.running("m")) == {}


def test_explain_and_tenants_show_the_reservations() -> None:
    """``sluice admin explain`` names the slots held for other tenants; ``sluice admin tenants`` each one's share."""
    from controlplane.servicers.admin_views import fair_share_proto, fair_standing_proto
    from sluice.admincli import fair_share_table, fair_standing_text
    w = Fleet4({"b": 0.5}, fair=True)
    ids = [w.submit("a") for _ in range(4)]
    w.submit("b")
    w.submit("b")
    w.core.release(ids[0], w.now)  # freed, not woken yet: b is owed both its slots, a may take none
    request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=100, max_tokens=100, tenant="a")
    standing = w.core.fair_standing(request, w.fleet(), w.now)
    assert dict(standing.held_slots) == {"b": 2}
    text = fair_standing_text(fair_standing_proto(standing, True))
    assert "held for reserved shares: b 2 slot(s)" in text.splitlines()
    own = w.core.fair_standing(replace(request, tenant="b"), w.fleet(), w.now)
    assert dict(own.held_slots) == {}  # its own share is not held from it
    table = fair_share_table(fair_share_proto(w.core.policy.fairness, w.core.tenant_shares()))
    rows = {line.split()[1]: line.split() for line in table.splitlines()[2:]}
    assert rows["b"][3] == "0.5" and rows["a"][3] == "-"


# -- the properties -----------------------------------------------------------------------------------------------------

SHARES = {"b": 0.5, "c": 0.25}
op = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["a", "b", "c"]), st.sampled_from([Priority.STANDARD,
                                                                                    Priority.CRITICAL])),
    st.tuples(st.just("release"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=80), st.booleans())
def test_reservations_hold_and_the_fleet_never_idles(ops: list[tuple[object, ...]], fair: bool) -> None:
    """Random arrivals of three tenants (b reserves 2 of the 4 slots, c 1, a none) and releases, fair share on or off.
    After every event:

    - work-conserving: a slot is free only while nothing is parked (every request here fits a free slot);
    - held: a slot went to a tenant that was owed nothing in the event only after every tenant that had work parked
      and ran fewer than its reserved slots (the event's release done: a freed slot may be its own) got as many of
      the event's slots as it was owed (or as it had parked).
    """
    w = Fleet4(SHARES, fair=fair)
    parked: Counter[str] = Counter()
    for item in ops:
        if item[0] == "release" and not w.running:
            continue
        released = sorted(w.running)[int(str(item[1])) % len(w.running)] if item[0] == "release" else None
        # What each tenant runs once the event's release is done: the freed slot may be its own reserved one.
        running = Counter(t for rid, t in w.running.items() if rid != released)
        owed = {t: min(reserve.reserved_slots(s, 4) - running[t], parked[t]) for t, s in SHARES.items()
                if parked[t] and running[t] < reserve.reserved_slots(s, 4)}
        if released is None:
            tenant, priority = str(item[1]), item[2]
            assert isinstance(priority, Priority)
            rid = w.submit(tenant, priority)
            started = [tenant] if rid in w.running else []
            if not started:
                parked[tenant] += 1
        else:
            started = w.release(released)
            for t in started:
                parked[t] -= 1
        got = Counter(started)
        for t, n in owed.items():
            if any(other not in owed for other in started):  # owed tenants share the slots among themselves first
                assert got[t] >= n, (t, n, started)
        assert w.free() == 0 or not w.core.parked(), (w.free(), len(w.core.parked()))
        assert sum(parked.values()) == len(w.core.parked())


def test_a_tenant_waiting_for_a_busy_engine_holds_no_free_slot() -> None:
    """b (half of 2 slots reserved) parks a long prompt that finishes sooner on the busy fast engine than on the free
    slow one (it waits for fast: ``waiting_for_faster``): the free slot is not one b would take, so a's short request
    takes it (as the pass-over rule lets it without reservations) instead of parking for b's share."""
    from tests.unit.coreinputs import FAST_AND_SLOW, busy_fast, chat

    core = AdmissionCore(Policy(fairness=FairShare(reserved={"b": 0.5})), Ledger(lease_seconds=600))
    busy_fast(core)
    head = core.check("head", replace(chat(prompt=1000, max_tokens=200), tenant="b"), core.fleet(FAST_AND_SLOW, 0.05),
                      0.05)
    assert (head.decision.reason, head.decision.idle_slot) == (Reason.WAITING_FOR_FASTER, True)
    assert core.owed("cortex", core.fleet(FAST_AND_SLOW, 0.1), 0.1) == {}
    short = core.check("short", replace(chat(prompt=10, max_tokens=20), tenant="a"), core.fleet(FAST_AND_SLOW, 0.1),
                       0.1)
    assert short.ticket is not None and short.ticket.engine == "slow"
