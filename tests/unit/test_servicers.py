"""Each servicer alone, against a fake of the one port it receives (no control plane, no gRPC server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import make_mocked_request
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import duration_pb2, struct_pb2

from controlplane.servicers.accesslog import AccessLogServicer, first_token
from controlplane.core.fairshare import FairStanding, TenantAhead, TenantShare
from controlplane.core.feedback import FirstToken, TtftSummary
from controlplane.core.prompt_tokens import PromptShape, PromptTokenRules, PromptTokenSummary, TokenRule
from controlplane.core.tenants import Usage
from controlplane.servicers.admin import AdminServicer
from controlplane.servicers.adminauth import AdminGuard, Token
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import Fleet
from controlplane.core.model import Decision, InferenceRequest, Reason, Ticket, Verdict
from controlplane.core.policy import Policy
from controlplane.servicers.httpendpoint import HttpEndpoint
from controlplane.metrics import SluiceMetrics
from controlplane.ports import FloorResult, ReloadResult, StatusFacts
from controlplane.admission.quota import TenantUsage
from controlplane.admission.watch import DecisionEvent, DecisionFeed, Watcher
from rig.waits import wait_until
from sluice.admin.v1 import admin_pb2
from tests.unit.fakes import AbortedError, FakeContext


@dataclass
class FakeCompletions:
    """A CompletionPort: knows one open ticket on ``thor``."""

    metrics: SluiceMetrics = field(default_factory=SluiceMetrics)
    open: dict[str, Ticket] = field(default_factory=lambda: {"t1": Ticket("t1", "thor", "cortex", 0.0, 0.0)})
    released: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)
    first_tokens: list[tuple[str, FirstToken]] = field(default_factory=list)
    prompts: list[tuple[PromptShape, int, int]] = field(default_factory=list)
    served_prompts: list[tuple[PromptShape, int, bool]] = field(default_factory=list)
    settled: list[tuple[str, Usage]] = field(default_factory=list)

    def release_ticket(self, ticket_id: str) -> Ticket | None:
        self.released.append(ticket_id)
        return self.open.pop(ticket_id, None)

    def note_engine_failure(self, engine: str, why: str) -> None:
        self.failures.append((engine, why))

    def knows_engine(self, engine: str) -> bool:
        return engine == "thor"

    def note_first_token(self, ticket: Ticket, timing: FirstToken) -> None:
        self.first_tokens.append((ticket.ticket_id, timing))

    def note_prompt_tokens(self, ticket: Ticket, shape: PromptShape, estimated: int, counted: int) -> None:
        self.prompts.append((shape, estimated, counted))

    def note_served_prompt(self, ticket: Ticket, shape: PromptShape, estimated: int, ok: bool) -> None:
        self.served_prompts.append((shape, estimated, ok))

    def settle_usage(self, ticket_id: str, usage: Usage) -> None:
        self.settled.append((ticket_id, usage))


def entry(*, ticket: str | None, code: int, first_byte: bool, connect_failure: bool = False) -> Any:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.common_properties.upstream_cluster = "thor"
    if ticket is not None:
        e.common_properties.metadata.filter_metadata["envoy.filters.http.ext_authz"].CopyFrom(
            struct_pb2.Struct(fields={"ticket": struct_pb2.Value(string_value=ticket)}))
    if first_byte:
        e.common_properties.time_to_first_upstream_rx_byte.CopyFrom(duration_pb2.Duration(nanos=1000))
    e.common_properties.response_flags.upstream_connection_failure = connect_failure
    e.response.response_code.value = code
    return e


async def stream(*entries: Any) -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)
    yield message


async def test_access_log_releases_the_ticket_it_names_and_marks_failed_engines() -> None:
    port = FakeCompletions()
    await AccessLogServicer(port).StreamAccessLogs(stream(
        entry(ticket="t1", code=200, first_byte=True),
        entry(ticket=None, code=503, first_byte=False, connect_failure=True),
        entry(ticket="unknown", code=200, first_byte=True),
    ), FakeContext())
    assert port.released == ["t1", "unknown"]
    assert port.failures and port.failures[0][0] == "thor" and "UF" in port.failures[0][1]
    assert port.metrics.registry.get_sample_value("sluice_access_log_entries_total", {"outcome": "no_ticket"}) == 1
    assert port.metrics.registry.get_sample_value("sluice_access_log_entries_total",
                                                  {"outcome": "unknown_ticket"}) == 1


def timed_entry(*, code: int = 200, content_type: str = "text/event-stream", first_token_after_s: float | None = 0.75,
                sent_s: float = 0.25, last_byte_s: float = 3.0) -> Any:
    """An entry of a request that arrived at t=1000.5 s, was fully sent to its engine ``sent_s`` later, got its first
    byte 10 ms after that (headers first) and its first token ``first_token_after_s`` after arrival."""
    e = entry(ticket="t1", code=code, first_byte=True)
    props = e.common_properties
    props.start_time.FromNanoseconds(1_000_500_000_000)
    props.time_to_last_upstream_tx_byte.FromNanoseconds(int(sent_s * 1e9))
    props.time_to_first_upstream_rx_byte.FromNanoseconds(int((sent_s + 0.01) * 1e9))
    props.time_to_last_upstream_rx_byte.FromNanoseconds(int(last_byte_s * 1e9))
    e.response.response_headers["content-type"] = content_type
    if first_token_after_s is not None:
        props.metadata.filter_metadata["sluice.usage"].CopyFrom(struct_pb2.Struct(fields={
            "first_token_us": struct_pb2.Value(number_value=1_000_500_000 + first_token_after_s * 1e6)}))
    return e


def test_first_token_is_timed_at_the_streams_first_token_not_its_first_byte() -> None:
    timing = first_token(timed_entry())
    assert timing is not None and timing.streamed
    assert timing.engine_s == pytest.approx(0.5) and timing.gateway_s == pytest.approx(0.25)


def test_a_non_streaming_responses_first_token_is_its_whole_body() -> None:
    timing = first_token(timed_entry(content_type="application/json", first_token_after_s=None))
    assert timing is not None and not timing.streamed
    assert (timing.engine_s, timing.gateway_s, timing.whole_s) == pytest.approx((2.75, 0.25, 2.75))


@pytest.mark.parametrize("kwargs", [{"first_token_after_s": None}, {"code": 500}],
                         ids=["stream-without-a-token", "not-served"])
def test_no_first_token_without_a_token_or_a_200(kwargs: dict[str, Any]) -> None:
    assert first_token(timed_entry(**kwargs)) is None


async def test_access_log_hands_each_served_requests_first_token_to_the_plane() -> None:
    port = FakeCompletions(open={"t1": Ticket("t1", "thor", "cortex", 0.0, 900.0, expected_ttft_s=0.4)})
    await AccessLogServicer(port).StreamAccessLogs(stream(timed_entry()), FakeContext())
    assert [(ticket, round(t.engine_s, 3)) for ticket, t in port.first_tokens] == [("t1", 0.5)]


async def test_redirector_retries_only_a_genuine_attempt() -> None:
    port = FakeCompletions()
    endpoint = HttpEndpoint("127.0.0.1", 0, port.metrics, port)
    forged = await endpoint.retry_redirect(make_mocked_request(
        "POST", "/v1/chat/completions", headers={"x-sluice-engine": "thor", "x-sluice-ticket": "guess", "host": "gw"}))
    assert forged.status == 503 and port.failures == []
    retried = await endpoint.retry_redirect(make_mocked_request(
        "POST", "/v1/chat/completions?x=1", headers={"x-sluice-engine": "thor", "x-sluice-ticket": "t1", "host": "gw"}))
    assert retried.status == 307
    assert retried.headers["location"] == "http://gw/v1/chat/completions?x=1&sluice_avoid=thor"
    assert port.failures and port.failures[0][0] == "thor" and "t1" not in port.open


@dataclass
class FakeAdmin:
    """An AdminPort over one engine."""

    drained: dict[str, bool] = field(default_factory=dict)
    reloads: list[str | None] = field(default_factory=list)
    floors: dict[str, str] = field(default_factory=dict)
    metrics: SluiceMetrics = field(default_factory=SluiceMetrics)
    feed: DecisionFeed = field(init=False)

    def __post_init__(self) -> None:
        self.feed = DecisionFeed(self.metrics)

    @property
    def policy(self) -> Policy:
        return Policy()

    def now(self) -> float:
        return 100.0

    def fleet(self, now: float) -> Fleet:
        view = EngineView("thor", "http://thor", 2, (ServedModel("cortex", 4096),), "0.11.0",
                          EngineSample(now, running=1, waiting=0), last_ok_at=now - 0.5, stale=False,
                          drained=self.drained.get("thor", False), chip_class="thor")
        return Fleet((view,))

    def status(self, now: float) -> StatusFacts:
        return StatusFacts("1.2.3", 42.0, 3, 10, 7, 0, 1, (), 1)

    def open_tickets(self, engine: str) -> int:
        return 3

    def medians(self, model: str, chip_class: str) -> tuple[float | None, float | None]:
        return 900.0, None

    def ttft_summary(self, engine: str) -> TtftSummary:
        return TtftSummary(samples=12, p50_s=0.2, p90_s=0.9, error_median=None, correction=1.5)

    def prompt_summary(self, model: str, engine: str) -> PromptTokenSummary:
        return PromptTokenSummary(TokenRule(1 / 1.3, 7.0, 40), 40, 1.02)

    def swap_samples(self, engine: str) -> int:
        return 0

    @property
    def prompt_rules(self) -> PromptTokenRules:
        return PromptTokenRules(TokenRule(0.25))

    async def set_drained(self, name: str, drained: bool) -> bool:
        if name != "thor":
            return False
        self.drained[name] = drained
        return True

    def decide_for(self, request: InferenceRequest, now: float) -> tuple[Decision, int]:
        return Decision(Verdict.ADMIT, Reason.FINISH_SOONEST, engine="thor"), 2

    def expected_cached(self, request: InferenceRequest) -> dict[str, int]:
        return {"thor": 64 * len(request.prefix_blocks)}  # as if thor held every block of the prompt

    def fair_standing(self, request: InferenceRequest, now: float) -> FairStanding:
        """As if ``a`` flooded: two of its requests, counter 900, before any other tenant's; one slot held for c."""
        ahead = () if request.tenant == "a" else (TenantAhead("a", 900.0, 2),)
        return FairStanding(request.tenant or "", 900.0, request.tenant != "a", 2, 0, ahead, {"c": 1})

    async def reload(self, path: str | None) -> ReloadResult:
        self.reloads.append(path)
        return ReloadResult(False, ("admission.x: unknown field",), (), path or "f.yaml")

    @property
    def config_source(self) -> str:
        return "f.yaml"

    async def set_version_floor(self, pattern: str, version: str) -> FloorResult:
        before = self.floors.get(pattern, "")
        self.floors[pattern] = version
        return FloorResult(True, (), before, version)

    def watch(self, model: str | None) -> Watcher:
        return self.feed.subscribe(model, size=2)

    def unwatch(self, watcher: Watcher) -> None:
        self.feed.unsubscribe(watcher)

    async def tenant_usage(self) -> tuple[TenantUsage, ...]:
        return ()

    def tenant_shares(self) -> list[TenantShare]:
        return []


