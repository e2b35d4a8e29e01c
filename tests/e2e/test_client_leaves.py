"""A client that leaves frees everything, through the real Envoy: while its prompt is being prefilled or mid-stream,
its ticket is released within a second and the engine stops generating for it (Envoy resets the upstream stream; the
engine counts the request under ``vllm:request_success_total{finished_reason="abort"}``). A client that leaves while
parked is tests/e2e/test_admission.py's."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from rig.waits import wait_for
from tests.harness import Stack, http_json, start_stack

SPEED = 5.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack([("a", "spark")], tmp_path_factory.mktemp("leaves"), speed=SPEED)
    yield s
    s.close()


def aborted(stack: Stack) -> float:
    text = urllib.request.urlopen(stack.sim_url("a") + "/metrics", timeout=5).read().decode()
    found = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', text)
    return float(found[1]) if found else 0.0


def send_stream(stack: Stack, body: dict[str, object]) -> socket.socket:
    raw = json.dumps({**body, "model": "cortex", "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", stack.config.envoy.listen_port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return sock


def leave_and_check(stack: Stack, sock: socket.socket, aborts_before: float) -> dict[str, object]:
    """Close the client's socket; the ticket must be released and the engine's request aborted within a second."""
    sock.close()
    left = time.monotonic()
    wait_for(lambda: stack.status().open_tickets == 0, timeout=1.0, what="the ticket released within 1 s")
    wait_for(lambda: aborted(stack) == aborts_before + 1, timeout=1.0, what="the engine's abort counted within 1 s")
    assert time.monotonic() - left < 1.5
    stats = http_json(stack.sim_url("a") + "/sim/stats")
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    entry: dict[str, object] = stack.sim_log("a")[-1]
    assert entry["status"] == "aborted", entry
    return entry


def test_a_client_that_leaves_during_its_prefill_stops_the_engine(stack: Stack) -> None:
    before = aborted(stack)
    # 30,000 prompt tokens (under spark's 32,768): 7.5 emulated seconds of its prefill, 1.5 s here.
    sock = send_stream(stack, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 50,
                               "sim_prompt_tokens": 30_000})
    wait_for(lambda: any(e["status"] == "running" for e in stack.sim_log("a")), timeout=5, what="the engine has it")
    sock.settimeout(0.3)
    head = sock.recv(65536)  # the headers come first (as vLLM sends them); no token yet
    assert b"200" in head.split(b"\r\n", 1)[0] and b'"content": "' not in head.replace(b'"content": ""', b"")
    entry = leave_and_check(stack, sock, before)
    assert entry["completion_tokens"] == 0, entry


def test_a_client_that_leaves_mid_stream_stops_the_engine(stack: Stack) -> None:
    wait_for(lambda: stack.status().open_tickets == 0, timeout=5, what="a quiet fleet")
    before = aborted(stack)
    sock = send_stream(stack, {"messages": [{"role": "user", "content": "a long story"}], "max_tokens": 3000,
                               "ignore_eos": True})
    received = b""
    sock.settimeout(5)
    while received.count(b'"content": "') < 6:  # the role chunk's empty content and five tokens
        received += sock.recv(65536)
    entry = leave_and_check(stack, sock, before)
    assert 0 < int(str(entry["completion_tokens"])) < 3000, entry
