"""``sluice deploy render``: Kubernetes manifests for a production shape, from one sluice config.

Written under ``--out`` (default ``deploy/kubernetes``):

- ``base/``: a kustomize base, regenerated on every render: the config as the ``sluice-config`` ConfigMap, the Envoy
  bootstrap as ``sluice-envoy-bootstrap`` (its one static cluster, ``sluice_controlplane``, is the control plane's
  Service by DNS: ADS, ext_authz and the access log all go there), and the objects of ``base_manifests``.
- ``overlays/<name>/``: an overlay (namespace, image, replicas, a patch), written only when it does not exist yet, so
  an operator's edits survive the next render.
- ``<name>.yaml``: the overlay built (base + overlay, ``build``), ready for ``kubectl apply -f``: the objects ``kubectl
  kustomize overlays/<name>`` builds, for the kustomization fields the overlays use (``resources``, ``namespace``,
  ``images``, ``replicas``, ``patches`` of strategic-merge patches: ``strategic_merge``), with no kustomize binary.

What the manifests describe (control plane, Envoy, Valkey, admin token, NetworkPolicies): README.md, Operating.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from pathlib import Path
from typing import Any

import yaml

from controlplane.config import Config, ConfigError, parse_config
from sluice.envoyrun import controlplane_transport_socket, render_bootstrap

log = logging.getLogger("sluice.deploy")

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
DEFAULT_OUT = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.34.0"
"""The Kubernetes version the manifests are written for and validated against (tests/unit/test_deploy.py)."""

APP = "sluice"
IMAGE = "sluice"
"""The image name in the base; an overlay's ``images:`` entry gives the real repository and tag."""
VALKEY_IMAGE = "valkey/valkey:8.1"
CONTROLPLANE = "sluice-controlplane"
"""The control plane's Deployment and Service name: Envoy's bootstrap reaches it as this DNS name, and Prometheus's job
label (the ServiceMonitor's Service) is this, as the alert rules expect."""
ENVOY = "sluice-envoy"
VALKEY = "sluice-valkey"
VALKEY_URL = f"redis://{VALKEY}:6379/0"
"""The StatefulSet's Service (headless, one pod): the control planes' ``store.url``."""
CONTROLPLANE_REPLICAS = 2
POD_IP_PLACEHOLDER = "@POD_IP@"
CONFIG_DIR = "/etc/sluice"
RUNTIME_CONFIG = "/tmp/sluice.yaml"
BOOTSTRAP_DIR = "/etc/envoy"
ADMIN_TOKEN_DIR = "/etc/sluice-admin"
ADMIN_TOKEN_SECRET = "sluice-admin-token"
ADMIN_TOKEN_KEY = "token"
ADMIN_TOKEN_FILE = f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}"
OPERATOR_LABEL = {"sluice.io/operator": "true"}
MONITORING_NAMESPACE = "monitoring"
UID = 10001
#: The control plane container's command: the pod IP into the config, then the control plane itself.
CONTROLPLANE_SCRIPT = (f'sed "s/{POD_IP_PLACEHOLDER}/$POD_IP/g" {CONFIG_DIR}/config.yaml > {RUNTIME_CONFIG} '
                       f"&& exec sluice controlplane --config {RUNTIME_CONFIG}")

EXAMPLE_OVERLAY_NAME = "example"

Manifest = dict[str, Any]