async def test_admin_reports_what_its_port_says() -> None:
    port = FakeAdmin()
    admin = AdminServicer(port, guard())
    status = await admin.GetStatus(admin_pb2.GetStatusRequest(), FakeContext())
    assert (status.version, status.open_tickets, status.engines_total, status.engines_ready) == ("1.2.3", 3, 1, 1)
    engines = (await admin.ListEngines(admin_pb2.ListEnginesRequest(), FakeContext())).engines
    assert engines[0].open_tickets == 3 and engines[0].prefill_median_tokens_per_s == 900.0
    assert engines[0].solo_decode_median_tokens_per_s == -1.0  # unknown, never 0
    assert (engines[0].ttft_samples, engines[0].ttft_p50_seconds, engines[0].ttft_p90_seconds) == (12, 0.2, 0.9)
    assert (engines[0].ttft_estimate_error_median, engines[0].ttft_correction) == (-1.0, 1.5)
    assert (round(engines[0].prompt_chars_per_token, 2), engines[0].prompt_template_tokens_per_message) == (1.3, 7.0)
    assert (engines[0].prompt_token_samples, engines[0].prompt_tokens_error_median) == (40, 1.02)
    drained = await admin.DrainEngine(admin_pb2.DrainEngineRequest(name="thor", drained=True), FakeContext())
    assert drained.drained
    with pytest.raises(AbortedError, match="no engine named 'nope'"):
        await admin.DrainEngine(admin_pb2.DrainEngineRequest(name="nope", drained=True), FakeContext())
    why = await admin.ExplainDecision(admin_pb2.ExplainDecisionRequest(model="cortex"), FakeContext())
    assert (why.verdict, why.engine, why.queued_ahead) == ("admit", "thor", 2)
    assert [e.expected_cached_tokens for e in why.engines if e.name == "thor"] == [0]  # no body: no prompt to match
    assert not why.fairness.enabled and why.fairness.tenant == ""  # Policy() has no tenants: fair share off
    why = await admin.ExplainDecision(admin_pb2.ExplainDecisionRequest(model="cortex", tenant="b"), FakeContext())
    assert (why.fairness.tenant, why.fairness.counter, why.fairness.lifted, why.fairness.ahead_in_class) == (
        "b", 900.0, True, 2)
    assert [(a.tenant, a.requests) for a in why.fairness.tenants_ahead] == [("a", 2)]
    assert dict(why.fairness.held_slots) == {"c": 1}
    body = '{"messages": [{"role": "user", "content": "%s"}]}' % ("x" * 1000)  # 1007 rendered characters: 3 blocks
    why = await admin.ExplainDecision(admin_pb2.ExplainDecisionRequest(model="cortex", body_json=body),
                                      FakeContext())
    assert [e.expected_cached_tokens for e in why.engines if e.name == "thor"] == [192]
    with pytest.raises(AbortedError, match="body_json"):
        await admin.ExplainDecision(admin_pb2.ExplainDecisionRequest(model="cortex", body_json="[1"), FakeContext())
    reload = await admin.ReloadConfig(admin_pb2.ReloadConfigRequest(path="x.yaml"), FakeContext())
    assert not reload.applied and list(reload.problems) == ["admission.x: unknown field"] and port.reloads == ["x.yaml"]


