"""A plain Envoy in front of engines (no ext_authz, no control plane): the benchmarks' reference path."""

from __future__ import annotations

import signal
import string
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sluice.bench.common import free_port
from sluice.envoyrun import envoy_binary

TEMPLATE = Path(__file__).resolve().parents[2] / "envoy" / "bench-plain.yaml"


@contextmanager
def plain_envoy(engine_ports: list[int], lb_policy: str = "ROUND_ROBIN") -> Iterator[str]:
    """Yields the base URL of an Envoy routing every request to ``engine_ports`` with Envoy's own ``lb_policy``."""
    listen, admin = free_port(), free_port()
    endpoints = "\n".join(
        f"              - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}"
        for p in engine_ports
    )
    bootstrap = Path(tempfile.mkdtemp(prefix="sluice-plain-")) / "plain.yaml"
    bootstrap.write_text(string.Template(TEMPLATE.read_text()).substitute(
        listen_port=listen, admin_port=admin, lb_policy=lb_policy, endpoints=endpoints))
    envoy = subprocess.Popen([str(envoy_binary()), "-c", str(bootstrap), "--use-dynamic-base-id", "--concurrency", "2",
                              "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or envoy.poll() is not None:
                    raise RuntimeError("plain Envoy did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{listen}"
    finally:
        envoy.send_signal(signal.SIGTERM)
        envoy.wait(10)
