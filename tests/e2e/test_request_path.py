"""The request path end to end: the official openai client -> real Envoy -> ext_authz/xDS/ALS on the real control plane ->
simulated engines, and back."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from rig.waits import wait_for
from tests.harness import Stack, http_json, post, push_broken_cluster, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack([("thor", "thor"), ("spark", "spark")], tmp_path_factory.mktemp("stack"), speed=20.0)
    yield s
    s.close()


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def served_by(stack: Stack) -> dict[str, list[dict[str, Any]]]:
    return {name: stack.sim_log(name) for name in stack.sims}


def test_chat_completion_non_streaming(stack: Stack, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="cortex", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
        extra_body={"ignore_eos": True},  # exactly max_tokens: the simulator otherwise stops at a drawn length
    )
    completion = raw.parse()
    assert raw.headers["x-sluice-engine"] in {"thor", "spark"}
    assert raw.headers["x-sluice-route-reason"] == "finish_soonest"
    assert completion.choices[0].message.content == "the quick river runs through"
    assert completion.usage is not None and completion.usage.completion_tokens == 5


def test_chat_completion_streaming_with_usage(stack: Stack, client: openai.OpenAI) -> None:
    with client.chat.completions.with_streaming_response.create(
        model="cortex", messages=[{"role": "user", "content": "hello"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ) as response:
        engine = response.headers["x-sluice-engine"]
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert engine in {"thor", "spark"}
    assert len(text.split()) == 12
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions(stack: Stack, client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model="cortex", prompt="Once upon a time", max_tokens=4)
    assert raw.headers["x-sluice-engine"] in {"thor", "spark"}
    assert raw.parse().choices[0].text == "the quick river runs"
    with client.completions.with_streaming_response.create(
        model="cortex", prompt="Once", max_tokens=3, stream=True
    ) as streamed:
        assert streamed.headers["x-sluice-engine"] in {"thor", "spark"}
        assert "".join(c.choices[0].text for c in streamed.parse()) == "the quick river"


def test_model_list_through_envoy(stack: Stack, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["cortex"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"model": "no-such-model", "messages": []}', 404, "model_not_found"),
        (b'{"model": "cortex", "messages": [', 400, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "missing_model"),
        (b"\xff\xfe not utf-8", 400, "invalid_json"),
        (b'{"model": "' + b"a" * (2 * 1024 * 1024) + b'"}', 413, "request_too_large"),
    ],
    ids=["unknown-model", "malformed-json", "missing-model", "not-utf8", "2MiB-body"],
)
def test_bad_requests_get_openai_shaped_errors(stack: Stack, body: bytes, status: int, code: str) -> None:
    before = {name: len(log) for name, log in served_by(stack).items()}
    got_status, headers, payload = post(stack, "/chat/completions", body)
    assert got_status == status
    assert headers["content-type"].startswith("application/json")
    error = json.loads(payload)["error"]
    assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
    assert {name: len(log) for name, log in served_by(stack).items()} == before, "a refused request reached an engine"


def test_openai_client_sees_404_for_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-nothing", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 404


def test_client_cannot_pick_its_engine(stack: Stack) -> None:
    """A client naming its own engine (and inventing other x-sluice-* headers) is served where the control plane chose.
    thor is drained, so the control plane never chooses it: any request reaching thor would be the client's doing."""
    from sluice.admin.v1 import admin_pb2

    stack.admin().DrainEngine(admin_pb2.DrainEngineRequest(name="thor", drained=True), timeout=5)
    try:
        thor_before = len(stack.sim_log("thor"))
        body = json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        chosen = []
        for _ in range(4):
            status, headers, _ = post(stack, "/chat/completions", body,
                                      {"x-sluice-engine": "thor", "x-sluice-anything": "1",
                                       "x-sluice-priority": "critical"})
            assert status == 200
            chosen.append(headers["x-sluice-engine"])
        assert chosen == ["spark"] * 4
        assert len(stack.sim_log("thor")) == thor_before
        # An operator asking why sees the drain.
        explained = subprocess.run(
            [sys.executable, "-m", "sluice", "admin", "explain", "cortex", "--prompt-tokens", "100", "--max-tokens",
             "10", "--target", stack.admin_target, "--json"],
            capture_output=True, text=True, timeout=30)
        report = json.loads(explained.stdout)
        assert (report["verdict"], report["engine"]) == ("admit", "spark")
        assert {e["name"]: e["drained"] for e in report["engines"]} == {"thor": True, "spark": False}
        for entry in stack.sim_log("spark")[-4:]:
            # The engine saw exactly one x-sluice-engine value, its own: the client's was overwritten, not appended.
            assert entry["x_sluice_engine"] == ["spark"]
            assert "x-sluice-anything" not in entry["x_sluice_headers"]
            assert "x-sluice-priority" in entry["x_sluice_headers"]  # a documented client input passes through
    finally:
        stack.admin().DrainEngine(admin_pb2.DrainEngineRequest(name="thor", drained=False), timeout=5)


