"""What a reload changes: the ``RELOADABLE`` sections that differ between the running config and the file's."""

from __future__ import annotations

from dataclasses import replace

from controlplane.config.types import RELOADABLE, Config
from controlplane.core.adapters import AdapterPolicy
from controlplane.core.fairshare import FairShare

_POLICY_PARTS = ("models", "version_floors", "boxes")
"""Sections of the config that become ``Policy`` fields of the same name; ``admission`` is the rest of ``Policy``."""


def _section_value(config: Config, name: str) -> object:
    """What a reloadable section (a ``RELOADABLE`` name) holds in ``config``."""
    if name == "admission":
        return replace(config.policy, models={}, version_floors=(), boxes=(), fairness=FairShare(),
                       adapters=AdapterPolicy())
    if name == "adapters":
        return config.policy.adapters
    if name == "fairness":  # its own settings: on under ``auto``, the weights and shares follow ``tenants``
        return replace(config.policy.fairness, enabled=False, weights={}, reserved={})
    if name in _POLICY_PARTS:
        return getattr(config.policy, name)
    section, _, attribute = name.partition(".")
    value = getattr(config, section)
    return getattr(value, attribute) if attribute else value


def changed_sections(old: Config, new: Config) -> list[str]:
    """The ``RELOADABLE`` sections that differ between ``old`` and ``new``, in ``RELOADABLE``'s order (what a reload
    reports as changed)."""
    return [name for name in RELOADABLE if _section_value(old, name) != _section_value(new, name)]
