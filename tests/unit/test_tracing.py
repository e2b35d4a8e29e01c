"""OpenTelemetry traces of the Checks (controlplane/tracing.py): the ``tracing`` config section, and the ext_authz servicer
with tracing on exporting through the real OTLP/HTTP exporter to a real receiver (tests/otlp.py) in this process. Nothing
of OpenTelemetry is faked: spans are sampled, batched, encoded and sent as in production, and read back off the wire."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from envoy.service.auth.v3 import external_auth_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from controlplane.app import ControlPlane
from controlplane.servicers.authz import AuthorizationServicer
from controlplane.config import DEFAULTS, ConfigError, TracingConfig, parse_config
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.tracing import CHECK_SPAN, SCOPE, CheckTracing, TracedAuthorizationServicer
from rig.waits import wait_until
from tests.otlp import OtlpReceiver, ReceivedSpan
from tests.unit.extauthz import OneEnginePlane, chat_body, check_request, denial, one_engine_plane
from tests.unit.fakes import FakeContext

ONE = {"engines": [{"name": "thor", "url": "http://127.0.0.1:9"}]}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
SERVER = 2  # OTLP SpanKind.SPAN_KIND_SERVER


def traceparent(flags: str = "01", trace_id: str = CLIENT_TRACE, parent: str = CLIENT_PARENT) -> str:
    return f"00-{trace_id}-{parent}-{flags}"


def sampled(sent: str) -> bool:
    """The W3C sampled flag (bit 0 of trace-flags; a trace the SDK starts also sets bit 1, its trace id is random)."""
    return bool(int(sent.rsplit("-", 1)[1], 16) & 0x01)


# -- the config section ----------------------------------------------------------------------------------------------------
def test_tracing_is_off_by_default_and_its_defaults_are_written_once() -> None:
    config = parse_config(ONE)
    assert config.tracing == TracingConfig()
    assert (config.tracing.enabled, config.tracing.otlp_endpoint, config.tracing.service_name,
            config.tracing.sample_ratio) == (False, "http://127.0.0.1:4318/v1/traces", "sluice-controlplane", 1.0)
    assert DEFAULTS["tracing"] == {"enabled": False, "otlp_endpoint": "http://127.0.0.1:4318/v1/traces",
                                   "service_name": "sluice-controlplane", "sample_ratio": 1.0,
                                   "export_timeout_seconds": 10.0}
    assert ControlPlane(config).tracing is None


def test_every_tracing_problem_is_reported_with_its_dotted_path() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**ONE, "tracing": {"enabled": "yes", "sample_ratio": 1.5, "otlp_endpoint": "ftp://collector/x",
                                         "service_name": "", "export_timeout_seconds": 0, "endpoint": "x"}})
    problems = "\n".join(raised.value.problems)
    for expected in ("tracing.enabled: must be true or false", "tracing.sample_ratio: must be >= 0 and <= 1",
                     "tracing.otlp_endpoint: must be an http:// or https:// URL with a host",
                     "tracing.service_name: must be a non-empty string", "tracing.export_timeout_seconds: must be >= 0.1",
                     "tracing.endpoint: unknown field"):
        assert expected in problems
    with pytest.raises(ConfigError, match=r"tracing.otlp_endpoint: must name the traces path, e.g. "
                                          r"http://collector:4318/v1/traces"):
        parse_config({**ONE, "tracing": {"otlp_endpoint": "http://collector:4318/"}})


def test_tracing_is_read_once_so_a_change_needs_a_restart() -> None:
    base = parse_config(ONE)
    traced = parse_config({**ONE, "tracing": {"enabled": True, "sample_ratio": 0.25,
                                              "otlp_endpoint": "https://collector.example:4318/v1/traces"}})
    assert traced.tracing.sample_ratio == 0.25
    assert base.restart_needed(traced) == ["tracing"]


def test_every_tracing_key_is_documented_with_its_default() -> None:
    root = Path(__file__).resolve().parents[2]
    table = (root / "docs" / "configuration.md").read_text().split("\n## `tracing`", 1)[1].split("\n## ", 1)[0]
    readme = (root / "README.md").read_text().split("\n### Traces", 1)[1].split("\n### ", 1)[0]
    rows = {row.split(" | ")[0].strip("| `"): row.split(" | ")[2].strip("`") for row in table.splitlines()
            if row.startswith("| `tracing.")}
    for key, default in DEFAULTS["tracing"].items():
        shown = str(default).lower() if isinstance(default, bool) else f"{default:g}" if isinstance(default, float) \
            else str(default)
        assert rows.get(f"tracing.{key}") == shown, f"tracing.{key} (default {shown}) not in the config table"
        assert f"{key}:" in readme, f"tracing.{key} not in README's Traces example"


# -- the traced servicer ---------------------------------------------------------------------------------------------------
@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver.start()
    yield r
    r.close()


def make_plane(monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, **tracing: Any) -> OneEnginePlane:
    """A control plane that is never started, tracing to ``receiver`` (its fleet as ``one_engine_plane``'s)."""
    return one_engine_plane(monkeypatch, {**ONE, "tracing": {"enabled": True, "otlp_endpoint": receiver.endpoint,
                                                             "service_name": "sluice-test", **tracing}})


@pytest.fixture
async def plane(monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver) -> AsyncIterator[OneEnginePlane]:
    p = make_plane(monkeypatch, receiver)
    yield p
    await p.stop()


def servicer(plane: ControlPlane) -> TracedAuthorizationServicer:
    assert plane.tracing is not None
    return TracedAuthorizationServicer(plane.service, plane.tracing)


async def check(plane: ControlPlane, headers: dict[str, str] | None = None, **body: Any) -> external_auth_pb2.CheckResponse:
    return await servicer(plane).Check(check_request(chat_body(**body), headers), FakeContext(290.0))


async def exported(plane: ControlPlane, receiver: OtlpReceiver, count: int = 1) -> list[ReceivedSpan]:
    assert plane.tracing is not None
    assert await plane.tracing.force_flush()
    return receiver.wait_for(count, CHECK_SPAN)


def upstream_headers(response: external_auth_pb2.CheckResponse) -> dict[str, list[str]]:
    assert response.HasField("ok_response"), "expected an admission"
    found: dict[str, list[str]] = {}
    for h in response.ok_response.headers:
        found.setdefault(h.header.key, []).append(h.header.value)
    return found


async def test_an_admission_is_a_child_span_of_the_clients_traceparent_and_the_engine_continues_it(
        plane: ControlPlane, receiver: OtlpReceiver) -> None:
    response = await check(plane, {"traceparent": traceparent(), "x-request-id": "req-1",
                                   "x-sluice-priority": "critical"}, max_tokens=5)
    [span] = await exported(plane, receiver)
    assert (span.trace_id, span.parent_span_id, span.kind) == (CLIENT_TRACE, CLIENT_PARENT, SERVER)
    attributes = span.attributes
    assert attributes["sluice.verdict"] == "admit" and attributes["sluice.engine"] == "thor"
    assert attributes["sluice.reason"] == "finish_soonest" and attributes["sluice.model"] == "cortex"
    assert attributes["sluice.priority"] == "critical" and attributes["sluice.request_id"] == "req-1"
    assert attributes["sluice.parked_ms"] == 0.0 and attributes["sluice.expected_ttft_s"] > 0
    assert attributes["http.request.method"] == "POST" and attributes["url.path"] == "/v1/chat/completions"
    assert "sluice.retry_after_s" not in attributes and "http.response.status_code" not in attributes
    headers = upstream_headers(response)
    assert attributes["sluice.ticket_id"] == headers["x-sluice-ticket"][0] and plane.ledger.open_tickets() == 1
    # The engine is told to continue the trace under the Check's span, once (it replaces the client's header).
    assert headers["traceparent"] == [f"00-{CLIENT_TRACE}-{span.span_id}-01"]
    assert "tracestate" not in headers
    assert span.resource["service.name"] == "sluice-test" and span.scope == SCOPE
    # The wire format itself, per the OTLP/JSON specification: ids are lowercase hex, not base64.
    wire = receiver.bodies[0]["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert (wire["traceId"], wire["parentSpanId"], wire["spanId"]) == (CLIENT_TRACE, CLIENT_PARENT, span.span_id)


async def test_the_clients_tracestate_rides_on_to_the_engine(plane: ControlPlane, receiver: OtlpReceiver) -> None:
    response = await check(plane, {"traceparent": traceparent(), "tracestate": "vendor=abc,other=1"}, max_tokens=5)
    [span] = await exported(plane, receiver)
    headers = upstream_headers(response)
    assert headers["traceparent"] == [f"00-{CLIENT_TRACE}-{span.span_id}-01"]
    assert headers["tracestate"] == ["vendor=abc,other=1"]


@pytest.mark.parametrize("sent", [None, "00-nonsense", traceparent(trace_id="0" * 32)],
                         ids=["none", "malformed", "all-zero-trace-id"])
async def test_without_a_valid_traceparent_the_check_starts_the_trace(plane: ControlPlane, receiver: OtlpReceiver,
                                                                       sent: str | None) -> None:
    response = await check(plane, {"traceparent": sent} if sent else {}, max_tokens=5)
    [span] = await exported(plane, receiver)
    assert span.parent_span_id == "" and len(span.trace_id) == 32 and span.trace_id != "0" * 32
    [sent] = upstream_headers(response)["traceparent"]
    assert sent.startswith(f"00-{span.trace_id}-{span.span_id}-") and sampled(sent)


async def test_a_refusal_carries_its_reason_and_status_and_sends_nothing_upstream(plane: ControlPlane,
                                                                                  receiver: OtlpReceiver) -> None:
    response = await check(plane, {"traceparent": traceparent()}, model="no-such-model")
    status, headers, _ = denial(response)
    assert status == 404 and "traceparent" not in headers
    [span] = await exported(plane, receiver)
    assert span.trace_id == CLIENT_TRACE
    a = span.attributes
    assert (a["sluice.verdict"], a["sluice.reason"], a["sluice.model"], a["http.response.status_code"]) == (
        "reject", "unknown_model", "no-such-model", 404)
    assert "sluice.engine" not in a and "sluice.ticket_id" not in a and "sluice.failure" not in a
    assert span.status_code == 0, "a refused request is the client's error, not the span's"


async def test_a_shed_carries_its_retry_after(plane: OneEnginePlane, receiver: OtlpReceiver) -> None:
    plane.cap_running = (1, 1)  # no seat: a sheddable request is shed, not parked
    status, headers, _ = denial(await check(plane, {"x-sluice-priority": "sheddable"}))
    [span] = await exported(plane, receiver)
    a = span.attributes
    assert status == 503 and (a["sluice.verdict"], a["sluice.reason"]) == ("shed", "saturated")
    assert a["sluice.retry_after_s"] == int(headers["retry-after"]) and a["sluice.priority"] == "sheddable"


async def test_a_parked_admission_records_its_wait_and_a_cancelled_park_is_marked(plane: OneEnginePlane,
                                                                                  receiver: OtlpReceiver) -> None:
    plane.cap_running = (1, 1)
    traced = servicer(plane)
    parked = asyncio.create_task(traced.Check(check_request(chat_body(max_tokens=5), {"x-request-id": "waits"}),
                                              FakeContext(290.0)))
    left = asyncio.create_task(traced.Check(check_request(chat_body(max_tokens=5), {"x-request-id": "leaves"}),
                                            FakeContext(290.0)))
    await wait_until(lambda: plane.admission.depth() == 2, what="both Checks parked")
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await left
    await wait_until(lambda: plane.admission.depth() == 1, what="the cancelled Check out of the lot")
    plane.cap_running = (1, 0)
    plane.service.wake()
    assert (await asyncio.wait_for(parked, 5)).HasField("ok_response")
    spans = {s.attributes["sluice.request_id"]: s for s in await exported(plane, receiver, 2)}
    assert spans["leaves"].attributes["sluice.cancelled"] is True and "sluice.verdict" not in spans["leaves"].attributes
    assert spans["waits"].attributes["sluice.verdict"] == "admit" and spans["waits"].attributes["sluice.parked_ms"] > 0


async def test_a_defect_is_an_error_span(plane: ControlPlane, receiver: OtlpReceiver,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("injected defect")

    monkeypatch.setattr("controlplane.core.fleetstate.decide", broken)
    status, _, _ = denial(await check(plane, {"traceparent": traceparent()}))
    [span] = await exported(plane, receiver)
    assert status == 500 and span.attributes["sluice.failure"] == "internal_error"
    assert span.attributes["http.response.status_code"] == 500 and span.status_code == 2  # STATUS_CODE_ERROR


async def test_an_overloaded_check_is_traced_without_a_decision(plane: ControlPlane, receiver: OtlpReceiver) -> None:
    queued = FakeContext(plane.config.authz_timeout_s - 2.0)
    response = await servicer(plane).Check(check_request(chat_body(), {"x-request-id": "late"}), queued)
    assert denial(response)[0] == 503
    [span] = await exported(plane, receiver)
    assert span.attributes["sluice.failure"] == "controlplane_overloaded"
    assert span.attributes["sluice.request_id"] == "late" and "sluice.verdict" not in span.attributes


@pytest.mark.parametrize(("ratio", "client_flags", "traced"), [
    (0.0, None, False),   # no parent, ratio 0: not sampled
    (0.0, "01", True),    # the client sampled its trace: followed, whatever the ratio
    (1.0, "00", False),   # the client did not sample: followed too
])
async def test_sampling_follows_the_client_and_the_ratio_decides_new_traces(
        monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, ratio: float, client_flags: str | None,
        traced: bool) -> None:
    plane = make_plane(monkeypatch, receiver, sample_ratio=ratio)
    try:
        headers = {"traceparent": traceparent(client_flags)} if client_flags else {}
        response = await check(plane, headers, max_tokens=5)
        assert plane.tracing is not None and await plane.tracing.force_flush()
        sent = upstream_headers(response)["traceparent"][0]
        _, trace_id, span_id, _ = sent.split("-")
        assert sampled(sent) is traced, "the engine is told whether the trace is recorded"
        if client_flags:
            assert trace_id == CLIENT_TRACE and span_id != CLIENT_PARENT
        if traced:
            [span] = receiver.wait_for(1, CHECK_SPAN)
            assert span.span_id == span_id
        else:
            assert receiver.spans == [], "an unsampled Check exported a span"
    finally:
        await plane.stop()


async def test_stopping_the_control_plane_flushes_the_spans(monkeypatch: pytest.MonkeyPatch,
                                                            receiver: OtlpReceiver) -> None:
    plane = make_plane(monkeypatch, receiver)
    await check(plane, {"x-request-id": "last"}, max_tokens=5)
    assert receiver.spans == [], "the batch processor should still hold the span (5 s schedule)"
    await plane.stop()
    [span] = receiver.wait_for(1, CHECK_SPAN, timeout=0.1)  # sent by stop() itself, not later
    assert span.attributes["sluice.request_id"] == "last"


async def test_tracing_off_leaves_the_check_and_the_clients_traceparent_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    plane = ControlPlane(parse_config(ONE))
    assert plane.tracing is None and plane.service.trace_outcome is None
    monkeypatch.setattr(plane.observation, "fleet", lambda now: plane.admission.fleet([EngineView(
        name="thor", url="", max_num_seqs=4, models=(ServedModel("cortex", 32_768),), version="0.11.0",
        sample=EngineSample(now, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000), last_ok_at=now,
        stale=False, chip_class="thor")], now))
    response = await AuthorizationServicer(plane.service).Check(
        check_request(chat_body(max_tokens=5), {"traceparent": traceparent()}), FakeContext(290.0))
    # No traceparent of its own: Envoy forwards the client's header to the engine as it came (tests/e2e/test_tracing.py).
    assert "traceparent" not in upstream_headers(response)


class StuckExporter(SpanExporter):
    """An exporter whose export never returns until released: a collector that accepted the connection and went silent
    for longer than any bound. Stands in for the exporter only to test that stopping is bounded; the spans themselves are
    tested through the real exporter above."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exporting = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exporting.set()
        self.release.wait(30)
        return SpanExportResult.FAILURE


async def test_a_stuck_collector_delays_the_stop_by_the_export_timeout_at_most(
        monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture) -> None:
    plane = make_plane(monkeypatch, receiver, export_timeout_seconds=0.3)
    stuck = StuckExporter()
    assert plane.tracing is not None
    await plane.tracing.shutdown()  # the fixture's real exporter, replaced by the stuck one
    plane.tracing = CheckTracing(plane.config.tracing, "test", exporter=stuck)
    plane.service.trace_outcome = plane.tracing.record
    try:
        await check(plane, max_tokens=5)
        started = time.monotonic()
        await plane.stop()
        took = time.monotonic() - started
        assert stuck.exporting.is_set(), "the stop should have tried to flush the span"
        assert took < 1.5, f"stop waited {took:.2f}s on a stuck collector (bound 0.3 s)"
        assert "spans not flushed" in caplog.text
    finally:
        stuck.release.set()
