"""Routing end to end: a TTFT deadline skips an engine too slow to prefill in time, sessions stick, and with the control
plane killed traffic follows the configured failure mode (fail-open by the last capacity weights, or fail-closed 503)."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any
from pathlib import Path

import pytest

from rig.waits import wait_for
from tests.harness import Stack, http_json, post, start_stack


def chat(content: str = "hi", max_tokens: int = 4) -> bytes:
    return json.dumps({"model": "cortex", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens}).encode()


def test_deadline_skips_the_engine_too_slow_to_prefill(tmp_path: Path) -> None:
    """Anchors (wall-clock, simulators at x10): thor prefills 15k tok/s and decodes 500 tok/s; spark 40k and 75. A 20k-token
    prompt with 100 tokens to write finishes soonest on thor (1.33 s + 0.2 s against 0.5 s + 1.33 s), but only spark starts
    it within a 1.8 s deadline (planned for 1.62 s: ``ttft_headroom_fraction`` 10%) with the band's 1 s margin."""
    engines = [
        {"name": "thor", "sim": "thor", "prefill_tokens_per_s": 15_000, "decode_tokens_per_s": 500},
        {"name": "spark", "sim": "spark", "prefill_tokens_per_s": 40_000, "decode_tokens_per_s": 75},
    ]
    stack = start_stack(engines, tmp_path, speed=10.0)
    try:
        def prompt(tag: str) -> str:  # a fresh prompt each time: a prefix cache hit would change the estimates
            return tag + "x" * (20_000 * 4 - 1)

        status, headers, _ = post(stack, "/chat/completions", chat(prompt("a"), max_tokens=100))
        assert status == 200 and headers["x-sluice-engine"] == "thor"
        assert headers["x-sluice-route-reason"] == "finish_soonest"
        status, headers, _ = post(stack, "/chat/completions", chat(prompt("b"), max_tokens=100),
                                  {"x-sluice-max-ttft-ms": "1800"})
        assert status == 200
        assert headers["x-sluice-engine"] == "spark" and headers["x-sluice-route-reason"] == "satisficing_band"
        status, headers, payload = post(stack, "/chat/completions", chat(prompt("c"), max_tokens=100),
                                        {"x-sluice-max-ttft-ms": "300"})
        assert status == 503 and json.loads(payload)["error"]["code"] == "ttft_unmeetable"
        assert 1 <= int(headers["retry-after"]) <= 60
        status, _, payload = post(stack, "/chat/completions", chat(), {"x-sluice-max-ttft-ms": "soon"})
        assert status == 400 and json.loads(payload)["error"]["code"] == "invalid_max_ttft_ms"
        # Every served request's first token (these non-streaming answers' whole body) is timed by the access log.
        assert stack.controlplane is not None
        port = stack.controlplane.plane.http.port

        def timed() -> float:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            counts = re.findall(r'sluice_engine_ttft_seconds_count\{engine="(\w+)"\} (\S+)', metrics)
            return sum(float(n) for _, n in counts)

        wait_for(lambda: timed() == 2, timeout=5, what="both served requests' first token timed")
    finally:
        stack.close()


def test_sessions_stick_to_their_engine(tmp_path: Path) -> None:
    stack = start_stack([("a", "spark"), ("b", "spark"), ("c", "spark")], tmp_path, speed=20.0)
    try:
        def engine_for(session: str) -> tuple[str, str]:
            status, headers, _ = post(stack, "/chat/completions", chat(),
                                      {"x-sluice-session": session, "x-sluice-max-ttft-ms": "10000"})
            assert status == 200
            # A conversation's next turn comes after its answer: let the access log close this turn's ticket first.
            wait_for(lambda: stack.status().open_tickets == 0, timeout=5, what="ticket released")
            return headers["x-sluice-engine"], headers["x-sluice-route-reason"]

        first, reason = engine_for("conversation-1")
        assert reason == "satisficing_band"
        for _ in range(6):
            assert engine_for("conversation-1") == (first, "session_affinity")
        others = {engine_for(f"other-{i}")[0] for i in range(12)}
        assert len(others) > 1, "without a session the band spreads requests"
    finally:
        stack.close()


