"""Two control-plane replicas over one store, in random interleavings: two real ``AdmissionService``s (each with its own
``AdmissionCore`` and mirror) share one ``MemoryState``, and their Checks, releases (through either replica, as Envoy's
access log reaches any of them) and the store's events interleave on one event loop. Whatever the interleaving:

- no engine ever has more open tickets in the store than its cap, and never more KV reserved than its limit;
- parked requests are admitted in the order they parked, across both replicas (strict FIFO: no LIFO, no backfill);
- every Check is answered once everything is released, and nothing is left in the store or a mirror;
- both replicas derive the same prefix index: every admission's event carries its prompt's blocks. (With the memory
  store no ``reserve`` suspends, so these replicas never race to a refusal; that an admission the store refused is taken
  back out of its replica's index is tests/unit/test_prefix_index.py's.)
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from typing import Any, cast

from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.admission.service import AdmissionService
from controlplane.config import load_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Verdict
from controlplane.core.prefix import prompt_blocks
from controlplane.metrics import SluiceMetrics
from controlplane.store.base import Claim
from controlplane.store.memory import MemoryState, MemoryStore

CAPACITY = 20_000
WATERMARK = 0.9
ENGINES = {"e1": 2, "e2": 3}
PROMPTS = {prompt: prompt_blocks(f"group {prompt} " * 2000, 256, 40) for prompt in (100, 2_000, 6_000)}
"""Each prompt size is one shared prefix (and its requests repeat it exactly)."""


class FakeObservation:
    """What the admission service reads from observation: fixed views of engines serving ``m`` (the probe saw nothing
    running at time 0), ``caps``: engine -> its cap."""

    def __init__(self, core: AdmissionCore, caps: dict[str, int] | None = None,
                 kv_capacity_tokens: int = CAPACITY) -> None:
        self.core = core
        self.views = {
            name: EngineView(name=name, url="", max_num_seqs=cap, models=(ServedModel("m", 32_768),), version="1.0",
                             sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0,
                                                 kv_capacity_tokens=kv_capacity_tokens),
                             last_ok_at=0.0, stale=False, chip_class=name)
            for name, cap in (caps or ENGINES).items()}

    def fleet(self, now: float) -> Any:
        return self.core.fleet(self.views.values(), now)

    def view_of(self, name: str, now: float) -> EngineView | None:
        return self.views.get(name)

    def model_label(self, model: str | None) -> str:
        return model or "-"


class Replicas:
    def __init__(self) -> None:
        base = load_config(None)
        # Strict line order holds where no head is passed over: a prefix kept on the engines its load needs lets the
        # requests of other prefixes pass a head waiting for its busy holders (tests/unit/test_prefix_affinity.py),
        # so that limit is off here (prefix_load_headroom 0).
        policy = replace(base.policy, lifo_after_ms=0, backfill=False, max_park_s=10_000, max_queue_depth=1000,
                         kv_high_watermark=WATERMARK, default_max_tokens=500, prefix_load_headroom=0.0)
        self.config = replace(base, policy=policy)
        self.state = MemoryState()
        self.now = 0.0
        self.park_order: list[str] = []
        self.admitted_from_park: list[str] = []
        self.services = [self._service(f"r{i}") for i in range(2)]
        self.checks: dict[str, asyncio.Task[None]] = {}
        self.ids = itertools.count()

    def _service(self, replica: str) -> AdmissionService:
        core = AdmissionCore(self.config.policy, Ledger(lease_seconds=10_000))
        store = MemoryStore(self.state, replica)
        park = store.park

        async def recorded_park(model: str, klass: int, request_id: str, at: float,
                                claim: Claim | None = None) -> float:
            self.park_order.append(request_id)
            return await park(model, klass, request_id, at, claim)
        store.park = recorded_park  # type: ignore[method-assign]
        service = AdmissionService(self.config, core, cast(Any, FakeObservation(core)), SluiceMetrics(),
                                   lambda: self.now, store)
        return service

    async def start(self) -> None:
        for service in self.services:
            await service.open_store()

    async def stop(self) -> None:
        for service in self.services:
            await service.stop()

    async def burst(self, n: int, prompt: int, max_tokens: int) -> None:
        """``n`` Checks started at once, alternating replicas: each decides before it hears the other's admissions,
        so only the store's own check keeps the caps (a settle after each, as ``submit`` does, would hide that)."""
        for i in range(n):
            await self.submit(i % 2, prompt, max_tokens, settle=False)
        await self.settle()

    async def submit(self, replica: int, prompt: int, max_tokens: int, settle: bool = True) -> None:
        service = self.services[replica]
        rid = f"q{next(self.ids)}"
        request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=prompt, max_tokens=max_tokens,
                                   prefix_blocks=PROMPTS[prompt][:1 + max_tokens // 200])

        async def check() -> None:
            outcome = await service.check(rid, request)
            if outcome.decision.verdict is Verdict.PARK:
                outcome = await service.wait_parked(rid)
                if outcome.ticket is not None:
                    self.admitted_from_park.append(rid)
        self.checks[rid] = asyncio.create_task(check())
        if settle:
            await self.settle()

    async def release(self, pick: int, via: int) -> None:
        open_ids = sorted(self.state.tickets)
        if open_ids:
            self.services[via].release_ticket(open_ids[pick % len(open_ids)])
        await self.settle()

    async def drain(self) -> None:
        """Release whatever is open until every Check has its answer; then every Check was answered (none raised) and
        the store holds no ticket and no line member."""
        for _ in range(200):
            if all(t.done() for t in self.checks.values()) and not self.state.tickets:
                break
            await self.release(0, 0)
        assert all(t.done() for t in self.checks.values()), "a Check was never answered"
        for task in self.checks.values():
            task.result()
        assert not self.state.tickets and not any(self.state.lines.values())

    async def settle(self) -> None:
        for _ in range(20):  # events, wakes and background store writes all run
            await asyncio.sleep(0)
        self.check_invariants()

    def check_invariants(self) -> None:
        for engine, cap in ENGINES.items():
            held = self.state.by_engine.get(engine, set())
            assert len(held) <= cap, f"{engine} has {len(held)} tickets over its cap {cap}"
            assert self.state.kv.get(engine, 0) <= CAPACITY * WATERMARK
        parked_admitted = [r for r in self.park_order if r in self.admitted_from_park]
        assert self.admitted_from_park == parked_admitted[:len(self.admitted_from_park)], \
            "parked requests were admitted out of line order"


op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 1), st.sampled_from([100, 2_000, 6_000]),
              st.sampled_from([100, 1_000, 4_000])),
    st.tuples(st.just("release"), st.integers(0, 40), st.integers(0, 1)),
    st.tuples(st.just("burst"), st.integers(2, 8), st.sampled_from([100, 2_000, 6_000]),
              st.sampled_from([100, 1_000, 4_000])),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(op, min_size=1, max_size=60))
