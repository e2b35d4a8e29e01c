"""The descriptor file (every problem reported with its path) and the rate-limit service, over a real grpc.aio server on
port 0 and the memory limiter: matching, per-value budgets, hits_addend, limit overrides, all or nothing, statuses."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import wrappers_pb2

from ratelimit.config import (
    LimitsConfigError, limiter_key, load_descriptor_config, parse_descriptor_config, parse_limits,
)
from ratelimit.core import Limits, Rate
from ratelimit.memory import MemoryRateLimiter
from ratelimit.rls import serve

Code = rls_pb2.RateLimitResponse.Code
Unit = rls_pb2.RateLimitResponse.RateLimit

CONFIG = {
    "domain": "sluice",
    "descriptors": [
        {"key": "generic_key", "value": "models", "rate_limit": {"unit": "minute", "requests_per_unit": 3}},
        {"key": "remote_address", "rate_limit": {"unit": "second", "requests_per_unit": 2},
         "descriptors": [{"key": "path", "value": "/admin", "rate_limit": {"unit": "hour", "requests_per_unit": 1}}]},
        {"key": "team", "descriptors": [{"key": "model", "rate_limit": {"unit": "Minute", "requests_per_unit": 10}}]},
    ],
}


# ---- the file -------------------------------------------------------------------------------------------------------

def test_matching_walks_the_tree_exact_value_first() -> None:
    config = parse_descriptor_config(CONFIG)
    models = config.match([("generic_key", "models")])
    assert models is not None and (models.rate, models.unit) == (Rate(3, 60.0), "minute")
    assert config.match([("generic_key", "other")]) is None
    one, two = config.match([("remote_address", "10.0.0.1")]), config.match([("remote_address", "10.0.0.2")])
    assert one is not None and two is not None and one.key != two.key and one.rate == Rate(2, 1.0)
    admin = config.match([("remote_address", "10.0.0.1"), ("path", "/admin")])
    assert admin is not None and admin.rate == Rate(1, 3600.0)
    assert config.match([("remote_address", "10.0.0.1"), ("path", "/")]) is None
    assert config.match([("team", "a")]) is None  # a node without rate_limit limits nothing itself
    deep = config.match([("team", "a"), ("model", "m")])
    assert deep is not None and deep.unit == "minute"


def test_limiter_keys_cannot_collide_and_stay_short() -> None:
    assert limiter_key("d", [("a", "b:c=d")]) != limiter_key("d", [("a", "b"), ("c", "d")])
    assert len(limiter_key("d", [("h", "x" * 5000)])) < 100


@pytest.mark.parametrize(("raw", "problems"), [
    ("just text", ["(top level): must be a mapping, not str"]),
    ({"descriptors": []}, ["domain: must be a non-empty string (the ratelimit filter's domain), not None"]),
    ({"domain": "d"}, ["descriptors: missing"]),
    ({"domain": "d", "descriptors": [{"key": "k", "rate_limit": {"unit": "fortnight", "requests_per_unit": 0}}]},
     ["descriptors[0].rate_limit.unit: must be one of second, minute, hour, day, week, month, year, not 'fortnight'",
      "descriptors[0].rate_limit.requests_per_unit: must be an integer >= 1, not 0"]),
    ({"domain": "d", "descriptors": [{"key": "k", "rate_limit": {"unit": "second"}}]},
     ["descriptors[0].rate_limit.requests_per_unit: missing"]),
    ({"domain": "d", "descriptors": [{"key": "k"}, {"value": "v", "rate_limit": {}}]},
     ["descriptors[0]: neither rate_limit nor descriptors (it would limit nothing)",
      "descriptors[1].key: must be a non-empty string, not None"]),
    ({"domain": "d", "descriptors": [{"key": "k", "valu": "x", "descriptors": [{"key": "j", "rate_limit": 5}]}]},
     ["descriptors[0].valu: unknown field (expected one of key, value, rate_limit, descriptors)",
      "descriptors[0].descriptors[0].rate_limit: must be a mapping, not int"]),
    ({"domain": "d", "descriptors": [{"key": "k", "value": "v", "rate_limit": {"unit": "second",
                                                                               "requests_per_unit": 1}}] * 2},
     ["descriptors[1]: a second descriptor with key 'k' and value 'v'"]),
], ids=["not-a-mapping", "no-domain", "no-descriptors", "bad-rate", "no-amount", "empty-node", "typos", "duplicate"])
def test_a_bad_file_is_refused_with_every_problem_and_its_path(raw: Any, problems: list[str]) -> None:
    with pytest.raises(LimitsConfigError) as refused:
        parse_descriptor_config(raw)
    assert refused.value.problems == problems


def test_a_file_that_cannot_be_read_or_parsed_names_itself(tmp_path: Path) -> None:
    with pytest.raises(LimitsConfigError, match="missing.yaml: invalid rate-limit configuration:\n  cannot read"):
        load_descriptor_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("domain: [unclosed")
    with pytest.raises(LimitsConfigError, match="not YAML"):
        load_descriptor_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize(("raw", "limits", "problems"), [
    ({"requests_per_minute": 60, "tokens_per_minute": 100_000, "concurrent_requests": 4},
     Limits.per_minute(60, 100_000, 4), []),
    ({"tokens_per_minute": 5000}, Limits.per_minute(tokens=5000), []),
    ({}, Limits(), []),
    ({"requests_per_minute": 0, "tokens_per_min": 5, "concurrent_requests": "4"}, Limits(),
     ["tenants.acme.limits.tokens_per_min: unknown field (expected one of requests_per_minute, tokens_per_minute, "
      "concurrent_requests)", "tenants.acme.limits.requests_per_minute: must be an integer >= 1, not 0",
      "tenants.acme.limits.concurrent_requests: must be an integer >= 1, not '4'"]),
    ([1], Limits(), ["tenants.acme.limits: must be a mapping, not list"]),
], ids=["all", "tokens-only", "none", "bad", "not-a-mapping"])
def test_parse_limits(raw: Any, limits: Limits, problems: list[str]) -> None:
    assert parse_limits(raw, "tenants.acme.limits") == (limits, problems)


# ---- the service ----------------------------------------------------------------------------------------------------

@pytest.fixture
async def stub() -> AsyncIterator[rls_pb2_grpc.RateLimitServiceStub]:
    server, _, port = await serve(MemoryRateLimiter(), parse_descriptor_config(CONFIG))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield rls_pb2_grpc.RateLimitServiceStub(channel)
    await server.stop(None)


def descriptor(*entries: tuple[str, str], hits: int | None = None,
               limit: tuple[int, int] | None = None) -> ratelimit_pb2.RateLimitDescriptor:
    d = ratelimit_pb2.RateLimitDescriptor(entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v)
                                                   for k, v in entries])
    if hits is not None:
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    if limit is not None:
        d.limit.requests_per_unit, d.limit.unit = limit
    return d


async def ask(stub: Any, *descriptors: ratelimit_pb2.RateLimitDescriptor, domain: str = "sluice",
              hits: int = 0) -> rls_pb2.RateLimitResponse:
    response: rls_pb2.RateLimitResponse = await stub.ShouldRateLimit(
        rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors), hits_addend=hits), timeout=5)
    return response


async def test_statuses_and_headers(stub: Any) -> None:
    models = descriptor(("generic_key", "models"))
    first = await ask(stub, models, descriptor(("unknown", "x")))
    assert first.overall_code == Code.OK
    limited, free = first.statuses
    assert (limited.code, limited.limit_remaining, limited.current_limit.requests_per_unit,
            limited.current_limit.unit) == (Code.OK, 2, 3, Unit.MINUTE)
    assert limited.duration_until_reset.seconds == 20
    assert (free.code, free.HasField("current_limit")) == (Code.OK, False)
    assert {h.key: h.value for h in first.response_headers_to_add} == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2", "x-ratelimit-reset-requests": "20s"}
    await ask(stub, models, hits=2)
    over = await ask(stub, models)
    assert (over.overall_code, over.statuses[0].code, over.statuses[0].limit_remaining) == (
        Code.OVER_LIMIT, Code.OVER_LIMIT, 0)
    headers = {h.key: h.value for h in over.response_headers_to_add}
    assert headers["retry-after"] == "20" and headers["x-ratelimit-remaining-requests"] == "0"


async def test_all_or_nothing_across_descriptors(stub: Any) -> None:
    address = descriptor(("remote_address", "10.1.1.1"))
    admin = descriptor(("remote_address", "10.1.1.1"), ("path", "/admin"))
    assert (await ask(stub, address, admin)).overall_code == Code.OK
    refused = await ask(stub, address, admin)  # /admin: 1 per hour
    assert [s.code for s in refused.statuses] == [Code.OK, Code.OVER_LIMIT]
    # Nothing was counted for the address: it still has its second request this second.
    assert (await ask(stub, address)).statuses[0].limit_remaining == 0


async def test_hits_addend_and_limit_overrides(stub: Any) -> None:
    heavy = await ask(stub, descriptor(("team", "a"), ("model", "m"), hits=4))
    assert heavy.statuses[0].limit_remaining == 6
    too_many = await ask(stub, descriptor(("team", "a"), ("model", "m"), hits=11))
    assert too_many.overall_code == Code.OVER_LIMIT
    assert "retry-after" not in {h.key for h in too_many.response_headers_to_add}  # no wait makes 11 of 10 fit
    overridden = await ask(stub, descriptor(("not", "configured"), limit=(1, Unit.DAY)))
    assert (overridden.statuses[0].current_limit.unit, overridden.statuses[0].limit_remaining) == (Unit.DAY, 0)
    assert (await ask(stub, descriptor(("not", "configured"), limit=(1, Unit.DAY)))).overall_code == Code.OVER_LIMIT


async def test_another_domain_is_not_limited(stub: Any) -> None:
    for _ in range(5):
        answer = await ask(stub, descriptor(("generic_key", "models")), domain="other")
        assert answer.overall_code == Code.OK and not answer.response_headers_to_add


# ---- sluice ratelimit -----------------------------------------------------------------------------------------------

def test_the_command_refuses_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    (tmp_path / "rl.yaml").write_text("domain: sluice\ndescriptors: [{key: k, rate_limit: {unit: minute}}]\n")
    assert main(["ratelimit", "--config", str(tmp_path / "rl.yaml"), "--port", "0"]) == 2
    assert main(["ratelimit", "--config", str(tmp_path / "rl.yaml"), "--store-url", "memcached://x"]) == 2


async def test_the_command_serves_reloads_on_sighup_and_stops_on_sigterm(tmp_path: Path) -> None:
    import asyncio
    import os
    import re
    import signal
    import sys

    path = tmp_path / "rl.yaml"
    path.write_text("domain: sluice\ndescriptors:\n"
                    "  - {key: generic_key, value: models, rate_limit: {unit: minute, requests_per_unit: 3}}\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sluice", "ratelimit", "--config", str(path), "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ})
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        found = re.search(r"on 127\.0\.0\.1:(\d+), store memory", line)
        assert found, line
        async with grpc.aio.insecure_channel(f"127.0.0.1:{found.group(1)}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            models = descriptor(("generic_key", "models"))
            assert (await ask(stub, models)).statuses[0].current_limit.requests_per_unit == 3
            path.write_text("domain: sluice\ndescriptors:\n"
                            "  - {key: generic_key, value: models, rate_limit: {unit: minute, requests_per_unit: 30}}\n"
                            "  - {key: generic_key, value: probe, rate_limit: {unit: minute, requests_per_unit: 1}}\n")
            process.send_signal(signal.SIGHUP)
            probe = descriptor(("generic_key", "probe"))
            for _ in range(200):  # until the new file is in force
                if (await ask(stub, probe)).statuses[0].HasField("current_limit"):
                    break
                await asyncio.sleep(0.05)
            # The budget survived the reload: 20 s of the minute were used (1 of 3), now 1 of 30 costs 2 s more.
            status = (await ask(stub, models)).statuses[0]
            assert (status.current_limit.requests_per_unit, status.limit_remaining) == (30, 19)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
