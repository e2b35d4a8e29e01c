"""Build the Envoy resources sluice serves over ADS: one stable listener, one route table, a cluster and CLA per engine.

The listener carries the whole request path (DESIGN.md): strip client ``x-sluice-*`` headers (Lua, first filter) ->
the body's model as a header (for the fail-open routes) -> the response reader (Lua, response side only: when an
admitted stream's first token passed, its deltas and usage, for the access log) -> ext_authz (body up to
``max_request_bytes`` as raw bytes; larger bodies get 413 from Envoy before any Check) -> router. Its
access log goes to the control plane over gRPC ALS; that entry is the completion signal that releases a ticket.

The listener never changes after start (an LDS change drains connections, SSE streams included): routing moves through RDS
and EDS only.
"""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2
from envoy.config.core.v3 import (
    address_pb2, backoff_pb2, base_pb2, config_source_pb2, grpc_service_pb2, substitution_format_string_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.matcher.v3 import regex_pb2
from envoy.type.matcher.v3 import string_pb2
from envoy.type.v3 import http_status_pb2, percent_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from controlplane.config import Config, EngineConfig, OnFailure
from controlplane.core.model import Reason
from controlplane.core.request import MODELS_PATH
from controlplane.edge import JSON_CONTENT_TYPE, REPLIES, Failure, error_json, header
from controlplane.names import CONTENT_TYPE_HEADER, ENGINE_HEADER, MODEL_HEADER, RETRY_AFTER_HEADER

LISTENER_NAME = "sluice_openai"
ROUTE_CONFIG_NAME = "sluice_routes"
CONTROLPLANE_CLUSTER = "sluice_controlplane"
METADATA_NAMESPACE = "sluice"
FAILURE_STATUS = 502
"""ext_authz's status when the control plane cannot answer; only a local-reply mapper sees it (rewritten to 503)."""
ACCESS_LOG_NAME = "sluice"
INFERENCE_PATH_REGEX = "^/v1/(chat/completions|completions|embeddings)$"
"""The OpenAI paths that carry a model and are routed to an engine (the same set ``parse_request`` accepts)."""
AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
USAGE_NAMESPACE = "sluice.usage"
"""Dynamic metadata the Lua response filter writes: on an admitted stream ``first_token_us`` (when its first token passed
Envoy, microseconds since the epoch); the engine's ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` when a
usage object passes (a non-streaming body's, a stream's with ``stream_options.include_usage``); ``deltas``, the content
deltas a response carried. The access log
reads them."""
FIRST_TOKEN_KEY = "first_token_us"
USAGE_PENDING_MAX_BYTES = 65536
"""The Lua usage filter keeps the text after the last complete SSE event (a whole non-streaming body) up to this much;
past it only the last 4 KiB stay (a body's ``usage`` object comes last)."""

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

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def _any(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _seconds(value: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(value * 1e9))
    return d


def _ads() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3
    )


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
        retry_back_off=backoff_pb2.BackoffStrategy(base_interval=_seconds(CHECK_RETRY_BASE_S),
                                                   max_interval=_seconds(2 * timeout_s)),
        retry_host_predicate=[base_pb2.RetryPolicy.RetryHostPredicate(
            name="envoy.retry_host_predicates.previous_hosts",
            typed_config=_any(previous_hosts_pb2.PreviousHostsPredicate()))],
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
        service.timeout.CopyFrom(_seconds(timeout_s))
        if retry:
            service.retry_policy.CopyFrom(_check_retry(timeout_s))
    return service


def _strip_headers_lua(kept: tuple[str, ...]) -> str:
    """Lua that removes every ``x-sluice-*`` request header except the client inputs in ``kept``.

    Envoy's header-mutation filters only remove exact names; a client could invent any ``x-sluice-`` header, so the prefix
    match needs code. This runs before ext_authz: nothing a client sends under that prefix reaches a decision or an engine
    unless it is a documented input.
    """
    keep = ", ".join(f'["{h}"] = true' for h in kept)
    return f"""
local keep = {{{keep}}}
function envoy_on_request(handle)
  local doomed = {{}}
  for name, _ in pairs(handle:headers()) do
    if string.sub(name, 1, 9) == "x-sluice-" and not keep[name] then
      doomed[#doomed + 1] = name
    end
  end
  for _, name in ipairs(doomed) do
    handle:headers():remove(name)
  end
end
"""


_MODEL_HEADER_LUA = f"""
function envoy_on_request(handle)
  local found = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
  if found ~= nil and found["model"] ~= nil then
    handle:headers():replace("{MODEL_HEADER}", found["model"])
  end
end
"""


# The response side of an admitted request (its ext_authz metadata holds a ticket; every other response returns at once
# and is never read). It reads body chunks as they pass (bodyChunks: Envoy does not buffer the stream for it). An event is
# the text between blank lines; a non-streaming body is one event, read when the body ends.
# - A stream (content-type text/event-stream): the moment the first event carrying a token passes (content, text,
#   reasoning or a tool call), in microseconds since the epoch, is kept as ``first_token_us``. A non-streaming
#   response's first token is left to the access log (its whole body: the last upstream byte's time).
# - The engine's usage object when one passes (a non-streaming body's; a stream's last SSE chunk with
#   stream_options.include_usage): the access log learns prompt tokens from it, reports the answer's length against
#   the estimate and settles a tenant's request with it.
# - The content deltas streamed so far (written after each chunk that added some, so a tenant's client that leaves
#   mid-stream is charged what it was sent, and a stream without a usage object still has a length).
_USAGE_LUA = f"""
local NS = "{USAGE_NAMESPACE}"
local MAX_PENDING = {USAGE_PENDING_MAX_BYTES}
local FIELDS = {{"prompt_tokens", "completion_tokens", "total_tokens"}}
local TOKEN_PATTERNS = {{'"content"%s*:%s*"[^"]', '"text"%s*:%s*"[^"]', '"reasoning_content"%s*:%s*"[^"]',
                        '"reasoning"%s*:%s*"[^"]', '"tool_calls"%s*:%s*%[%s*{{'}}

local function has_token(text)
  for _, pattern in ipairs(TOKEN_PATTERNS) do
    if string.find(text, pattern) then
      return true
    end
  end
  return false
end

function envoy_on_response(handle)
  local authz = handle:streamInfo():dynamicMetadata():get("{AUTHZ_NAMESPACE}")
  if authz == nil or authz["ticket"] == nil then
    return
  end
  local content_type = handle:headers():get("content-type")
  local streamed = content_type ~= nil and string.find(content_type, "text/event-stream", 1, true) ~= nil
  local waiting_first = streamed
  -- Envoy's objects are valid only until the script yields (each chunk): fetch the metadata object afresh every time.
  local function put(key, value)
    handle:streamInfo():dynamicMetadata():set(NS, key, value)
  end
  local deltas = 0
  local pending = ""
  local function event(text)
    if waiting_first and has_token(text) then
      put("{FIRST_TOKEN_KEY}", tonumber(handle:timestampString(EnvoyTimestampResolution.MICROSECOND)))
      waiting_first = false
    end
    if string.find(text, '"content"%s*:%s*"[^"]') or string.find(text, '"text"%s*:%s*"[^"]') then
      deltas = deltas + 1
    end
    local at = string.find(text, '"usage"%s*:%s*{{')
    if at ~= nil then
      local part = string.sub(text, at, at + 1024)
      for _, name in ipairs(FIELDS) do
        local n = string.match(part, '"' .. name .. '"%s*:%s*(%d+)')
        if n ~= nil then
          put(name, tonumber(n))
        end
      end
    end
  end
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size > 0 then
      local before = deltas
      pending = pending .. (string.gsub(chunk:getBytes(0, size), "\\r", ""))
      local start = 1
      while true do
        local stop = string.find(pending, "\\n\\n", start, true)
        if stop == nil then
          break
        end
        event(string.sub(pending, start, stop - 1))
        start = stop + 2
      end
      pending = string.sub(pending, start)
      if #pending > MAX_PENDING then
        pending = string.sub(pending, -4096)
      end
      if deltas ~= before then
        put("deltas", deltas)
      end
    end
  end
  if #pending > 0 then
    local before = deltas
    event(pending)
    if deltas ~= before then
      put("deltas", deltas)
    end
  end
end
"""


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
    strip = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=_strip_headers_lua(ev.client_headers_kept)))
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
    model_header = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=_MODEL_HEADER_LUA),
                               clear_route_cache=wrappers_pb2.BoolValue(value=True))
    usage = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=_USAGE_LUA), stat_prefix="usage")
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
    access_log = als_pb2.HttpGrpcAccessLogConfig(
        common_config=als_pb2.CommonGrpcAccessLogConfig(
            log_name=ACCESS_LOG_NAME,
            grpc_service=_controlplane_grpc(),
            transport_api_version=config_source_pb2.V3,
            buffer_flush_interval=_seconds(ev.access_log_flush_seconds),
            buffer_size_bytes=wrappers_pb2.UInt32Value(value=ev.access_log_buffer_bytes),
        ),
        additional_request_headers_to_log=[ENGINE_HEADER],
        additional_response_headers_to_log=[CONTENT_TYPE_HEADER],
    )
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix="sluice",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=_ads(), route_config_name=ROUTE_CONFIG_NAME),
        http_filters=[
            hcm_pb2.HttpFilter(name="sluice.strip_client_headers", typed_config=_any(strip)),
            hcm_pb2.HttpFilter(name="envoy.filters.http.json_to_metadata", typed_config=_any(lift_model)),
            hcm_pb2.HttpFilter(name="sluice.model_header", typed_config=_any(model_header)),
            hcm_pb2.HttpFilter(name="sluice.usage", typed_config=_any(usage)),
            hcm_pb2.HttpFilter(name="envoy.filters.http.ext_authz", typed_config=_any(authz)),
            hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=_any(router_pb2.Router())),
        ],
        access_log=[accesslog_pb2.AccessLog(name="envoy.access_loggers.http_grpc", typed_config=_any(access_log))],
        stream_idle_timeout=_seconds(ev.stream_idle_timeout_seconds),
        # Slow-header clients are closed (408) instead of holding a connection slot forever; the whole request, a park
        # included, is bounded by the idle timeout (a park is at most the idle timeout less 20 s, config validation).
        request_headers_timeout=_seconds(ev.request_headers_timeout_seconds),
        request_timeout=_seconds(ev.stream_idle_timeout_seconds),
        # When Envoy closes a client connection (an engine died mid-stream, a local reply with connection: close) it
        # waits this long for the client to close first; the timer runs while the response waits to be flushed, so a
        # short one closes busy connections with their answer unwritten. 0 (the default): close once flushed.
        delayed_close_timeout=_seconds(ev.delayed_close_timeout_seconds),
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
                        name="envoy.filters.network.http_connection_manager", typed_config=_any(hcm)
                    )
                ]
            )
        ],
    )