# Found by bursts: a refused woken request restored behind requests parked in the same instant disagreed with the
# store's line (both replicas waited for a head the other never offered); and a ticket learned from a refusal's list
# never got its prompt's blocks from its admission event (the replicas' indexes differed).
@example(ops=[("submit", 0, 100, 100)] * 4 + [("burst", 6, 100, 100)])
@example(ops=[("submit", 0, 100, 100)] * 4 + [("burst", 2, 100, 1000)])
def test_two_replicas_keep_caps_kv_and_line_order(ops: list[tuple[Any, ...]]) -> None:
    async def run() -> None:
        world = Replicas()
        await world.start()
        try:
            for kind, *args in ops:
                if kind == "submit":
                    await world.submit(*args)
                elif kind == "burst":
                    await world.burst(*args)
                else:
                    await world.release(*args)
            await world.drain()
            assert all(not s.core.tickets() for s in world.services), "a mirror kept a released ticket"
            first, second = (s.core for s in world.services)
            for prompt, blocks in PROMPTS.items():
                probe = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=prompt, prefix_blocks=blocks)
                assert first.expected_cached(probe) == second.expected_cached(probe), "the replicas' indexes differ"
            assert first.prefixes.held == second.prefixes.held
        finally:
            await world.stop()
    asyncio.run(run())
