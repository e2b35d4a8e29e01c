"""Every HTTP header and query parameter sluice reads or writes, named once.

A leaf module (it imports nothing) so that the pure core (which parses the client's headers), the HTTP edge (which writes
sluice's own headers) and the xDS builders (which tell Envoy what to match, strip and log) all read the same spelling without
importing each other. Tests keep the literals: they are the contract these names must not drift from.
"""

from __future__ import annotations

# Client inputs: the only x-sluice-* request headers Envoy lets through (envoy.client_headers_kept), read by parse_request.
PRIORITY_HEADER = "x-sluice-priority"
"""critical | standard | sheddable."""
TTFT_HEADER = "x-sluice-max-ttft-ms"
"""A TTFT deadline in milliseconds."""
SESSION_HEADER = "x-sluice-session"
"""An affinity key: a conversation stays on one engine while that engine stays good enough."""
CLIENT_HEADERS = (PRIORITY_HEADER, TTFT_HEADER, SESSION_HEADER)

# Set by sluice on the upstream request (never taken from a client).
ENGINE_HEADER = "x-sluice-engine"
"""The engine a Check chose; the pinned route sends the request to the cluster it names (also returned to the client)."""
TICKET_HEADER = "x-sluice-ticket"
"""The admission's ticket, for the retry redirector to release; rides to the engine, never back to the client."""
PREEMPTIBLE_HEADER = "x-sluice-preemptible"
"""On a sheddable admission with ``fairness.preempt_sheddable``: the route that passes the stream through ext_proc
(decision 0028) matches it; removed before the engine."""
MODEL_HEADER = "x-sluice-model"
"""The body's ``model``, set by Envoy itself so the fail-open fallback routes can match on it."""

# On the response to the client.
ROUTE_REASON_HEADER = "x-sluice-route-reason"
"""What decided: the decision's reason, or the error code of an answer the Check made without a decision."""
PARKED_MS_HEADER = "x-sluice-parked-ms"
"""How long the request waited in the parking lot."""
RETRY_AFTER_HEADER = "retry-after"
CONTENT_TYPE_HEADER = "content-type"

AVOID_PARAM = "sluice_avoid"
"""Query parameter the retry redirector adds: the engine that failed, which the new Check must not choose again."""
