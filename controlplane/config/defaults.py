"""The file's layout, and the default table derived from the section types.

``ConfigFile`` is the shape of the whole YAML file: one field per top-level key, typed by its section's type (a mapping,
a list of mappings, or a mapping keyed by the user's names). It is never built; the parser takes the top-level keys from
it and the reference walks it. ``DEFAULTS`` is derived from the section types' field defaults: nothing here is a default
of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, is_dataclass
from typing import Any

from controlplane.config.policy import (
    AdaptersConfig, AdmissionConfig, BoxConfig, FairnessConfig, ModelConfig, TenantConfig,
)
from controlplane.config.sections import (
    AdminConfig, ControlPlaneConfig, EnvoyConfig, ObserveConfig, RateLimitConfig, StoreConfig, TicketConfig,
    TracingConfig,
)
from controlplane.config.setting import defaults, keys_of, setting
from controlplane.config.types import EngineConfig


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """A config file's top-level keys. Every key is optional but ``engines``."""

    controlplane: ControlPlaneConfig
    """The control plane's listeners, its overload answers and its replicas."""
    admin: AdminConfig
    """Who may use the admin API (see "Admin API" in docs/architecture.md)."""
    envoy: EnvoyConfig
    """Envoy's listener, limits and timeouts."""
    observe: ObserveConfig
    """How the engines are probed."""
    tickets: TicketConfig
    """Tickets: an admission's hold on its engine's slot."""
    store: StoreConfig
    """Where the ledger lives: this process, or Valkey shared by every replica."""
    ratelimit: RateLimitConfig
    """How the tenants' limiter runs."""
    tracing: TracingConfig
    """OpenTelemetry traces of the Checks, opt-in."""
    engines: tuple[EngineConfig, ...]
    """The engines (at least one). Engines a reload adds or removes reach Envoy over CDS/EDS (``sluice up`` does not start
    or stop simulators for them)."""
    admission: AdmissionConfig
    """How requests are admitted, parked, routed and shed."""
    models: Mapping[str, ModelConfig] = field(metadata=setting(placeholder="<id>"))
    """Settings per model, keyed by its id."""
    version_floors: Mapping[str, str] = field(metadata=setting(placeholder="<pattern>"))
    """Minimum engine version for models whose id contains the pattern (case-insensitive)."""
    boxes: tuple[BoxConfig, ...]
    """Engines sharing one machine's KV."""
    fairness: FairnessConfig
    """Fair share between tenants within each parking class (decision 0015)."""
    adapters: AdaptersConfig
    """LoRA adapters: the base of adapters an engine lists without one, the swap prior, placement by traffic share and
    dynamic loading ("LoRA adapters" in docs/architecture.md)."""
    tenants: Mapping[str, TenantConfig]
    """API keys, priorities and limits per tenant; none: authentication and fair share off."""


DEFAULTS: dict[str, Any] = {key.name: defaults(key.hint) for key in keys_of(ConfigFile) if isinstance(key.hint, type) and is_dataclass(key.hint)}
"""Section -> key -> default, for every section that is one mapping (as YAML writes the values)."""