def _inference_paths() -> route_components_pb2.RouteMatch:
    return route_components_pb2.RouteMatch(safe_regex=regex_pb2.RegexMatcher(regex=INFERENCE_PATH_REGEX))


def _direct_error(name: str, match: route_components_pb2.RouteMatch, key: Reason | Failure, message: str,
                  headers: tuple[tuple[str, str], ...] = (), *, skip_authz: bool = False) -> route_components_pb2.Route:
    """A route Envoy answers itself, with the status, type and code the edge gives ``key`` (edge.py)."""
    route = route_components_pb2.Route(
        name=name, match=match,
        direct_response=route_components_pb2.DirectResponseAction(
            status=REPLIES[key].status, body=base_pb2.DataSource(inline_string=error_json(key, message))),
        response_headers_to_add=[header(CONTENT_TYPE_HEADER, JSON_CONTENT_TYPE), *(header(k, v) for k, v in headers)],
    )
    if skip_authz:
        route.typed_per_filter_config["envoy.filters.http.ext_authz"].Pack(ext_authz_pb2.ExtAuthzPerRoute(disabled=True))
    return route


def _retry_elsewhere() -> tuple[route_components_pb2.RetryPolicy, route_components_pb2.InternalRedirectPolicy]:
    """Engine failure before the first byte -> one retry, which goes to the engine cluster's priority-1 endpoint (the
    control plane's retry redirector, never the engine again) -> a 307 back to the same URL with ``sluice_avoid`` ->
    Envoy's internal redirect runs the whole filter chain again: a new Check, a new ticket, another engine."""
    priorities = previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=1)
    retry = route_components_pb2.RetryPolicy(
        retry_on="connect-failure,refused-stream,reset,retriable-status-codes",
        retriable_status_codes=[503],
        num_retries=wrappers_pb2.UInt32Value(value=1),
        retry_priority=route_components_pb2.RetryPolicy.RetryPriority(
            name="envoy.retry_priorities.previous_priorities", typed_config=_any(priorities)),
    )
    redirect = route_components_pb2.InternalRedirectPolicy(
        max_internal_redirects=wrappers_pb2.UInt32Value(value=1), redirect_response_codes=[307])
    return retry, redirect


