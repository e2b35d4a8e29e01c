"""OpenTelemetry traces of the Checks (opt-in: ``tracing.enabled``, ``TracingConfig`` in ``config/sections.py``).

One span per ext_authz Check, ``sluice.check`` (kind SERVER): a child of the client's W3C ``traceparent`` when the Check's
request headers carry one, else the root of a new trace. It carries the decision (``record``) and the answer
(``finish``). An admission sends the engine a ``traceparent`` (and the span's ``tracestate``) naming this span, through
the ext_authz OK response's upstream headers, replacing whatever the client sent. Tracing off, nothing here runs.

Spans leave in batches (``BatchSpanProcessor``: a bounded queue that drops rather than waits, so a slow or absent
collector never slows a Check) to ``tracing.otlp_endpoint`` over OTLP/HTTP in JSON (why not protobuf: decision 0024).
``shutdown`` flushes what is queued in a thread, off the event loop (bounded by ``tracing.export_timeout_seconds``). The
provider is this control plane's own, never OpenTelemetry's global one, so several control planes in one process (the
tests) keep their spans apart. The attributes, sampling and cost: docs/architecture.md, Tracing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

import grpc
from envoy.service.auth.v3 import external_auth_pb2
from opentelemetry import trace
from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from controlplane.servicers.authz import AuthorizationServicer
from controlplane.config import TracingConfig
from controlplane.core.model import InferenceRequest, Outcome, Verdict
from controlplane.edge import Failure, header
from controlplane.names import ROUTE_REASON_HEADER
from controlplane.ports import CheckPort, QuotaPort

log = logging.getLogger("sluice.tracing")

CHECK_SPAN = "sluice.check"
"""The name of every Check's span."""
SCOPE = "sluice.controlplane"
"""The instrumentation scope the spans are reported under."""
_FAILURES = frozenset(f.value for f in Failure)


class CheckTracing:
    """The control plane's tracer: its own ``TracerProvider`` (the config's service name and sampling, a batch processor
    in front of the OTLP exporter) and the W3C trace-context propagator."""

    def __init__(self, config: TracingConfig, version: str, exporter: SpanExporter | None = None) -> None:
        """``exporter``: None for the OTLP/HTTP exporter to ``config.otlp_endpoint`` (anything else is for tools that
        want spans elsewhere; the tests use the real exporter against a real receiver)."""
        self.config = config
        self.provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: config.service_name, SERVICE_VERSION: version}),
            # Parent-based: a client's sampled flag is followed (its trace is never cut here); the ratio decides the
            # Checks that start a trace.
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, timeout=config.export_timeout_seconds)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, export_timeout_millis=config.export_timeout_seconds * 1000))
        self.tracer = self.provider.get_tracer(SCOPE, version)
        self.propagator = TraceContextTextMapPropagator()

    def record(self, model: str | None, outcome: Outcome, request: InferenceRequest | None) -> None:
        """The decision's attributes on the current Check's span (``AdmissionService.record_outcome`` calls this in the
        Check's own task, where its span is current). Outside a Check the current span is not recording: nothing happens."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        d = outcome.decision
        attributes: dict[str, str | int | float] = {
            "sluice.verdict": d.verdict.value, "sluice.reason": d.reason.value, "sluice.request_id": outcome.request_id,
            "sluice.parked_ms": round(outcome.parked_for * 1000, 1),
        }
        if model:
            attributes["sluice.model"] = model
        if request is not None:
            attributes["sluice.priority"] = request.priority.value
        if d.engine:
            attributes["sluice.engine"] = d.engine
        if d.verdict is Verdict.ADMIT:
            attributes["sluice.expected_ttft_s"] = d.expected_ttft_s
        if d.retry_after_s is not None:
            attributes["sluice.retry_after_s"] = d.retry_after_s
        if outcome.ticket is not None:
            attributes["sluice.ticket_id"] = outcome.ticket.ticket_id
        span.set_attributes(attributes)

    def finish(self, span: trace.Span, response: external_auth_pb2.CheckResponse) -> None:
        """The answer on the span; an admission's upstream headers get the span's trace context (``traceparent``, and
        ``tracestate`` when the trace has one) for the engine."""
        if response.HasField("ok_response"):
            carrier: dict[str, str] = {}
            self.propagator.inject(carrier, trace.set_span_in_context(span))
            response.ok_response.headers.extend(header(key, value) for key, value in carrier.items())
            return
        denied = response.denied_response
        span.set_attribute("http.response.status_code", denied.status.code)
        reason = next((h.header.value for h in denied.headers if h.header.key == ROUTE_REASON_HEADER), "")
        if reason in _FAILURES:  # answered without (or against) a decision: overloaded, internal error, engine avoided
            span.set_attribute("sluice.failure", reason)
            if reason == Failure.INTERNAL_ERROR:
                span.set_status(Status(StatusCode.ERROR, "the control plane failed on this Check"))

    async def force_flush(self) -> bool:
        """Export every ended span now (in a thread: the export is blocking HTTP)."""
        return await asyncio.to_thread(self.provider.force_flush, int(self.config.export_timeout_seconds * 1000))

    async def shutdown(self) -> None:
        """Flush what is queued and stop the exporter, waiting at most ``tracing.export_timeout_seconds``.

        The SDK's own shutdown may block far longer (it joins its worker for up to 30 s while a dead collector's export
        retries), so it runs in a daemon thread of its own: past the bound the control plane stops anyway, says how many
        spans may be lost, and the thread dies with the process (an executor thread would hold the exit up)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():  # not already given up on
                done.set_result(None)

        def flush() -> None:
            try:
                self.provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=flush, name="tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, self.config.export_timeout_seconds)
        except TimeoutError:
            log.warning("tracing: spans not flushed to %s within %gs; the ones still queued are lost",
                        self.config.otlp_endpoint, self.config.export_timeout_seconds)


class TracedAuthorizationServicer(AuthorizationServicer):
    """The ext_authz servicer with each Check inside its span. The Check itself is ``AuthorizationServicer``'s, unchanged;
    the wiring registers this class only when tracing is on."""

    def __init__(self, admission: CheckPort, tracing: CheckTracing, quota: QuotaPort | None = None) -> None:
        super().__init__(admission, quota)
        self.tracing = tracing

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> external_auth_pb2.CheckResponse:
        http = request.attributes.request.http
        tracing = self.tracing
        parent = tracing.propagator.extract(http.headers)  # no or a malformed traceparent: a new trace
        attributes = {"http.request.method": http.method, "url.path": http.path.partition("?")[0]}
        request_id = http.headers.get("x-request-id")
        if request_id:  # the Check's own id (record() sets it) differs only when a client reused one in flight
            attributes["sluice.request_id"] = request_id
        with tracing.tracer.start_as_current_span(CHECK_SPAN, context=parent, kind=SpanKind.SERVER,
                                                  attributes=attributes) as span:
            try:
                response = await super().Check(request, context)
            except asyncio.CancelledError:  # the client left while the Check was parked: no answer, not an error
                span.set_attribute("sluice.cancelled", True)
                raise
            tracing.finish(span, response)
        return response