def guard(port: FakeAdmin | None = None, *, reads: bool = False) -> AdminGuard:
    metrics = port.metrics if port is not None else SluiceMetrics()
    return AdminGuard((Token("ops", "operator-secret"),), reads, metrics)


def refused(port: FakeAdmin, method: str) -> float:
    return port.metrics.registry.get_sample_value("sluice_admin_refused_total", {"method": method}) or 0.0


async def test_admin_changes_without_or_with_a_wrong_token_are_refused_and_change_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    port = FakeAdmin()
    admin = AdminServicer(port, guard(port))
    caplog.set_level("INFO")
    for token in (None, "wrong-secret"):
        for call in (lambda c: admin.DrainEngine(admin_pb2.DrainEngineRequest(name="thor", drained=True), c),
                     lambda c: admin.ReloadConfig(admin_pb2.ReloadConfigRequest(path="evil.yaml"), c),
                     lambda c: admin.SetVersionFloor(admin_pb2.SetVersionFloorRequest(model_pattern="cortex",
                                                                                      version="9"), c)):
            context = FakeContext(token=token)
            with pytest.raises(AbortedError):
                await call(context)
            assert context.aborted_code is grpc.StatusCode.UNAUTHENTICATED
    assert port.drained == {} and port.reloads == [] and port.floors == {}
    assert (refused(port, "DrainEngine"), refused(port, "ReloadConfig"), refused(port, "SetVersionFloor")) == (2, 2, 2)
    audit = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sluice.audit"]
    assert len(audit) == 6 and all(a["result"] == "refused: unauthenticated" and a["who"] == "-" for a in audit)
    assert "wrong-secret" not in caplog.text  # the token sent is never logged
    # Reads need no token by default; with require_token_for_reads they do.
    assert (await admin.GetStatus(admin_pb2.GetStatusRequest(), FakeContext(token=None))).version == "1.2.3"
    strict = AdminServicer(port, guard(port, reads=True))
    with pytest.raises(AbortedError):
        await strict.GetStatus(admin_pb2.GetStatusRequest(), FakeContext(token="wrong-secret"))
    # The right token: applied, and audited with the token's name (never its secret) and before/after.
    caplog.clear()
    floor = await admin.SetVersionFloor(admin_pb2.SetVersionFloorRequest(model_pattern="cortex", version="0.11"),
                                        FakeContext())
    assert floor.applied and port.floors == {"cortex": "0.11"}
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sluice.audit"]
    assert (line["who"], line["what"]["method"], line["before"], line["after"], line["result"]) == (
        "ops", "SetVersionFloor", None, "0.11", "applied")
    assert "operator-secret" not in caplog.text


