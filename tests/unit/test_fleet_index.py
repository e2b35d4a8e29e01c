"""The fleet index (fleetindex.py) and ``decide``'s indexed choice: the same decisions as the full scan, on random fleets."""

from __future__ import annotations

import random
import weakref
from dataclasses import replace

import pytest

from controlplane.core.admission import AdmissionCore
from controlplane.core.decide import decide
from controlplane.core.ledger import Ledger
from controlplane.core.model import Decision, InferenceRequest, Priority, Verdict
from controlplane.core.fleet import BatchRates, RateTables
from controlplane.core.engines import EngineRates, EngineSample, EngineView, ServedModel
from controlplane.core.policy import ModelPolicy, Policy

MODELS = ("m", "n")


def random_view(rng: random.Random, i: int) -> EngineView:
    cap = rng.choice([None, 1, 2, 4, 8])
    models = tuple(ServedModel(m, rng.choice([None, 4096, 32768])) for m in MODELS if rng.random() < 0.8) or (
        ServedModel("m", None),)
    sample = EngineSample(0.0, running=rng.choice([None, 0, 1, 2, 3, 6]), waiting=rng.choice([None, 0, 1]),
                          kv_usage=rng.choice([None, 0.0, 0.3, 0.85, 0.95]),
                          kv_capacity_tokens=rng.choice([None, 20_000, 200_000]))
    rates = None if rng.random() < 0.3 else EngineRates(1.0, prefill_tokens_per_s=rng.choice([None, 2000.0, 9000.0]),
                                                        decode_tokens_per_s_each=rng.uniform(10, 90))
    return EngineView(
        name=f"e{i}", url="", max_num_seqs=cap, models=models, version=rng.choice(["0.10.0", "0.11.0", None]),
        sample=sample, last_ok_at=0.0, stale=rng.random() < 0.1, chip_class=f"c{rng.randint(0, 3)}",
        drained=rng.random() < 0.05, rates=rates, anchor_decode_tokens_per_s=rng.choice([None, 30.0]),
    )


def random_policy(rng: random.Random) -> Policy:
    return Policy(
        default_max_tokens=rng.choice([128, 1024]),
        wait_for_faster_margin=rng.choice([0.0, 0.2]),
        max_wait_for_faster_services=rng.choice([0.0, 0.5, 2.0]),
        band_margin_ms=rng.choice([200.0, 1000.0]),
        version_floors=(("n", "0.11.0"),) if rng.random() < 0.3 else (),
        models={"m": ModelPolicy(decode_floor_tokens_per_s=rng.choice([None, 10.0]), solo_decode_tokens_per_s=40.0)},
        prefix_max_replicas=rng.choice([0, 0, 1, 3]),
        prefix_demand_slack=rng.choice([0.0, 1.25]),
        max_share_over_capacity=rng.choice([0.0, 1.0, 1.4]),
        near_tie_fraction=rng.choice([0.0, 0.05, 0.5]),
        near_tie_max_engines=rng.choice([0, 1, 3, 8]),
        near_tie_warm_seconds=rng.choice([0.0, 4.0, 1000.0]),
        band_ttft_grain_fraction=rng.choice([0.0, 0.01, 0.05]),
    )


def build(seed: int) -> tuple[AdmissionCore, RateTables, list[EngineView], Policy, random.Random]:
    rng = random.Random(seed)
    policy = random_policy(rng)
    core = AdmissionCore(policy, Ledger(3600), admit_stale=rng.random() < 0.7)
    views = [random_view(rng, i) for i in range(rng.randint(1, 40))]
    core.set_engines(v.name for v in views)
    for v in views:
        core.note_view(v)
    tables = RateTables(
        solo_decode={("m", f"c{c}"): 50.0 for c in range(2)},
        prefill_median={(m, f"c{c}"): rng.uniform(1000, 12000) for m in MODELS for c in range(0, 4, 2)},
        decode_by_batch={v.name: BatchRates({b: rng.uniform(10, 60) for b in rng.sample(range(1, 9), 3)})
                         for v in views if rng.random() < 0.6},
    )
    return core, tables, views, policy, rng


def random_request(rng: random.Random) -> InferenceRequest:
    return InferenceRequest(
        "POST", "/v1/chat/completions", rng.choice(MODELS), prompt_tokens=rng.choice([0, 50, 2000, 30000]),
        max_tokens=rng.choice([None, 16, 300, 5000]), priority=rng.choice(list(Priority)),
        max_ttft_ms=rng.choice([None, None, 500, 3000, 20000]), session=None,
    )


