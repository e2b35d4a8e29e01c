"""Tenant fair share in the parking lot (core/fairshare.py): a virtual token counter per tenant and model, the lowest
counter's oldest request first within a class, a tenant back from idle lifted to the backlogged minimum, per-tenant
weights; off, the lot is FIFO exactly as before."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.config import parse_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.fairshare import ANONYMOUS, FairMode, FairShare, TenantCounters, service_order
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Priority, QueueRule, Verdict
from controlplane.core.policy import Policy
from controlplane.core.tenants import Usage
from controlplane.store.base import Claim
from controlplane.store.memory import MemoryState
from tests.unit.replicaworld import CAPACITY, ENGINES, WATERMARK, Replicas

ENGINE = EngineView(
    name="one", url="", max_num_seqs=1, models=(ServedModel("m", 131_072),), version="1",
    sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=1_000_000), last_ok_at=0.0,
    stale=False, chip_class="one", anchor_prefill_tokens_per_s=10_000, anchor_decode_tokens_per_s=100,
)


def chat(tenant: str | None, prompt: int = 100, out: int = 100,
         priority: Priority = Priority.STANDARD) -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=prompt, max_tokens=out,
                            priority=priority, tenant=tenant)


def policy(enabled: bool = True, weights: dict[str, float] | None = None, credit: float = 0.0, **kw: Any) -> Policy:
    """No shedding on the way (long window, no overload bound, deep lot): the tests look at order alone. The lift is
    the paper's (no credit) unless a test gives one."""
    return Policy(fairness=FairShare(enabled=enabled, weights=weights or {}, lift_credit_requests=credit),
                  shed_decision_s=1000.0,
                  overload_shed_after_ms=0, max_park_s=1000.0, max_queue_depth=10_000, lifo_after_ms=0,
                  default_expected_output_tokens=100, **kw)


class Lot:
    """One engine with one slot, always busy: every release admits exactly the next request the lot picks."""

    def __init__(self, p: Policy) -> None:
        self.core = AdmissionCore(p, Ledger(lease_seconds=3600))
        self.now = 0.0
        self.running: str | None = None
        self.served: list[str] = []
        self.requests: dict[str, InferenceRequest] = {}
        self.n = 0
        assert self.submit(None) is not None  # the slot's first occupant: everyone after parks

    def submit(self, tenant: str | None, prompt: int = 100, out: int = 100,
               priority: Priority = Priority.STANDARD) -> str | None:
        """A new request; returns its id if admitted at once."""
        self.n += 1
        self.now += 0.001
        rid = f"{tenant or 'anon'}-{self.n}"
        request = chat(tenant, prompt, out, priority)
        self.requests[rid] = request
        outcome = self.core.check(rid, request, self.core.fleet([ENGINE], self.now), self.now)
        if outcome.ticket is not None:
            self.running = rid
            return rid
        assert outcome.decision.verdict is Verdict.PARK, outcome.decision
        return None

    def step(self, used_out: int | None = None) -> str | None:
        """The running request finishes (having generated ``used_out`` tokens, if given: settled); the next starts."""
        assert self.running is not None
        self.now += 0.001
        done = self.running
        self.core.release(done, self.now)
        if used_out is not None:
            self.core.settle_usage(done, self.requests[done].prompt_tokens, used_out)
        self.running = None
        outcomes = self.core.wake(self.core.fleet([ENGINE], self.now), self.now)
        admitted = [o for o in outcomes if o.ticket is not None]
        assert len(admitted) <= 1
        if admitted:
            self.running = admitted[0].request_id
            self.served.append(self.running)
            return self.running
        return None


def tenant(rid: str) -> str:
    return rid.rsplit("-", 1)[0]


# -- the order ----------------------------------------------------------------------------------------------------------

def test_off_keeps_parking_order_whatever_the_tenants() -> None:
    lot = Lot(policy(enabled=False))
    for _ in range(5):
        lot.submit("a")
    for _ in range(3):
        lot.submit("b")
    while lot.step():
        pass
    assert lot.served == [f"a-{i}" for i in range(2, 7)] + [f"b-{i}" for i in range(7, 10)]


def test_on_alternates_equal_tenants() -> None:
    lot = Lot(policy())
    for _ in range(5):
        lot.submit("a")
    for _ in range(3):
        lot.submit("b")
    while lot.step():
        pass
    # b lifted to a's counter as it parks (both 0): equal counters, a's older request first; then one each
    assert [tenant(r) for r in lot.served] == ["a", "b", "a", "b", "a", "b", "a", "a"]
    assert [r for r in lot.served if tenant(r) == "a"] == [f"a-{i}" for i in range(2, 7)]  # FIFO within a tenant


