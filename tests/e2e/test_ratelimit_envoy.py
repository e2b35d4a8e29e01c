"""``sluice ratelimit``'s servicer behind the real Envoy: a listener with ``envoy.filters.http.ratelimit`` and route
``rate_limits`` actions, a second listener of the same Envoy as the upstream (a direct response: a route with a direct
response never consults the ratelimit filter). N + k requests: exactly N pass, the rest are 429 with OpenAI's headers;
per-value budgets; two service replicas on one Valkey; a store that goes away."""

from __future__ import annotations

import asyncio
import string
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from controlplane.store.valkeyserver import ValkeyServer
from ratelimit import ChargeRequest, LimitState, RateLimiter, Scope, Settlement, Verdict, open_limiter
from ratelimit.config import parse_descriptor_config
from ratelimit.rls import serve
from sluice.envoyrun import envoy_binary, listener_port, read_admin_address
from rig.waits import free_port, wait_for
from tests.harness import http_json

DESCRIPTORS = parse_descriptor_config({
    "domain": "sluice",
    "descriptors": [
        {"key": "generic_key", "value": "models", "rate_limit": {"unit": "minute", "requests_per_unit": 5}},
        {"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 3}},  # one budget per user
    ],
})

BOOTSTRAP = string.Template("""
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: 0}}
static_resources:
  listeners:
  - name: front
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/v1/models"}
                route:
                  cluster: backend
                  rate_limits: [{actions: [{generic_key: {descriptor_value: models}}]}]
              - match: {prefix: "/per-user"}
                route:
                  cluster: backend
                  rate_limits: [{actions: [{request_headers: {header_name: x-user, descriptor_key: user}}]}]
              - match: {prefix: "/"}
                route: {cluster: backend}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: sluice
              timeout: 5s
              failure_mode_deny: true
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {envoy_grpc: {cluster_name: ratelimit}}
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  - name: backend
    address: {socket_address: {address: 127.0.0.1, port_value: $backend_port}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: backend
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [{match: {prefix: "/"}, direct_response: {status: 200, body: {inline_string: "ok"}}}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: backend
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $backend_port}}}}]
  - name: ratelimit
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: ratelimit
      endpoints: [{lb_endpoints: [$rls_endpoints]}]
""")


class CountingLimiter:
    """A limiter that counts the charges it passes on (which replica Envoy asked)."""

    def __init__(self, inner: RateLimiter) -> None:
        self.inner = inner
        self.settings = inner.settings
        self.charges = 0

    async def charge(self, request: ChargeRequest, now: float) -> Verdict:
        self.charges += 1
        return await self.inner.charge(request, now)

    async def settle(self, charge_id: str, actual_tokens: int, now: float, *,
                     refund_request: bool = False) -> Settlement:
        return await self.inner.settle(charge_id, actual_tokens, now, refund_request=refund_request)

    async def peek(self, scopes: Sequence[Scope], now: float) -> tuple[LimitState, ...]:
        return await self.inner.peek(scopes, now)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Gateway:
    base: str
    process: subprocess.Popen[bytes]


@pytest.fixture
def envoy_for() -> Iterator[Any]:
    """``start(rls_ports)``: an Envoy whose ratelimit cluster has those endpoints (round robin)."""
    started: list[subprocess.Popen[bytes]] = []
    work = Path(tempfile.mkdtemp(prefix="sluice-rls-e2e-"))

    def start(rls_ports: list[int]) -> Gateway:
        endpoints = ", ".join(f"{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}}}"
                              for p in rls_ports)
        bootstrap = work / f"envoy-{len(started)}.yaml"
        bootstrap.write_text(BOOTSTRAP.substitute(backend_port=free_port(), rls_endpoints=endpoints))
        address_path = work / f"admin-{len(started)}"
        process = subprocess.Popen([str(envoy_binary()), "-c", str(bootstrap), "--use-dynamic-base-id",
                                    "--concurrency", "2", "--log-level", "warning",
                                    "--admin-address-path", str(address_path)],
                                   stdout=(work / "envoy.log").open("ab"), stderr=subprocess.STDOUT)
        started.append(process)

        def admin() -> tuple[str, int] | None:
            if process.poll() is not None:
                raise RuntimeError(f"Envoy exited {process.returncode}: {(work / 'envoy.log').read_text()[-2000:]}")
            return read_admin_address(address_path)

        _, admin_port = wait_for(admin, timeout=30, what="Envoy's admin address")
        port = wait_for(lambda: listener_port(http_json(f"http://127.0.0.1:{admin_port}/listeners?format=json",
                                                        timeout=2), "front"), timeout=30, what="Envoy's listener")
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=2).status == 200,
                 timeout=30, what="Envoy ready")
        return Gateway(f"http://127.0.0.1:{port}", process)

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def get(http: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, dict[str, str]]:
    async with http.get(url, headers=headers) as response:
        await response.read()
        return response.status, {k.lower(): v for k, v in response.headers.items()}