def same(a: Decision, b: Decision) -> None:
    assert (a.verdict, a.reason, a.engine, a.detail) == (b.verdict, b.reason, b.engine, b.detail)
    assert a.expected_done_at == pytest.approx(b.expected_done_at)
    assert a.reserved_tokens == b.reserved_tokens


@pytest.mark.parametrize("seed", range(150))
def test_indexed_choice_equals_full_scan(seed: int) -> None:
    core, tables, views, policy, rng = build(seed)
    now = 10.0
    for step in range(30):
        fleet = core.indexed_fleet(now, tables)
        assert fleet.index is not None
        request = random_request(rng)
        affinity = rng.choice([None, *(v.name for v in views)])
        pick = rng.random()
        behind = rng.choice([0, 0, 3])
        # Expected prefix-cache hits on a few engines (some longer than the prompt, which the core clamps).
        cached = {v.name: rng.choice([64, 1000, 40_000]) for v in views if rng.random() < 0.2}
        waiting = {v.name: rng.choice([1, 3]) for v in views if rng.random() < 0.1}  # passed heads waiting there
        # Prefix affinity's evictions on other engines (affinity.py), charged in the choice on both paths alike.
        # Every engine evicting (no room: the prefix keeps to what its load needs) or some.
        evicting = rng.choice([0.5, 1.0])
        displaced = {v.name: rng.choice([256, 2000, 8000]) for v in views if cached and rng.random() < evicting}
        share = rng.choice([0.0, 0.05, 0.2, 0.6])  # the prefix's share of recent arrivals (choose.holders_suffice)
        # What the prefixes each engine holds ask of it (PrefixIndex.demand): none, or some engines over their part.
        demand = {v.name: rng.choice([0.05, 0.3, 0.8]) for v in views if rng.random() < 0.5}
        indexed = decide(request, fleet, policy, now, 0, affinity, pick, behind, cached=cached, waiting=waiting,
                         displaced=displaced, prefix_share=share, prefix_demand=demand)
        full = decide(request, replace(fleet, index=None), policy, now, 0, affinity, pick, behind, cached=cached,
                      waiting=waiting, displaced=displaced, prefix_share=share, prefix_demand=demand)
        same(indexed, full)
        assert indexed.detail == full.detail and indexed.park_limit_s == full.park_limit_s
        assert indexed.retry_after_s == full.retry_after_s
        # The world moves: admit what was admitted, release something, re-probe an engine, advance time.
        if indexed.verdict is Verdict.ADMIT:
            core.check(f"r{seed}-{step}", request, fleet, now)
        open_ids = list(core.ledger._open)
        if open_ids and rng.random() < 0.4:
            core.release(rng.choice(open_ids), now)
        if rng.random() < 0.3:  # the access log's TTFTs: some engines come in slower than estimated
            for _ in range(rng.choice([1, 20])):
                core.observe_ttft(rng.choice(views).name, rng.choice([0.2, 1.0, 1.5, 3.0, 10.0]), now)
        if rng.random() < 0.2:  # corrections held past their half-life decay (their engines' rows are redone)
            core.decay_corrections(now + rng.choice([0.0, 90.0, 400.0]))
        if rng.random() < 0.3:
            i = rng.randrange(len(views))
            sample = views[i].sample
            assert sample is not None
            views[i] = replace(random_view(rng, i), sample=replace(sample, taken_at=now))
            core.note_view(views[i])
            core.ledger.note_probe(views[i].name, now)
            if rng.random() < 0.5:  # as the probe worker's batches do: the rows are redone between Checks
                core.refresh_index(now, tables)
        now += rng.choice([0.0, 0.05, 1.0])


def test_index_rows_follow_views_and_tickets() -> None:
    core = AdmissionCore(Policy(), Ledger(3600))
    view = EngineView("a", "", 2, (ServedModel("m"),), "1", EngineSample(0.0, running=0, waiting=0), 0.0, stale=False)
    core.set_engines(["a"])
    core.note_view(view)
    first = core.indexed_fleet(1.0).index.models["m"]
    core.ledger.admit("t", "a", "m", 1.0)
    second = core.indexed_fleet(1.0).index.models["m"]
    assert (first.load[0], second.load[0]) == (0.0, 1.0)  # the handed-out snapshot did not change under its holder
    core.note_view(replace(view, drained=True))
    assert not core.indexed_fleet(1.0).index.models["m"].ok[0]
    # Rows redone between Checks (after a batch of probes) never change a snapshot already handed out.
    held = core.indexed_fleet(1.0).index.models["m"]
    core.note_view(replace(view, drained=False, sample=EngineSample(2.0, running=1, waiting=0)))
    core.refresh_index(2.0, RateTables())
    assert not held.ok[0] and held.views[0].drained
    fresh = core.indexed_fleet(2.0).index.models["m"]
    assert fresh.ok[0] and not fresh.views[0].drained


