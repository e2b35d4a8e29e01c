"""Plain-Envoy ``LEAST_REQUEST`` arms with the policy's knobs set (``sluice bench steady``): ``choice_count``, the
full-scan selection method and ``active_request_bias``, through the cluster's ``load_balancing_policy`` extension
(``envoy.load_balancing_policies.least_request``) instead of the bare ``lb_policy`` enum ``bench.plain`` renders.

What Envoy does with them (its least_request documentation and ``least_request_lb.cc``): with **equal** endpoint weights
it picks, among ``choice_count`` random hosts (``N_CHOICES``, drawn with replacement) or among all of them
(``FULL_SCAN``), the one with the fewest active requests; with **unequal** weights both are unused and it runs an EDF
schedule on ``weight / (active_requests + 1) ^ active_request_bias`` (bias 0: weighted round robin; Envoy's default
1.0).
A capped arm lists an engine once per multiple of the smallest cap (``plain.render``): its host count is the scan's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bench.common import free_port
from bench.plain import PlainEnvoy, render, running_envoy


@dataclass(frozen=True, slots=True)
class LeastRequestArm:
    """One configuration: every arm of this kind is capped at each engine's max_num_seqs, as ``LR+w+cap`` is."""

    name: str
    weighted: bool
    """Endpoint weights proportional to the engines' measured throughput (else equal)."""
    active_request_bias: float | None
    """None: Envoy's default (1.0)."""
    full_scan: bool = True
    """``FULL_SCAN`` with ``choice_count`` = the host count; False: Envoy's default two random choices."""


def hosts(max_per_host: list[int]) -> int:
    """The cluster's host count when each engine is listed once per multiple of the smallest cap (``plain.render``)."""
    unit = min(max_per_host)
    return sum(cap // unit for cap in max_per_host)


def policy_block(choice_count: int, full_scan: bool, active_request_bias: float | None) -> str:
    """The cluster's ``load_balancing_policy`` (YAML, at the cluster's indentation) for these settings."""
    lines = ["      load_balancing_policy:", "        policies:", "          - typed_extension_config:",
             "              name: envoy.load_balancing_policies.least_request", "              typed_config:",
             '                "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.'
             "LeastRequest", f"                choice_count: {choice_count}"]
    if full_scan:
        lines.append("                selection_method: FULL_SCAN")
    if active_request_bias is not None:
        lines.append(f"                active_request_bias: {{default_value: {active_request_bias:g}, "
                     "runtime_key: bench.least_request.active_request_bias}")
    return "\n".join(lines) + "\n"


def render_arm(listen: int, admin: int, engine_ports: list[int], arm: LeastRequestArm, weights: list[int],
               max_per_host: list[int]) -> str:
    """``plain.render``'s capped bootstrap with its ``lb_policy: LEAST_REQUEST`` line replaced by the arm's policy."""
    text = render(listen, admin, engine_ports, "LEAST_REQUEST", weights if arm.weighted else None, max_per_host)
    line = "      lb_policy: LEAST_REQUEST\n"
    if text.count(line) != 1:
        raise ValueError("envoy/bench-plain.yaml no longer has one `lb_policy` line at the cluster's indentation")
    choices = hosts(max_per_host) if arm.full_scan else 2
    return text.replace(line, policy_block(choices, arm.full_scan, arm.active_request_bias))


@contextmanager
def least_request_arm(engine_ports: list[int], arm: LeastRequestArm, weights: list[int],
                      max_per_host: list[int]) -> Iterator[PlainEnvoy]:
    """A running plain Envoy for ``arm`` (one worker: per-host caps need one connection pool, see
    ``plain.plain_envoy_arm``)."""
    listen, admin = free_port(), free_port()
    with running_envoy(render_arm(listen, admin, engine_ports, arm, weights, max_per_host), listen, admin, 1,
                       f"plain Envoy for {arm.name}") as envoy:
        yield envoy