def build_routes(config: Config, weights: dict[str, dict[str, int]] | None = None) -> route_pb2.RouteConfiguration:
    """Only the OpenAI paths reach an engine, whether the control plane is up or down:

    1. ``pinned``: an inference path that ext_authz pinned (``x-sluice-engine``) -> that engine's cluster.
    2. ``fallback:<model>``: an inference path ext_authz let through unanswered (fail-open: the control plane is
       unreachable) -> the model's engines by their last capacity weights, each behind its per-engine circuit breaker.
    3. ``models``: ``GET /v1/models`` is answered by the control plane; reaching the route means it could not answer.
    4. ``unpinned``: an inference path with no model to route by -> 503 ``not_admitted``.
    5. ``unknown``: every other path -> 404 ``unknown_url`` from Envoy itself, without a Check.
    """
    retry, redirect = _retry_elsewhere()
    pinned = route_components_pb2.Route(
        name="pinned",
        match=route_components_pb2.RouteMatch(
            safe_regex=regex_pb2.RegexMatcher(regex=INFERENCE_PATH_REGEX),
            headers=[route_components_pb2.HeaderMatcher(name=ENGINE_HEADER, present_match=True)],
        ),
        route=route_components_pb2.RouteAction(cluster_header=ENGINE_HEADER, timeout=_seconds(0)),
    )
    if config.envoy.retry_on_engine_failure:
        pinned.route.retry_policy.CopyFrom(retry)
        pinned.route.internal_redirect_policy.CopyFrom(redirect)
    fallback = [
        route_components_pb2.Route(
            name=f"fallback:{model}",
            match=route_components_pb2.RouteMatch(
                safe_regex=regex_pb2.RegexMatcher(regex=INFERENCE_PATH_REGEX),
                headers=[route_components_pb2.HeaderMatcher(
                    name=MODEL_HEADER, string_match=string_pb2.StringMatcher(exact=model))],
            ),
            route=route_components_pb2.RouteAction(
                weighted_clusters=route_components_pb2.WeightedCluster(clusters=[
                    route_components_pb2.WeightedCluster.ClusterWeight(
                        name=engine, weight=wrappers_pb2.UInt32Value(value=weight))
                    for engine, weight in engine_weights.items()
                ]),
                timeout=_seconds(0),
            ),
        )
        for model, engine_weights in sorted((weights or {}).items()) if engine_weights
    ]
    unavailable = ((RETRY_AFTER_HEADER, str(config.envoy.failure_retry_after_seconds)),)
    models = _direct_error("models", route_components_pb2.RouteMatch(path=MODELS_PATH), Failure.CONTROLPLANE_UNAVAILABLE,
                           "The admission control plane is unreachable; retry later", unavailable)
    unpinned = _direct_error("unpinned", _inference_paths(), Failure.NOT_ADMITTED,
                             "No engine was chosen for this request", unavailable)
    # The same answer (404 unknown_url) a Check gives an unknown path (Reason.UNKNOWN_PATH), without a Check.
    unknown = _direct_error("unknown", route_components_pb2.RouteMatch(prefix="/"), Reason.UNKNOWN_PATH,
                            "Unknown request URL (sluice routes only /v1/chat/completions, /v1/completions, "
                            "/v1/embeddings and /v1/models)", skip_authz=True)
    return route_pb2.RouteConfiguration(
        name=ROUTE_CONFIG_NAME,
        virtual_hosts=[route_components_pb2.VirtualHost(name="openai", domains=["*"],
                                                         routes=[pinned, *fallback, models, unpinned, unknown])],
    )


