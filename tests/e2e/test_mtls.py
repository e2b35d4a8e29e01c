"""Mutual TLS on the Envoy-facing gRPC port: a real Envoy with the client certificate the control plane's CA signed gets
ADS, its listener and admitted requests; an Envoy without a client certificate never gets a stream (no listener, no ADS
stream counted). The admin listener over TLS answers ``sluice admin --ca-file``. Certificates are generated here."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from controlplane.config import ClientTls
from controlplane.xds.resources import CONTROLPLANE_CLUSTER, LISTENER_NAME
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
from sluice.envoyrun import envoy_command, read_admin_address, write_bootstrap
from tests.certs import CertificateAuthority
from rig.waits import wait_for
from tests.harness import admin_section, http_json, post, start_stack, stop

BODY = json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def test_envoy_needs_its_client_certificate_to_reach_the_control_plane(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    server, client = ca.issue("controlplane", server=True), ca.issue("envoy", server=False)
    stack = start_stack(
        [("thor", "thor")], tmp_path, with_envoy=False,
        controlplane={"tls": {"cert_file": server.cert_file, "key_file": server.key_file, "client_ca_file": ca.ca_file}},
        envoy={"controlplane_tls": {"ca_file": ca.ca_file, "cert_file": client.cert_file, "key_file": client.key_file}},
    )
    try:
        # A client without a certificate (plaintext or TLS) gets no RPC through on the Envoy-facing port.
        target = f"127.0.0.1:{stack.config.controlplane.grpc_port}"
        for channel in (grpc.insecure_channel(target),
                        grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(ca.ca_file).read_bytes()))):
            with pytest.raises(grpc.RpcError) as caught:
                admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=3)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE

        # An Envoy that trusts the CA but has no client certificate: the handshake fails, ADS never opens.
        anonymous = replace(stack.config, envoy=replace(stack.config.envoy, admin_port=0, listen_port=0,
                                                        controlplane_tls=ClientTls(ca.ca_file)))
        directory = tmp_path / "anonymous"
        directory.mkdir()
        address_path = directory / "admin-address"
        process = subprocess.Popen(
            envoy_command(anonymous, write_bootstrap(anonymous, directory, node_id="anonymous"),
                          admin_address_path=address_path),
            stdout=(directory / "envoy.log").open("wb"), stderr=subprocess.STDOUT)
        try:
            _, admin_port = wait_for(lambda: read_admin_address(address_path), timeout=30, what="Envoy's admin")
            fails = f"cluster.{CONTROLPLANE_CLUSTER}.upstream_cx_connect_fail"

            def refused() -> int:
                stats = http_json(f"http://127.0.0.1:{admin_port}/stats?format=json&filter={fails}")["stats"]
                return sum(int(stat["value"]) for stat in stats if stat["name"] == fails)

            wait_for(lambda: refused() >= 2, timeout=30, what="Envoy's connection to the control plane refused twice")
            dump = json.dumps(http_json(f"http://127.0.0.1:{admin_port}/config_dump", timeout=5))
            assert LISTENER_NAME not in dump
            assert process.poll() is None
            assert stack.status().envoy_streams == 0
        finally:
            stop(process)

        # The Envoy with its client certificate: ADS, its listener, admitted requests.
        stack.start_envoy()
        stack.wait_serving()
        status, headers, _ = post(stack, "/chat/completions", BODY)
        assert status == 200 and headers.get("x-sluice-engine") == "thor"
        assert stack.status().envoy_streams == 1
    finally:
        stack.close()


def test_admin_listener_over_tls(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    server = ca.issue("admin", server=True)
    stack = start_stack([("thor", "thor")], tmp_path, with_envoy=False,
                        admin={**admin_section(tmp_path),
                               "tls": {"cert_file": server.cert_file, "key_file": server.key_file}})
    try:
        # Plaintext is refused; with the CA the status reads.
        plain = admin_pb2_grpc.AdminStub(grpc.insecure_channel(stack.admin_target))
        with pytest.raises(grpc.RpcError) as caught:
            plain.GetStatus(admin_pb2.GetStatusRequest(), timeout=3)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        stack.admin_ca_file = ca.ca_file
        assert stack.status().engines_total == 1
        drained = subprocess.run([sys.executable, "-m", "sluice", "admin", "drain", "thor", *stack.admin_args()],
                                 capture_output=True, text=True, timeout=30)
        assert drained.returncode == 0, drained.stderr
        assert stack.engines()["thor"].drained
    finally:
        stack.close()