# -- the config and the bootstrap as the cluster sees them ---------------------------------------------------------------------
def cluster_raw_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config as the control plane pod runs it: bound to the pod IP (``@POD_IP@``, replaced by the container's
    command: the control plane advertises that address to Envoy as every engine cluster's retry redirector, so it must
    be one other pods reach, and two replicas' xDS differ in that endpoint), the admin listener on the pod with the token
    Secret as its token file (any ``admin.token_env`` dropped: the pod has no such variable), Envoy's listener on every
    interface."""
    out = copy.deepcopy(raw)
    out.setdefault("controlplane", {})["host"] = POD_IP_PLACEHOLDER
    out["controlplane"]["admin_host"] = "0.0.0.0"
    admin = out.setdefault("admin", {}) or {}
    admin.pop("token_env", None)
    admin["token_file"] = ADMIN_TOKEN_FILE
    out["admin"] = admin
    out.setdefault("envoy", {})["listen_host"] = "0.0.0.0"
    # Several replicas share one ledger in the Valkey StatefulSet (issue 11); a config that names its own store keeps it.
    store = out.get("store") or {}
    if store.get("backend", "memory") == "memory":
        store = {**store, "backend": "valkey", "url": VALKEY_URL}
    out["store"] = store
    for engine in out.get("engines") or []:
        if isinstance(engine, dict):
            engine.pop("sim", None)  # nothing starts simulators in a cluster: every engine runs elsewhere
            engine.pop("speed", None)
            engine.pop("sim_flavor", None)
            engine.pop("sim_model", None)
    return out


def validate_raw(raw: Any, source: str) -> Config:
    """Validate a cluster config here, where its engines' Service names do not resolve: every engine's host is checked
    as 127.0.0.1 (the control plane resolves the real names in its pod, when it loads the config)."""
    if not isinstance(raw, dict):
        raise ConfigError(["(top): the config must be a mapping"])
    probe = copy.deepcopy(raw)
    for engine in probe.get("engines") or []:
        if isinstance(engine, dict) and isinstance(engine.get("url"), str):
            scheme, _, rest = engine["url"].partition("://")
            hostport = rest.split("/", 1)[0]
            port = hostport.rsplit(":", 1)[1] if ":" in hostport else ""
            engine["url"] = f"{scheme}://127.0.0.1" + (f":{port}" if port else "")
    cp = probe.setdefault("controlplane", {})
    if cp.get("host") == POD_IP_PLACEHOLDER:
        cp["host"] = "127.0.0.1"
    return parse_config(probe, source)


def cluster_bootstrap(config: Config) -> dict[str, Any]:
    """``envoy/bootstrap.yaml`` rendered for the cluster: the control plane's cluster resolves the Service by DNS."""
    bootstrap: dict[str, Any] = yaml.safe_load(render_bootstrap(config))
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "sluice_controlplane"]
    cluster["type"] = "STRICT_DNS"
    cluster["dns_lookup_family"] = "V4_ONLY"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"]["address"] = CONTROLPLANE
    tls = config.envoy.controlplane_tls
    if tls is not None and tls.server_name is None:  # the certificate names the Service, not the pod IP
        cluster["transport_socket"] = controlplane_transport_socket(tls, CONTROLPLANE)
    return bootstrap


# -- the base --------------------------------------------------------------------------------------------------------------
def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}


def _meta(name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "labels": _labels(component), **extra}


