"""gRPC access-log service: Envoy's entry for a finished stream releases the ticket its admission created.

The ticket id travels from ``Check`` to here in ext_authz dynamic metadata (namespace ``envoy.filters.http.ext_authz``), which
Envoy copies into every entry's ``common_properties.metadata``. Entries without a ticket (denied or locally answered requests)
are counted and otherwise ignored. Envoy never gets a reply on this stream.

Every admitted request's first token is timed here (``first_token``): the engine's TTFT as clients saw it, which the
estimate's error and the TTFT feedback learn from (``CompletionPort.note_first_token``).

Every admitted request's usage, when its entry tells it, corrects its tenant's fair-share counter
(``CompletionPort.settle_usage``, core/fairshare.py). A tenant's request (its entry's ext_authz metadata names the
tenant) is also settled here: what it really used
(``core/tenants.py``'s ``settled_usage``: the engine's ``usage`` object, else the prompt estimate plus the content
deltas) comes from the ``sluice.usage`` metadata Envoy's Lua response filter wrote while the body streamed by
(``xds/resources/lua.py``), and replaces the pre-charge (``quota.py``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any
import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from controlplane.core.feedback import FirstToken
from controlplane.core.model import Ticket
from controlplane.core.prompt_tokens import PromptShape
from controlplane.core.tenants import ObservedResponse, settled_usage
from controlplane.names import CONTENT_TYPE_HEADER
from controlplane.ports import CompletionPort, QuotaPort
from controlplane.xds.resources import AUTHZ_NAMESPACE, FIRST_TOKEN_KEY, USAGE_NAMESPACE

log = logging.getLogger("sluice.accesslog")


def first_token(entry: Any) -> FirstToken | None:
    """When an admitted request's first token reached Envoy, from its access-log entry; None when it had none (not a
    200, the client left before it, the engine sent no token).

    A stream's time is the Lua response filter's ``first_token_us`` (the first event carrying a token passed Envoy);
    a non-streaming response's is its last upstream byte (the whole body is the first token the client sees). Both are
    measured from the moment the request was fully sent to the engine (after the Check and any park), which is also
    what the gateway's own part is measured to: Envoy's ``start_time`` and the Lua filter's clock are the same system
    clock."""
    props = entry.common_properties
    if entry.response.response_code.value != 200 or not props.HasField("time_to_last_upstream_tx_byte"):
        return None
    sent_s = props.time_to_last_upstream_tx_byte.ToTimedelta().total_seconds()
    whole_s = max(0.0, props.time_to_last_upstream_rx_byte.ToTimedelta().total_seconds() - sent_s) \
        if props.HasField("time_to_last_upstream_rx_byte") else None
    usage = props.metadata.filter_metadata[USAGE_NAMESPACE].fields \
        if USAGE_NAMESPACE in props.metadata.filter_metadata else {}
    output_tokens = int(usage["completion_tokens"].number_value) if "completion_tokens" in usage else \
        int(usage["deltas"].number_value) if "deltas" in usage else None
    content_type = entry.response.response_headers.get(CONTENT_TYPE_HEADER, "")
    if "text/event-stream" in content_type:
        if FIRST_TOKEN_KEY not in usage:
            return None
        start = props.start_time
        first_s = usage[FIRST_TOKEN_KEY].number_value / 1e6 - (start.seconds + start.nanos / 1e9)
        return FirstToken(engine_s=max(0.0, first_s - sent_s), gateway_s=sent_s, streamed=True, whole_s=whole_s,
                          output_tokens=output_tokens)
    if whole_s is None:
        return None
    return FirstToken(engine_s=whole_s, gateway_s=sent_s, streamed=False, whole_s=whole_s, output_tokens=output_tokens)


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, plane: CompletionPort, quota: QuotaPort | None = None) -> None:
        self.plane = plane
        self.quota = quota

    async def StreamAccessLogs(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext[Any, Any]
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self._record(entry)
        return als_pb2.StreamAccessLogsResponse()

    def _record(self, entry: Any) -> None:
        plane = self.plane
        self._note_engine_failure(entry)
        metadata = entry.common_properties.metadata.filter_metadata
        if AUTHZ_NAMESPACE not in metadata or "ticket" not in metadata[AUTHZ_NAMESPACE].fields:
            plane.metrics.access_log_entries.labels("no_ticket").inc()
            return
        authz = metadata[AUTHZ_NAMESPACE].fields
        ticket_id = authz["ticket"].string_value
        ticket = plane.release_ticket(ticket_id)
        plane.metrics.access_log_entries.labels("released" if ticket else "unknown_ticket").inc()
        seen = self._observed(entry, authz)
        usage = settled_usage(seen)
        if "tenant" in authz and self.quota is not None:
            charged = "charged" in authz and authz["charged"].bool_value
            self.quota.settle(authz["tenant"].string_value, ticket_id if charged else None, usage)
        if usage.reported or "tenant" in authz or not (seen.reached_engine and seen.status < 400):
            # What it really used (the deltas are counted for tenants' streams only): its tenant's fair-share counter
            # is corrected from the admission's estimate. Else the estimate stands.
            plane.settle_usage(ticket_id, usage)
        if ticket is not None:
            timing = first_token(entry)
            if timing is not None:
                plane.note_first_token(ticket, timing)
            self._learn_prompt_tokens(entry, ticket, authz)

    def _learn_prompt_tokens(self, entry: Any, ticket: Ticket, authz: Any) -> None:
        """What the Check counted of a released request's prompt (its ext_authz metadata), for its engine's prompt-token
        counter window; with the engine's own count (its usage object, read by the Lua response filter), a sample of
        the prompt-token rule and of the estimate's error."""
        if "prompt_chars" not in authz:
            return
        shape = PromptShape(int(authz["prompt_chars"].number_value), int(authz["prompt_messages"].number_value))
        estimated = int(authz["prompt_tokens"].number_value)
        ok = entry.response.response_code.value == 200
        self.plane.note_served_prompt(ticket, shape, estimated, ok)
        filter_metadata = entry.common_properties.metadata.filter_metadata
        if not ok or USAGE_NAMESPACE not in filter_metadata:
            return
        usage = filter_metadata[USAGE_NAMESPACE].fields
        if "prompt_tokens" in usage:
            self.plane.note_prompt_tokens(ticket, shape, estimated, int(usage["prompt_tokens"].number_value))

    @staticmethod
    def _observed(entry: Any, authz: Any) -> ObservedResponse:
        """A finished request's response as its entry tells it: the Lua filter's usage metadata (the engine's usage
        object, or the deltas it counted for a tenant's stream), the Check's prompt estimate, the status."""
        props = entry.common_properties
        usage = props.metadata.filter_metadata[USAGE_NAMESPACE].fields \
            if USAGE_NAMESPACE in props.metadata.filter_metadata else {}

        def count(name: str) -> int | None:
            return int(usage[name].number_value) if name in usage else None

        return ObservedResponse(
            prompt_estimate=int(authz["prompt_tokens"].number_value) if "prompt_tokens" in authz else 0,
            status=entry.response.response_code.value,
            reached_engine=props.HasField("time_to_last_upstream_tx_byte"),
            deltas=count("deltas") or 0, prompt_tokens=count("prompt_tokens"),
            completion_tokens=count("completion_tokens"), total_tokens=count("total_tokens"))

    def _note_engine_failure(self, entry: Any) -> None:
        """An engine that failed a request before its first byte leaves the candidates at once (``note_engine_failure``),
        whether the request was admitted or went by the fail-open weights."""
        props = entry.common_properties
        engine = props.upstream_cluster
        if not engine or props.HasField("time_to_first_upstream_rx_byte") and \
                entry.response.response_code.value != 503:
            return  # the engine answered (a 503 from the engine itself counts as a failure)
        f = props.response_flags
        flags = [name for name, seen in (("UF", f.upstream_connection_failure), ("UR", f.upstream_remote_reset),
                                         ("UC", f.upstream_connection_termination), ("UH", f.no_healthy_upstream))
                 if seen]
        if not flags and entry.response.response_code.value == 503 and \
                props.HasField("time_to_first_upstream_rx_byte"):
            flags = ["503"]
        if flags and self.plane.knows_engine(engine):
            self.plane.metrics.engine_failures.labels(engine, ",".join(flags)).inc()
            self.plane.note_engine_failure(engine, "request failed before its first byte (" + ",".join(flags) + ")")
