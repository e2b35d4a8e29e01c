"""Envoy's ext_authz Check as the servicer tests make it: a request body (``chat_body``) and a CheckRequest around it
(``check_request``), a control plane that is never started whose fleet is one engine with the seats a test sets
(``one_engine_plane``, a ``OneEnginePlane``), and a denial read back as Envoy reads it (``denial``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.service.auth.v3 import external_auth_pb2

from controlplane.app import ControlPlane
from controlplane.config import parse_config
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import Fleet

CHAT = "/v1/chat/completions"


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def check_request(body: bytes, headers: dict[str, str] | None = None) -> external_auth_pb2.CheckRequest:
    request = external_auth_pb2.CheckRequest()
    http = request.attributes.request.http
    http.method, http.path, http.raw_body = "POST", CHAT, body
    http.headers.update({"content-type": "application/json", **(headers or {})})
    return request


class OneEnginePlane(ControlPlane):
    """A control plane whose fleet is one fresh engine serving cortex with ``cap_running[0]`` seats, ``cap_running[1]``
    of them taken (a test sets them)."""

    cap_running: tuple[int, int] = (4, 0)


def one_engine_plane(monkeypatch: pytest.MonkeyPatch, raw: dict[str, Any]) -> OneEnginePlane:
    """A ``OneEnginePlane`` from ``raw`` that is never started."""
    plane = OneEnginePlane(parse_config(raw))

    def fleet(now: float) -> Fleet:
        cap, running = plane.cap_running
        view = EngineView(name="thor", url="", max_num_seqs=cap, models=(ServedModel("cortex", 32_768),),
                          version="0.11.0", sample=EngineSample(now, running=running, waiting=0, kv_usage=0.0,
                                                                kv_capacity_tokens=100_000),
                          last_ok_at=now, stale=False, chip_class="thor")
        return plane.admission.fleet([view], now)

    monkeypatch.setattr(plane.observation, "fleet", fleet)  # the servicer's port reads the fleet from observation
    return plane


def denial(response: external_auth_pb2.CheckResponse) -> tuple[int, dict[str, str], dict[str, Any]]:
    assert response.HasField("denied_response"), "expected a denial, got an admission"
    denied = response.denied_response
    headers = {h.header.key: h.header.value for h in denied.headers}
    assert headers["content-type"] == "application/json"
    return denied.status.code, headers, json.loads(denied.body)["error"]
