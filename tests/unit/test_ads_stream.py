"""The ADS stream state machine against a fake Envoy that fails the test on any protocol violation."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2, duration_pb2
from google.rpc import status_pb2

from controlplane.config import Config, parse_config
from controlplane.xds.resources import (
    CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, build_cluster, build_listener, build_load_assignment,
    build_routes,
)
from controlplane.xds.snapshot import InconsistentSnapshot, Snapshot, check_consistent, make_snapshot
from controlplane.xds.stream import AdsStream


class ProtocolViolation(AssertionError):
    pass


def _config(*names: str) -> Config:
    return parse_config({"engines": [{"name": n, "url": f"http://127.0.0.1:{9000 + i}"} for i, n in enumerate(names)]})


def snapshot_for(*names: str, extra_clusters: tuple[cluster_pb2.Cluster, ...] = ()) -> Snapshot:
    cfg = _config(*names)
    return make_snapshot(
        listeners=[build_listener(cfg)],
        routes=[build_routes(cfg)],
        clusters=[*(build_cluster(e, cfg) for e in cfg.engines), *extra_clusters],
        endpoints=[build_load_assignment(e) for e in cfg.engines],
    )


BROKEN = cluster_pb2.Cluster(name="broken", type=cluster_pb2.Cluster.STATIC, connect_timeout=duration_pb2.Duration(seconds=-1))


@dataclass
class FakeEnvoy:
    """Plays Envoy's side of SotW ADS, in order, and fails on any protocol violation by the server.

    Responses the server produces are queued (the wire) and Envoy handles them one by one, answering each with an ACK or a
    NACK and, after clusters arrive, subscribing to their load assignments. Checks happen when the server produces a
    response, against what the server can know at that moment: a response needs an open watch (a request it has not
    answered), nonces only grow, a NACKed version never comes back, and named types answer exactly the names last asked.
    """

    stream: AdsStream
    snapshot: Snapshot
    reject: str = "broken"
    inbox: deque[discovery_pb2.DiscoveryResponse] = field(default_factory=deque)
    watch_open: dict[str, bool] = field(default_factory=dict)
    server_names: dict[str, set[str]] = field(default_factory=dict)
    last_sent_nonce: dict[str, str] = field(default_factory=dict)
    seen_nonce: dict[str, str] = field(default_factory=dict)
    last_nonce: int = 0
    accepted: dict[str, str] = field(default_factory=dict)
    accepted_names: dict[str, set[str]] = field(default_factory=dict)
    rejected: dict[str, set[str]] = field(default_factory=dict)
    subscriptions: dict[str, list[str]] = field(default_factory=dict)
    responses: list[discovery_pb2.DiscoveryResponse] = field(default_factory=list)
    first: bool = True

    def request(self, type_url: str, names: list[str] | None = None, nonce: str | None = None, error: str | None = None,
                version: str | None = None) -> None:
        if names is not None:
            self.subscriptions[type_url] = names
        nonce = self.seen_nonce.get(type_url, "") if nonce is None else nonce
        req = discovery_pb2.DiscoveryRequest(
            type_url=type_url, response_nonce=nonce,
            version_info=self.accepted.get(type_url, "") if version is None else version,
            resource_names=self.subscriptions.get(type_url, []),
        )
        if self.first:
            req.node.CopyFrom(base_pb2.Node(id="fake-envoy"))
            self.first = False
        if error is not None:
            req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        if not nonce or nonce == self.last_sent_nonce.get(type_url):
            self.watch_open[type_url] = True
            self.server_names[type_url] = set(req.resource_names)
        self.produced(self.stream.on_request(req, self.snapshot))

    def push(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.produced(self.stream.on_snapshot(snapshot))
        self.run()

    def produced(self, responses: list[discovery_pb2.DiscoveryResponse]) -> None:
        for response in responses:
            t = response.type_url
            if not self.watch_open.get(t):
                raise ProtocolViolation(f"{t} response without an outstanding request")
            self.watch_open[t] = False
            if not response.nonce.isdigit() or int(response.nonce) <= self.last_nonce:
                raise ProtocolViolation(f"nonce went backwards or repeated: {response.nonce} after {self.last_nonce}")
            self.last_nonce = int(response.nonce)
            if response.version_info in self.rejected.get(t, set()):
                raise ProtocolViolation(f"resent {t} version {response.version_info} that Envoy rejected")
            if t in (ENDPOINT_TYPE, ROUTE_TYPE):
                got = {_name(a) for a in response.resources}
                if got != self.server_names.get(t, set()):
                    raise ProtocolViolation(f"{t} answered {got}, last asked {self.server_names.get(t)}")
            self.last_sent_nonce[t] = response.nonce
            self.inbox.append(response)
            self.responses.append(response)

    def run(self) -> None:
        while self.inbox:
            self.react(self.inbox.popleft())

    def react(self, response: discovery_pb2.DiscoveryResponse) -> None:
        t = response.type_url
        self.seen_nonce[t] = response.nonce
        names = [_name(a) for a in response.resources]
        if self.reject in names:
            self.rejected.setdefault(t, set()).add(response.version_info)
            self.request(t, error="Proto constraint validation failed: connect_timeout")
            return
        self.accepted[t] = response.version_info
        self.accepted_names[t] = set(names)
        self.request(t)
        if t == CLUSTER_TYPE and sorted(names) != self.subscriptions.get(ENDPOINT_TYPE):
            self.request(ENDPOINT_TYPE, names=sorted(names))
        if t == LISTENER_TYPE and ROUTE_TYPE not in self.subscriptions:
            self.request(ROUTE_TYPE, names=["sluice_routes"])

    def connect(self) -> None:
        self.request(CLUSTER_TYPE, names=[])
        self.request(LISTENER_TYPE, names=[])
        self.run()


def _name(packed: any_pb2.Any) -> str:
    for cls, attr in ((cluster_pb2.Cluster, "name"), (endpoint_pb2.ClusterLoadAssignment, "cluster_name"),
                      (listener_pb2.Listener, "name")):
        if packed.Is(cls.DESCRIPTOR):
            msg = cls()
            packed.Unpack(msg)
            return str(getattr(msg, attr))
    from envoy.config.route.v3 import route_pb2

    msg = route_pb2.RouteConfiguration()
    packed.Unpack(msg)
    return str(msg.name)


def test_initial_handshake_delivers_everything_and_acks() -> None:
    snap = snapshot_for("thor", "spark")
    envoy = FakeEnvoy(AdsStream(), snap)
    envoy.connect()
    for t in (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE):
        assert envoy.accepted[t] == snap.version(t), t
        assert envoy.stream.acked_version(t) == snap.version(t)
    assert envoy.accepted_names[CLUSTER_TYPE] == {"thor", "spark"}
    assert envoy.accepted_names[ENDPOINT_TYPE] == {"thor", "spark"}
    assert envoy.stream.node_id == "fake-envoy"


def test_no_response_before_envoy_asks() -> None:
    stream = AdsStream()
    assert stream.on_snapshot(snapshot_for("thor")) == []


def test_nack_is_recorded_never_resent_and_recovery_works() -> None:
    good = snapshot_for("thor")
    envoy = FakeEnvoy(AdsStream(), good)
    envoy.connect()
    bad = snapshot_for("thor", extra_clusters=(BROKEN,))
    envoy.push(bad)
    assert [n.version for n in envoy.stream.nacks] == [bad.version(CLUSTER_TYPE)]
    assert envoy.accepted[CLUSTER_TYPE] == good.version(CLUSTER_TYPE)
    # The same bad content again (a periodic rebuild) must not be resent: the fake would raise.
    envoy.push(snapshot_for("thor", extra_clusters=(BROKEN,)))
    envoy.request(CLUSTER_TYPE, nonce="")  # even a fresh request on the type does not bring the bad version back
    envoy.run()
    assert len(envoy.stream.nacks) == 1
    fixed = snapshot_for("thor", "spark")
    envoy.push(fixed)
    assert envoy.accepted[CLUSTER_TYPE] == fixed.version(CLUSTER_TYPE)
    assert envoy.accepted_names[ENDPOINT_TYPE] == {"thor", "spark"}
    # Going back to the rejected content later still never sends it again (the go-control-plane #962 loop).
    sent = len(envoy.responses)
    envoy.push(snapshot_for("thor", extra_clusters=(BROKEN,)))
    assert CLUSTER_TYPE not in [r.type_url for r in envoy.responses[sent:]]
    assert envoy.accepted[CLUSTER_TYPE] == fixed.version(CLUSTER_TYPE)


def test_stale_nonce_is_ignored() -> None:
    snap = snapshot_for("thor")
    envoy = FakeEnvoy(AdsStream(), snap)
    envoy.connect()
    first_cds_nonce = next(r.nonce for r in envoy.responses if r.type_url == CLUSTER_TYPE)
    newer = snapshot_for("thor", "spark")
    envoy.push(newer)
    stale = discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE, response_nonce=first_cds_nonce, version_info="old")
    assert envoy.stream.on_request(stale, newer) == []
    assert envoy.stream.acked_version(CLUSTER_TYPE) == newer.version(CLUSTER_TYPE)


def test_cluster_change_resends_load_assignments_even_if_unchanged() -> None:
    envoy = FakeEnvoy(AdsStream(), snapshot_for("thor", "spark"))
    envoy.connect()
    eds_before = sum(1 for r in envoy.responses if r.type_url == ENDPOINT_TYPE)
    # Change only a cluster setting: endpoints are byte-identical, yet warming clusters need their CLA again.
    cfg = _config("thor", "spark")
    changed = make_snapshot(
        listeners=[build_listener(cfg)], routes=[build_routes(cfg)],
        clusters=[build_cluster(e, parse_config({"envoy": {"connect_timeout_seconds": 2.0},
                                                 "engines": [{"name": e.name, "url": e.url}]})) for e in cfg.engines],
        endpoints=[build_load_assignment(e) for e in cfg.engines],
    )
    assert changed.version(ENDPOINT_TYPE) == envoy.snapshot.version(ENDPOINT_TYPE)
    envoy.push(changed)
    assert sum(1 for r in envoy.responses if r.type_url == ENDPOINT_TYPE) > eds_before


def test_newly_requested_name_is_answered_and_unknown_gets_empty_assignment() -> None:
    snap = snapshot_for("thor")
    envoy = FakeEnvoy(AdsStream(), snap)
    envoy.connect()
    envoy.request(ENDPOINT_TYPE, names=["thor", "ghost"])
    envoy.run()
    last = [r for r in envoy.responses if r.type_url == ENDPOINT_TYPE][-1]
    assert {_name(a) for a in last.resources} == {"thor", "ghost"}
    ghost = endpoint_pb2.ClusterLoadAssignment()
    next(a for a in last.resources if _name(a) == "ghost").Unpack(ghost)
    assert not ghost.endpoints


def test_reconnect_after_restart_gets_full_state() -> None:
    """A restarted control plane builds the same content, so the same version: Envoy is told it is current."""
    snap = snapshot_for("thor")
    first = FakeEnvoy(AdsStream(), snap)
    first.connect()
    again = FakeEnvoy(AdsStream(), snapshot_for("thor"))
    again.accepted = dict(first.accepted)
    again.connect()
    assert again.accepted == first.accepted


def test_versions_are_content_hashes() -> None:
    assert snapshot_for("thor").version(CLUSTER_TYPE) == snapshot_for("thor").version(CLUSTER_TYPE)
    assert snapshot_for("thor").version(CLUSTER_TYPE) != snapshot_for("thor", "spark").version(CLUSTER_TYPE)


def test_inconsistent_snapshot_is_refused() -> None:
    cfg = _config("thor")
    snap = make_snapshot(listeners=[build_listener(cfg)], routes=[], clusters=[build_cluster(cfg.engines[0], cfg)],
                         endpoints=[])
    with pytest.raises(InconsistentSnapshot, match="no ClusterLoadAssignment.*|unknown route config"):
        check_consistent(snap)
