"""LoRA adapters in the decision core: candidates serve the base, a floor on the base covers its adapters, an engine whose
adapter slots are all held by other adapters cannot start the request, a swap is priced into TTFT; and, over random
interleavings, no admitted request ever waits inside an engine for an adapter slot."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.adapterhomes import placed
from controlplane.core.adapters import AdapterPolicy, resident
from controlplane.core.admission import AdmissionCore
from controlplane.core.decide import decide
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import EngineLedger, Fleet
from controlplane.core.model import InferenceRequest, Reason, Verdict
from controlplane.core.policy import Policy
from controlplane.core.route import estimate

BASE = "llama-8b"
ADAPTERS = ("sql", "chat", "legal", "code")
P = Policy(default_max_tokens=100, adapters=AdapterPolicy(swap_s=2.0))


def engine(name: str, *, slots: int | None = 1, models: tuple[str, ...] = (BASE, *ADAPTERS), parent: str = BASE,
           version: str = "0.10.1", running: tuple[str, ...] | None = None, seqs: int = 4) -> EngineView:
    served = tuple(ServedModel(m, 32_768 if m == BASE else None, None if m == BASE else parent) for m in models)
    return EngineView(name=name, url=f"http://{name}", max_num_seqs=seqs, models=served, version=version,
                      sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000,
                                          lora_running=running),
                      last_ok_at=0.0, stale=False, chip_class="gpu", max_loras=slots,
                      anchor_prefill_tokens_per_s=1000.0, anchor_decode_tokens_per_s=20.0)


def fleet(*engines: EngineView, open_: dict[str, tuple[str, ...]] | None = None,
          recent: dict[str, tuple[str, ...]] | None = None) -> Fleet:
    ledger = {name: EngineLedger(open_tickets=len(models), open_by_model=tuple((m, 1) for m in models),
                                 expected_done=tuple(10.0 for _ in models))
              for name, models in (open_ or {}).items()}
    bases = {m.model_id: m.parent for e in engines for m in e.models if m.parent}
    return Fleet(tuple(engines), ledger, adapters=bases, adapter_recent=recent or {})


def ask(model: str) -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", model, prompt_tokens=100, max_tokens=50)


def test_the_engine_holding_the_adapter_wins_by_the_swap_it_spares() -> None:
    warm, cold = engine("warm"), engine("cold")
    f = fleet(cold, warm, recent={"warm": ("sql",), "cold": ("chat",)})
    decision = decide(ask("sql"), f, P, now=0.0)
    assert decision.verdict is Verdict.ADMIT and decision.engine == "warm"
    hot = estimate(warm, ask("sql"), True, f, P, 0.0)
    swapped = estimate(cold, ask("sql"), True, f, P, 0.0)
    assert swapped.ttft_s - hot.ttft_s == 2.0  # the configured swap prior, nothing else differs
    assert estimate(cold, ask(BASE), True, f, P, 0.0).ttft_s == estimate(warm, ask(BASE), True, f, P, 0.0).ttft_s


def test_resident_adapters_follow_tickets_then_the_engine_then_history_up_to_the_slots() -> None:
    e = engine("e", slots=2, running=("legal",))
    f = fleet(e, open_={"e": ("sql",)}, recent={"e": ("chat", "code")})
    assert resident(e, f, f.adapters) == ("sql", "legal")
    unknown = engine("u", slots=None, running=("legal",))
    assert resident(unknown, fleet(unknown, recent={"u": ("chat",)}), f.adapters) == ("legal", "chat")


def test_an_engine_whose_slots_other_adapters_hold_cannot_start_it() -> None:
    busy, free = engine("busy"), engine("free")
    # busy's one slot runs "chat"; free's is idle. A request for "sql" goes to free although busy is first in order.
    decision = decide(ask("sql"), fleet(busy, free, open_={"busy": ("chat",)}), P, now=0.0)
    assert decision.verdict is Verdict.ADMIT and decision.engine == "free"
    # The same adapter shares its slot: a second "chat" request may join busy.
    assert decide(ask("chat"), fleet(busy, open_={"busy": ("chat",)}), P, now=0.0).verdict is Verdict.ADMIT
    # Both engines' slots held by other adapters: it parks, for the adapter slots, not the sequence cap.
    parked = decide(ask("sql"), fleet(busy, free, open_={"busy": ("chat",), "free": ("legal",)}), P, now=0.0)
    assert parked.verdict is Verdict.PARK and parked.reason is Reason.ADAPTER_SLOTS
    # Unknown slots: no slot rule (it may queue inside the engine, as before adapters were known).
    unknown = engine("unknown", slots=None)
    assert decide(ask("sql"), fleet(unknown, open_={"unknown": ("chat",)}), P, now=0.0).verdict is Verdict.ADMIT


def test_only_engines_serving_the_base_are_candidates_and_its_floor_covers_adapters() -> None:
    other = engine("other", models=("mistral-7b", "sql"), parent="mistral-7b")
    right = engine("right")
    f = Fleet((other, right), adapters={"sql": BASE})  # the operator's mapping names the base
    assert decide(ask("sql"), f, P, now=0.0).engine == "right"
    floored = Policy(default_max_tokens=100, version_floors=((BASE, "0.11"),))
    shed = decide(ask("sql"), fleet(engine("old", version="0.10.1")), floored, now=0.0)
    assert shed.verdict is Verdict.SHED and shed.reason is Reason.VERSION_FLOOR
    assert decide(ask("sql"), fleet(engine("new", version="0.11.0")), floored, now=0.0).verdict is Verdict.ADMIT


def test_configured_adapters_count_where_engines_name_no_parent() -> None:
    plain = EngineView(name="e", url="", max_num_seqs=4, models=(ServedModel(BASE, 32_768), ServedModel("sql")),
                       sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0), last_ok_at=0.0, stale=False,
                       max_loras=1)
    policy = Policy(default_max_tokens=100, adapters=AdapterPolicy(base_models={"sql": BASE, "chat": BASE}))
    f = Fleet((plain,), {"e": EngineLedger(open_tickets=1, open_by_model=(("chat", 1),), expected_done=(5.0,))})
    assert decide(ask("sql"), f, policy, now=0.0).reason is Reason.ADAPTER_SLOTS


# -- the invariant over random interleavings ---------------------------------------------------------------------------
ENGINES = (("a", 1), ("b", 2), ("c", None))
op = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(ADAPTERS + (BASE,)), st.integers(1, 4)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("tick"), st.floats(0.1, 20.0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=60))
def test_no_admitted_request_waits_inside_an_engine_for_an_adapter_slot(ops: list[tuple[Any, ...]]) -> None:
    """After every event, each engine with known slots holds open tickets of at most that many distinct adapters (so
    every admitted request's adapter had a slot the moment it arrived), and parked requests are woken as slots free."""
    core = AdmissionCore(Policy(default_max_tokens=100, max_queue_depth=50, max_park_s=1000), Ledger(lease_seconds=10_000))
    views = [engine(name, slots=slots) for name, slots in ENGINES]
    for v in views:
        core.note_view(v)
    now, seq, open_tickets = 0.0, 0, []
    slots = dict(ENGINES)

    def check_invariant() -> None:
        for name, n in slots.items():
            held = {t.model for t in core.tickets() if t.engine == name and t.model != BASE}
            if n is not None:
                assert len(held) <= n, (name, held)

    for kind, *args in ops:
        if kind == "submit":
            model, count = args
            for _ in range(int(count)):
                seq += 1
                outcome = core.check(f"r{seq}", ask(str(model)), core.fleet(views, now), now)
                if outcome.ticket is not None:
                    open_tickets.append(outcome.ticket.ticket_id)
        elif kind == "release" and open_tickets:
            ticket = open_tickets.pop(int(args[0]) % len(open_tickets))
            core.release(ticket, now)
            for outcome in core.wake(core.fleet(views, now), now):
                if outcome.ticket is not None:
                    open_tickets.append(outcome.ticket.ticket_id)
                check_invariant()
        else:
            now += float(args[0]) if kind == "tick" else 0.0
        check_invariant()
    # Every slot freed: what is still parked can run.
    for ticket in open_tickets:
        core.release(ticket, now)
    woken = core.wake(core.fleet(views, now), now)
    check_invariant()
    assert all(o.decision.verdict is not Verdict.PARK for o in woken)


def test_a_near_tie_keeps_the_adapter_where_it_is_loaded() -> None:
    """A swap far smaller than the near-tie margin still decides the tie: spreading by recent serves would load the
    adapter on a second engine, stalling its batch and evicting another adapter."""
    small = Policy(default_max_tokens=100, adapters=AdapterPolicy(swap_s=0.01))
    warm, cold = engine("warm"), engine("cold")
    base = fleet(warm, cold, recent={"warm": ("sql",)})
    busy_warm = Fleet(base.engines, base.ledger, adapters=base.adapters, adapter_recent=base.adapter_recent,
                      recent_serves={"warm": 50.0})
    assert decide(ask("sql"), busy_warm, small, now=0.0).engine == "warm"
    assert decide(ask(BASE), busy_warm, small, now=0.0).engine == "cold"  # a base request spreads as before


def test_an_engines_swap_is_learned_from_its_cold_and_warm_first_tokens() -> None:
    """Each adapter request's TTFT less the rest of its estimate is a residual: cold when its admission priced a swap,
    warm otherwise. The engine's swap is the cold median over the warm one (the estimate's own error cancels) once it
    has ``swap_min_samples`` of each; the estimates then use it, outside the TTFT correction."""
    policy = Policy(default_max_tokens=100, adapters=AdapterPolicy(swap_s=2.0, swap_min_samples=2))
    core = AdmissionCore(policy, Ledger(lease_seconds=1000))
    views = [engine("e", slots=1)]
    now = 0.0

    def serve(model: str, residual: float, priced: float) -> None:
        nonlocal now
        now += 1.0
        outcome = core.check(f"r{now}", ask(model), core.fleet(views, now), now)
        assert outcome.ticket is not None and outcome.decision.swap_s == priced
        rest = outcome.decision.expected_ttft_s - priced
        assert core.observe_first_token(outcome.ticket.ticket_id, rest + residual) == pytest.approx(residual)
        assert core.observe_first_token(outcome.ticket.ticket_id, 9.0) is None  # one observation a ticket
        core.release(outcome.ticket.ticket_id, now)

    serve("sql", 0.9, 2.0)   # cold: the one slot held nothing
    serve("sql", 0.2, 0.0)   # warm
    serve("chat", 0.7, 2.0)  # cold: evicts sql
    assert core.fleet(views, now).adapter_swap_s == {}  # one warm residual is not enough yet
    serve("chat", 0.4, 0.0)  # warm
    f = core.fleet(views, now)
    assert f.adapter_swap_s["e"] == pytest.approx(0.8 - 0.3)
    assert core.check("next", ask("sql"), f, now).decision.swap_s == pytest.approx(0.5)
    assert core.fleet([engine("other")], now).adapter_swap_s.get("other") is None  # others keep the prior


def test_a_swap_is_charged_for_the_requests_it_stalls() -> None:
    """A load stalls the engine's whole batch: the choice charges the swap once per request already there, so a busy
    engine without the adapter loses to an idle one without it, though their own estimates for the request tie."""
    busy = replace(engine("busy"), sample=EngineSample(0.0, running=3, waiting=0, kv_usage=0.0,
                                                       kv_capacity_tokens=100_000))
    idle = engine("idle")
    f = fleet(busy, idle)
    x = estimate(busy, ask("sql"), True, f, P, 0.0)
    assert x.swap_s == 2.0 and x.stall_s == 2.0 * 3
    assert estimate(idle, ask("sql"), True, f, P, 0.0).stall_s == 0.0
    # Its one slot holds another adapter: loading this one evicts it, and (no shares known) its next request there
    # reloads it: a whole swap more in the choice.
    full = fleet(busy, idle, recent={"busy": ("chat",)})
    charged = placed("sql", [estimate(busy, ask("sql"), True, full, P, 0.0)], [busy], full, 1.5, 0.25, full.adapters,
                     {})
    assert charged[0].stall_s == 2.0 * (3 + 1)
    assert estimate(busy, ask(BASE), True, f, P, 0.0).stall_s == 0.0
