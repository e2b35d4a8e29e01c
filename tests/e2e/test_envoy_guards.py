"""Envoy's own guards, through the real Envoy: only the OpenAI paths reach an engine (up or down), the fail-open path is
bounded by per-engine circuit breakers, Envoy's own errors are in the OpenAI shape, and slow-header clients are closed."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rig.waits import wait_for
from tests.harness import Stack, http_json, post, start_stack

HEADER_TIMEOUT_S = 1.0
ENGINE_PATHS = ["/metrics", "/sim/log", "/sim/fault", "/v1/load_lora_adapter", "/health", "/v1/../metrics"]


def chat(max_tokens: int = 3) -> bytes:
    return json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()


def raw_exchange(port: int, data: bytes, wait: float = 15.0) -> bytes:
    """Send raw bytes on a fresh connection; read one whole response (its content-length, or until Envoy closes the
    connection), waiting at most ``wait`` for each read: a loaded machine can be seconds slow."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(wait)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                head, sep, body = out.partition(b"\r\n\r\n")
                length = [line.split(b":", 1)[1] for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:")]
                if sep and length and len(body) >= int(length[0]):
                    break
        except socket.timeout:
            pass
    return out


def error_of(response: bytes) -> tuple[int, str, dict[str, Any]]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("content-type", ""), json.loads(body)["error"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack([("thor", "thor"), ("spark", "spark")], tmp_path_factory.mktemp("guards"), speed=20.0,
                    envoy={"request_headers_timeout_seconds": HEADER_TIMEOUT_S})
    yield s
    s.close()


def served_counts(stack: Stack) -> dict[str, int]:
    return {name: len(stack.sim_log(name)) for name in stack.sims}


def test_only_openai_paths_reach_an_engine(stack: Stack) -> None:
    before = served_counts(stack)
    for path in ENGINE_PATHS:
        status, headers, payload = post(stack, path.removeprefix("/v1"), chat())
        assert status == 404, path
        assert headers["content-type"] == "application/json"
        assert json.loads(payload)["error"]["code"] == "unknown_url"
    assert served_counts(stack) == before
    status, headers, _ = post(stack, "/chat/completions", chat())
    assert status == 200 and headers["x-sluice-engine"] in stack.sims


def test_envoys_own_errors_are_openai_shaped(stack: Stack) -> None:
    port = stack.config.envoy.listen_port
    status, content_type, error = error_of(raw_exchange(
        port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello"))
    assert (status, content_type, error["code"]) == (400, "application/json", "invalid_http_request")
    big = b"x-big: " + b"a" * 100_000 + b"\r\n"
    status, content_type, error = error_of(raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n"))
    assert (status, content_type, error["code"]) == (431, "application/json", "request_header_fields_too_large")
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(10_000))
    status, _, error = error_of(raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"))
    assert (status, error["code"]) == (431, "request_header_fields_too_large")
    # ext_authz's own 400 keeps its body: the codec mapper must not swallow it.
    status, content_type, error = error_of(raw_exchange(
        port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"))
    assert (status, error["code"]) == (400, "invalid_json")


def test_slow_header_clients_are_closed_and_others_served(stack: Stack) -> None:
    port = stack.config.envoy.listen_port
    slow = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        slow.append(s)
    try:
        status, headers, _ = post(stack, "/chat/completions", chat())
        assert status == 200 and headers["x-sluice-engine"] in stack.sims  # a normal client is served meanwhile
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 10
        for s in slow:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            answer = b""
            while chunk := s.recv(65536):  # raises socket.timeout if Envoy keeps holding the connection
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
            assert b'"code": "request_timeout"' in answer
    finally:
        for s in slow:
            s.close()


def test_fail_open_is_bounded_by_each_engines_cap(tmp_path: Path) -> None:
    """The control plane down (fail-open): requests go by the last weights, but never more than an engine's cap plus
    headroom (0 here) run on it; the overflow is an OpenAI-shaped 503 with retry-after. Unknown paths stay 404."""
    stack = start_stack([("thor", "thor"), ("spark", "spark")], tmp_path, speed=20.0,
                        envoy={"engine_overflow_headroom": 0})
    try:
        wait_for(lambda: "fallback:cortex" in json.dumps(http_json(
            stack.admin_url + "/config_dump?resource=dynamic_route_configs")), what="fallback weights pushed")
        assert stack.controlplane is not None
        stack.controlplane.close()
        stack.controlplane = None
        for path in ENGINE_PATHS:
            status, _, payload = post(stack, path.removeprefix("/v1"), chat())
            assert status == 404 and json.loads(payload)["error"]["code"] == "unknown_url", path
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda _: post(stack, "/chat/completions", chat(max_tokens=200)), range(24)))
        overflow = [(h, json.loads(p)["error"]) for s, h, p in answers if s != 200]
        assert overflow, "24 concurrent long requests on 4 slots must overflow"
        for headers, error in overflow:
            assert error["code"] == "engine_overloaded" and headers["retry-after"] == "1"
        assert any(s == 200 for s, _, _ in answers)
        for name in stack.sims:
            stats = http_json(stack.sim_url(name) + "/sim/stats")
            assert stats["max_running_seen"] <= 2, (name, stats)
    finally:
        stack.close()


def _metric(stack: Stack, name: str, **labels: str) -> float:
    assert stack.controlplane is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.controlplane.plane.http.port}/metrics", timeout=5).read()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.decode().splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_engine_failure_before_first_byte_is_retried_on_another_engine(tmp_path: Path) -> None:
    """A session pins its requests to one engine; that engine dies. The next request of the session is pinned to it
    (nothing has noticed yet), fails to connect, and is retried once through a new Check on the other engine: the client
    sees a 200, never the failure, and no ticket leaks. The dead engine is out of the candidates at once."""
    stack = start_stack([("a", "thor"), ("b", "thor")], tmp_path, speed=20.0,
                        observe={"poll_interval_seconds": 2.0, "poll_timeout_seconds": 1.0})
    try:
        wait_for(lambda: all(e.ready for e in stack.engines().values()), what="both engines probed")
        session = {"x-sluice-session": "conversation-1"}
        status, headers, _ = post(stack, "/chat/completions", chat(), session)
        assert status == 200
        dead, alive = headers["x-sluice-engine"], ({"a", "b"} - {headers["x-sluice-engine"]}).pop()
        stack.sims[dead].kill()
        stack.sims[dead].wait()
        started = time.monotonic()
        status, headers, payload = post(stack, "/chat/completions", chat(), session)
        assert status == 200, payload
        assert headers["x-sluice-engine"] == alive
        assert time.monotonic() - started < 2.0  # no wait for a probe to notice
        assert _metric(stack, "sluice_engine_retries_total", engine=dead) == 1
        assert stack.engines()[dead].stale
        status, headers, _ = post(stack, "/chat/completions", chat(), session)  # no second trip to the dead engine
        assert status == 200 and headers["x-sluice-engine"] == alive
        assert _metric(stack, "sluice_engine_retries_total", engine=dead) == 1
        wait_for(lambda: sum(e.open_tickets for e in stack.engines().values()) == 0, what="every ticket released")
    finally:
        stack.close()


def test_a_stream_cut_by_a_dying_engine_ends_promptly(tmp_path: Path) -> None:
    import openai

    stack = start_stack([("a", "thor")], tmp_path, speed=2.0)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)
        stream = client.chat.completions.create(model="cortex", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=500, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        stack.sims["a"].kill()
        killed = time.monotonic()
        with pytest.raises(Exception):
            for _ in chunks:
                pass
        assert time.monotonic() - killed < 1.0
    finally:
        stack.close()
