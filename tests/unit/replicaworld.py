"""Two control-plane replicas over one store for the property tests: two real ``AdmissionService``s (each with its own
``AdmissionCore`` and mirror) share one ``MemoryState``; their Checks (``submit``, ``burst``), releases through either
replica and the store's events interleave on one event loop, and ``settle`` checks after each step that no engine holds
more open tickets than its cap or more KV than its limit, and that parked requests were admitted in the order they
parked. ``drain`` releases until every Check is answered and the store is empty."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from typing import Any, cast

from controlplane.admission.service import AdmissionService
from controlplane.config import load_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.model import InferenceRequest, Verdict
from controlplane.core.prefix import prompt_blocks
from controlplane.metrics import SluiceMetrics
from controlplane.store.base import Claim
from controlplane.store.memory import MemoryState, MemoryStore
from tests.unit.fakes import FakeObservation

CAPACITY = 20_000
WATERMARK = 0.9
ENGINES = {"e1": 2, "e2": 3}
PROMPTS = {prompt: prompt_blocks(f"group {prompt} " * 2000, 256, 40) for prompt in (100, 2_000, 6_000)}
"""Each prompt size is one shared prefix (and its requests repeat it exactly)."""



class RecordedParks(MemoryStore):
    """A memory store that notes its ``park`` calls in ``order`` (the line's order, shared by the replicas)."""

    def __init__(self, state: MemoryState, replica: str, order: list[str]) -> None:
        super().__init__(state, replica)
        self.order = order

    async def park(self, model: str, klass: int, request_id: str, at: float, claim: Claim | None = None,
                   tenant: str | None = None, lift_credit: float = 0.0) -> float:
        self.order.append(request_id)
        return await super().park(model, klass, request_id, at, claim, tenant, lift_credit)


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
        store = RecordedParks(self.state, replica, self.park_order)
        service = AdmissionService(self.config, core, cast(Any, FakeObservation(core, ENGINES, CAPACITY)), SluiceMetrics(),
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