def engine_max_requests(engine: EngineConfig, config: Config, reported_cap: int | None = None) -> int:
    """Envoy's per-engine circuit breaker: the engine's cap (configured, else reported) plus the configured headroom."""
    cap = engine.max_num_seqs or reported_cap
    if cap is None:
        return config.envoy.engine_max_requests_unknown_cap
    return cap + config.envoy.engine_overflow_headroom


def build_cluster(engine: EngineConfig, config: Config, reported_cap: int | None = None) -> cluster_pb2.Cluster:
    """An EDS cluster per engine, behind a circuit breaker of the engine's cap plus headroom.

    Admitted traffic never reaches the breaker (the control plane's cap is exact and cluster-wide); it bounds what the
    fail-open path, or a client that somehow got past a Check, can pile onto one engine. Overflow is Envoy's local 503
    (flag ``UO``), rewritten to ``engine_overloaded`` + retry-after. Connections and pending requests stay wide so that
    only concurrent requests are counted.
    """
    limit = engine_max_requests(engine, config, reported_cap)
    thresholds = circuit_breaker_pb2.CircuitBreakers.Thresholds(
        max_connections=wrappers_pb2.UInt32Value(value=100000),
        max_pending_requests=wrappers_pb2.UInt32Value(value=100000),
        max_requests=wrappers_pb2.UInt32Value(value=limit),
        max_retries=wrappers_pb2.UInt32Value(value=100000),
    )
    return cluster_pb2.Cluster(
        name=engine.name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=_ads()),
        connect_timeout=_seconds(config.envoy.connect_timeout_seconds),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(thresholds=[thresholds]),
        # The retry redirector at priority 1 must never take first attempts: no panic spill-over to it.
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=0.0)),
    )


def _lb_endpoint(host: str, port: int) -> endpoint_components_pb2.LbEndpoint:
    return endpoint_components_pb2.LbEndpoint(endpoint=endpoint_components_pb2.Endpoint(
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port))))


def build_load_assignment(engine: EngineConfig,
                          redirectors: Sequence[tuple[str, int]] = ()) -> endpoint_pb2.ClusterLoadAssignment:
    """The engine at priority 0; the control plane's retry redirectors (every replica's, when given) at priority 1, which
    only a retry reaches (``previous_priorities``)."""
    localities = [endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[_lb_endpoint(engine.host, engine.port)])]
    if redirectors:
        localities.append(endpoint_components_pb2.LocalityLbEndpoints(
            priority=1, lb_endpoints=[_lb_endpoint(host, port) for host, port in redirectors]))
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=engine.name, endpoints=localities)
