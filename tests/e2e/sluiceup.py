"""``sluice up`` as a subprocess on a config of free ports with an ``openai`` client on its Envoy (``Up``), for the
end-to-end tests that start the stack as a user does: supervision, replicas, tenants over a store, failover and reload."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai

from rig.upprocess import UpProcess
from rig.waits import free_port
from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
from sluice.up import free_controlplane_ports, replicas_in


class Up(UpProcess):
    """``sluice up`` as a subprocess (rig/upprocess.py) on a config of free ports, with an ``openai`` client on it."""

    def __init__(self, tmp_path: Path, engines: list[dict[str, Any]], args: tuple[str, ...] = (),
                 sections: dict[str, Any] | None = None, api_key: str = "unused") -> None:
        """``sections``: more of the config (``tenants``, ...); ``api_key``: what ``client`` sends."""
        raw: dict[str, Any] = {
            "controlplane": free_controlplane_ports(replicas_in(args)),
            "envoy": {"listen_port": free_port(), "admin_port": free_port()},
            "engines": [{"url": f"http://127.0.0.1:{free_port()}", **e} for e in engines],
            **(sections or {}),
        }
        super().__init__(raw, tmp_path / "sluice.yaml", args)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0)

    def has_fallback_route(self, model: str) -> bool:
        """Whether Envoy holds the model's fail-open route (capacity weights, pushed after the first probes)."""
        url = f"http://127.0.0.1:{self.raw['envoy']['admin_port']}/config_dump?resource=dynamic_route_configs"
        with urllib.request.urlopen(url, timeout=5) as response:
            return f"fallback:{model}" in response.read().decode()

    def admin_engines(self) -> dict[str, admin_pb2.Engine]:
        # A fresh channel per call: a channel's reconnect backoff must not hide the restarted control plane.
        with grpc.insecure_channel(f"127.0.0.1:{self.raw['controlplane']['admin_port']}") as channel:
            reply = admin_pb2_grpc.AdminStub(channel).ListEngines(admin_pb2.ListEnginesRequest(), timeout=2)
        return {e.name: e for e in reply.engines}

    def complete(self, model: str, max_tokens: int = 2) -> Any:
        return self.client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens)
