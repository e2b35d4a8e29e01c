"""The one listener: it carries the whole request path (DESIGN.md): strip client ``x-sluice-*`` headers (Lua, first
filter) -> the body's model as a header (for the fail-open routes) -> the response reader (Lua, response side only: when
an admitted stream's first token passed, its deltas and usage, for the access log) -> ext_authz (body up to
``max_request_bytes`` as raw bytes; larger bodies get 413 from Envoy before any Check) -> ext_proc (only on the route of
preemptible streams: decision 0028) -> router. Its access log goes to
the control plane over gRPC ALS; that entry is the completion signal that releases a ticket. Envoy's own errors are
rewritten into the OpenAI error shape by local-reply mappers (edge.py's table).

The listener never changes after start (an LDS change drains connections, SSE streams included): routing moves through
RDS and EDS only (routing.py)."""

from __future__ import annotations

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    address_pb2, backoff_pb2, base_pb2, config_source_pb2, grpc_service_pb2, substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import wrappers_pb2

from controlplane.config import Config, OnFailure
from controlplane.edge import JSON_CONTENT_TYPE, REPLIES, Failure, error_json, header
from controlplane.names import CONTENT_TYPE_HEADER, ENGINE_HEADER, RETRY_AFTER_HEADER
from controlplane.xds.resources.lua import METADATA_NAMESPACE, MODEL_HEADER_LUA, USAGE_LUA, strip_headers_lua
from controlplane.xds.resources.protos import ads_source, pack, seconds
from controlplane.xds.resources.routing import EXT_PROC_FILTER, ROUTE_CONFIG_NAME

LISTENER_NAME = "sluice_openai"
CONTROLPLANE_CLUSTER = "sluice_controlplane"
FAILURE_STATUS = 502
"""ext_authz's status when the control plane cannot answer; only a local-reply mapper sees it (rewritten to 503)."""
ACCESS_LOG_NAME = "sluice"

CHECK_RETRY_ON = "connect-failure,refused-stream,reset,unavailable"
"""When Envoy asks a Check again: its replica refused the connection or the stream, reset the stream (it died with the
Check sent, parked or not), or answered gRPC UNAVAILABLE (a server shutting down). A Check's every answer is a gRPC OK
(denials included), so none of these is a decision being repeated."""
CHECK_RETRIES = 3
"""Retries of one Check: with ``previous_hosts`` each goes to a replica not asked yet while one is left (a fleet of
up to four replicas is asked in full)."""
CHECK_RETRY_BASE_S = 0.025
"""Back-off base: retry k waits a random time below (2^k - 1) x this, so all three together wait under 0.275 s."""
CHECK_HOST_SELECTION_ATTEMPTS = 5
"""How often Envoy picks again when the host it picked was asked already (then it takes the last pick)."""


def _check_retry(timeout_s: float) -> base_pb2.RetryPolicy:
    """A Check whose replica went away is asked again, of a replica not asked before, within the Check's timeout.

    Contract, as Envoy 1.40 applies a ``GrpcService.retry_policy`` to ext_authz (measured with the real binary; the
    ``EnvoyGrpc.retry_policy`` field is not read by ext_authz): ``retry_on`` covers a refused connection or stream, a
    reset after the Check was sent (a parked Check whose replica died) and gRPC UNAVAILABLE; the retried CheckRequest
    is the same message (same ``x-request-id``) and carries the original ``grpc-timeout``; the Check's ``timeout``
    bounds all attempts together; ``previous_hosts`` sends each retry to a replica not tried before while one is left.
    Envoy turns ``retry_back_off.max_interval`` into the per-try timeout (a parked Check is reset when it passes), so
    max_interval is twice the Check's timeout: no attempt is cut before the Check's own timeout, and the back-off (a
    random wait below (2^k - 1) x base before retry k) never comes near max_interval. When every retry fails (no
    replica reachable) the Check fails and ``envoy.on_controlplane_failure`` applies. Each retry in flight holds one of
    the control-plane cluster's ``max_retries`` (bootstrap), which is set out of reach."""
    return base_pb2.RetryPolicy(
        retry_on=CHECK_RETRY_ON,
        num_retries=wrappers_pb2.UInt32Value(value=CHECK_RETRIES),
        retry_back_off=backoff_pb2.BackoffStrategy(base_interval=seconds(CHECK_RETRY_BASE_S),
                                                   max_interval=seconds(2 * timeout_s)),
        retry_host_predicate=[base_pb2.RetryPolicy.RetryHostPredicate(
            name="envoy.retry_host_predicates.previous_hosts",
            typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()))],
        host_selection_retry_max_attempts=CHECK_HOST_SELECTION_ATTEMPTS,
    )


