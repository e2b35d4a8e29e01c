"""Never admitted unchecked (issue 8), through the real Envoy. ext_authz runs fail-open, and Envoy fails open on *every*
failed Check: so inputs that once made the Check raise, and a control plane too busy to answer in time, must come back as
answers (400, or 503 ``controlplane_overloaded``), never as a request served without ``x-sluice-engine``."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rig.waits import wait_for
from tests.harness import Stack, start_stack

MAX_CHECK_QUEUE_MS = 500


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack([("thor", "thor"), ("spark", "spark")], tmp_path_factory.mktemp("never-unchecked"), speed=20.0,
                    controlplane={"max_check_queue_ms": MAX_CHECK_QUEUE_MS})
    yield s
    s.close()


def post(stack: Stack, body: bytes, headers: dict[str, str | bytes] | None = None) -> tuple[int, dict[str, str], bytes]:
    """POST /v1/chat/completions with raw header values (http.client sends bytes as they are, e.g. UTF-8 "①")."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.config.envoy.listen_port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        for key, value in {"content-type": "application/json", "content-length": str(len(body)),
                           **(headers or {})}.items():
            connection.putheader(key, value)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def engine_log_sizes(stack: Stack) -> dict[str, int]:
    return {name: len(stack.sim_log(name)) for name in stack.sims}


def counter(stack: Stack, name: str) -> float:
    assert stack.controlplane is not None
    return stack.controlplane.plane.metrics.registry.get_sample_value(name) or 0.0


def assert_openai_error(status: int, headers: dict[str, str], payload: bytes, want_status: int, code: str) -> None:
    assert status == want_status, f"got {status} (x-sluice-engine={headers.get('x-sluice-engine')}): {payload[:200]!r}"
    assert "x-sluice-engine" not in headers
    assert headers["content-type"].startswith("application/json")
    error = json.loads(payload)["error"]
    assert error["code"] == code and error["message"] and error["param"] is None
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       **fields}).encode()


def nested(depth: int) -> bytes:
    return b'{"model": "cortex", "max_tokens": 3, "messages": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    ("body", "headers", "code"),
    [
        (chat(), {"x-sluice-max-ttft-ms": "9" * 5000}, "invalid_max_ttft_ms"),
        (chat(), {"x-sluice-max-ttft-ms": "1" + "0" * 400}, "invalid_max_ttft_ms"),
        (chat(), {"x-sluice-max-ttft-ms": "①".encode()}, "invalid_max_ttft_ms"),
        (nested(990), {}, "json_too_deep"),
        (b"[" * 100_000, {}, "json_too_deep"),
        (chat(max_tokens=10**400), {}, "invalid_max_tokens"),
    ],
    ids=["ttft-5000-digits", "ttft-1e400", "ttft-circled-one", "nested-990", "nested-100k", "max-tokens-1e400"],
)
def test_inputs_that_crashed_the_check_are_refused_400(stack: Stack, body: bytes, headers: dict[str, str | bytes],
                                                      code: str) -> None:
    before = engine_log_sizes(stack)
    assert_openai_error(*post(stack, body, headers), 400, code)
    assert engine_log_sizes(stack) == before, "a refused request reached an engine"
    assert counter(stack, "sluice_authz_internal_errors_total") == 0, "refused by parsing, not caught as a failure"


def test_null_max_completion_tokens_does_not_hide_max_tokens(stack: Stack) -> None:
    """The engine honours max_tokens when max_completion_tokens is null; so must the context check."""
    before = engine_log_sizes(stack)
    assert_openai_error(*post(stack, chat(max_completion_tokens=None, max_tokens=5_000_000)), 400,
                        "context_length_exceeded")
    assert engine_log_sizes(stack) == before, "a refused request reached an engine"


def test_overloaded_control_plane_answers_503_instead_of_failing_open(stack: Stack) -> None:
    """Block the control plane's event loop for 2 s while 20 requests arrive: the Checks queue in grpc-core. Each is then
    either admitted (pinned to an engine) or, having waited past max_check_queue_ms, shed 503 at once."""
    assert stack.controlplane is not None
    blocked = threading.Event()

    def block() -> None:
        blocked.set()
        time.sleep(2.0)

    stack.controlplane.loop.call_soon_threadsafe(block)
    assert blocked.wait(5)
    block_started = time.monotonic()

    def one(_: int) -> tuple[float, int, dict[str, str], bytes]:
        sent = time.monotonic() - block_started
        return (sent, *post(stack, chat()))

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(one, range(20)))
    shed = 0
    for sent, status, headers, payload in answers:
        if status == 200:
            assert headers["x-sluice-engine"] in {"thor", "spark"}, "served without a Check's pin"
        else:
            assert_openai_error(status, headers, payload, 503, "controlplane_overloaded")
            assert headers["retry-after"] == "1"
            shed += 1
        if sent < 2.0 - MAX_CHECK_QUEUE_MS / 1000 - 0.3:  # queued well past the limit: must have been shed
            assert status == 503, f"a request sent {sent:.2f}s into the 2 s block was not shed"
    assert shed >= 1 and counter(stack, "sluice_authz_overloaded_total") == shed
    # The backlog drained: the next request is admitted again.
    wait_for(lambda: post(stack, chat())[0] == 200, timeout=10, what="admission after the overload")
