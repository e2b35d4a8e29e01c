"""``parse_config``: a raw mapping (every key optional but ``engines``) checked into a frozen ``Config``, every problem
reported at once with its dotted path. Pure: no I/O (an engine's hostname is resolved afterwards, ``load.py``).

A key's type, bounds and default are its field's (``setting.py``); this module adds the checks that span keys.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any
from urllib.parse import urlsplit

from controlplane.config.check import Checker, ConfigError
from controlplane.config.defaults import ConfigFile
from controlplane.config.parsepolicy import parse_policy, parse_tenants
from controlplane.config.sections import (
    AdminConfig, ClientTls, ControlPlaneConfig, EnvoyConfig, ObserveConfig, RateLimitConfig, ReplicaAddress, ServerTls,
    StoreConfig, TicketConfig, TracingConfig,
)
from controlplane.config.setting import key_names, key_of, keys_of
from controlplane.config.types import AUTHZ_TIMEOUT_GRACE_S, Config, EngineConfig
from controlplane.names import ENGINE_HEADER, TICKET_HEADER

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_RESERVED_PREFIX = "sluice_"


def parse_config(raw: Any, source: str = "<memory>") -> Config:
    """Validate a raw mapping into a frozen ``Config``; raise ``ConfigError`` listing every problem."""
    c = Checker()
    if not isinstance(raw, dict):
        raise ConfigError(["(top): the config must be a mapping"])
    for key in sorted(set(raw) - key_names(ConfigFile)):
        c.problems.append(f"{key}: unknown field")
    cp = c.section(raw, "controlplane", ControlPlaneConfig)
    controlplane, admin = _controlplane(c, cp, c.section(raw, "admin", AdminConfig))
    envoy = _envoy(c, c.section(raw, "envoy", EnvoyConfig), controlplane.tls, server_given=cp.get("tls") is not None)
    observe = c.settings("observe", c.section(raw, "observe", ObserveConfig), ObserveConfig)
    if observe.rate_min_samples > observe.rate_ring_size:
        c.problems.append("observe.rate_min_samples: must not exceed observe.rate_ring_size")
    if observe.poll_timeout_seconds > observe.poll_interval_seconds:
        c.problems.append("observe.poll_timeout_seconds: must not exceed observe.poll_interval_seconds")
    tickets = c.settings("tickets", c.section(raw, "tickets", TicketConfig), TicketConfig)
    store = c.settings("store", c.section(raw, "store", StoreConfig), StoreConfig)
    if store.url is not None and not store.url.startswith(("redis://", "rediss://", "unix://")):
        c.problems.append(f"store.url: must be a redis://, rediss:// or unix:// URL, got {store.url!r}")
    if store.replica_id is not None and ("|" in store.replica_id or ":" in store.replica_id):
        c.problems.append("store.replica_id: must not contain '|' or ':'")
    tracing = _tracing(c, c.section(raw, "tracing", TracingConfig))
    ratelimit = c.settings("ratelimit", c.section(raw, "ratelimit", RateLimitConfig), RateLimitConfig)
    tenants = parse_tenants(c, raw.get("tenants"))
    engines = _engines(c, raw.get("engines"))
    policy = parse_policy(c, raw, {e.name for e in engines}, tenants)
    if envoy.stream_idle_timeout_seconds < policy.max_park_s + 2 * AUTHZ_TIMEOUT_GRACE_S:
        c.problems.append(
            f"admission.max_park_seconds: must stay {2 * AUTHZ_TIMEOUT_GRACE_S:g} s below "
            f"envoy.stream_idle_timeout_seconds ({envoy.stream_idle_timeout_seconds:g}): a parked request is a silent "
            "stream, and Envoy's Check timeout is the idle timeout less 10 s"
        )
    if policy.adapters.dynamic_loading and \
            envoy.stream_idle_timeout_seconds < policy.adapters.load_timeout_s + 2 * AUTHZ_TIMEOUT_GRACE_S:
        c.problems.append(
            f"adapters.load_timeout_seconds: must stay {2 * AUTHZ_TIMEOUT_GRACE_S:g} s below "
            f"envoy.stream_idle_timeout_seconds ({envoy.stream_idle_timeout_seconds:g}): a Check waits for the load, "
            "and Envoy's Check timeout is the idle timeout less 10 s"
        )
    if c.problems:
        raise ConfigError(c.problems)
    return Config(controlplane, envoy, observe, tickets, engines, source, policy, admin, store, tracing, tenants,
                  ratelimit)


def _controlplane(c: Checker, cp: dict[str, Any], am: dict[str, Any]) -> tuple[ControlPlaneConfig, AdminConfig]:
    controlplane = c.settings(
        "controlplane", cp, ControlPlaneConfig,
        tls=_server_tls(c, "controlplane.tls", cp.get("tls"), _tls_keys(ControlPlaneConfig)),
        replicas=_replicas(c, cp.get("replicas", []), cp.get("host", key_of(ControlPlaneConfig, "host").default)),
    )
    admin = c.settings("admin", am, AdminConfig, tls=_server_tls(c, "admin.tls", am.get("tls"), _tls_keys(AdminConfig)))
    if not is_loopback(controlplane.admin_host) and not admin.has_token_source:
        c.problems.append(f"controlplane.admin_host: {controlplane.admin_host!r} is not a loopback address; an admin "
                          "listener reachable from other hosts needs admin.token_file or admin.token_env")
    return controlplane, admin


def _tls_keys(section: type) -> tuple[str, ...]:
    """The keys a section's ``tls`` block takes: its ``Setting.keys``, else every key of ``ServerTls``."""
    return key_of(section, "tls").setting.keys or tuple(k.name for k in keys_of(ServerTls))


