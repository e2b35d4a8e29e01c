"""Handles on one shared store, for the ``Store`` contract's tests (controlplane/store/base.py): the in-process memory
store or a real valkey-server (the ``handles`` fixture, tests/unit/conftest.py, makes one on each), and the tickets and
times those tests write."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.core.model import Ticket
from controlplane.store.base import Store

BASE = round(time.time())
"""Shared time is the epoch (base.py): a ticket's key expires in the server's own clock, so tests use real times."""


def ticket(tid: str, engine: str = "thor", reserved: int = 100, lease: float = 1000.0, model: str = "m") -> Ticket:
    return Ticket(tid, engine, model, admitted_at=BASE + 10.0, lease_deadline=BASE + lease, reserved_tokens=reserved,
                  expected_done_at=BASE + 20.5, expected_ttft_s=0.25)


@dataclass
class Handles:
    """Handles on ONE shared store: ``get`` one per replica id (opened once), ``new`` another handle of an id."""

    make: Callable[[str], Store]
    made: list[Store] = field(default_factory=list)
    named: dict[str, Store] = field(default_factory=dict)

    async def new(self, replica: str) -> Store:
        store = self.make(replica)
        await store.open()
        self.made.append(store)
        return store

    async def get(self, replica: str) -> Store:
        if replica not in self.named:
            self.named[replica] = await self.new(replica)
        return self.named[replica]
