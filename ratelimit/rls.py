"""The limiter as Envoy's rate-limit service (``envoy.service.ratelimit.v3.RateLimitService``): ``sluice ratelimit``.

For request-rate limits on routes where the Check does not run or is not wanted (``/v1/models``, an admin path, per
client address): Envoy's own ``envoy.filters.http.ratelimit`` filter sends the route's descriptors here, and the
descriptor file (``config.py``) says which are limited by how much. Same GCRA, same backends as the Check's limiter,
so several ``sluice ratelimit`` processes on one Valkey enforce one budget.

One ``ShouldRateLimit`` is one charge, all or nothing: a request is counted against every limited descriptor only if
every one has room (envoyproxy/ratelimit counts the others anyway). A descriptor's ``hits_addend`` overrides the
request's (0 or unset: 1); its ``limit`` override replaces the configured rate (and limits a descriptor the file does
not name). The answer carries, per descriptor, ``current_limit``, ``limit_remaining`` and ``duration_until_reset``
(seconds until the budget is full again), and OpenAI's ``x-ratelimit-*-requests`` + ``retry-after`` in
``response_headers_to_add``. A store that cannot answer is a gRPC ``UNAVAILABLE``: the filter's ``failure_mode_deny``
decides (false, its default: the request passes).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import duration_pb2

from ratelimit.config import (
    UNITS, DescriptorConfig, DescriptorMatch, LimitsConfigError, limiter_key, load_descriptor_config,
)
from ratelimit.core import ChargeRequest, Limits, LimitKind, Outcome, Rate, Scope, Verdict
from ratelimit.headers import openai_headers
from ratelimit.port import RateLimiter, StoreUnavailable

log = logging.getLogger("sluice.ratelimit")

# Envoy pings its gRPC peers every 30 s; without these a grpc server answers GOAWAY too_many_pings (the same options as
# the control plane's, controlplane/app.py).
GRPC_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]

_UNIT_ENUM = {
    "second": rls_pb2.RateLimitResponse.RateLimit.SECOND, "minute": rls_pb2.RateLimitResponse.RateLimit.MINUTE,
    "hour": rls_pb2.RateLimitResponse.RateLimit.HOUR, "day": rls_pb2.RateLimitResponse.RateLimit.DAY,
    "week": rls_pb2.RateLimitResponse.RateLimit.WEEK, "month": rls_pb2.RateLimitResponse.RateLimit.MONTH,
    "year": rls_pb2.RateLimitResponse.RateLimit.YEAR,
}
_UNIT_NAME = {number: name for name, number in _UNIT_ENUM.items()}


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One request descriptor, out of its proto."""

    entries: tuple[tuple[str, str], ...]
    hits: int | None = None
    """Its own ``hits_addend`` (``None``: the request's)."""
    override: tuple[int, str] | None = None
    """Its ``limit`` override: (requests per unit, unit name)."""


@dataclass(frozen=True, slots=True)
class RlsPlan:
    matches: tuple[DescriptorMatch | None, ...]
    """Per request descriptor, the budget it draws on (``None``: not limited)."""
    charge: ChargeRequest | None
    """``None``: nothing to charge."""


def plan_request(config: DescriptorConfig, domain: str, descriptors: Sequence[Descriptor], hits: int) -> RlsPlan:
    """Which budgets a request draws on and the one charge that counts it against all of them. Two descriptors that
    reach one budget draw on it once, with their hits added."""
    if domain != config.domain:
        return RlsPlan(tuple(None for _ in descriptors), None)
    matches: list[DescriptorMatch | None] = []
    costs: dict[str, int] = {}
    rates: dict[str, Rate] = {}
    for d in descriptors:
        match = config.match(d.entries)
        if d.override is not None:
            amount, unit = d.override
            period = UNITS[unit]
            match = DescriptorMatch(limiter_key(config.domain, d.entries), Rate(amount, period), unit)
        matches.append(match)
        if match is not None:
            costs[match.key] = costs.get(match.key, 0) + (hits if d.hits is None else d.hits)
            rates.setdefault(match.key, match.rate)
    if not costs:
        return RlsPlan(tuple(matches), None)
    scopes = tuple(Scope(key, Limits(requests=rates[key]), requests_cost=cost) for key, cost in costs.items())
    return RlsPlan(tuple(matches), ChargeRequest(scopes, tokens=0))


def descriptors_of(request: rls_pb2.RateLimitRequest) -> list[Descriptor]:
    out = []
    for d in request.descriptors:
        override = None
        if d.HasField("limit") and d.limit.requests_per_unit > 0 and d.limit.unit in _UNIT_NAME:
            override = (int(d.limit.requests_per_unit), _UNIT_NAME[d.limit.unit])
        hits = int(d.hits_addend.value) if d.HasField("hits_addend") else None
        out.append(Descriptor(tuple((e.key, e.value) for e in d.entries), hits, override))
    return out


