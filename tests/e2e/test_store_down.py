"""The shared store stopped mid-run and started again (issue 11), through the real Envoy and a real valkey-server:
``store.on_failure: closed`` answers 503 ``store_unavailable`` + retry-after while it is down; ``open`` admits on the
replica's own ledger (counted) and writes those tickets back once the store returns. Either way the control plane is
admitting through the store again once it is back."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from controlplane.store.valkeyserver import ValkeyServer
from rig.waits import wait_for
from tests.harness import Stack, start_stack


@pytest.fixture
def valkey() -> Iterator[ValkeyServer]:
    with ValkeyServer() as server:
        yield server


def _stack(tmp_path: Path, server: ValkeyServer, on_failure: str) -> Stack:
    return start_stack([("a", "spark")], tmp_path, speed=20.0,
                       store={"backend": "valkey", "url": server.url, "on_failure": on_failure,
                              "timeout_seconds": 0.2, "heartbeat_seconds": 0.2})


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, max_tokens: int = 3) -> int:
    try:
        reply = client.chat.completions.with_raw_response.create(
            model="cortex", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens)
        return reply.http_response.status_code
    except openai.APIStatusError as error:
        assert error.status_code != 503 or error.response.json()["error"]["code"] == "store_unavailable", \
            error.response.text
        assert error.status_code != 503 or int(error.response.headers["retry-after"]) >= 1
        return error.status_code


def _metric(stack: Stack, name: str) -> float:
    assert stack.controlplane is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.controlplane.plane.http.port}/metrics",
                                timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def _restart(server: ValkeyServer) -> None:
    server.start()  # the same port and data dir
    wait_for(lambda: redis.Redis(port=server.port).ping(), timeout=10, what="valkey back")


def test_closed_store_failure_answers_503_then_recovers(tmp_path: Path, valkey: ValkeyServer) -> None:
    stack = _stack(tmp_path, valkey, "closed")
    try:
        client = _client(stack)
        assert _ask(client) == 200
        valkey.kill()
        wait_for(lambda: _metric(stack, "sluice_store_up") == 0, timeout=10, what="the store seen down")
        assert [_ask(client) for _ in range(3)] == [503, 503, 503]
        _restart(valkey)
        wait_for(lambda: _metric(stack, "sluice_store_up") == 1, timeout=10, what="the store seen back")
        wait_for(lambda: _ask(client) == 200, timeout=10, what="admissions through the store again")
    finally:
        stack.close()


def test_open_store_failure_admits_counted_and_writes_tickets_back(tmp_path: Path, valkey: ValkeyServer) -> None:
    stack = _stack(tmp_path, valkey, "open")
    try:
        client = _client(stack)
        assert _ask(client) == 200
        valkey.kill()
        wait_for(lambda: _metric(stack, "sluice_store_up") == 0, timeout=10, what="the store seen down")
        assert [_ask(client) for _ in range(3)] == [200, 200, 200]
        assert _metric(stack, "sluice_store_fail_open_total") == 3
        # A long request admitted while the store is down is still open when it comes back: it is written back.
        assert stack.controlplane is not None
        plane = stack.controlplane.plane
        before = plane.ledger.admitted_total
        done = threading.Event()
        reader = threading.Thread(target=_stream_long, args=(client, done), daemon=True)
        reader.start()
        wait_for(lambda: plane.ledger.admitted_total > before, timeout=10, what="the long request admitted")
        _restart(valkey)
        wait_for(lambda: _metric(stack, "sluice_store_up") == 1, timeout=10, what="the store seen back")

        def written_back() -> bool:
            keys = redis.Redis(port=valkey.port).keys(f"{plane.config.store.prefix}:t:*")
            return len(keys) >= 1
        wait_for(written_back, timeout=10, what="the open ticket restored to the store")
        assert _ask(client) == 200
        done.set()
        reader.join(10)
    finally:
        stack.close()


def _stream_long(client: openai.OpenAI, done: threading.Event) -> None:
    """A long streaming request, read to its end (or until the test is over)."""
    stream = client.chat.completions.create(model="cortex", messages=[{"role": "user", "content": "long"}],
                                            max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
    for _ in stream:
        if done.is_set():
            break
    stream.close()


def test_a_store_down_at_start_up_does_not_stop_the_control_plane(tmp_path: Path) -> None:
    """A store that is not running at all at start-up: the control plane still starts (its first load fails, it resyncs
    once the store answers) and, with ``open``, serves."""
    server = ValkeyServer()
    from controlplane.store.valkeyserver import free_port
    server.port = free_port()
    stack = start_stack([("a", "spark")], tmp_path, speed=20.0,
                        store={"backend": "valkey", "url": server.url, "on_failure": "open", "timeout_seconds": 0.2,
                               "heartbeat_seconds": 0.2})
    try:
        started = time.monotonic()
        assert _ask(_client(stack)) == 200
        assert time.monotonic() - started < 5
        server.start()
        wait_for(lambda: _metric(stack, "sluice_store_up") == 1, timeout=10, what="the store seen")
    finally:
        stack.close()
        server.close()
