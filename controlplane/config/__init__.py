"""sluice's configuration: one YAML file, validated all-or-nothing into a frozen ``Config``.

Each key is written once, as a field of its section's type (``sections.py``; ``policy.py`` for the sections the core's
types are built from, whose defaults are the core's own): the field's default is the key's default, its annotation and
``Setting`` metadata its type and bounds, and the first paragraph of its docstring the key's meaning. The parser
(``check.py``, ``parse.py``, ``parsepolicy.py``), ``DEFAULTS`` and the reference (``reference.py``, rendered into
docs/configuration.md; a unit test keeps the two equal) all read them from there. ``ConfigFile`` (``defaults.py``) is
the file's layout.

Units are in names: a key, and the field mirroring it, says ``_seconds`` or ``_ms`` as the file does (never renamed);
every other identifier says ``_s`` or ``_ms``. A key becomes the core field of the same name, else the key with
``_seconds`` spelled ``_s`` (``core_field``): the one translation. Validation does no I/O; ``load.py`` reads the file
and resolves engine hostnames. ``RELOADABLE`` alone names what a reload may change (``reload.py`` reports it). Port 0
(any free port) is accepted where a process reports what it bound; ``sluice up`` and ``sluice envoy`` refuse it.
"""

from controlplane.config.check import ConfigError
from controlplane.config.defaults import DEFAULTS, ConfigFile
from controlplane.config.enums import (
    EngineFlavor, OnFailure, OnStale, ProbeProcess, RateLimitOnFailure, SimFlavor, StoreBackend, StoreOnFailure,
    WorkerPriority,
)
from controlplane.config.load import (
    BUNDLED_CONFIG, load_config, load_resolved_config, read_raw, resolve_engines, resolve_engines_blocking,
)
from controlplane.config.parse import is_loopback, parse_config
from controlplane.config.reload import changed_sections
from controlplane.config.sections import (
    PROBE_PROCESS_MIN_ENGINES, AdminConfig, ClientTls, ControlPlaneConfig, EnvoyConfig, ObserveConfig, RateLimitConfig,
    ReplicaAddress, ServerTls, StoreConfig, TicketConfig, TracingConfig,
)
from controlplane.config.types import AUTHZ_TIMEOUT_GRACE_S, RELOADABLE, Config, EngineConfig

__all__ = [
    "AUTHZ_TIMEOUT_GRACE_S", "BUNDLED_CONFIG", "DEFAULTS", "PROBE_PROCESS_MIN_ENGINES", "RELOADABLE", "AdminConfig",
    "ClientTls", "Config", "ConfigError", "ConfigFile", "ControlPlaneConfig", "EngineConfig", "EngineFlavor",
    "EnvoyConfig", "ObserveConfig", "OnFailure", "OnStale", "ProbeProcess", "RateLimitConfig", "RateLimitOnFailure",
    "ReplicaAddress", "ServerTls", "SimFlavor", "StoreBackend", "StoreConfig", "StoreOnFailure", "TicketConfig",
    "TracingConfig", "WorkerPriority", "changed_sections", "is_loopback", "load_config", "load_resolved_config",
    "read_raw", "resolve_engines", "resolve_engines_blocking", "parse_config",
]