async def test_no_token_configured_refuses_every_change() -> None:
    port = FakeAdmin()
    admin = AdminServicer(port, AdminGuard((), False, port.metrics))
    with pytest.raises(AbortedError, match="no admin token is configured"):
        await admin.DrainEngine(admin_pb2.DrainEngineRequest(name="thor", drained=True), FakeContext())
    assert port.drained == {}


def event(n: int) -> DecisionEvent:
    return DecisionEvent(float(n), f"r{n}", "admit", "finish_soonest", "thor", "cortex", "", 0.0, 0.5, 0, "standard")


async def test_a_slow_watcher_drops_events_and_is_told_how_many() -> None:
    port = FakeAdmin()
    admin = AdminServicer(port, guard(port))
    stream = admin.WatchDecisions(admin_pb2.WatchDecisionsRequest(), FakeContext())
    first = asyncio.ensure_future(stream.__anext__())
    await wait_until(lambda: len(port.feed.watchers) == 1, what="the stream subscribed")
    for n in range(5):  # a queue of 2 (FakeAdmin.watch): r0 and r1 queue, r2..r4 are dropped
        port.feed.publish(event(n))
    got = [await asyncio.wait_for(first, 2), await asyncio.wait_for(stream.__anext__(), 2)]
    port.feed.publish(event(5))
    got.append(await asyncio.wait_for(stream.__anext__(), 2))
    assert [e.request_id for e in got] == ["r0", "r1", "r5"]
    assert sum(e.dropped_since_last for e in got) == 3 and got[-1].dropped_since_last == 0
    assert port.metrics.registry.get_sample_value("sluice_admin_watch_dropped_total") == 3
    assert isinstance(stream, AsyncGenerator)
    await stream.aclose()
    assert port.feed.watchers == []