def response(plan: RlsPlan, verdict: Verdict | None) -> rls_pb2.RateLimitResponse:
    """The proto answer: a status per request descriptor, in order, and OpenAI's headers."""
    Code = rls_pb2.RateLimitResponse.Code
    states = {s.key: s for s in verdict.states if s.kind is LimitKind.REQUESTS} if verdict else {}
    refused = {s.key for s in verdict.denied_by} if verdict and not verdict.allowed else set()
    answer = rls_pb2.RateLimitResponse(overall_code=Code.OVER_LIMIT if refused else Code.OK)
    for match in plan.matches:
        status = answer.statuses.add(code=Code.OK)
        if match is None or match.key not in states:
            continue
        state = states[match.key]
        status.code = Code.OVER_LIMIT if match.key in refused else Code.OK
        status.current_limit.CopyFrom(rls_pb2.RateLimitResponse.RateLimit(
            name=match.key, requests_per_unit=match.rate.limit, unit=_UNIT_ENUM[match.unit]))
        status.limit_remaining = state.remaining
        status.duration_until_reset.CopyFrom(_duration(state.reset_s))
    if verdict is not None:
        answer.response_headers_to_add.extend(base_pb2.HeaderValue(key=k, value=v) for k, v in openai_headers(verdict))
    return answer


def _duration(seconds: float) -> duration_pb2.Duration:
    nanos = max(0, round(seconds * 1e9))
    return duration_pb2.Duration(seconds=nanos // 1_000_000_000, nanos=nanos % 1_000_000_000)


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):
    """``clock``: wall-clock seconds (``time.time``): every process sharing the store must agree on it."""

    def __init__(self, limiter: RateLimiter, config: DescriptorConfig,
                 clock: Callable[[], float] = time.time) -> None:
        self.limiter = limiter
        self.config = config
        """Replaced whole by a reload (``sluice ratelimit`` on SIGHUP); the budgets stay."""
        self.clock = clock
        self._unknown_domains: set[str] = set()

    async def ShouldRateLimit(self, request: rls_pb2.RateLimitRequest,
                              context: grpc.aio.ServicerContext[Any, Any]) -> rls_pb2.RateLimitResponse:
        config = self.config
        if request.domain != config.domain and request.domain not in self._unknown_domains:
            self._unknown_domains.add(request.domain)
            log.warning("rate-limit requests for domain %r are not limited: the descriptor file's domain is %r",
                        request.domain, config.domain)
        plan = plan_request(config, request.domain, descriptors_of(request), request.hits_addend or 1)
        if plan.charge is None:
            return response(plan, None)
        try:
            verdict = await self.limiter.charge(plan.charge, self.clock())
        except StoreUnavailable as exc:
            log.warning("%s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise  # not reached: abort raises
        if verdict.outcome is Outcome.TOO_LARGE:
            log.debug("a request's hits exceed a whole budget: %s", [s.key for s in verdict.denied_by])
        return response(plan, verdict)


async def serve(limiter: RateLimiter, config: DescriptorConfig, host: str = "127.0.0.1",
                port: int = 0) -> tuple[grpc.aio.Server, RateLimitServicer, int]:
    """A started grpc.aio server answering ``ShouldRateLimit``; returns it, its servicer and the port bound."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    servicer = RateLimitServicer(limiter, config)
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return server, servicer, bound


def run_ratelimit_service(config_path: str, port: int, host: str = "127.0.0.1", store_url: str | None = None,
                          store_timeout_s: float = 0.5) -> int:
    """``sluice ratelimit``: serve until SIGINT/SIGTERM; SIGHUP re-reads the descriptor file (a file with a problem
    leaves the running one in place). Exit 2 on a bad file or store URL."""
    from ratelimit import open_limiter

    try:
        config = load_descriptor_config(config_path)
        limiter = open_limiter(store_url, timeout_s=store_timeout_s)
    except (LimitsConfigError, ValueError) as exc:
        log.error("%s", exc)
        return 2

    async def main() -> None:
        server, servicer, bound = await serve(limiter, config, host, port)
        print(f"sluice ratelimit: domain {config.domain!r} on {host}:{bound}, store {store_url or 'memory'}",
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)

        def reload() -> None:
            try:
                servicer.config = load_descriptor_config(config_path)
                log.info("reloaded %s (domain %r)", config_path, servicer.config.domain)
            except LimitsConfigError as exc:
                log.error("reload refused, the running descriptors stay: %s", exc)

        loop.add_signal_handler(signal.SIGHUP, reload)
        await stop.wait()
        await server.stop(grace=2.0)
        await limiter.close()

    asyncio.run(main())
    return 0