def test_an_array_kept_from_a_dropped_snapshot_never_changes_and_a_dropped_one_costs_no_copy() -> None:
    """Rows are written in place once no snapshot's array is alive (the Check that took it answered); one array kept
    from a snapshot, even without the snapshot, keeps its values."""
    core = AdmissionCore(Policy(), Ledger(3600))
    view = EngineView("a", "", 2, (ServedModel("m"),), "1", EngineSample(0.0, running=0, waiting=0), 0.0, stale=False)
    core.set_engines(["a"])
    core.note_view(view)
    kept_load = core.indexed_fleet(1.0).index.models["m"].load  # the snapshot itself is dropped at once
    core.ledger.admit("t", "a", "m", 1.0)
    assert core.indexed_fleet(1.0).index.models["m"].load[0] == 1.0
    assert kept_load[0] == 0.0
    del kept_load
    matrix = weakref.ref(core.index._rows["m"].values)  # (a weak reference: holding the matrix would be a reader)
    core.ledger.admit("u", "a", "m", 1.0)
    core.refresh_index(1.0, RateTables())
    assert core.index._rows["m"].values is matrix()  # nobody held the last snapshot: written in place


def test_a_model_whose_rows_did_not_change_is_handed_out_again_and_follows_its_next_change() -> None:
    """A Check freezes every model's rows; a model none of whose engines changed gets the same arrays again (no pass over
    its rows), and the first change after that shows."""
    core = AdmissionCore(Policy(), Ledger(3600))
    a = EngineView("a", "", 2, (ServedModel("m"),), "1", EngineSample(0.0, running=0, waiting=0), 0.0, stale=False)
    b = replace(a, name="b", models=(ServedModel("n"),))
    tables = RateTables()  # the rate book's tables: the same object until a median moves
    core.set_engines(["a", "b"])
    core.note_view(a)
    core.note_view(b)
    first = core.indexed_fleet(1.0, tables).index.models
    core.ledger.admit("t", "a", "m", 1.0)
    second = core.indexed_fleet(1.0, tables).index.models
    assert second["n"] is first["n"] and second["m"] is not first["m"]
    assert (first["m"].load[0], second["m"].load[0]) == (0.0, 1.0)
    core.ledger.admit("u", "b", "n", 1.0)
    third = core.indexed_fleet(1.0, tables).index.models
    assert third["n"].load[0] == 1.0 and second["n"].load[0] == 0.0
    assert third["m"] is second["m"]


def test_weights_jitter_at_scale_is_not_a_change() -> None:
    from controlplane.core.weights import moved, should_push

    rng = random.Random(3)
    published = {"m": {f"e{i}": 5 for i in range(200)}}
    jittered = {"m": {f"e{i}": 5 + rng.choice([-1, 0, 1]) for i in range(200)}}
    assert not moved(published, jittered, 0.10)  # one unit of rounding on every engine moves ~7% of the traffic
    assert not should_push(published, jittered, 0.10, now=100.0, last_push_at=0.0)
    half = {"m": {f"e{i}": (9 if i < 100 else 1) for i in range(200)}}
    assert moved(published, half, 0.10)
    assert not should_push(published, half, 0.10, now=5.0, last_push_at=0.0)  # drift waits for the interval
    assert should_push(published, half, 0.10, now=10.0, last_push_at=0.0)
    gone = {"m": {f"e{i}": 5 for i in range(199)}}
    assert should_push(published, gone, 0.10, now=1.0, last_push_at=0.0)  # an engine left: at once


