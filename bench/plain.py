"""A plain Envoy in front of engines (no ext_authz, no control plane): the benchmarks' reference path."""

from __future__ import annotations

import json
import signal
import string
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port
from sluice.envoyrun import envoy_binary

TEMPLATE = Path(__file__).resolve().parents[1] / "envoy" / "bench-plain.yaml"


@dataclass(frozen=True)
class PlainEnvoy:
    base: str
    admin: str
    bootstrap: str
    """The exact bootstrap YAML this Envoy runs."""
    concurrency: int

    def counters(self, prefix: str = "cluster.engine.") -> dict[str, int]:
        """Envoy's counters and gauges under ``prefix`` (admin ``/stats?format=json``)."""
        with urllib.request.urlopen(f"{self.admin}/stats?format=json&filter=^{prefix}", timeout=5) as response:
            stats = json.load(response)["stats"]
        return {s["name"][len(prefix):]: int(s["value"]) for s in stats if "value" in s}


def render(listen: int, admin: int, engine_ports: list[int], lb_policy: str, weights: list[int] | None = None,
           max_per_host: list[int] | None = None, hash_header: str | None = None) -> str:
    """The bootstrap for ``engine_ports``. ``weights``: each engine's ``load_balancing_weight``. ``max_per_host``: each
    engine's concurrency cap, enforced as per-host ``max_connections`` over HTTP/1.1; Envoy has one per-host value per
    cluster, so an engine whose cap is a multiple m of the smallest is listed m times (m hosts, same address, each with
    1/m of its weight), which gives it m x the per-host cap. ``hash_header``: the route hashes this request header (for
    ``RING_HASH`` / ``MAGLEV``: requests with the same value go to the same engine)."""
    lines: list[str] = []
    unit = min(max_per_host) if max_per_host else 1
    for i, port in enumerate(engine_ports):
        copies = 1
        if max_per_host:
            copies, rest = divmod(max_per_host[i], unit)
            if rest:
                raise ValueError(f"engine caps {max_per_host} are not multiples of the smallest")
        for _ in range(copies):
            line = f"              - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}"
            if weights:
                share = max(1, round(weights[i] / copies))
                line += f"\n                load_balancing_weight: {share}"
            lines.append(line)
    per_host = (f"        per_host_thresholds:\n          - {{max_connections: {unit}}}" if max_per_host else "")
    hash_policy = f", hash_policy: [{{header: {{header_name: {hash_header}}}}}]" if hash_header else ""
    return string.Template(TEMPLATE.read_text()).substitute(
        listen_port=listen, admin_port=admin, lb_policy=lb_policy, endpoints="\n".join(lines), per_host=per_host,
        hash_policy=hash_policy)


@contextmanager
def plain_envoy_arm(engine_ports: list[int], lb_policy: str = "ROUND_ROBIN", weights: list[int] | None = None,
                    max_per_host: list[int] | None = None, concurrency: int = 2,
                    hash_header: str | None = None) -> Iterator[PlainEnvoy]:
    """A running plain Envoy (see ``render``). With per-host caps run it with ``concurrency=1``: each worker has its own
    connection pools, so with two workers an idle keep-alive connection in one worker's pool would hold a slot the other
    worker's pending requests cannot use."""
    listen, admin = free_port(), free_port()
    with running_envoy(render(listen, admin, engine_ports, lb_policy, weights, max_per_host, hash_header), listen,
                       admin, concurrency, "plain Envoy") as envoy:
        yield envoy


@contextmanager
def running_envoy(text: str, listen: int, admin: int, concurrency: int, name: str) -> Iterator[PlainEnvoy]:
    """Envoy on the bootstrap ``text`` (listening on ``listen``, its admin on ``admin``), ready when yielded (at most
    15 s, else RuntimeError naming ``name``), stopped on the way out."""
    bootstrap = Path(tempfile.mkdtemp(prefix="sluice-plain-")) / "plain.yaml"
    bootstrap.write_text(text)
    envoy = subprocess.Popen([str(envoy_binary()), "-c", str(bootstrap), "--use-dynamic-base-id", "--concurrency",
                              str(concurrency), "--log-level", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or envoy.poll() is not None:
                    raise RuntimeError(f"{name} did not start") from None
                time.sleep(0.1)
        yield PlainEnvoy(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", text, concurrency)
    finally:
        envoy.send_signal(signal.SIGTERM)
        envoy.wait(10)


@contextmanager
def plain_envoy(engine_ports: list[int], lb_policy: str = "ROUND_ROBIN") -> Iterator[str]:
    """Yields the base URL of an Envoy routing every request to ``engine_ports`` with Envoy's own ``lb_policy``."""
    with plain_envoy_arm(engine_ports, lb_policy) as arm:
        yield arm.base
