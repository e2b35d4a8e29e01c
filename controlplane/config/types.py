"""The validated config: frozen, built by ``parse_config`` only. ``RELOADABLE`` alone names what a reload may change."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from controlplane.config.enums import EngineFlavor, SimFlavor
from controlplane.config.sections import (
    AdminConfig, ControlPlaneConfig, EnvoyConfig, ObserveConfig, RateLimitConfig, StoreConfig, TicketConfig,
    TracingConfig,
)
from controlplane.config.setting import setting
from controlplane.core.policy import Policy
from controlplane.core.tenants import Tenants

AUTHZ_TIMEOUT_GRACE_S = 10.0
"""Margin between the longest park and Envoy's limits, so a full park never becomes an authz error or a stream reset."""

_DERIVED = setting(key="")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """An engine sluice routes to. One with ``sim`` is a simulator ``sluice up`` starts; any other runs elsewhere."""

    name: str
    """``[a-z0-9][a-z0-9_-]*``, not ``sluice_*``; also the Envoy cluster name."""
    url: str
    """``http://host:port``; a hostname is resolved (asynchronously) each time the config is loaded or reloaded."""
    host: str = field(metadata=_DERIVED)
    """``url``'s host: as written by ``parse_config``, an IP address once ``resolve_engines`` ran (Envoy's EDS endpoints
    take addresses, not names)."""
    port: int = field(metadata=_DERIVED)
    max_num_seqs: int | None = field(default=None, metadata=setting(minimum=1))
    """The engine's concurrency cap; none: what the engine reports (``sluice up`` writes a vLLM-flavoured simulator's
    from its profile: vLLM reports none)."""
    models: tuple[str, ...] = ()
    """Models served before discovery answers (discovery from ``/v1/models`` adds to them)."""
    sim: str | None = None
    """Simulator profile ``sluice up`` starts for this engine; none: an engine running elsewhere."""
    sim_speed: float = field(default=1.0, metadata=setting(key="speed", minimum=0.001))
    """The simulator's time scale."""
    flavor: EngineFlavor = EngineFlavor.AUTO
    """The engine's metric dialect: ``auto`` (detected from ``/metrics``) or one of ``vllm``, ``sglang``, ``llamacpp``,
    ``tgi``."""
    chip_class: str = field(default="", metadata=setting(default="the engine's name"))
    """Engines of one chip class share prefill/decode medians."""
    sim_flavor: SimFlavor = SimFlavor.VLLM_V1
    """The metric dialect the simulator speaks."""
    prefill_tokens_per_s: float | None = field(default=None, metadata=setting(minimum=0.001))
    """Anchor for this engine's prefill rate (wall-clock), used until one is measured."""
    decode_tokens_per_s: float | None = field(default=None, metadata=setting(minimum=0.001))
    """Anchor for one request's decode rate on this engine (wall-clock), used until one is measured."""
    sim_model: str | None = None
    """Model id a simulator serves instead of its profile's."""
    max_loras: int | None = field(default=None, metadata=setting(minimum=1))
    """LoRA adapter slots (vLLM's ``--max-loras``): at most this many distinct adapters run on it at once; none: what the
    engine's ``lora_requests_info`` reports."""
    runtime_lora_updating: bool = False
    """The engine loads and unloads LoRA adapters at runtime (vLLM with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):
    ``adapters.dynamic_loading`` may load adapters on it."""

    def __post_init__(self) -> None:
        if not self.chip_class:
            object.__setattr__(self, "chip_class", self.name)


#: Sections a running control plane can take from a reloaded file; the others shape processes, ports or Envoy's
#: listener (changing the listener would drain every open stream) and need a restart. Engines added or removed by a
#: reload reach Envoy over CDS/EDS; ``sluice up`` does not start or stop simulators for them.
RELOADABLE = ("admission", "models", "version_floors", "boxes", "observe.on_stale", "engines", "tenants", "fairness",
              "adapters")

PROCESS_SECTIONS = ("controlplane", "envoy", "observe", "tickets", "admin", "store", "tracing", "ratelimit")
"""The sections read once, when a process starts (less any field ``RELOADABLE`` names)."""


@dataclass(frozen=True, slots=True)
class Config:
    controlplane: ControlPlaneConfig
    envoy: EnvoyConfig
    observe: ObserveConfig
    tickets: TicketConfig
    engines: tuple[EngineConfig, ...]
    source: str
    policy: Policy = Policy()
    """The ``admission``, ``models``, ``version_floors``, ``boxes``, ``fairness`` and ``adapters`` sections."""
    admin: AdminConfig = AdminConfig()
    store: StoreConfig = StoreConfig()
    tracing: TracingConfig = TracingConfig()
    tenants: Tenants = Tenants()
    """API keys, priorities and limits per tenant (``controlplane/core/tenants.py``); none: authentication off."""
    ratelimit: RateLimitConfig = RateLimitConfig()

    @property
    def authz_timeout_s(self) -> float:
        """Envoy's ext_authz timeout: tied to the stream idle timeout, not to the (reloadable) park bound, so the listener
        never changes on a policy reload. Validation keeps ``max_park_s + grace`` below it."""
        return self.envoy.stream_idle_timeout_seconds - AUTHZ_TIMEOUT_GRACE_S

    def restart_needed(self, other: Config) -> list[str]:
        """Sections that differ between this config and ``other`` outside ``RELOADABLE`` (a section some of whose fields
        are reloadable, like ``observe``, is compared without them)."""
        changed = []
        for name in PROCESS_SECTIONS:
            mine, theirs = getattr(self, name), getattr(other, name)
            reloadable = {f.split(".", 1)[1]: getattr(theirs, f.split(".", 1)[1]) for f in RELOADABLE
                          if f.startswith(name + ".")}
            if replace(mine, **reloadable) != theirs:
                changed.append(name)
        return changed