def test_per_class_tables_follow_a_rate_book_class_by_class() -> None:
    """Without chip classes configured every engine is its own class, and the index redoes only the classes whose
    medians changed (the book's change log): after any sequence of probes its prefill and quality-cap arrays equal
    those of an index built from scratch on the same tables, as do its decisions."""
    from controlplane.observe.rates import RateBook

    rng = random.Random(11)
    policy = Policy(models={"m": ModelPolicy(decode_floor_tokens_per_s=10.0, solo_decode_tokens_per_s=40.0)})
    views = [replace(random_view(rng, i), chip_class=f"e{i}", stale=False, drained=False, version="0.11.0")
             for i in range(40)]
    book = RateBook(capacity=8, min_samples=2)
    live = AdmissionCore(policy, Ledger(3600))
    live.set_engines(v.name for v in views)
    for v in views:
        live.note_view(v)
    for step in range(60):
        for v in rng.sample(views, rng.randint(0, 4)):
            book.record("m", v.chip_class, EngineRates(1.0, prefill_tokens_per_s=rng.uniform(1000, 9000), solo=True,
                                                       decode_tokens_per_s_each=rng.uniform(20, 80)))
            live.note_view(v)
        if step == 30:  # an engine of a class never seen before joins
            views.append(replace(views[0], name="late", chip_class="late"))
            live.set_engines(v.name for v in views)
            live.note_view(views[-1])
        tables = book.tables()
        fresh = AdmissionCore(policy, Ledger(3600))
        fresh.set_engines(v.name for v in views)
        for v in views:
            fresh.note_view(v)
        ours, theirs = live.indexed_fleet(float(step), tables), fresh.indexed_fleet(float(step), tables)
        assert ours.index is not None and theirs.index is not None
        a, b = ours.index.models["m"], theirs.index.models["m"]
        assert list(a.prefill) == list(b.prefill)
        assert list(a.quality_block) == list(b.quality_block)
        request = random_request(rng)
        same(decide(request, ours, policy, float(step)), decide(request, theirs, policy, float(step)))
    assert tables.class_serial > 30  # the log was used, not a rebuild per table


def test_a_class_change_log_answers_what_changed_since_a_table_or_that_it_forgot() -> None:
    from controlplane.core.fleet import ClassChangeLog

    log = ClassChangeLog(keep=3)
    for serial, key in enumerate([("m", "a"), ("m", "b"), ("n", "a"), ("m", "c")], start=1):
        log.append(serial, frozenset({key}))
    assert log.since(4, 4) == set()
    assert log.since(3, 4) == {("m", "c")}
    assert log.since(1, 4) == {("m", "b"), ("n", "a"), ("m", "c")}
    assert log.since(1, 3) == {("m", "b"), ("n", "a")}
    assert log.since(0, 4) is None  # table 1's change is forgotten (keep=3)


@pytest.mark.parametrize("seed", range(200))
def test_soonest_row_breaks_ties_as_the_full_scan_orders_them(seed: int) -> None:
    """The index's finish-soonest pick (``_soonest_row``) is the full scan's ``_soonest`` order: finish rounded to a
    microsecond, then the lighter load, the more headroom, the name. Finishes here sit within a microsecond of each
    other and on both sides of a rounding boundary, where a shortcut could pick differently."""
    import numpy as np
    from types import SimpleNamespace

    from controlplane.core.indexed import _soonest_row

    rng = random.Random(seed)
    n = rng.randint(1, 12)
    base = rng.choice([1.0, 2.5, 7.0000005])
    finish = np.array([base + rng.choice([0.0, 0.0, 3e-7, 4.9e-7, 5.1e-7, 9e-7, 2e-6, 0.5]) for _ in range(n)])
    load = np.array([float(rng.choice([0, 1, 2])) for _ in range(n)])
    cap = np.array([rng.choice([np.inf, 0.0, 2.0, 4.0]) for _ in range(n)])
    names = [f"e{i:02d}" for i in rng.sample(range(n), n)]
    rows = SimpleNamespace(load=load, cap=cap, name_rank=np.array([sorted(names).index(x) for x in names]))
    among = np.array(sorted(rng.sample(range(n), rng.randint(1, n))))

    def key(i: int) -> tuple[float, float, float, str]:
        headroom = load[i] / cap[i] if np.isfinite(cap[i]) and cap[i] > 0 else load[i]
        return (round(float(finish[i]), 6), float(load[i]), float(headroom), names[i])

    assert _soonest_row(rows, among, finish) == min((int(i) for i in among), key=key)


def test_the_core_counts_its_decisions_and_those_the_index_answered() -> None:
    """``AdmissionCore.decisions``: every Check's ``decide`` counted once, those decided on the fleet index apart (what
    ``bench fleet`` reports); a preview (``sluice admin explain``) counts nothing."""
    core = AdmissionCore(Policy(), Ledger(3600))
    view = EngineView(name="e", url="", max_num_seqs=4, models=(ServedModel("m", 32_768),), version="0.11.0",
                      sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=200_000),
                      last_ok_at=0.0, stale=False, chip_class="c")
    core.set_engines(["e"])
    core.note_view(view)
    request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=100, max_tokens=50)
    indexed = core.check("a", request, core.indexed_fleet(0.0), 0.0)
    assert indexed.decision.on_index and indexed.ticket is not None
    scanned = core.check("b", request, core.fleet([view], 0.0), 0.0)
    assert not scanned.decision.on_index and scanned.ticket is not None
    core.preview(request, core.indexed_fleet(0.0), 0.0)
    assert (core.decisions.decided, core.decisions.on_index, core.decisions.full_scan) == (2, 1, 1)
