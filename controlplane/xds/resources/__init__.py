"""The Envoy resources sluice serves over ADS: one stable listener (listener.py, with its Lua filters in lua.py), one
route table, and a cluster and load assignment per engine (routing.py). Built from the config (and the weights and
caps the publisher passes), as pure functions of their inputs."""

from __future__ import annotations

from controlplane.xds.resources.listener import CONTROLPLANE_CLUSTER, LISTENER_NAME, build_listener
from controlplane.xds.resources.lua import AUTHZ_NAMESPACE, FIRST_TOKEN_KEY, USAGE_NAMESPACE
from controlplane.xds.resources.routing import INFERENCE_PATH_REGEX, build_cluster, build_load_assignment, build_routes

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

__all__ = [
    "AUTHZ_NAMESPACE", "CLUSTER_TYPE", "CONTROLPLANE_CLUSTER", "ENDPOINT_TYPE", "FIRST_TOKEN_KEY", "INFERENCE_PATH_REGEX",
    "LISTENER_NAME", "LISTENER_TYPE", "ROUTE_TYPE", "USAGE_NAMESPACE", "build_cluster", "build_listener",
    "build_load_assignment", "build_routes",
]