def _controlplane_grpc(timeout_s: float | None = None, *, retry: bool = False) -> grpc_service_pb2.GrpcService:
    """The control-plane cluster as a gRPC service; ``retry`` (with ``timeout_s``): a unary call retried on another
    replica when its replica goes away (``_check_retry``). A stream (the access log) is not retried: Envoy reopens
    it."""
    service = grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=CONTROLPLANE_CLUSTER)
    )
    if timeout_s is not None:
        service.timeout.CopyFrom(seconds(timeout_s))
        if retry:
            service.retry_policy.CopyFrom(_check_retry(timeout_s))
    return service


def _status_filter(status: int) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(
        status_code_filter=accesslog_pb2.StatusCodeFilter(
            comparison=accesslog_pb2.ComparisonFilter(
                op=accesslog_pb2.ComparisonFilter.EQ,
                value=base_pb2.RuntimeUInt32(default_value=status, runtime_key=f"sluice.local_reply.{status}"),
            )
        )
    )


def _flags_filter(*flags: str) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=list(flags)))


def _json_error_mapper(
    log_filter: accesslog_pb2.AccessLogFilter, failure: Failure, message: str, *, set_status: bool = False,
    headers: tuple[tuple[str, str], ...] = (),
) -> hcm_pb2.ResponseMapper:
    """A local-reply mapper that turns one kind of Envoy-generated error into the OpenAI error shape, its type and code
    from the edge's table (edge.py). ``set_status``: reply with the table's status instead of the one Envoy produced (a
    filter on response flags may match several statuses; those mappers keep Envoy's)."""
    mapper = hcm_pb2.ResponseMapper(
        filter=log_filter,
        body_format_override=substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source=base_pb2.DataSource(inline_string=error_json(failure, message)),
            content_type=JSON_CONTENT_TYPE,
        ),
        headers_to_add=[header(k, v) for k, v in headers],
    )
    if set_status:
        mapper.status_code.value = REPLIES[failure].status
    return mapper