async def test_envoy_lets_exactly_the_budget_through_and_answers_the_rest_429(envoy_for: Any,
                                                                              http: aiohttp.ClientSession) -> None:
    server, _, port = await serve(open_limiter("memory"), DESCRIPTORS)
    try:
        gateway = envoy_for([port])
        answers = await asyncio.gather(*(get(http, gateway.base + "/v1/models") for _ in range(12)))
        statuses = sorted(status for status, _ in answers)
        assert statuses == [200] * 5 + [429] * 7
        refused = [h for status, h in answers if status == 429]
        for headers in refused:
            assert headers["x-ratelimit-limit-requests"] == "5"
            assert headers["x-ratelimit-remaining-requests"] == "0"
            assert headers["x-ratelimit-reset-requests"].endswith("s")  # about a minute: "59.9s", "1m0s"
            assert 1 <= int(headers["retry-after"]) <= 12  # one request's share of the minute: 12 s
        admitted = [h for status, h in answers if status == 200]
        assert sorted(int(h["x-ratelimit-remaining-requests"]) for h in admitted) == [0, 1, 2, 3, 4]
        # Routes without rate_limits never consult the service.
        assert [s for s, _ in await asyncio.gather(*(get(http, gateway.base + "/free") for _ in range(8)))] == [200] * 8
    finally:
        await server.stop(None)


async def test_a_descriptor_without_a_value_has_a_budget_per_value(envoy_for: Any,
                                                                   http: aiohttp.ClientSession) -> None:
    server, _, port = await serve(open_limiter("memory"), DESCRIPTORS)
    try:
        gateway = envoy_for([port])
        alice = [s for s, _ in await asyncio.gather(*(get(http, gateway.base + "/per-user", **{"x-user": "alice"})
                                                      for _ in range(5)))]
        bob = [s for s, _ in await asyncio.gather(*(get(http, gateway.base + "/per-user", **{"x-user": "bob"})
                                                    for _ in range(3)))]
        assert sorted(alice) == [200, 200, 200, 429, 429]
        assert bob == [200, 200, 200]
    finally:
        await server.stop(None)


async def test_two_service_replicas_on_one_valkey_enforce_one_budget(envoy_for: Any,
                                                                     http: aiohttp.ClientSession) -> None:
    with ValkeyServer() as valkey:
        limiters = [CountingLimiter(open_limiter(valkey.url, timeout_s=2.0)) for _ in range(2)]
        replicas = [await serve(limiter, DESCRIPTORS) for limiter in limiters]
        try:
            gateway = envoy_for([port for _, _, port in replicas])
            answers = await asyncio.gather(*(get(http, gateway.base + "/v1/models") for _ in range(20)))
            assert sorted(s for s, _ in answers) == [200] * 5 + [429] * 15
            calls = [limiter.charges for limiter in limiters]
            assert min(calls) > 0, f"Envoy should have spread the calls over both replicas: {calls}"

            # The store goes away: the service answers UNAVAILABLE and the filter's failure_mode_deny (true here)
            # refuses; the budget is not silently bypassed.
            valkey.stop()
            started = time.monotonic()
            status, _ = await get(http, gateway.base + "/v1/models")
            assert status == 500
            assert time.monotonic() - started < 5
        finally:
            for server, _, _ in replicas:
                await server.stop(None)
            for limiter in limiters:
                await limiter.close()


async def test_the_servicer_answers_unavailable_when_the_store_is_down() -> None:
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    valkey = ValkeyServer().start()
    limiter = open_limiter(valkey.url, timeout_s=0.3)
    server, _, port = await serve(limiter, DESCRIPTORS)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            request = rls_pb2.RateLimitRequest(domain="sluice", descriptors=[ratelimit_pb2.RateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="generic_key", value="models")])])
            ok = await stub.ShouldRateLimit(request, timeout=5)
            assert ok.overall_code == rls_pb2.RateLimitResponse.OK
            assert (ok.statuses[0].current_limit.requests_per_unit, ok.statuses[0].limit_remaining) == (5, 4)
            valkey.stop()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.ShouldRateLimit(request, timeout=5)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
        await limiter.close()
        valkey.close()
