"""TLS settings: ``controlplane.tls``, ``envoy.controlplane_tls`` and ``admin.tls`` validate all or nothing with dotted
paths, and the bootstrap's control plane cluster gets the matching ``transport_socket``."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from controlplane.config import ClientTls, ConfigError, ServerTls, parse_config
from sluice.envoyrun import render_bootstrap

ENGINES = [{"name": "a", "url": "http://127.0.0.1:8101"}]
SERVER = {"cert_file": "/certs/cp.crt", "key_file": "/certs/cp.key", "client_ca_file": "/certs/ca.crt"}
CLIENT = {"ca_file": "/certs/ca.crt", "cert_file": "/certs/envoy.crt", "key_file": "/certs/envoy.key"}


def parse(**sections: Any) -> Any:
    return parse_config({"engines": ENGINES, **sections})


def problems(**sections: Any) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(**sections)
    return caught.value.problems


def test_plaintext_by_default_and_mutual_tls_when_both_ends_are_set() -> None:
    plain = parse()
    assert (plain.controlplane.tls, plain.envoy.controlplane_tls, plain.admin.tls) == (None, None, None)
    config = parse(controlplane={"tls": SERVER}, envoy={"controlplane_tls": CLIENT},
                   admin={"tls": {"cert_file": "/a.crt", "key_file": "/a.key"}})
    assert config.controlplane.tls == ServerTls("/certs/cp.crt", "/certs/cp.key", "/certs/ca.crt")
    assert config.controlplane.tls.mutual
    assert config.envoy.controlplane_tls == ClientTls("/certs/ca.crt", "/certs/envoy.crt", "/certs/envoy.key")
    assert config.admin.tls == ServerTls("/a.crt", "/a.key") and not config.admin.tls.mutual
    server_only = parse(controlplane={"tls": {"cert_file": "/c", "key_file": "/k"}},
                        envoy={"controlplane_tls": {"ca_file": "/ca"}})
    assert server_only.controlplane.tls is not None and not server_only.controlplane.tls.mutual


@pytest.mark.parametrize("sections,expected", [
    ({"controlplane": {"tls": {"cert_file": "/c"}}, "envoy": {"controlplane_tls": CLIENT}},
     "controlplane.tls: needs both cert_file and key_file"),
    ({"controlplane": {"tls": {**SERVER, "ca": "/x"}}, "envoy": {"controlplane_tls": CLIENT}},
     "controlplane.tls.ca: unknown field"),
    ({"controlplane": {"tls": SERVER}}, "envoy.controlplane_tls: needed when controlplane.tls is set"),
    ({"envoy": {"controlplane_tls": CLIENT}}, "envoy.controlplane_tls: set, but controlplane.tls is not"),
    ({"controlplane": {"tls": SERVER}, "envoy": {"controlplane_tls": {"ca_file": "/ca"}}},
     "envoy.controlplane_tls.cert_file: needed"),
    ({"controlplane": {"tls": SERVER}, "envoy": {"controlplane_tls": {"cert_file": "/c", "key_file": "/k"}}},
     "envoy.controlplane_tls.ca_file: needed"),
    ({"controlplane": {"tls": SERVER}, "envoy": {"controlplane_tls": {**CLIENT, "key_file": None}}},
     "envoy.controlplane_tls: cert_file and key_file go together"),
    ({"admin": {"tls": {"cert_file": "/c", "key_file": "/k", "client_ca_file": "/ca"}}},
     "admin.tls.client_ca_file: unknown field"),
    ({"admin": {"tls": "yes"}}, "admin.tls: must be a mapping"),
    ({"admin": {"tls": {"cert_file": "", "key_file": "/k"}}}, "admin.tls.cert_file: must be a non-empty string"),
], ids=["half-a-pair", "unknown-key", "server-without-envoy", "envoy-without-server", "mtls-without-client-cert",
        "no-ca", "cert-without-key", "admin-no-client-auth", "admin-not-a-mapping", "empty-path"])
def test_tls_blocks_are_all_or_nothing(sections: dict[str, Any], expected: str) -> None:
    found = problems(**sections)
    assert any(p.startswith(expected) for p in found), found
    assert len(found) == 1, found  # one problem, said once


def _cluster(text: str) -> dict[str, Any]:
    clusters: list[dict[str, Any]] = yaml.safe_load(text)["static_resources"]["clusters"]
    (cluster,) = [c for c in clusters if c["name"] == "sluice_controlplane"]
    return cluster


def test_bootstrap_transport_socket() -> None:
    assert "transport_socket" not in _cluster(render_bootstrap(parse()))
    config = parse(controlplane={"tls": SERVER}, envoy={"controlplane_tls": CLIENT})
    socket = _cluster(render_bootstrap(config))["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    context = socket["typed_config"]
    assert context["@type"].endswith("UpstreamTlsContext") and "sni" not in context  # an address: no SNI
    common = context["common_tls_context"]
    assert common["tls_certificates"] == [{"certificate_chain": {"filename": "/certs/envoy.crt"},
                                           "private_key": {"filename": "/certs/envoy.key"}}]
    assert common["validation_context"] == {
        "trusted_ca": {"filename": "/certs/ca.crt"},
        "match_typed_subject_alt_names": [{"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}]}
    named = parse(controlplane={"tls": SERVER}, envoy={"controlplane_tls": {**CLIENT, "server_name": "cp.example"}})
    context = _cluster(render_bootstrap(named))["transport_socket"]["typed_config"]
    assert context["sni"] == "cp.example"
    assert context["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "cp.example"}}]


def test_the_cluster_bootstrap_checks_the_service_name() -> None:
    from sluice import deploy

    config = parse(controlplane={"tls": SERVER}, envoy={"controlplane_tls": CLIENT})
    (cluster,) = deploy.cluster_bootstrap(config)["static_resources"]["clusters"]
    context = cluster["transport_socket"]["typed_config"]
    assert context["sni"] == deploy.CONTROLPLANE  # the certificate names the Service, not the pod IP
    assert context["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": deploy.CONTROLPLANE}}]