@given(st.lists(st.integers(1, 400), min_size=1, max_size=25), st.booleans())
@settings(max_examples=60, deadline=None)
def test_one_tenant_is_fifo_with_fairness_on(prompts: list[int], named: bool) -> None:
    """Requests without a tenant form one tenant (and so does any single tenant): the order is the parking order."""
    lot = Lot(policy())
    for p in prompts:
        lot.submit("solo" if named else None, prompt=p)
    while lot.step():
        pass
    assert lot.served == sorted(lot.served, key=lambda r: int(r.rsplit("-", 1)[1]))


@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 1.0}, {"a": 1.0, "b": 3.0}],
                         ids=["equal", "a-twice", "b-thrice"])
def test_served_tokens_converge_to_the_weights(weights: dict[str, float]) -> None:
    """Both tenants always backlogged, with different request shapes (b's answers longer than the model's expected
    100, settled at their real length): tokens served (prompt x 1 + output x 2, the counters' units) over each
    tenant's weight come out equal."""
    lot = Lot(policy(weights=weights))
    shapes = {"a": (300, 50), "b": (60, 150)}
    for _ in range(40):
        for t in "ab":
            lot.submit(t, *shapes[t])
    served: Counter[str] = Counter()
    for _ in range(400):
        done = lot.running
        assert done is not None
        rid = lot.step(used_out=shapes[tenant(done)][1] if tenant(done) in shapes else None)
        assert rid is not None
        t = tenant(rid)
        served[t] += shapes[t][0] + 2 * shapes[t][1]
        lot.submit(t, *shapes[t])  # still backlogged
    per_weight = {t: served[t] / weights[t] for t in "ab"}
    assert per_weight["a"] == pytest.approx(per_weight["b"], rel=0.05)


def test_settled_usage_corrects_the_estimate() -> None:
    """b's answers run 5x longer than their estimate (100 tokens): once settled, its counter carries the real tokens
    (100 + 2 x 500 = 1100 a request against a's 300), so a gets about 11 / 3 of its requests per one of b's."""
    lot = Lot(policy())
    real = {"a": 100, "b": 500}
    for _ in range(30):
        lot.submit("a")
        lot.submit("b")
    picks: list[str] = []
    for _ in range(120):
        done = lot.running
        assert done is not None
        rid = lot.step(used_out=real[tenant(done)] if tenant(done) in real else 100)
        assert rid is not None
        picks.append(tenant(rid))
        lot.submit(tenant(rid))
    counts = Counter(picks[20:])
    assert 3.2 <= counts["a"] / counts["b"] <= 4.2
    core = lot.core
    assert core.fair.counter("m", "a") == pytest.approx(core.fair.counter("m", "b"), abs=2 * (100 + 2 * 500))


@pytest.mark.parametrize("credit", [0.0, 2.0])
def test_a_returning_tenant_is_lifted_not_credited_past_its_credit(credit: float) -> None:
    """a alone for 50 requests; then b, idle all along, arrives with a backlog of its own. Without the lift b's counter
    (0) would win every pick for 50 requests' worth; lifted to a's less ``credit`` of its requests, b goes first for
    ``credit`` requests (and one more on the tie, having served less), then they alternate."""
    lot = Lot(policy(credit=credit))
    for _ in range(60):
        lot.submit("a")
    for _ in range(50):
        lot.step()
    before = lot.core.fair.counter("m", "b")
    for _ in range(10):
        lot.submit("b")
    assert before == 0.0
    cost = 100 + 2 * 100
    assert lot.core.fair.counter("m", "b") == pytest.approx(lot.core.fair.counter("m", "a") - credit * cost)
    nxt = "".join(tenant(r)[0] for r in (lot.step() for _ in range(10)) if r is not None)
    ahead = int(credit) + 1
    assert nxt[:ahead] == "b" * ahead and nxt[ahead:] == ("ab" * 5)[:10 - ahead]