def _envoy(c: Checker, ev: dict[str, Any], server: ServerTls | None, *, server_given: bool) -> EnvoyConfig:
    kept = ev.get("client_headers_kept", list(key_of(EnvoyConfig, "client_headers_kept").default))
    if not isinstance(kept, list) or not all(isinstance(h, str) and h.lower().startswith("x-sluice-") for h in kept):
        c.problems.append("envoy.client_headers_kept: must be a list of x-sluice-* header names")
        kept = []
    for internal in (ENGINE_HEADER, TICKET_HEADER):
        if internal in [h.lower() for h in kept]:
            c.problems.append(f"envoy.client_headers_kept: {internal} can never come from a client")
    client = _client_tls(c, "envoy.controlplane_tls", ev.get("controlplane_tls"))
    envoy = c.settings("envoy", ev, EnvoyConfig, client_headers_kept=tuple(h.lower() for h in kept),
                       controlplane_tls=client)
    _check_tls_pair(c, server, client, server_given=server_given, client_given=ev.get("controlplane_tls") is not None)
    return envoy


def _server_tls(c: Checker, path: str, value: Any, known: tuple[str, ...]) -> ServerTls | None:
    """``controlplane.tls`` or ``admin.tls``: a certificate and its key, both or neither (and the client CA where
    ``known`` names it)."""
    block = c.files(path, value, known)
    if block is None:
        return None
    cert, key, ca = block["cert_file"], block["key_file"], block.get("client_ca_file")
    if not cert or not key:
        c.problems.append(f"{path}: needs both cert_file and key_file (TLS is all or nothing)")
        return None
    return ServerTls(cert, key, ca)


def _client_tls(c: Checker, path: str, value: Any) -> ClientTls | None:
    block = c.files(path, value, tuple(k.name for k in keys_of(ClientTls)))
    if block is None:
        return None
    if not block["ca_file"]:
        c.problems.append(f"{path}.ca_file: needed (the CA that signed the control plane's certificate)")
        return None
    if bool(block["cert_file"]) != bool(block["key_file"]):
        c.problems.append(f"{path}: cert_file and key_file go together (Envoy's client certificate and its key)")
        return None
    return ClientTls(block["ca_file"], block["cert_file"], block["key_file"], block["server_name"])


def _check_tls_pair(c: Checker, server: ServerTls | None, client: ClientTls | None, *, server_given: bool,
                    client_given: bool) -> None:
    """Both ends of the Envoy-facing port, from one config, must agree (a block refused already is not reported again)."""
    if server is not None and client is None and not client_given:
        c.problems.append("envoy.controlplane_tls: needed when controlplane.tls is set (Envoy must speak TLS to the "
                          "control plane: ca_file, and cert_file/key_file for mutual TLS)")
    if client is not None and server is None and not server_given:
        c.problems.append("envoy.controlplane_tls: set, but controlplane.tls is not (the control plane's gRPC port would "
                          "be plaintext)")
    if server is not None and server.mutual and client is not None and client.cert_file is None:
        c.problems.append("envoy.controlplane_tls.cert_file: needed, controlplane.tls.client_ca_file asks every client "
                          "for a certificate (mutual TLS)")


