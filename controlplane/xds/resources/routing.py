"""What RDS, CDS and EDS carry, and what moves when the fleet does: the route table (only the OpenAI paths reach an
engine, whether the control plane is up or down), a cluster per engine behind a circuit breaker of its cap plus
headroom, and its load assignment (the engine at priority 0, the retry redirectors at priority 1)."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.matcher.v3 import regex_pb2
from envoy.type.matcher.v3 import string_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import wrappers_pb2

from controlplane.config import Config, EngineConfig
from controlplane.core.model import Reason
from controlplane.core.request import MODELS_PATH
from controlplane.edge import JSON_CONTENT_TYPE, REPLIES, Failure, error_json, header
from controlplane.names import CONTENT_TYPE_HEADER, ENGINE_HEADER, MODEL_HEADER, PREEMPTIBLE_HEADER, RETRY_AFTER_HEADER
from controlplane.xds.resources.protos import ads_source, pack, seconds

ROUTE_CONFIG_NAME = "sluice_routes"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
"""The filter that lets the control plane end a preemptible stream (decision 0028): in the listener's chain, enabled
on one route only."""
_MODE = processing_mode_pb2.ProcessingMode
PREEMPTIBLE_MODE = _MODE(request_header_mode=_MODE.SEND, response_header_mode=_MODE.SEND,
                         request_body_mode=_MODE.NONE, response_body_mode=_MODE.STREAMED,
                         request_trailer_mode=_MODE.SKIP, response_trailer_mode=_MODE.SKIP)
"""What ext_proc sends of a preemptible stream: its request headers (the ticket), its response headers and every
response chunk, each waiting for the control plane's answer; not the request body, not trailers."""
INFERENCE_PATH_REGEX = "^/v1/(chat/completions|completions|embeddings)$"
"""The OpenAI paths that carry a model and are routed to an engine (the same set ``parse_request`` accepts)."""


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
            name="envoy.retry_priorities.previous_priorities", typed_config=pack(priorities)),
    )
    redirect = route_components_pb2.InternalRedirectPolicy(
        max_internal_redirects=wrappers_pb2.UInt32Value(value=1), redirect_response_codes=[307])
    return retry, redirect


def build_routes(config: Config, weights: dict[str, dict[str, int]] | None = None) -> route_pb2.RouteConfiguration:
    """Only the OpenAI paths reach an engine, whether the control plane is up or down:

    1. ``pinned``: an inference path that ext_authz pinned (``x-sluice-engine``) -> that engine's cluster;
       ``pinned_preemptible`` the same for a stream the Check marked preemptible (``x-sluice-preemptible``), through
       ext_proc, which the virtual host disables on every other route (decision 0028).
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
        route=route_components_pb2.RouteAction(cluster_header=ENGINE_HEADER, timeout=seconds(0)),
    )
    if config.envoy.retry_on_engine_failure:
        pinned.route.retry_policy.CopyFrom(retry)
        pinned.route.internal_redirect_policy.CopyFrom(redirect)
    preemptible = route_components_pb2.Route()
    preemptible.CopyFrom(pinned)
    preemptible.name = "pinned_preemptible"
    preemptible.match.headers.append(route_components_pb2.HeaderMatcher(name=PREEMPTIBLE_HEADER, present_match=True))
    preemptible.request_headers_to_remove.append(PREEMPTIBLE_HEADER)
    preemptible.typed_per_filter_config[EXT_PROC_FILTER].Pack(
        ext_proc_pb2.ExtProcPerRoute(overrides=ext_proc_pb2.ExtProcOverrides(processing_mode=PREEMPTIBLE_MODE)))
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
                timeout=seconds(0),
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
    host = route_components_pb2.VirtualHost(name="openai", domains=["*"],
                                            routes=[preemptible, pinned, *fallback, models, unpinned, unknown])
    host.typed_per_filter_config[EXT_PROC_FILTER].Pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))
    return route_pb2.RouteConfiguration(name=ROUTE_CONFIG_NAME, virtual_hosts=[host])


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
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ads_source()),
        connect_timeout=seconds(config.envoy.connect_timeout_seconds),
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