def test_a_tenant_back_after_the_lot_emptied_starts_at_the_last_served() -> None:
    counters = TenantCounters()
    share = FairShare(enabled=True)
    counters.charge("t1", "m", "a", 1000, 0, share)
    assert counters.lift("m", "b", backlogged=()) == 1000.0  # nobody backlogged: the counter of the one served last
    assert counters.lift("m", "c", backlogged={"a", "b"}) == 1000.0
    counters.charge("t2", "m", "c", 5000, 0, share)
    assert counters.lift("m", "c", backlogged={"a", "b"}) == 6000.0  # never lowered


def test_no_tenant_starves_under_a_flood() -> None:
    """a keeps ten requests parked at every moment (refilled as fast as it is served); b's requests, parked behind
    all of them, are each served within two picks of parking, and a's own oldest waits no longer than its turn."""
    lot = Lot(policy())
    for _ in range(10):
        lot.submit("a")
    waits: list[int] = []
    for round_ in range(60):
        if round_ % 5 == 0:
            lot.submit("b")
            parked_at = len(lot.served)
            while True:
                rid = lot.step()
                assert rid is not None
                lot.submit("a")
                if tenant(rid) == "b":
                    waits.append(len(lot.served) - parked_at)
                    break
        else:
            assert lot.step() is not None
            lot.submit("a")
    assert waits and max(waits) <= 2
    a_served = [int(r.rsplit("-", 1)[1]) for r in lot.served if tenant(r) == "a"]
    assert a_served == sorted(a_served)  # a's requests in its own order: none is passed for ever


def test_weights_count_per_model_and_class_order_holds() -> None:
    """Critical before standard whatever the counters: a critical request of the tenant with the highest counter still
    goes before every standard one."""
    lot = Lot(policy())
    for _ in range(6):
        lot.submit("a")
    lot.submit("b")
    for _ in range(4):
        lot.step()  # a and b alternate; a's counter is now the higher
    lot.submit("a", priority=Priority.CRITICAL)
    rid = lot.step()
    assert rid is not None and lot.requests[rid].priority is Priority.CRITICAL


def test_service_order_projection() -> None:
    class E:
        def __init__(self, rid: str, seq: int) -> None:
            self.request_id, self.seq = rid, seq
    entries = [E("a1", 1), E("a2", 2), E("a3", 3), E("b1", 4)]
    counters = {"a": (0.0, 0.0), "b": (150.0, 0.0)}
    order = service_order(entries, lambda e: e.request_id[0], counters.__getitem__, lambda e: 100.0)
    assert [e.request_id for e in order] == ["a1", "a2", "b1", "a3"]
    newest = service_order(entries, lambda e: e.request_id[0], counters.__getitem__, lambda e: 100.0, True)
    assert [e.request_id for e in newest] == ["a3", "a2", "b1", "a1"]
    # equal counters: the tenant served less goes first (b, lifted level with a, has served nothing)
    level = {"a": (100.0, 100.0), "b": (100.0, 0.0)}
    assert [e.request_id for e in service_order(entries, lambda e: e.request_id[0], level.__getitem__,
                                                lambda e: 100.0)] == ["b1", "a1", "a2", "a3"]


# -- charges ------------------------------------------------------------------------------------------------------------

def test_a_retracted_admission_gives_its_charge_back() -> None:
    core = AdmissionCore(policy(), Ledger(lease_seconds=3600))
    outcome = core.check("x", chat("a"), core.fleet([ENGINE], 0.0), 0.0)
    assert outcome.ticket is not None
    assert core.fair.counter("m", "a") == pytest.approx(100 + 2 * 100)
    core.retract(outcome, 0.0)
    assert core.fair.counter("m", "a") == 0.0


def test_weights_and_anonymous() -> None:
    share = FairShare(enabled=True, weights={"big": 4.0})
    assert share.cost("big", 100, 100) == pytest.approx(75.0)
    assert share.cost(ANONYMOUS, 100, 100) == pytest.approx(300.0)
    lot = Lot(policy())
    lot.submit(None)
    assert lot.core.tenant_shares()[0].tenant == ANONYMOUS


def test_shares_report_counter_served_and_waiting() -> None:
    lot = Lot(policy())
    lot.submit("a")
    lot.submit("a")
    lot.step(used_out=100)
    by = {s.tenant: s for s in lot.core.tenant_shares()}
    assert by["a"].waiting == 1 and by["a"].served_tokens == pytest.approx(200.0)


# -- shed early counts the fair order -----------------------------------------------------------------------------------

