"""Closed sets are enums, frozen dataclasses hold read-only mappings (issue 10, types)."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.config import ConfigError, EngineFlavor, OnFailure, OnStale, SimFlavor, parse_config
from controlplane.core.engines import Flavor
from controlplane.core.fleet import BatchRates, EngineLedger, Fleet, RateTables
from controlplane.core.policy import ModelPolicy, Policy
from enginesim.exposition import Dialect

ENGINE = {"name": "a", "url": "http://127.0.0.1:9", "flavor": "sglang", "sim_flavor": "llamacpp"}


def test_the_config_and_the_simulator_name_the_same_dialects() -> None:
    # Two definitions on purpose (the config does not import the simulator); this keeps them one set.
    assert [f.value for f in SimFlavor] == [d.value for d in Dialect]
    assert [f.value for f in EngineFlavor if f is not EngineFlavor.AUTO] == [f.value for f in Flavor]


def test_config_strings_become_enums_that_still_compare_as_strings() -> None:
    config = parse_config({"engines": [ENGINE], "observe": {"on_stale": "closed"},
                           "envoy": {"on_controlplane_failure": "closed"}})
    engine = config.engines[0]
    assert engine.flavor is EngineFlavor.SGLANG and engine.flavor.configured is Flavor.SGLANG
    assert engine.sim_flavor is SimFlavor.LLAMACPP and not engine.sim_flavor.vllm
    assert config.observe.on_stale is OnStale.CLOSED and config.envoy.on_controlplane_failure is OnFailure.CLOSED
    on_stale: str = config.observe.on_stale  # a StrEnum is a str
    assert on_stale == "closed" and f"{engine.flavor}" == "sglang"  # YAML, logs, labels: as before


@pytest.mark.parametrize(("section", "key", "allowed"), [
    ("observe", "on_stale", "open, closed"), ("envoy", "on_controlplane_failure", "open, closed"),
])
def test_a_value_outside_the_set_is_refused_with_the_same_message(section: str, key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"engines": [ENGINE], section: {key: "sometimes"}})
    assert f"{section}.{key}: must be one of {allowed}, got 'sometimes'" in caught.value.problems


def test_frozen_dataclasses_hold_read_only_copies() -> None:
    models = {"m": ModelPolicy(max_ttft_ms=5)}
    policy = Policy(models=models)
    models["other"] = ModelPolicy()
    assert list(policy.models) == ["m"]
    ledger = {"a": EngineLedger(open_tickets=1)}
    fleet = Fleet((), ledger)
    ledger["b"] = EngineLedger()
    assert list(fleet.ledger) == ["a"]
    by_batch = {"a": {1: 10.0}}
    # RateTables takes plain mappings and copies them (__post_init__); its field's type names only BatchRates.
    tables = RateTables(decode_by_batch=by_batch)  # type: ignore[arg-type]
    by_batch["a"][2] = 5.0
    assert dict(tables.decode_by_batch["a"]) == {1: 10.0}
    for mapping in (policy.models, fleet.ledger, fleet.expected_output, tables.solo_decode, tables.decode_by_batch):
        assert isinstance(mapping, MappingProxyType)
        with pytest.raises(TypeError):
            mapping["x"] = None  # type: ignore[index]  # the write its type forbids, tried at run time
    with pytest.raises(TypeError):  # an engine's rates by batch (BatchRates): read-only, kept sorted for bisection
        tables.decode_by_batch["a"][3] = 1.0  # type: ignore[index]  # likewise


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(1, 300), st.floats(1, 100), min_size=1, max_size=40), st.integers(0, 400))
def test_batch_rates_reads_the_nearest_measured_batch(rates: dict[int, float], batch: int) -> None:
    """The bisection gives what a pass over every batch gives: the nearest measured batch, the smaller of two as near."""
    nearest = min(rates, key=lambda n: (abs(n - batch), n))
    assert BatchRates(rates).nearest(batch) == rates[nearest]
