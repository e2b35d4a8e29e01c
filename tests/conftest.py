"""The test tiers, as markers set from each test's folder: ``unit`` (in-process, no Envoy; about a minute),
``e2e`` (real Envoy, simulators, Valkey, Prometheus; a few minutes) and ``real`` (a real llama.cpp server, run only by
``make test-real``). ``pytest -m unit`` runs the fast tier alone."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "e2e", "real")
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(HERE).parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