def test_shed_early_counts_who_is_ahead_in_the_fair_order() -> None:
    """a has 40 requests parked, 4 s of service ahead; the overload bound is 2 s. a's next arrival would wait behind all
    40: shed at once. b's would be picked next: it parks."""
    p = Policy(fairness=FairShare(enabled=True), shed_decision_s=1000.0, overload_shed_after_ms=2000,
               overload_shed_services=0, max_park_s=1000.0, max_queue_depth=10_000, lifo_after_ms=0,
               default_expected_output_tokens=10, overload_burst_s=0.0)
    core = AdmissionCore(p, Ledger(lease_seconds=3600))
    fleet = core.fleet([ENGINE], 0.0)
    assert core.check("run", chat("a", out=10), fleet, 0.0).ticket is not None
    parked = 0
    for i in range(40):
        if core.check(f"a{i}", chat("a", out=10), core.fleet([ENGINE], 0.0), 0.0).decision.verdict is Verdict.PARK:
            parked += 1
    assert 0 < parked < 40  # the later ones were already past the bound
    late = core.check("a-late", chat("a", out=10), core.fleet([ENGINE], 0.0), 0.0)
    assert late.decision.verdict is Verdict.SHED
    b = core.check("b0", chat("b", out=10), core.fleet([ENGINE], 0.0), 0.0)
    assert b.decision.verdict is Verdict.PARK


# -- the shared store ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("across", "rule"), [(True, QueueRule.FAIR), (False, QueueRule.CLASS)])
def test_a_fair_wake_admits_with_the_stores_fair_rule_or_the_class_rule(across: bool, rule: QueueRule) -> None:
    lot = Lot(replace(policy(), fairness=FairShare(enabled=True, across_replicas=across)))
    lot.submit("a")
    lot.submit("a")
    lot.submit("b")
    lot.now += 0.001
    lot.core.release(lot.running or "", lot.now)
    outcomes = lot.core.wake(lot.core.fleet([ENGINE], lot.now), lot.now)
    assert [o.rule for o in outcomes] == [rule]
    off = Lot(policy(enabled=False))
    off.submit("a")
    off.now += 0.001
    off.core.release(off.running or "", off.now)
    assert [o.rule for o in off.core.wake(off.core.fleet([ENGINE], off.now), off.now)] == [QueueRule.OLDEST]


# -- config -------------------------------------------------------------------------------------------------------------

ONE = {"engines": [{"name": "a", "url": "http://127.0.0.1:1"}]}


@pytest.mark.parametrize(("fairness", "tenants", "on"), [
    (None, False, False), (None, True, True), ({"enabled": False}, True, False), ({"enabled": True}, False, True),
    ({"enabled": "auto"}, True, True),
], ids=["auto-no-tenants", "auto-tenants", "off", "on", "auto-explicit"])
def test_config_default_is_on_with_tenants(fairness: dict[str, object] | None, tenants: bool, on: bool) -> None:
    raw: dict[str, object] = dict(ONE)
    if fairness is not None:
        raw["fairness"] = fairness
    if tenants:
        raw["tenants"] = {"acme": {"keys": ["a" * 64], "weight": 3}, "other": {"keys": ["b" * 64]}}
    share = parse_config(raw).policy.fairness
    assert share.enabled is on
    if tenants:
        assert share.weight("acme") == 3.0 and share.weight("other") == 1.0
    assert share.prompt_weight == 1.0 and share.output_weight == 2.0
    assert share.mode in FairMode


# -- seen: metrics, admin, CLI ------------------------------------------------------------------------------------------

async def test_metrics_show_each_tenants_counter_served_tokens_and_waiting() -> None:
    from prometheus_client import generate_latest

    from controlplane.metrics import SluiceMetrics
    lot = Lot(policy())
    lot.submit("a")
    lot.submit("b")
    lot.step(used_out=100)
    metrics = SluiceMetrics(tenant_shares=lambda: [(s.model, s.tenant, s.counter, s.served_tokens, s.waiting)
                                                   for s in lot.core.tenant_shares()])
    generate_latest(metrics.registry)  # renders
    get = metrics.registry.get_sample_value
    assert get("sluice_tenant_waiting_requests", {"model": "m", "tenant": "b"}) == 1
    assert get("sluice_tenant_waiting_requests", {"model": "m", "tenant": "a"}) == 0
    assert get("sluice_tenant_served_tokens", {"model": "m", "tenant": "a"}) == 200
    # lifted to the tenantless first request's 300 as it parked, then charged its own 300
    assert get("sluice_tenant_fair_counter", {"model": "m", "tenant": "a"}) == pytest.approx(600.0)
    assert get("sluice_tenant_fair_counter", {"model": "m", "tenant": "-"}) is not None  # the first, tenantless one