_SECURITY = {
    "runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}


def base_manifests(raw: dict[str, Any], config: Config) -> dict[str, list[Manifest]]:
    """File name (in ``base/``) -> the objects it holds. The control plane runs ``CONTROLPLANE_REPLICAS`` sharing the
    Valkey StatefulSet's ledger (1 when the config's store is not Valkey); its pod template carries the
    config's hash, so a changed policy ConfigMap rolls the Deployment. The Secrets ``sluice-admin-token`` (fill it in
    before the pod can start) and ``sluice-tenant-keys`` (nothing reads it yet) are declared empty."""
    cfg_text = yaml.safe_dump(raw, sort_keys=False)
    bootstrap_text = "# Rendered by `sluice deploy render` from envoy/bootstrap.yaml.\n" + yaml.safe_dump(
        cluster_bootstrap(config), sort_keys=False)
    digest = hashlib.sha256(cfg_text.encode()).hexdigest()[:16]
    boot_digest = hashlib.sha256(bootstrap_text.encode()).hexdigest()[:16]
    cp, ev = config.controlplane, config.envoy
    probe = {"httpGet": {"path": "/healthz", "port": "metrics"}}

    controlplane = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta("sluice-config", "controlplane"),
         "data": {"config.yaml": cfg_text}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": _meta(CONTROLPLANE, "controlplane", annotations={
             "sluice.io/replicas": "any number: tickets, the parking line and sessions live in the shared store"}),
         "spec": {
             "replicas": CONTROLPLANE_REPLICAS if config.store.backend.value == "valkey" else 1,
             "selector": {"matchLabels": _labels("controlplane")},
             "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
             "template": {
                 "metadata": {"labels": _labels("controlplane"), "annotations": {"sluice.io/config-sha256": digest}},
                 "spec": {
                     "securityContext": {"runAsNonRoot": True, "fsGroup": UID},
                     "terminationGracePeriodSeconds": 30,
                     "containers": [{
                         "name": "controlplane", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
                         "command": ["sh", "-c", CONTROLPLANE_SCRIPT],
                         "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                         "ports": [{"name": "grpc", "containerPort": cp.grpc_port, "protocol": "TCP"},
                                   {"name": "admin", "containerPort": cp.admin_port, "protocol": "TCP"},
                                   {"name": "metrics", "containerPort": cp.metrics_port, "protocol": "TCP"}],
                         "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
                         "livenessProbe": {**probe, "initialDelaySeconds": 10, "periodSeconds": 10,
                                           "failureThreshold": 3, "timeoutSeconds": 3},
                         "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
                         "securityContext": _SECURITY,
                         "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                                          {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
                                          {"name": "tmp", "mountPath": "/tmp"}],
                     }],
                     "volumes": [{"name": "config", "configMap": {"name": "sluice-config"}},
                                 # Readable by the pod's group only (fsGroup); the container cannot write it.
                                 {"name": "admin-token", "secret": {"secretName": ADMIN_TOKEN_SECRET,
                                                                    "defaultMode": 0o440}},
                                 {"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}],
                 },
             },
         }},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(CONTROLPLANE, "controlplane"),
         "spec": {"selector": _labels("controlplane"), "ports": [
             {"name": "grpc", "port": cp.grpc_port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
             {"name": "admin", "port": cp.admin_port, "targetPort": "admin", "protocol": "TCP", "appProtocol": "grpc"},
             {"name": "metrics", "port": cp.metrics_port, "targetPort": "metrics", "protocol": "TCP"}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(CONTROLPLANE, "controlplane"),
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels("controlplane")}}},
    ]

    envoy = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta("sluice-envoy-bootstrap", "envoy"),
         "data": {"bootstrap.yaml": bootstrap_text}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(ENVOY, "envoy"),
         "spec": {
             "replicas": 2,
             "selector": {"matchLabels": _labels("envoy")},
             "template": {
                 "metadata": {"labels": _labels("envoy"), "annotations": {"sluice.io/bootstrap-sha256": boot_digest}},
                 "spec": {
                     "securityContext": {"runAsNonRoot": True},
                     # Streams run up to envoy.stream_idle_timeout_seconds; give running ones time to finish.
                     "terminationGracePeriodSeconds": 60,
                     "containers": [{
                         "name": "envoy", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
                         "command": ["envoy"],
                         "args": ["-c", f"{BOOTSTRAP_DIR}/bootstrap.yaml", "--log-level", "warning",
                                  "--concurrency", str(ev.concurrency), "--use-dynamic-base-id",
                                  "--service-node", "$(POD_NAME)"],
                         "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                         "ports": [{"name": "http", "containerPort": ev.listen_port, "protocol": "TCP"}],
                         # Ready once the listener from LDS is bound: it serves even with the control plane down.
                         "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
                         # Alive while Envoy's admin (loopback only) answers /ready.
                         "livenessProbe": {"exec": {"command": [
                             "python", "-c",
                             f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{ev.admin_port}/ready',"
                             " timeout=3)"]},
                             "initialDelaySeconds": 30, "periodSeconds": 15, "timeoutSeconds": 5},
                         "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                         "securityContext": _SECURITY,
                         "volumeMounts": [{"name": "bootstrap", "mountPath": BOOTSTRAP_DIR, "readOnly": True}],
                     }],
                     "volumes": [{"name": "bootstrap", "configMap": {"name": "sluice-envoy-bootstrap"}}],
                 },
             },
         }},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(ENVOY, "envoy"),
         "spec": {"selector": _labels("envoy"), "ports": [
             {"name": "http", "port": ev.listen_port, "targetPort": "http", "protocol": "TCP"}]}},
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(ENVOY, "envoy"),
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": ENVOY},
                  "minReplicas": 2, "maxReplicas": 10,
                  "metrics": [{"type": "Resource", "resource": {
                      "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(ENVOY, "envoy"),
         "spec": {"minAvailable": 1, "selector": {"matchLabels": _labels("envoy")}}},
    ]

    valkey = [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": _meta(VALKEY, "store"),
         "spec": {"clusterIP": "None", "selector": _labels("store"),
                  "ports": [{"name": "valkey", "port": 6379, "targetPort": "valkey", "protocol": "TCP"}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet",
         "metadata": _meta(VALKEY, "store"),
         "spec": {
             "serviceName": VALKEY, "replicas": 1, "selector": {"matchLabels": _labels("store")},
             "template": {"metadata": {"labels": _labels("store")}, "spec": {
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "fsGroup": 999},
                 "containers": [{
                     "name": "valkey", "image": VALKEY_IMAGE,
                     # The ledger survives a Valkey restart: append-only file, fsync every second (a crash loses at
                     # most the last second's admissions, which leases and probes correct). No RDB snapshots.
                     "args": ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", "/data"],
                     "ports": [{"name": "valkey", "containerPort": 6379, "protocol": "TCP"}],
                     "readinessProbe": {"exec": {"command": ["valkey-cli", "ping"]}, "periodSeconds": 5},
                     "livenessProbe": {"tcpSocket": {"port": "valkey"}, "initialDelaySeconds": 10, "periodSeconds": 10},
                     "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
                     "securityContext": {**_SECURITY, "runAsUser": 999, "runAsGroup": 999},
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                 }],
             }},
             "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                 "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}],
         }},
    ]

    secrets = [
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": _meta(ADMIN_TOKEN_SECRET, "controlplane", annotations={
             "sluice.io/purpose": f"the admin API's bearer tokens (one name:secret line each), mounted read-only at "
                                  f"{ADMIN_TOKEN_FILE} (admin.token_file); the control plane does not start without it",
             "sluice.io/fill-in": f"kubectl create secret generic {ADMIN_TOKEN_SECRET} --from-literal="
                                  f"{ADMIN_TOKEN_KEY}=operator:$(openssl rand -hex 24) --dry-run=client -o yaml | "
                                  "kubectl apply -f -"}),
         "data": {}},
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": _meta("sluice-tenant-keys", "controlplane", annotations={
             "sluice.io/purpose": "tenant API keys (to come with tenants); not read yet",
             "sluice.io/fill-in": "kubectl create secret generic sluice-tenant-keys --from-file=keys.yaml "
                                  "--dry-run=client -o yaml | kubectl apply -f -"}),
         "data": {}},
    ]

    envoy_pods = {"podSelector": {"matchLabels": _labels("envoy")}}
    network = [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(CONTROLPLANE, "controlplane"),
         "spec": {
             "podSelector": {"matchLabels": _labels("controlplane")}, "policyTypes": ["Ingress"],
             "ingress": [
                 # ADS, ext_authz, the access log: Envoy alone.
                 {"from": [envoy_pods], "ports": [{"port": "grpc", "protocol": "TCP"}]},
                 # The admin API: the operator namespaces (its changes also need the token).
                 {"from": [{"namespaceSelector": {"matchLabels": OPERATOR_LABEL}}],
                  "ports": [{"port": "admin", "protocol": "TCP"}]},
                 # /metrics for Prometheus; the retry redirector for Envoy.
                 {"from": [envoy_pods, {"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": MONITORING_NAMESPACE}}}],
                  "ports": [{"port": "metrics", "protocol": "TCP"}]},
             ]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(ENVOY, "envoy"),
         "spec": {"podSelector": {"matchLabels": _labels("envoy")}, "policyTypes": ["Ingress"],
                  "ingress": [{"ports": [{"port": "http", "protocol": "TCP"}]}]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(VALKEY, "store"),
         "spec": {"podSelector": {"matchLabels": _labels("store")}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": _labels("controlplane")}}],
                               "ports": [{"port": "valkey", "protocol": "TCP"}]}]}},
    ]

    alerts = yaml.safe_load(ALERTS.read_text())
    monitoring = [
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _meta(CONTROLPLANE, "controlplane"),
         "spec": {"selector": {"matchLabels": _labels("controlplane")},
                  "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": _meta("sluice", "controlplane"),
         "spec": {"groups": alerts["groups"]}},
    ]
    return {"controlplane.yaml": controlplane, "envoy.yaml": envoy, "valkey.yaml": valkey, "secrets.yaml": secrets,
            "networkpolicy.yaml": network, "monitoring.yaml": monitoring}


