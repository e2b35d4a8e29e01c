"""Tenants (issue 12): the pure rules (``controlplane/core/tenants.py``), the ``tenants:`` and ``ratelimit:`` config
sections, the quota shell over a real limiter (memory, and a Valkey that is not there), and the access log's settle."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import duration_pb2, struct_pb2

from controlplane.servicers.accesslog import AccessLogServicer
from controlplane.config import ConfigError, RateLimitOnFailure, parse_config
from controlplane.core.feedback import FirstToken
from controlplane.core.model import InferenceRequest, Priority, Reason, Ticket, Verdict
from controlplane.core.policy import Policy
from controlplane.core.prompt_tokens import PromptShape
from controlplane.core.tenants import (
    ObservedResponse, Tenant, Tenants, Usage, every_scope, key_digest, limiter_scopes, precharge_tokens,
    settled_usage, tenant_priority,
)
from controlplane.metrics import SluiceMetrics
from controlplane.admission.quota import Charged, Quota, Refused, make_limiter
from ratelimit import LimitKind, Limits
from ratelimit.memory import MemoryRateLimiter
from tests.unit.fakes import FakeContext

ACME = key_digest("sk-acme-1")
ENGINES = [{"name": "a", "url": "http://127.0.0.1:1"}]


def tenants_config(tenants: dict[str, Any], **sections: Any) -> Any:
    return parse_config({"engines": ENGINES, "tenants": tenants, **sections})


# ---- who ------------------------------------------------------------------------------------------------------------

def test_a_bearer_key_names_its_tenant_by_digest_only() -> None:
    acme = Tenant("acme", (ACME,))
    tenants = Tenants.of([acme, Tenant("beta", (key_digest("sk-beta"),))])
    assert tenants.enabled and not Tenants().enabled
    assert tenants.identify("Bearer sk-acme-1") is acme
    assert tenants.identify("bearer  sk-acme-1 ") is acme  # the scheme is case-insensitive, blanks around the key go
    for wrong in (None, "", "Bearer ", "Bearer sk-acme-2", "Basic sk-acme-1", "sk-acme-1", f"Bearer {ACME}"):
        assert tenants.identify(wrong) is None, wrong
    with pytest.raises(ValueError, match="two tenants"):
        Tenants.of([acme, Tenant("copy", (ACME,))])


def test_a_tenants_class_is_its_default_and_never_above_its_max() -> None:
    tenant = Tenant("acme", (ACME,), default_priority=Priority.SHEDDABLE, max_priority=Priority.STANDARD)
    assert tenant_priority(tenant, None, Priority.STANDARD) is Priority.SHEDDABLE
    assert tenant_priority(tenant, " ", Priority.STANDARD) is Priority.SHEDDABLE
    assert tenant_priority(tenant, "critical", Priority.CRITICAL) is Priority.STANDARD
    assert tenant_priority(tenant, "standard", Priority.STANDARD) is Priority.STANDARD
    assert tenant_priority(tenant, "sheddable", Priority.SHEDDABLE) is Priority.SHEDDABLE


def test_scopes_and_precharge() -> None:
    tenant = Tenant("acme", (ACME,), limits=Limits.per_minute(requests=10),
                    model_limits={"cortex": Limits.per_minute(tokens=500), "free": Limits()})
    assert [s.key for s in limiter_scopes(tenant, "cortex")] == ["acme", "acme/cortex"]
    assert [s.key for s in limiter_scopes(tenant, "other")] == ["acme"]
    assert [s.key for s in every_scope(tenant)] == ["acme", "acme/cortex"]
    assert limiter_scopes(Tenant("open", (ACME,)), "cortex") == ()
    policy = Policy(default_max_tokens=300)
    chat = InferenceRequest("POST", "/v1/chat/completions", "cortex", prompt_tokens=40, max_tokens=100)
    assert precharge_tokens(chat, policy) == 140
    assert precharge_tokens(InferenceRequest("POST", "/v1/completions", "cortex", prompt_tokens=40), policy) == 340
    assert precharge_tokens(InferenceRequest("POST", "/v1/embeddings", "cortex", prompt_tokens=40), policy) == 40


@pytest.mark.parametrize(("seen", "usage"), [
    (ObservedResponse(50, 200, True, deltas=9, prompt_tokens=48, completion_tokens=12, total_tokens=60),
     Usage(48, 12, True)),
    (ObservedResponse(50, 200, True, prompt_tokens=48, total_tokens=48), Usage(48, 0, True)),  # embeddings
    (ObservedResponse(50, 200, True, total_tokens=70), Usage(70, 0, True)),
    (ObservedResponse(50, 200, True, deltas=9), Usage(50, 9, False)),  # streamed without include_usage
    (ObservedResponse(50, 0, True, deltas=3), Usage(50, 3, False)),  # the client left after 3 deltas
    (ObservedResponse(50, 400, True), Usage(0, 0, False)),  # the engine refused it
    (ObservedResponse(50, 503, False), Usage(0, 0, False)),  # never reached an engine
], ids=["usage", "embeddings", "total-only", "deltas", "client-left", "engine-refused", "not-sent"])
def test_settled_usage(seen: ObservedResponse, usage: Usage) -> None:
    assert settled_usage(seen) == usage


# ---- config ---------------------------------------------------------------------------------------------------------

def test_the_tenants_section_parses_to_tenants() -> None:
    config = tenants_config({
        "acme": {"keys": [ACME.upper()], "priority": {"default": "sheddable", "max": "critical"},
                 "limits": {"requests_per_minute": 60, "tokens_per_minute": 10000, "concurrent_requests": 4},
                 "models": {"cortex": {"tokens_per_minute": 2000}}, "models_allowed": ["cortex", "small"]},
        "beta": {"keys": [key_digest("sk-beta")]},
    }, ratelimit={"on_failure": "closed", "timeout_seconds": 0.2})
    acme = config.tenants.by_name["acme"]
    assert acme.key_digests == (ACME,)
    assert (acme.default_priority, acme.max_priority) == (Priority.SHEDDABLE, Priority.CRITICAL)
    assert acme.limits == Limits.per_minute(requests=60, tokens=10000, concurrent=4)
    assert acme.model_limits["cortex"] == Limits.per_minute(tokens=2000)
    assert acme.models_allowed == frozenset({"cortex", "small"})
    beta = config.tenants.by_name["beta"]
    assert (beta.default_priority, beta.max_priority, beta.models_allowed) == (Priority.STANDARD, Priority.STANDARD,
                                                                               None)
    assert config.ratelimit.on_failure is RateLimitOnFailure.CLOSED
    assert not parse_config({"engines": ENGINES}).tenants.enabled


def test_every_tenant_problem_is_reported_and_no_key_is_echoed() -> None:
    with pytest.raises(ConfigError) as caught:
        tenants_config({
            "acme": {"keys": ["sk-live-secret"], "priority": {"default": "critical", "max": "standard", "x": 1},
                     "limits": {"tokens_per_minute": 0}, "models": {"big": {"requests_per_minute": 5}},
                     "models_allowed": ["small"], "colour": "red"},
            "acme/x": {"keys": [ACME]},
            "copy": {"keys": [ACME]},
            "none": {"keys": []},
        }, ratelimit={"on_failure": "maybe"})
    problems = caught.value.problems
    assert "sk-live-secret" not in str(caught.value)
    expected = [
        "tenants.acme.colour: unknown field",
        "tenants.acme.keys[0]: must be a SHA-256 hex digest",
        "tenants.acme.priority.x: unknown field",
        "tenants.acme.priority.default: critical is above max (standard)",
        "tenants.acme.limits.tokens_per_minute: must be an integer >= 1",
        "tenants.acme.models.big: limits a model models_allowed does not allow",
        "tenants.acme/x: the name must match",
        "tenants.copy.keys[0]: the same key digest is listed by tenant 'acme/x'",
        "tenants.none.keys: must be a non-empty list",
        "ratelimit.on_failure: must be one of open, closed",
    ]
    for want in expected:
        assert any(p.startswith(want) for p in problems), (want, problems)


# ---- the quota shell ------------------------------------------------------------------------------------------------

def _chat(max_tokens: int = 100, prompt: int = 10, model: str = "cortex") -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", model, prompt_tokens=prompt, max_tokens=max_tokens)


async def test_quota_charges_refuses_gives_back_and_settles() -> None:
    config = tenants_config({"acme": {"keys": [ACME], "limits": {"requests_per_minute": 2,
                                                                 "tokens_per_minute": 1000}}})
    metrics = SluiceMetrics()
    quota = Quota(config, MemoryRateLimiter(), metrics)
    acme = config.tenants.by_name["acme"]
    started = time.monotonic()
    first = await quota.charge(acme, _chat(), "r1")
    assert isinstance(first, Charged) and first.charge_id == "r1"
    assert dict(first.headers)["x-ratelimit-remaining-tokens"] == "890"
    assert dict(first.headers)["x-ratelimit-remaining-requests"] == "1"
    too_big = await quota.charge(acme, _chat(max_tokens=2000), "r2")
    assert isinstance(too_big, Refused) and too_big.decision.verdict is Verdict.REJECT
    assert too_big.decision.reason is Reason.RATE_LIMITED and too_big.decision.retry_after_s is None
    assert "Requested 2010" in too_big.decision.detail
    second = await quota.charge(acme, _chat(), "r3")
    assert isinstance(second, Charged)
    third = await quota.charge(acme, _chat(), "r4")
    assert isinstance(third, Refused) and third.decision.verdict is Verdict.SHED
    assert third.decision.retry_after_s == 30 and "on requests per min (RPM): Limit 2, Remaining 0" in \
        third.decision.detail
    quota.refund("r3")  # shed after its charge: its request and tokens come back
    quota.settle("acme", "r1", Usage(10, 20, True))  # used 30 of its 110
    await asyncio.sleep(0)
    states = {s.kind: s.remaining for s in (await quota.usage())[0].states}
    refilled = (time.monotonic() - started) * 1000 / 60  # the budget refills 1000 tokens a minute meanwhile
    assert states[LimitKind.REQUESTS] == 1
    assert 970 <= states[LimitKind.TOKENS] <= 970 + refilled + 1, (states, refilled)
    sample = metrics.registry.get_sample_value
    assert sample("sluice_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}) == 20
    assert sample("sluice_ratelimit_decisions_total", {"tenant": "acme", "result": "over_limit"}) == 1
    assert sample("sluice_ratelimit_decisions_total", {"tenant": "acme", "result": "too_large"}) == 1
    await quota.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("on_failure", ["open", "closed"])
async def test_an_unreachable_store_fails_open_or_closed(on_failure: str) -> None:
    config = tenants_config({"acme": {"keys": [ACME], "limits": {"requests_per_minute": 2}}},
                            store={"backend": "valkey", "url": f"redis://127.0.0.1:{_closed_port()}/0"},
                            ratelimit={"on_failure": on_failure, "timeout_seconds": 0.2,
                                       "failure_retry_after_seconds": 3})
    metrics = SluiceMetrics()
    quota = Quota(config, make_limiter(config), metrics)
    answer = await quota.charge(config.tenants.by_name["acme"], _chat(), "r1")
    if on_failure == "open":
        assert answer == Charged(None)
    else:
        assert isinstance(answer, Refused)
        assert (answer.decision.reason, answer.decision.retry_after_s) == (Reason.RATELIMIT_UNAVAILABLE, 3)
    assert metrics.registry.get_sample_value("sluice_ratelimit_errors_total", {"op": "charge"}) == 1
    assert metrics.registry.get_sample_value("sluice_ratelimit_decisions_total",
                                             {"tenant": "acme", "result": "store_error"}) == 1
    await quota.close()


# ---- the access log settles -----------------------------------------------------------------------------------------

class Completions:
    def __init__(self) -> None:
        self.metrics = SluiceMetrics()
        self.settled: list[tuple[str, Usage]] = []

    def release_ticket(self, ticket_id: str) -> Ticket | None:
        return Ticket(ticket_id, "thor", "cortex", 0.0, 0.0)

    def note_engine_failure(self, engine: str, why: str) -> None:
        pass

    def knows_engine(self, engine: str) -> bool:
        return True

    def note_first_token(self, ticket: Ticket, timing: FirstToken) -> None:
        pass

    def note_prompt_tokens(self, ticket: Ticket, shape: PromptShape, estimated: int, counted: int) -> None:
        pass

    def note_served_prompt(self, ticket: Ticket, shape: PromptShape, estimated: int, ok: bool) -> None:
        pass

    def settle_usage(self, ticket_id: str, usage: Usage) -> None:
        self.settled.append((ticket_id, usage))


def _entry(ticket: str, usage: dict[str, float], *, charged: bool = True, code: int = 200) -> Any:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.common_properties.upstream_cluster = "thor"
    e.common_properties.time_to_first_upstream_rx_byte.CopyFrom(duration_pb2.Duration(nanos=1000))
    e.common_properties.time_to_last_upstream_tx_byte.CopyFrom(duration_pb2.Duration(nanos=500))
    authz = struct_pb2.Struct()
    authz.update({"ticket": ticket, "engine": "thor", "tenant": "acme", "prompt_tokens": 10, "charged": charged})
    e.common_properties.metadata.filter_metadata["envoy.filters.http.ext_authz"].CopyFrom(authz)
    if usage:
        seen = struct_pb2.Struct()
        seen.update(usage)
        e.common_properties.metadata.filter_metadata["sluice.usage"].CopyFrom(seen)
    e.response.response_code.value = code
    return e


async def _log(*entries: Any) -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)
    yield message


async def test_the_access_log_settles_a_tenants_request_with_what_it_used() -> None:
    config = tenants_config({"acme": {"keys": [ACME], "limits": {"tokens_per_minute": 1000}}})
    port = Completions()
    quota = Quota(config, MemoryRateLimiter(), port.metrics)
    acme = config.tenants.by_name["acme"]
    for rid in ("usage", "deltas", "uncharged"):
        assert isinstance(await quota.charge(acme, _chat(max_tokens=290), rid), Charged)  # 300 each
    await AccessLogServicer(port, quota).StreamAccessLogs(_log(
        _entry("usage", {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42, "deltas": 30}),
        _entry("deltas", {"deltas": 7}),  # the estimate 10 + 7
        _entry("uncharged", {"deltas": 100}, charged=False),  # counted, but its charge (if any) stays
    ), FakeContext())
    await asyncio.sleep(0)
    (usage,) = await quota.usage()
    assert [s.remaining for s in usage.states] == [1000 - 42 - 17 - 300]
    sample = port.metrics.registry.get_sample_value
    assert sample("sluice_tenant_tokens_total", {"tenant": "acme", "kind": "prompt"}) == 12 + 10 + 10
    assert sample("sluice_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}) == 30 + 7 + 100
    await quota.close()
