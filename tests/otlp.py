"""A real OTLP trace receiver for the tracing tests: what a collector is to the control plane.

It serves OTLP/HTTP's binding of ``opentelemetry.proto.collector.trace.v1.TraceService/Export``: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` in OTLP's JSON encoding (what ``tracing.py``'s exporter sends; see its docstring for why JSON),
decoded with the OpenTelemetry project's generated classes for those protos (``opentelemetry-proto-json``) and answered
with an ``ExportTraceServiceResponse``, like a collector. A stdlib HTTP server on its own thread, bound to port 0, so it
serves a control plane on any event loop (the unit tests' or ``ThreadedControlPlane``'s) while the test thread waits.

Each request's raw JSON is kept too, so a test can check the wire format against the OTLP specification itself (ids as
lowercase hex) rather than only through the same generated classes."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto_json.collector.trace.v1.trace_service import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)
from opentelemetry.proto_json.common.v1.common import AnyValue, KeyValue

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    """32 lowercase hex digits, as in a ``traceparent``."""
    span_id: str
    parent_span_id: str
    """"" for a root span."""
    name: str
    kind: int
    """OTLP's ``SpanKind`` number (2 = SERVER)."""
    status_code: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str


def _value(value: AnyValue | None) -> Any:
    if value is None:
        return None
    for name in ("string_value", "bool_value", "int_value", "double_value"):
        found = getattr(value, name)
        if found is not None:
            return found
    raise AssertionError(f"unexpected attribute value {value}")


def _attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if pair.key}


def _hex(raw: bytes | None) -> str:
    return (raw or b"").hex()


@dataclass
class OtlpReceiver:
    """Start with ``OtlpReceiver.start()``; ``endpoint`` is the URL to configure as ``tracing.otlp_endpoint``."""

    server: ThreadingHTTPServer
    thread: threading.Thread
    spans: list[ReceivedSpan] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    """Every request body as the raw JSON the exporter sent."""
    changed: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def start(cls) -> OtlpReceiver:
        receiver: OtlpReceiver | None = None

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                assert receiver is not None
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != TRACES_PATH or not self.headers.get("content-type", "").startswith("application/json"):
                    self.send_error(404 if self.path != TRACES_PATH else 415)
                    return
                receiver.accept(body)
                answer = ExportTraceServiceResponse().to_json().encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
                pass  # quiet: the tests say what they saw

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                  name="otlp-receiver")
        receiver = cls(server, thread)
        thread.start()
        return receiver

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{TRACES_PATH}"

    def accept(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.from_json(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes) if resource_spans.resource else {}
            for scope_spans in resource_spans.scope_spans:
                scope = (scope_spans.scope.name or "") if scope_spans.scope else ""
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        _hex(span.trace_id), _hex(span.span_id), _hex(span.parent_span_id), span.name or "",
                        int(span.kind or 0), int(span.status.code or 0) if span.status else 0,
                        _attributes(span.attributes), resource, scope))
        with self.changed:
            self.bodies.append(json.loads(body))
            self.spans.extend(spans)
            self.changed.notify_all()

    def wait_for(self, count: int, name: str | None = None, timeout: float = 15.0) -> list[ReceivedSpan]:
        """The spans received (named ``name``, when given) once there are at least ``count``; AssertionError on timeout."""
        def matching() -> list[ReceivedSpan]:
            return [s for s in self.spans if name is None or s.name == name]

        with self.changed:
            if not self.changed.wait_for(lambda: len(matching()) >= count, timeout):
                raise AssertionError(f"{len(matching())} spans received within {timeout}s, wanted {count}: {self.spans}")
            return matching()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