def test_admin_and_cli_show_the_shares() -> None:
    from controlplane.servicers.admin_views import fair_share_proto
    from sluice.admincli import fair_share_table
    lot = Lot(policy(weights={"a": 2.0}))
    lot.submit("a")
    lot.submit("b")
    proto = fair_share_proto(lot.core.policy.fairness, lot.core.tenant_shares())
    assert proto.enabled and [(s.tenant, s.weight, s.waiting) for s in proto.shares] == [
        ("", 1.0, 0), ("a", 2.0, 1), ("b", 1.0, 1)]
    text = fair_share_table(proto)
    assert text.splitlines()[0].startswith("fair share: on")
    assert text.splitlines()[1].split() == ["MODEL", "TENANT", "WEIGHT", "RESERVED", "COUNTER", "SERVED", "TOKENS",
                                            "WAITING"]
    assert text.splitlines()[3].split()[:4] == ["m", "a", "2", "-"]


# -- explain: why a request would wait ------------------------------------------------------------------------------------

def _flooded(enabled: bool = True) -> Lot:
    """The slot's first occupant (no tenant) charged 300 (100 prompt + 100 output x 2); a lifted to it and served once
    (600); 3 more of a parked; b lifted to 600 and parked once, never served; one critical request of c parked."""
    lot = Lot(policy(enabled=enabled))
    lot.submit("a")
    lot.step()
    for _ in range(3):
        lot.submit("a")
    lot.submit("b")
    lot.submit("c", priority=Priority.CRITICAL)
    return lot


@pytest.mark.parametrize(("enabled", "who", "priority", "want"), [
    # a's next request: behind a's own 3 and b's one (equal counters, b served less)
    (True, "a", Priority.STANDARD, ("a", 600.0, False, 4, 1, [("a", 600.0, 3), ("b", 600.0, 1)])),
    # d never served: lifted to the backlogged minimum, then behind b alone (served as little, parked first)
    (True, "d", Priority.STANDARD, ("d", 600.0, True, 1, 1, [("b", 600.0, 1)])),
    # no tenant (served 300 at the start): lifted too; b first (served less), then a's oldest (parked first)
    (True, None, Priority.STANDARD, ("", 600.0, True, 2, 1, [("a", 600.0, 1), ("b", 600.0, 1)])),
    # critical: nobody of a higher class; c's own request first
    (True, "c", Priority.CRITICAL, ("c", 600.0, False, 1, 0, [("c", 600.0, 1)])),
    # off: parking order, every standard request parked
    (False, "d", Priority.STANDARD, ("d", 600.0, True, 4, 1, [("a", 600.0, 3), ("b", 600.0, 1)])),
], ids=["backlogged-tenant", "new-tenant-lifted", "no-tenant", "critical", "fifo"])
def test_fair_standing_says_who_goes_first(enabled: bool, who: str | None, priority: Priority,
                                          want: tuple[object, ...]) -> None:
    lot = _flooded(enabled)
    before = lot.core.tenant_shares()
    s = lot.core.fair_standing(chat(who, priority=priority), lot.core.fleet([ENGINE], lot.now), lot.now)
    assert (s.tenant, s.counter, s.lifted, s.ahead_in_class, s.ahead_in_higher_classes,
            [(a.tenant, a.counter, a.requests) for a in s.tenants_ahead]) == want
    assert lot.core.tenant_shares() == before  # explaining changes nothing


def test_explain_text_names_the_counters() -> None:
    from controlplane.servicers.admin_views import fair_standing_proto
    from sluice.admincli import fair_standing_text
    lot = _flooded()
    text = fair_standing_text(fair_standing_proto(lot.core.fair_standing(chat("a"), lot.core.fleet([ENGINE], lot.now), lot.now), True))
    assert text.splitlines()[0] == "fair share: a's counter 600; 4 of its class ahead, 1 of higher classes"
    assert [line.split() for line in text.splitlines()[1:]] == [["AHEAD", "COUNTER", "REQUESTS"], ["a", "600", "3"],
                                                                ["b", "600", "1"]]
    off_lot = _flooded(False)
    off = fair_standing_text(fair_standing_proto(
        off_lot.core.fair_standing(chat(None), off_lot.core.fleet([ENGINE], off_lot.now), off_lot.now), False))
    assert off.startswith("fair share off: its class is FIFO; 4 of its class and 1 of higher classes parked ahead")


