"""An admission service on a shared store, as the tests of the shared line run it: ``service`` (strict FIFO: no LIFO
and no backfill; engines of ``caps`` serving ``m``, long leases), ``running`` (the same, joined to the store and started
for the block), ``answer`` (a Check as the ext_authz handler makes it), ``line`` (the memory store's line members, in
order) and ``parked`` (the service's lot)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, cast

from controlplane.admission.service import AdmissionService
from controlplane.config import load_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.model import InferenceRequest, Outcome, Verdict
from controlplane.core.ledger import Ledger
from controlplane.metrics import SluiceMetrics
from controlplane.store.base import Store
from controlplane.store.memory import MemoryState
from tests.unit.fakes import FakeObservation

REQUEST = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=10, max_tokens=10)


def service(store: Store, caps: dict[str, int], max_park_s: float = 3.0) -> AdmissionService:
    base = load_config(None)
    config = replace(base, policy=replace(base.policy, lifo_after_ms=0, backfill=False, max_park_s=max_park_s,
                                          max_queue_depth=5000))
    core = AdmissionCore(config.policy, Ledger(lease_seconds=10_000))
    observation = cast(Any, FakeObservation(core, caps, kv_capacity_tokens=100_000))
    return AdmissionService(config, core, observation, SluiceMetrics(), time.monotonic, store)


@asynccontextmanager
async def running(store: Store, caps: dict[str, int], max_park_s: float = 3.0) -> AsyncIterator[AdmissionService]:
    """An admission service on ``store``, joined and started, stopped on the way out."""
    svc = service(store, caps, max_park_s)
    await svc.open_store()
    svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


async def answer(svc: AdmissionService, request_id: str) -> Outcome:
    """A Check as the ext_authz handler makes it: decide, and wait in the lot when parked."""
    outcome = await svc.check(request_id, REQUEST)
    if outcome.decision.verdict is Verdict.PARK:
        outcome = await svc.wait_parked(request_id)
    return outcome


def line(state: MemoryState) -> list[str]:
    return [m for members in state.lines.values() for m in members]


def parked(svc: AdmissionService) -> list[str]:
    """The request ids in the service's lot, in its order."""
    return [p.request_id for p in svc.core.parked()]
