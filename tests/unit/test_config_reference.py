"""The configuration reference (docs/configuration.md) is the config types rendered, and each key is written once: its
default, type and bounds in its field, the core's defaults read from the core's own types."""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from controlplane.config import DEFAULTS, parse_config
from controlplane.config.defaults import ConfigFile
from controlplane.config.policy import AdmissionConfig, TenantLimits
from controlplane.config.reference import COMMAND, render
from controlplane.config.setting import core_field, key_names, keys_of
from controlplane.core.policy import Policy
from ratelimit.config import LIMIT_FIELDS, parse_limits

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ONE = {"engines": [{"name": "a", "url": "http://127.0.0.1:1"}]}


def test_the_reference_in_docs_is_the_config_types_rendered() -> None:
    assert REFERENCE.read_text() == render(), f"docs/configuration.md is out of date; regenerate it: {COMMAND}"


def test_every_key_of_the_file_is_in_the_reference() -> None:
    text = render()
    for section in keys_of(ConfigFile):
        assert f"## `{section.name}`" in text
    for key in DEFAULTS["envoy"]:
        assert f"| `envoy.{key}` |" in text
    assert "| `engines[].speed` |" in text and "| `tenants.<name>.priority.max` |" in text


def test_an_empty_section_is_its_types_defaults() -> None:
    config = parse_config(ONE)
    for section in ("controlplane", "admin", "envoy", "observe", "tickets", "store", "tracing", "ratelimit"):
        shape = typing.get_type_hints(ConfigFile)[section]
        assert getattr(config, section) == shape(), section
    assert config.policy == Policy()


def test_every_admission_key_is_a_policy_field_of_the_same_type_and_order() -> None:
    """No knob of the policy is out of the file's reach, and the key is the field (``_seconds`` spelled ``_s``)."""
    parts = {"models", "version_floors", "boxes", "fairness", "adapters"}
    knobs = [f.name for f in fields(Policy) if f.name not in parts]
    assert [core_field(Policy, f.name) for f in fields(AdmissionConfig)] == knobs
    policy_types, key_types = typing.get_type_hints(Policy), typing.get_type_hints(AdmissionConfig)
    for f in fields(AdmissionConfig):
        assert key_types[f.name] == policy_types[core_field(Policy, f.name)], f.name
        assert f.default is not MISSING and f.default == getattr(Policy(), core_field(Policy, f.name))


def test_a_tenants_limits_are_the_limiters_keys_with_the_limiters_bounds() -> None:
    assert key_names(TenantLimits) == frozenset(LIMIT_FIELDS)
    for key in keys_of(TenantLimits):
        assert key.setting.minimum == 1 and key.integer
        assert parse_limits({key.name: 1})[1] == [] and parse_limits({key.name: 0})[1] != []


def test_a_number_without_bounds_is_refused_when_the_types_are_read() -> None:
    from controlplane.config.check import Checker
    from controlplane.config.setting import Key, Setting

    with pytest.raises(TypeError, match="needs a minimum"):
        Checker().value("x.y", 1, Key("y", "y", int, 0, Setting()))