def example_overlay() -> dict[str, Any]:
    """File name (in ``overlays/<name>/``) -> content: a namespace, the image, Envoy's replicas, a LoadBalancer."""
    return {
        "kustomization.yaml": {
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": "sluice",
            "resources": ["namespace.yaml", "../../base"],
            "images": [{"name": IMAGE, "newName": "registry.example.com/sluice", "newTag": "0.1.0"}],
            "replicas": [{"name": ENVOY, "count": 3}],
            "patches": [{"path": "envoy-service.yaml"}],
        },
        "namespace.yaml": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "sluice"}}],
        "envoy-service.yaml": [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": ENVOY},
                                "spec": {"type": "LoadBalancer"}}],
    }


# -- a small kustomize ------------------------------------------------------------------------------------------------------
def _load_docs(path: Path) -> list[Manifest]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strategic_merge(target: Any, patch: Any) -> Any:
    """Mappings merge key by key (``null`` deletes), lists of mappings that all have ``name`` merge by name, any other
    value (other lists included) is replaced. The subset of a strategic-merge patch the overlays use."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if (isinstance(target, list) and isinstance(patch, list) and target and patch
            and all(isinstance(i, dict) and "name" in i for i in [*target, *patch])):
        merged = [copy.deepcopy(i) for i in target]
        for item in patch:
            index = next((n for n, t in enumerate(merged) if t["name"] == item["name"]), None)
            if index is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[index] = strategic_merge(merged[index], item)
        return merged
    return copy.deepcopy(patch)


def build(directory: Path) -> list[Manifest]:
    """The objects ``kubectl kustomize directory`` would print (for the fields this module writes)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        objects.extend(build(path) if path.is_dir() else _load_docs(path))
    for patch_ref in kustomization.get("patches", []):
        for patch in _load_docs(directory / patch_ref["path"]):
            matches = [i for i, o in enumerate(objects)
                       if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]]
            if len(matches) != 1:
                raise ValueError(f"patch {patch_ref['path']}: {patch['kind']}/{patch['metadata']['name']} matches "
                                 f"{len(matches)} objects")
            objects[matches[0]] = strategic_merge(objects[matches[0]], patch)
    for entry in kustomization.get("replicas", []):
        for o in objects:
            if o["metadata"]["name"] == entry["name"] and o["kind"] in ("Deployment", "StatefulSet"):
                o["spec"]["replicas"] = entry["count"]
    for entry in kustomization.get("images", []):
        for o in objects:
            for container in _containers(o):
                name, _, tag = container["image"].partition(":")
                if name == entry["name"]:
                    container["image"] = f"{entry.get('newName', name)}:{entry.get('newTag', tag or 'latest')}"
    namespace = kustomization.get("namespace")
    if namespace:
        for o in objects:
            if o["kind"] != "Namespace":
                o["metadata"]["namespace"] = namespace
    return objects