def test_config_dump_shows_engine_clusters_from_xds(stack: Stack) -> None:
    dump = http_json(stack.admin_url + "/config_dump?resource=dynamic_active_clusters")
    names = {c["cluster"]["name"] for c in dump["configs"]}
    assert names == {"thor", "spark"}
    listeners = http_json(stack.admin_url + "/config_dump?resource=dynamic_listeners")
    assert [listener["name"] for listener in listeners["configs"]] == ["sluice_openai"]


def test_invalid_resource_is_nacked_and_traffic_keeps_flowing(stack: Stack, client: openai.OpenAI) -> None:
    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    before = stack.status().xds_nacks_total
    push_broken_cluster(stack)
    wait_for(lambda: stack.status().xds_nacks_total == before + 1, what="Envoy's NACK")
    dump = http_json(stack.admin_url + "/config_dump?resource=dynamic_active_clusters")
    assert {c["cluster"]["name"] for c in dump["configs"]} == {"thor", "spark"}
    completion = client.chat.completions.create(model="cortex", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert completion.choices[0].message.content == "the quick"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{plane.http.port}/metrics").read().decode()
    assert 'sluice_xds_nacks_total{type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster"} 1.0' in metrics
    # The rejected version is not resent in a loop: the count stays put.
    stack.controlplane.call(plane.xds.publish())
    cds = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    snapshot = plane.xds.cache.snapshot
    assert snapshot is not None
    good = snapshot.version(cds)
    wait_for(lambda: _acked(stack, cds) == good, what="ACK of the restored config")
    assert stack.status().xds_nacks_total == before + 1


def _acked(stack: Stack, type_url: str) -> str:
    entry = next(t for t in stack.status().xds if t.type_url == type_url)
    return next(iter(entry.acked_versions.values()), "")


def test_burst_releases_every_ticket(stack: Stack) -> None:
    body = json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "go"}], "max_tokens": 6}).encode()
    admitted_before = stack.status().tickets_admitted_total
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda _: post(stack, "/chat/completions", body), range(24)))
    assert [status for status, _, _ in results] == [200] * 24
    status = stack.status()
    assert status.tickets_admitted_total - admitted_before == 24
    wait_for(lambda: all(e.open_tickets == 0 for e in stack.engines().values()), timeout=10, what="tickets released")
    final = stack.status()
    assert final.open_tickets == 0 and final.tickets_expired_total == 0
    assert stack.controlplane is not None
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.controlplane.plane.http.port}/metrics").read().decode()
    assert 'sluice_tickets_open{engine="thor"} 0.0' in metrics and 'sluice_tickets_open{engine="spark"} 0.0' in metrics


def test_unknown_path_is_404(stack: Stack) -> None:
    status, _, payload = post(stack, "/nothing/here", b"{}")
    assert status == 404 and json.loads(payload)["error"]["code"] == "unknown_url"


def test_every_served_request_was_pinned(stack: Stack) -> None:
    """Every request an engine served came through Envoy pinned by the control plane (never unpinned)."""
    for name, log in served_by(stack).items():
        assert all(entry["x_sluice_engine"] == [name] for entry in log), name


def test_an_engine_that_dies_is_a_clear_503_and_leaks_nothing(tmp_path: Path) -> None:
    """Between the engine dying and the probes noticing, a pinned request meets a closed port: the client gets an OpenAI
    error with Retry-After, never a hang or an empty reply, and the ticket comes back through the access log."""
    from tests.harness import stop

    lone = start_stack([("only", "spark")], tmp_path)
    try:
        stop(lone.sims["only"])
        status, headers, payload = post(lone, "/chat/completions", json.dumps(
            {"model": "cortex", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).encode())
        assert status == 503
        assert json.loads(payload)["error"]["code"] in ("upstream_unavailable", "no_ready_engine")
        assert headers["retry-after"] == "1" or int(headers["retry-after"]) >= 1
        wait_for(lambda: lone.status().open_tickets == 0, timeout=5, what="the failed request's ticket released")
        assert lone.status().tickets_expired_total == 0
    finally:
        lone.close()