def build_listener(config: Config) -> listener_pb2.Listener:
    ev = config.envoy
    fail_open = ev.on_controlplane_failure is OnFailure.OPEN
    strip = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=strip_headers_lua(ev.client_headers_kept)))
    # The body's model, lifted into metadata and then into a header the fallback routes match on: when the control plane
    # cannot answer (fail-open), Envoy still sends each request to an engine serving its model, by the last weights.
    lift_model = json_to_metadata_pb2.JsonToMetadata(
        request_rules=json_to_metadata_pb2.JsonToMetadata.MatchRules(
            rules=[json_to_metadata_pb2.JsonToMetadata.Rule(
                selectors=[json_to_metadata_pb2.JsonToMetadata.Selector(key="model")],
                on_present=json_to_metadata_pb2.JsonToMetadata.KeyValuePair(
                    metadata_namespace=METADATA_NAMESPACE, key="model",
                    type=json_to_metadata_pb2.JsonToMetadata.STRING,
                ),
            )],
            allow_empty_content_type=True,
        )
    )
    model_header = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=MODEL_HEADER_LUA),
                               clear_route_cache=wrappers_pb2.BoolValue(value=True))
    usage = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=USAGE_LUA), stat_prefix="usage")
    authz = ext_authz_pb2.ExtAuthz(
        grpc_service=_controlplane_grpc(config.authz_timeout_s, retry=True),
        transport_api_version=config_source_pb2.V3,
        failure_mode_allow=fail_open,
        with_request_body=ext_authz_pb2.BufferSettings(
            max_request_bytes=ev.max_request_bytes, allow_partial_message=False, pack_as_bytes=True
        ),
        clear_route_cache=True,
        status_on_error=http_status_pb2.HttpStatus(code=FAILURE_STATUS),
    )
    # Present always, so that a reload can turn preemption on and off without a listener change; it processes nothing
    # (every mode SKIP or NONE: no stream to the control plane) except on the route ``pinned_preemptible``, whose
    # per-route override sets PREEMPTIBLE_MODE (routing.py; every other route disables it). A reply Envoy makes before
    # any route is chosen (a codec error) finds it inert too.
    preempt = ext_proc_pb2.ExternalProcessor(
        grpc_service=_controlplane_grpc(),
        failure_mode_allow=True,  # a control plane that cannot answer leaves the stream running, unprocessed
        message_timeout=seconds(ev.preempt_message_timeout_ms / 1000),
        processing_mode=processing_mode_pb2.ProcessingMode(
            request_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
            response_header_mode=processing_mode_pb2.ProcessingMode.SKIP),
    )
    access_log = als_pb2.HttpGrpcAccessLogConfig(
        common_config=als_pb2.CommonGrpcAccessLogConfig(
            log_name=ACCESS_LOG_NAME,
            grpc_service=_controlplane_grpc(),
            transport_api_version=config_source_pb2.V3,
            buffer_flush_interval=seconds(ev.access_log_flush_seconds),
            buffer_size_bytes=wrappers_pb2.UInt32Value(value=ev.access_log_buffer_bytes),
        ),
        additional_request_headers_to_log=[ENGINE_HEADER],
        additional_response_headers_to_log=[CONTENT_TYPE_HEADER],
    )
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix="sluice",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=ads_source(), route_config_name=ROUTE_CONFIG_NAME),
        http_filters=[
            hcm_pb2.HttpFilter(name="sluice.strip_client_headers", typed_config=pack(strip)),
            hcm_pb2.HttpFilter(name="envoy.filters.http.json_to_metadata", typed_config=pack(lift_model)),
            hcm_pb2.HttpFilter(name="sluice.model_header", typed_config=pack(model_header)),
            hcm_pb2.HttpFilter(name="sluice.usage", typed_config=pack(usage)),
            hcm_pb2.HttpFilter(name="envoy.filters.http.ext_authz", typed_config=pack(authz)),
            hcm_pb2.HttpFilter(name=EXT_PROC_FILTER, typed_config=pack(preempt)),
            hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=pack(router_pb2.Router())),
        ],
        access_log=[accesslog_pb2.AccessLog(name="envoy.access_loggers.http_grpc", typed_config=pack(access_log))],
        stream_idle_timeout=seconds(ev.stream_idle_timeout_seconds),
        # Slow-header clients are closed (408) instead of holding a connection slot forever; the whole request, a park
        # included, is bounded by the idle timeout (a park is at most the idle timeout less 20 s, config validation).
        request_headers_timeout=seconds(ev.request_headers_timeout_seconds),
        request_timeout=seconds(ev.stream_idle_timeout_seconds),
        # When Envoy closes a client connection (an engine died mid-stream, a local reply with connection: close) it
        # waits this long for the client to close first; the timer runs while the response waits to be flushed, so a
        # short one closes busy connections with their answer unwritten. 0 (the default): close once flushed.
        delayed_close_timeout=seconds(ev.delayed_close_timeout_seconds),
        local_reply_config=hcm_pb2.LocalReplyConfig(
            mappers=[
                _json_error_mapper(
                    _status_filter(413), Failure.REQUEST_TOO_LARGE,
                    f"Request body exceeds the gateway limit of {ev.max_request_bytes} bytes",
                ),
                # Fail-closed: ext_authz could not reach the control plane (only then is FAILURE_STATUS produced).
                _json_error_mapper(
                    accesslog_pb2.AccessLogFilter(and_filter=accesslog_pb2.AndFilter(
                        filters=[_status_filter(FAILURE_STATUS), _flags_filter("UAEX")])),
                    Failure.CONTROLPLANE_UNAVAILABLE, "The admission control plane is unreachable; retry later",
                    set_status=True, headers=((RETRY_AFTER_HEADER, str(ev.failure_retry_after_seconds)),),
                ),
                # An engine's circuit breaker (its cap + envoy.engine_overflow_headroom) overflowed: only the fail-open
                # path can get here, admitted traffic never exceeds the cap.
                _json_error_mapper(
                    _flags_filter("UO"), Failure.ENGINE_OVERLOADED, "The engine is at its concurrency limit; retry later",
                    set_status=True, headers=((RETRY_AFTER_HEADER, "1"),),
                ),
                _json_error_mapper(_status_filter(431), Failure.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                   "Request headers are too large"),
                _json_error_mapper(_status_filter(408), Failure.REQUEST_TIMEOUT, "The request was not received in time"),
                # Codec errors (conflicting Content-Length, malformed framing): a 400 for a request whose headers never
                # reached the filters. ext_authz's own 400s (which carry their own body) always have a :path.
                _json_error_mapper(
                    accesslog_pb2.AccessLogFilter(and_filter=accesslog_pb2.AndFilter(filters=[
                        _status_filter(400),
                        accesslog_pb2.AccessLogFilter(header_filter=accesslog_pb2.HeaderFilter(
                            header=route_components_pb2.HeaderMatcher(name=":path", present_match=True,
                                                                      invert_match=True))),
                    ])),
                    Failure.INVALID_HTTP_REQUEST, "Malformed HTTP request",
                ),
                _json_error_mapper(
                    _flags_filter("NC", "UH", "UF", "URX", "NR", "UC", "UR"), Failure.UPSTREAM_UNAVAILABLE,
                    "No engine could take the request (upstream unavailable)",
                    headers=((RETRY_AFTER_HEADER, "1"),),  # an engine that died is noticed within a few polls
                ),
            ]
        ),
    )
    return listener_pb2.Listener(
        name=LISTENER_NAME,
        address=address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address=ev.listen_host, port_value=ev.listen_port)
        ),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager", typed_config=pack(hcm)
                    )
                ]
            )
        ],
    )