def test_no_servicer_imports_the_wiring() -> None:
    import ast
    from pathlib import Path

    for name in ("servicers/authz", "servicers/accesslog", "servicers/admin", "servicers/httpendpoint",
                 "admission/service", "admission/replication", "admission/mirror", "observe/observation"):
        tree = ast.parse((Path(__file__).resolve().parents[2] / "controlplane" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "controlplane.app" not in imported, name



async def test_access_log_hands_the_engines_prompt_count_to_the_plane() -> None:
    port = FakeCompletions()
    e = timed_entry(content_type="application/json", first_token_after_s=None)
    e.common_properties.metadata.filter_metadata["envoy.filters.http.ext_authz"].update(
        {"prompt_chars": 1300, "prompt_messages": 2, "prompt_tokens": 325})
    e.common_properties.metadata.filter_metadata["sluice.usage"].update({"prompt_tokens": 1010})
    await AccessLogServicer(port).StreamAccessLogs(stream(e), FakeContext())
    assert port.prompts == [(PromptShape(1300, 2), 325, 1010)]


async def test_access_log_hands_every_released_prompt_to_its_engines_counter_window() -> None:
    """Usage or not, a released request's prompt as the Check counted it goes to its engine's counter window, with
    whether the engine answered it (a failed one spoils the window)."""
    port = FakeCompletions(open={t: Ticket(t, "thor", "cortex", 0.0, 0.0) for t in ("t1", "t2")})
    served = timed_entry(content_type="application/json", first_token_after_s=None)
    failed = timed_entry(content_type="application/json", first_token_after_s=None)
    failed.response.response_code.value = 500
    for e, ticket in ((served, "t1"), (failed, "t2")):
        e.common_properties.metadata.filter_metadata["envoy.filters.http.ext_authz"].update(
            {"ticket": ticket, "prompt_chars": 400, "prompt_messages": 1, "prompt_tokens": 100})
    await AccessLogServicer(port).StreamAccessLogs(stream(served, failed), FakeContext())
    assert port.served_prompts == [(PromptShape(400, 1), 100, True), (PromptShape(400, 1), 100, False)]
    assert port.prompts == []  # no usage: nothing for the rule's per-request samples