def _containers(o: Manifest) -> list[dict[str, Any]]:
    spec = o.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


# -- writing ---------------------------------------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)

HEADER = "# Written by `sluice deploy render`; {what}.\n"


def dump(documents: list[Manifest] | Manifest, what: str) -> str:
    docs = documents if isinstance(documents, list) else [documents]
    body = "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=120) for d in docs)
    return HEADER.format(what=what) + body


def render(config_path: str, out: Path = DEFAULT_OUT, overlay: str = EXAMPLE_OVERLAY_NAME) -> list[Path]:
    """Write ``base/``, ``overlays/<overlay>/`` (when absent) and ``<overlay>.yaml``; return the paths written."""
    try:
        raw = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"(file): cannot read {config_path}: {exc}"]) from None
    in_cluster = cluster_raw_config(raw if isinstance(raw, dict) else {})
    config = validate_raw(in_cluster, config_path)
    # The ports are written out: the manifests' containerPorts and Services are these.
    in_cluster["controlplane"].update(grpc_port=config.controlplane.grpc_port,
                                      metrics_port=config.controlplane.metrics_port,
                                      admin_port=config.controlplane.admin_port)
    in_cluster["envoy"].update(listen_port=config.envoy.listen_port, admin_port=config.envoy.admin_port)
    written: list[Path] = []
    base = out / "base"
    base.mkdir(parents=True, exist_ok=True)
    files = base_manifests(in_cluster, config)
    for name, docs in files.items():
        (base / name).write_text(dump(docs, f"regenerated from {Path(config_path).name} on every render"))
        written.append(base / name)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": list(files)}
    (base / "kustomization.yaml").write_text(dump(kustomization, "regenerated on every render"))
    written.append(base / "kustomization.yaml")
    overlay_dir = out / "overlays" / overlay
    if not (overlay_dir / "kustomization.yaml").exists():
        overlay_dir.mkdir(parents=True, exist_ok=True)
        for name, content in example_overlay().items():
            (overlay_dir / name).write_text(dump(content, "an example overlay: edit it, later renders keep it"))
            written.append(overlay_dir / name)
    built = out / f"{overlay}.yaml"
    built.write_text(dump(build(overlay_dir), f"overlays/{overlay} built (base + overlay): kubectl apply -f {built.name}"))
    written.append(built)
    return written


def find(objects: list[Manifest], kind: str, name: str) -> Manifest:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def run_render(config_path: str, out: str | None, overlay: str) -> int:
    try:
        written = render(config_path, Path(out) if out else DEFAULT_OUT, overlay)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    for path in written:
        print(path)
    return 0

