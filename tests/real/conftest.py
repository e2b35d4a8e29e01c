"""Real-engine fixtures: two mainline llama.cpp ``llama-server`` processes (``engines``) behind sluice's real control
plane and the real Envoy (``stack``), one of each per run (tests/real/llamastack.py starts them). ``make test`` never
collects this directory (pyproject's ``norecursedirs``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rig.waits import free_port
from tests.harness import Stack
from tests.real.llamastack import Engine, require_built, start_real_stack


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    require_built()
    logs = tmp_path_factory.mktemp("llama")
    pair = [Engine("llama-a", free_port(), logs / "llama-a.log"), Engine("llama-b", free_port(), logs / "llama-b.log")]
    try:
        for engine in pair:
            engine.start()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


@pytest.fixture(scope="session")
def stack(engines: list[Engine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_real_stack(engines, tmp_path_factory.mktemp("stack"))
    yield s
    s.close()