def _kill_controlplane(stack: Stack) -> None:
    assert stack.controlplane is not None
    stack.controlplane.close()
    stack.controlplane = None


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_controlplane_killed_traffic_follows_the_failure_mode(tmp_path: Path, mode: str) -> None:
    # Decode anchors (per request, wall-clock at x20): spark has ~1.7x thor's throughput, so it gets the larger weight.
    engines = [{"name": "thor", "sim": "thor", "decode_tokens_per_s": 25.4 * 20},
               {"name": "spark", "sim": "spark", "decode_tokens_per_s": 43.9 * 20}]
    stack = start_stack(engines, tmp_path, speed=20.0, envoy={"on_controlplane_failure": mode})
    try:
        weights = _wait_for_fallback(stack, {"thor", "spark"})
        assert set(weights) == {"thor", "spark"} and weights["spark"] > weights["thor"]  # spark has more throughput

        _kill_controlplane(stack)
        served = []
        for _ in range(10):
            status, headers, payload = post(stack, "/chat/completions", chat())
            served.append((status, headers, payload))
        if mode == "open":
            assert [s for s, _, _ in served] == [200] * 10
            reached = {name for name in stack.sims if stack.sim_log(name)[-10:]}
            assert reached, "requests reached engines by the last weights"
            assert all("x-sluice-route-reason" not in h for _, h, _ in served)  # no Check answered them
        else:
            for status, headers, payload in served:
                assert status == 503
                assert json.loads(payload)["error"]["code"] == "controlplane_unavailable"
                assert headers["retry-after"] == "5"
        status, _, payload = post(stack, "/chat/completions", json.dumps({"model": "nope"}).encode())
        # An unknown model has no fallback route: fail-open lets it through to the "unpinned" route, fail-closed never
        # gets past ext_authz.
        assert status == 503
        assert json.loads(payload)["error"]["code"] == ("not_admitted" if mode == "open" else "controlplane_unavailable")
    finally:
        stack.close()


def _wait_for_fallback(stack: Stack, engines: set[str]) -> dict[str, int]:
    """Wait until Envoy holds fallback weights for ``engines``; return them."""
    def weights() -> dict[str, int]:
        dump = http_json(stack.admin_url + "/config_dump?resource=dynamic_route_configs")
        return {c["name"]: c["weight"] for c in _fallback_clusters(dump)}

    wait_for(lambda: set(weights()) == engines, what="fallback weights pushed over RDS")
    return weights()


def _fallback_clusters(dump: dict[str, Any]) -> list[dict[str, Any]]:
    for config in dump["configs"]:
        for vhost in config["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                if route.get("name") == "fallback:cortex":
                    clusters: list[dict[str, Any]] = route["route"]["weighted_clusters"]["clusters"]
                    return clusters
    return []


def test_restarted_controlplane_takes_envoy_back(tmp_path: Path) -> None:
    """Kill the control plane, start a new one on the same port: Envoy reconnects its ADS stream (same content, same
    versions) and Checks pin requests again, with no request lost meanwhile under fail-open."""
    from rig.threaded import ThreadedControlPlane

    stack = start_stack([("thor", "thor"), ("spark", "spark")], tmp_path, speed=20.0)
    try:
        _wait_for_fallback(stack, {"thor", "spark"})
        # Clusters, endpoints and the listener are rebuilt byte for byte, so their versions match (routes carry weights,
        # which the new control plane learns afresh).
        def versions() -> dict[str, str]:
            return {t.type_url: t.current_version for t in stack.status().xds if "RouteConfiguration" not in t.type_url}

        versions_before = versions()
        _kill_controlplane(stack)
        status, headers, _ = post(stack, "/chat/completions", chat())
        assert status == 200 and "x-sluice-route-reason" not in headers  # fail-open while it is down
        assert stack.plane_config is not None
        stack.controlplane = ThreadedControlPlane(stack.plane_config)
        wait_for(lambda: stack.status().envoy_streams == 1, timeout=40, what="Envoy's ADS stream back")
        assert versions() == versions_before

        def pinned() -> bool:
            status, headers, _ = post(stack, "/chat/completions", chat())
            return status == 200 and headers.get("x-sluice-route-reason") in ("finish_soonest", "stale_fail_open")

        wait_for(pinned, timeout=20, interval=0.2, what="Checks answered by the new control plane")
    finally:
        stack.close()