def _replicas(c: Checker, raw: Any, default_host: Any) -> tuple[ReplicaAddress, ...]:
    if not isinstance(raw, list):
        c.problems.append("controlplane.replicas: must be a list of {host, grpc_port, metrics_port}")
        return ()
    return tuple(c.settings(path, item, ReplicaAddress, host=c.text(f"{path}.host", item.get("host", default_host)))
                 for _, path, item in c.entries("controlplane.replicas", raw, key_names(ReplicaAddress)))


def _tracing(c: Checker, tr: dict[str, Any]) -> TracingConfig:
    endpoint = c.text("tracing.otlp_endpoint", tr.get("otlp_endpoint", key_of(TracingConfig, "otlp_endpoint").default))
    if endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            c.problems.append(f"tracing.otlp_endpoint: must be an http:// or https:// URL with a host, got {endpoint!r}")
        elif parts.path in ("", "/"):
            # The exporter posts to the URL as given; a bare collector address would get every batch answered 404.
            c.problems.append(f"tracing.otlp_endpoint: must name the traces path, e.g. {endpoint.rstrip('/')}/v1/traces")
    return c.settings("tracing", tr, TracingConfig, otlp_endpoint=endpoint)


def _engines(c: Checker, raw: Any) -> tuple[EngineConfig, ...]:
    if not isinstance(raw, list) or not raw:
        c.problems.append("engines: must be a non-empty list")
        return ()
    engines: list[EngineConfig] = []
    names: set[str] = set()
    for _, path, item in c.entries("engines", raw, key_names(EngineConfig)):
        name = c.text(f"{path}.name", item.get("name"))
        if name and (not _NAME_RE.match(name) or name.startswith(_RESERVED_PREFIX)):
            c.problems.append(
                f"{path}.name: {name!r} must match {_NAME_RE.pattern} and not start with {_RESERVED_PREFIX!r}"
            )
        if name in names:
            c.problems.append(f"{path}.name: duplicate engine name {name!r}")
        names.add(name)
        url = c.text(f"{path}.url", item.get("url"))
        host, port = _host_port(c, f"{path}.url", url) if url else ("", 0)
        models = item.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            c.problems.append(f"{path}.models: must be a list of model ids")
            models = []
        sim = item.get("sim")
        if sim is not None and (not isinstance(sim, str) or not sim):
            # Which profiles exist is the simulator launcher's business (sluice/simulated.py), not the control plane's.
            c.problems.append(f"{path}.sim: must be a simulator profile name, got {sim!r}")
            sim = None
        chip_class = item.get("chip_class", name)
        if not isinstance(chip_class, str) or not chip_class:
            c.problems.append(f"{path}.chip_class: must be a non-empty string")
            chip_class = name
        sim_model = item.get("sim_model")
        if sim_model is not None and (not isinstance(sim_model, str) or not sim_model):
            c.problems.append(f"{path}.sim_model: must be a model id")
            sim_model = None
        engines.append(c.settings(path, item, EngineConfig, name=name, url=url, host=host, port=port,
                                  models=tuple(models), sim=sim, chip_class=chip_class, sim_model=sim_model))
    return tuple(engines)


def _host_port(c: Checker, path: str, url: str) -> tuple[str, int]:
    """``url``'s host (a name stays a name: ``resolve_engines`` turns it into an address) and port."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        c.problems.append(f"{path}: must be an http:// URL with a host, got {url!r}")
        return "", 0
    try:
        port = parts.port if parts.port is not None else 80
    except ValueError:
        c.problems.append(f"{path}: bad port in {url!r}")
        return "", 0
    if port == 0:
        c.problems.append(f"{path}: an engine's URL needs its real port, got {url!r}")
        return "", 0
    return parts.hostname, port


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); a wildcard (``0.0.0.0``, ``::``) or any other host is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