# -- two replicas, fair share in the store: exactly the order of one ------------------------------------------------------

class Admissions(MemoryState):
    """A shared ledger that notes every admission it writes, in its order."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def admitted(self, claim: Claim, owner: str) -> None:
        self.order.append(claim.ticket.ticket_id)
        super().admitted(claim, owner)


class FairReplicas(Replicas):
    """``count`` replicas (``Replicas``'s services) with fair share on, over one store that notes its admissions; shed
    early off (the replicas' lots see different lines, and only the order is compared here)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        policy = replace(self.config.policy, fairness=FairShare(enabled=True), shed_decision_s=0.0)
        self.config = replace(self.config, policy=policy)
        self.state = self.admissions = Admissions()
        self.services = [self._service(f"r{i}") for i in range(count)]
        self.tenants: dict[str, str] = {}

    def check_invariants(self) -> None:  # caps and KV; the line's parking order is not fair share's
        for engine, cap in ENGINES.items():
            assert len(self.state.by_engine.get(engine, set())) <= cap
            assert self.state.kv.get(engine, 0) <= CAPACITY * WATERMARK

    async def arrive(self, replica: int, who: str | None, max_tokens: int) -> None:
        service = self.services[replica % len(self.services)]
        rid = f"q{next(self.ids)}"
        self.tenants[rid] = who or ANONYMOUS
        request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=100, max_tokens=max_tokens,
                                   tenant=who)

        async def check() -> None:
            outcome = await service.check(rid, request)
            if outcome.decision.verdict is Verdict.PARK:
                await service.wait_parked(rid)
        self.checks[rid] = asyncio.create_task(check())
        await self.settle()

    async def complete(self, pick: int, via: int, used_out: int | None) -> None:
        """An open ticket's request ends; its access-log entry reaches replica ``via`` (settling its usage, if told)."""
        open_ids = sorted(self.state.tickets)
        if open_ids:
            service = self.services[via % len(self.services)]
            ticket_id = open_ids[pick % len(open_ids)]
            service.release_ticket(ticket_id)
            if used_out is not None:
                service.settle_usage(ticket_id, Usage(100, used_out, reported=True))
        await self.settle()

    def order(self) -> list[str]:
        return [self.tenants[r] for r in self.admissions.order]


fair_op = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 1), st.sampled_from(["a", "b", "c", None]),
              st.sampled_from([100, 400])),
    st.tuples(st.just("flood"), st.integers(0, 1), st.sampled_from(["a", "b", "c", None]), st.integers(2, 6)),
    st.tuples(st.just("complete"), st.integers(0, 40), st.integers(0, 1), st.one_of(st.none(), st.integers(0, 800))),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(fair_op, min_size=1, max_size=60))
# The five slots taken by a, then a parked on r0 and b on r1: b goes first (lifted level with a, served less), though
# r0 hears the release first and a is the pick of its own lot.
@example(ops=[("arrive", 0, "a", 100)] * 6 + [("arrive", 1, "b", 100), ("complete", 0, 0, None)])
def test_two_replicas_admit_in_the_order_one_would(ops: list[tuple[Any, ...]]) -> None:
    """The same arrivals and completions (their access-log entries reaching either replica) on two replicas sharing one
    store and on one replica alone: the same requests admitted in the same order, after every step, whichever replica
    holds each parked request and whichever admitted each finished one (the counters and the fair pick are the
    store's). Every cap and KV limit holds and every Check is answered once everything is released."""
    async def run() -> None:
        one, two = FairReplicas(1), FairReplicas(2)
        worlds = (one, two)
        for world in worlds:
            await world.start()
        try:
            for kind, *args in ops:
                for world in worlds:
                    if kind == "flood":  # one tenant's burst on one replica
                        replica, who, n = args
                        for _ in range(n):
                            await world.arrive(replica, who, 100)
                    else:
                        await (world.arrive(*args) if kind == "arrive" else world.complete(*args))
                assert two.admissions.order == one.admissions.order, (two.order(), one.order())
            for world in worlds:
                await world.drain()
            assert two.admissions.order == one.admissions.order, (two.order(), one.order())
        finally:
            for world in worlds:
                await world.stop()
    asyncio.run(run())
