"""The state machine of one state-of-the-world ADS stream, sans I/O.

Feed it Envoy's ``DiscoveryRequest``s (``on_request``) and snapshot changes (``on_snapshot``); it returns the
``DiscoveryResponse``s to send. Per type URL it tracks:

- a **watch**: Envoy has a request outstanding; a response is only ever sent into an open watch, which it closes;
- the last response sent (version, nonce, names) — a request whose ``response_nonce`` is not that nonce is stale and ignored;
- ACK (no ``error_detail``): the acked version; NACK (``error_detail`` set): the sent version is **rejected** and is never
  sent again on this stream (no go-control-plane #962 loop); Envoy keeps serving its last accepted config meanwhile;
- for EDS and RDS, the resource names Envoy subscribes to; a newly requested name is answered even if the version is unchanged.

After a CDS response, every watched cluster's load assignment is resent (a cluster only leaves warming when its CLA arrives).
Changes are pushed in make-before-break order: CDS, EDS, LDS, RDS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from controlplane.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE
from controlplane.xds.snapshot import NAMED_TYPES, PUSH_ORDER, Snapshot


@dataclass
class _TypeState:
    watching: bool = False
    names: frozenset[str] = frozenset()
    sent_version: str | None = None
    sent_nonce: str | None = None
    sent_names: frozenset[str] = frozenset()
    acked_version: str | None = None
    rejected: set[str] = field(default_factory=set)
    force: bool = False
    """Resend even if the version did not move (EDS after a CDS change)."""


@dataclass(frozen=True, slots=True)
class Nack:
    type_url: str
    version: str
    message: str


class AdsStream:
    def __init__(self) -> None:
        self.node_id: str | None = None
        self._types: dict[str, _TypeState] = {}
        self._nonce = 0
        self.nacks: list[Nack] = []
        """Every rejection Envoy reported on this stream, oldest first (the shell drains it for metrics and logs)."""

    def acked_version(self, type_url: str) -> str | None:
        state = self._types.get(type_url)
        return state.acked_version if state else None

    def on_request(self, request: discovery_pb2.DiscoveryRequest, snapshot: Snapshot | None) -> list[discovery_pb2.DiscoveryResponse]:
        if self.node_id is None and request.node.id:
            self.node_id = request.node.id
        type_url = request.type_url
        state = self._types.setdefault(type_url, _TypeState())
        if request.response_nonce:
            if request.response_nonce != state.sent_nonce:
                return []  # answers a response we have since superseded
            if request.HasField("error_detail"):
                if state.sent_version is not None:
                    state.rejected.add(state.sent_version)
                    self.nacks.append(Nack(type_url, state.sent_version, request.error_detail.message))
            else:
                state.acked_version = request.version_info
        state.watching = True
        if type_url in NAMED_TYPES:
            names = frozenset(request.resource_names)
            if names - state.sent_names:
                state.force = True
            state.names = names
        return self._flush(snapshot, (type_url,))

    def on_snapshot(self, snapshot: Snapshot) -> list[discovery_pb2.DiscoveryResponse]:
        return self._flush(snapshot, PUSH_ORDER)

    def _flush(self, snapshot: Snapshot | None, order: tuple[str, ...]) -> list[discovery_pb2.DiscoveryResponse]:
        if snapshot is None:
            return []
        out: list[discovery_pb2.DiscoveryResponse] = []
        for type_url in order:
            response = self._maybe_respond(type_url, snapshot)
            if response is None:
                continue
            out.append(response)
            if type_url == CLUSTER_TYPE:
                self._types.setdefault(ENDPOINT_TYPE, _TypeState()).force = True
                if ENDPOINT_TYPE not in order:
                    # An EDS watch may already be open: serve it now rather than waiting for the next snapshot.
                    eds = self._maybe_respond(ENDPOINT_TYPE, snapshot)
                    if eds is not None:
                        out.append(eds)
        return out

    def _maybe_respond(self, type_url: str, snapshot: Snapshot) -> discovery_pb2.DiscoveryResponse | None:
        state = self._types.get(type_url)
        if state is None or not state.watching:
            return None
        version = snapshot.version(type_url)
        if version in state.rejected:
            return None
        first = state.sent_version is None
        if not (first or state.force or version != state.sent_version):
            return None
        available = snapshot.resources(type_url)
        if type_url in NAMED_TYPES:
            names = sorted(state.names)
            resources = [available[n] for n in names if n in available]
            if type_url == ENDPOINT_TYPE:
                resources += [_empty_load_assignment(n) for n in names if n not in available]
        else:
            resources = [available[n] for n in sorted(available)]
        self._nonce += 1
        nonce = str(self._nonce)
        state.watching = False
        state.force = False
        state.sent_version = version
        state.sent_nonce = nonce
        state.sent_names = state.names
        return discovery_pb2.DiscoveryResponse(
            version_info=version, resources=resources, type_url=type_url, nonce=nonce
        )


def _empty_load_assignment(cluster_name: str) -> any_pb2.Any:
    """The answer for a cluster Envoy asks about that the snapshot does not hold."""
    packed = any_pb2.Any()
    packed.Pack(endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name))
    return packed
