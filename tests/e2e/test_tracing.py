"""W3C trace context end to end: a client -> the real Envoy -> the real control plane's ext_authz Check -> a simulated engine,
with the Check's spans exported by the real OTLP/HTTP exporter to a real receiver (tests/otlp.py).

Tracing on: the engine receives a ``traceparent`` in the client's trace whose parent is the exported Check span, so the
engine's own spans hang under the gateway's decision. Tracing off: the client's ``traceparent`` and ``tracestate`` reach the
engine exactly as sent (Envoy forwards them; the Lua filter strips only ``x-sluice-*``; Envoy traces nothing itself). What
the engine received is read from the simulator's ``/sim/log``, which keeps those headers."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import Stack, chat_body, post, start_stack
from tests.otlp import OtlpReceiver, ReceivedSpan
from controlplane.tracing import CHECK_SPAN


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver.start()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Stack]:
    s = start_stack([("thor", "thor")], tmp_path_factory.mktemp("traced"), speed=20.0,
                    tracing={"enabled": True, "otlp_endpoint": receiver.endpoint, "service_name": "sluice-e2e"})
    yield s
    s.close()


@pytest.fixture(scope="module")
def untraced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack([("thor", "thor")], tmp_path_factory.mktemp("untraced"), speed=20.0)
    yield s
    s.close()


def fresh_context() -> tuple[str, str]:
    """A new trace id and parent span id, as a client's tracer would make them (so each test finds its own request)."""
    return secrets.token_hex(16), secrets.token_hex(8)


def served_in_trace(stack: Stack, trace_id: str) -> dict[str, Any]:
    """The one request the engine served whose ``traceparent`` is in ``trace_id``."""
    found = [e for e in stack.sim_log("thor") if any(trace_id in v for v in e["traceparent"])]
    assert len(found) == 1, f"expected one request in trace {trace_id} at the engine, found {found}"
    return found[0]


def exported_check_span(stack: Stack, receiver: OtlpReceiver, trace_id: str) -> ReceivedSpan:
    plane = stack.controlplane
    assert plane is not None and plane.plane.tracing is not None
    assert plane.call(plane.plane.tracing.force_flush())
    spans = [s for s in receiver.wait_for(1, CHECK_SPAN) if s.trace_id == trace_id]
    assert len(spans) == 1, f"expected one Check span in trace {trace_id}, got {spans}"
    return spans[0]


def test_the_engine_continues_the_clients_trace_under_the_check_span(traced: Stack, receiver: OtlpReceiver) -> None:
    trace_id, parent = fresh_context()
    status, headers, _ = post(traced, "/chat/completions", chat_body(max_tokens=3),
                              {"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "client=1"})
    assert status == 200 and headers["x-sluice-engine"] == "thor"
    span = exported_check_span(traced, receiver, trace_id)
    served = served_in_trace(traced, trace_id)
    # The Check span is the client's span's child; the engine's parent is the Check span.
    assert span.parent_span_id == parent and span.span_id != parent
    assert served["traceparent"] == [f"00-{trace_id}-{span.span_id}-01"]
    assert served["tracestate"] == ["client=1"]
    a = span.attributes
    assert (a["sluice.verdict"], a["sluice.engine"], a["sluice.model"]) == ("admit", "thor", "cortex")
    assert a["sluice.request_id"] == served["x_request_id"], "the span names the request as the engine's log does"
    assert span.resource["service.name"] == "sluice-e2e"


def test_without_a_client_trace_the_check_starts_one_for_the_engine(traced: Stack, receiver: OtlpReceiver) -> None:
    status, _, _ = post(traced, "/chat/completions", chat_body(max_tokens=7))  # this module's only 7-token request
    assert status == 200
    served = [e for e in traced.sim_log("thor") if e["max_tokens"] == 7]
    assert len(served) == 1, f"one request without trace context should have reached the engine: {served}"
    [sent] = served[0]["traceparent"]
    _, trace_id, span_id, flags = sent.split("-")
    span = exported_check_span(traced, receiver, trace_id)
    assert span.parent_span_id == "" and span.span_id == span_id and int(flags, 16) & 0x01


def test_a_refused_request_is_traced_and_never_reaches_the_engine(traced: Stack, receiver: OtlpReceiver) -> None:
    trace_id, parent = fresh_context()
    unknown = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, _ = post(traced, "/chat/completions", unknown, {"traceparent": f"00-{trace_id}-{parent}-01"})
    assert status == 404
    span = exported_check_span(traced, receiver, trace_id)
    assert (span.attributes["sluice.reason"], span.attributes["http.response.status_code"]) == ("unknown_model", 404)
    assert not [e for e in traced.sim_log("thor") if any(trace_id in v for v in e["traceparent"])]


def test_tracing_off_the_clients_trace_context_reaches_the_engine_unchanged(untraced: Stack) -> None:
    assert untraced.controlplane is not None and untraced.controlplane.plane.tracing is None
    trace_id, parent = fresh_context()
    sent = f"00-{trace_id}-{parent}-01"
    status, _, _ = post(untraced, "/chat/completions", chat_body(max_tokens=3),
                        {"traceparent": sent, "tracestate": "client=1,other=x"})
    assert status == 200
    served = served_in_trace(untraced, trace_id)
    assert served["traceparent"] == [sent] and served["tracestate"] == ["client=1,other=x"]
    # And nobody invents one: a request without trace context reaches the engine without it.
    assert post(untraced, "/chat/completions", chat_body(max_tokens=7))[0] == 200
    [plain] = [e for e in untraced.sim_log("thor") if e["max_tokens"] == 7]
    assert plain["traceparent"] == [] and plain["tracestate"] == []
