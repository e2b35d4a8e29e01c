"""Runtime policy changes: a reloaded file's policy applies at once, all or nothing; a file with a problem, or one that
changes what needs a restart, leaves the running policy untouched and says why."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.harness import Stack, post, start_stack

BODY = json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def reload(stack: Stack, raw: dict[str, Any], tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return subprocess.run(
        [sys.executable, "-m", "sluice", "admin", "reload", str(path), *stack.admin_args()], capture_output=True,
        text=True, timeout=30)


def test_reload_applies_policy_all_or_nothing(tmp_path: Path) -> None:
    stack = start_stack([("thor", "thor")], tmp_path)
    try:
        assert post(stack, "/chat/completions", BODY)[0] == 200

        floored = copy.deepcopy(stack.raw)
        floored["version_floors"] = {"cortex": "0.11"}
        done = reload(stack, floored, tmp_path, "floored")
        assert done.returncode == 0 and "changed: version_floors" in done.stdout
        status, _, payload = post(stack, "/chat/completions", BODY)
        assert status == 503 and json.loads(payload)["error"]["code"] == "version_floor"

        broken = copy.deepcopy(floored)
        broken["version_floors"] = {}
        broken["admission"] = {"kv_high_watermark": 2}
        refused = reload(stack, broken, tmp_path, "broken")
        assert refused.returncode == 1 and "admission.kv_high_watermark" in refused.stderr
        assert post(stack, "/chat/completions", BODY)[0] == 503  # the running policy (with its floor) stays

        moved = copy.deepcopy(stack.raw)
        moved["envoy"]["listen_port"] += 1
        refused = reload(stack, moved, tmp_path, "moved")
        assert refused.returncode == 1 and "envoy: changed, which needs a restart" in refused.stderr

        assert reload(stack, stack.raw, tmp_path, "original").returncode == 0
        assert post(stack, "/chat/completions", BODY)[0] == 200
    finally:
        stack.close()


def test_sighup_reloads_the_control_planes_own_file(tmp_path: Path) -> None:
    import signal
    import urllib.request

    import grpc

    from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
    from rig.waits import free_port, wait_for

    raw: dict[str, Any] = {
        "controlplane": {"grpc_port": free_port(), "metrics_port": free_port(), "admin_port": free_port()},
        "engines": [{"name": "far", "url": "http://127.0.0.1:9", "models": ["cortex"]}],  # discard: nothing answers
    }
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(raw))
    plane = subprocess.Popen([sys.executable, "-m", "sluice", "controlplane", "--config", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{raw['controlplane']['admin_port']}"))

    def verdict() -> str:
        why = stub.ExplainDecision(admin_pb2.ExplainDecisionRequest(model="cortex", prompt_tokens=10), timeout=2)
        return f"{why.verdict}/{why.reason}"

    try:
        assert wait_for(verdict, what="control plane up") == "admit/stale_fail_open"  # unreachable engine, fail-open
        path.write_text(yaml.safe_dump({**raw, "version_floors": {"cortex": "1.0"}}))
        plane.send_signal(signal.SIGHUP)
        wait_for(lambda: verdict() == "shed/version_floor", what="the floor applied on SIGHUP")
        path.write_text("engines: [")  # broken: the running policy must stay
        plane.send_signal(signal.SIGHUP)
        metrics = f"http://127.0.0.1:{raw['controlplane']['metrics_port']}/metrics"
        wait_for(lambda: 'sluice_config_reloads_total{result="refused"} 1.0' in urllib.request.urlopen(
            metrics, timeout=2).read().decode(), what="the broken reload refused")
        assert verdict() == "shed/version_floor"
    finally:
        plane.terminate()
        output = plane.communicate(timeout=10)[0]
    assert "reload of" in output and "refused" in output


def test_reload_adds_and_removes_engines_over_xds(tmp_path: Path) -> None:
    from rig.waits import wait_for
    from tests.harness import http_json, launch_sim, stop

    stack = start_stack([("a", "spark")], tmp_path)
    b, b_port = launch_sim("spark", "b", 20.0, tmp_path)
    try:
        def clusters() -> set[str]:
            dump = http_json(stack.admin_url + "/config_dump?resource=dynamic_active_clusters")
            return {c["cluster"]["name"] for c in dump["configs"]}

        both = copy.deepcopy(stack.raw)
        both["engines"].append({"name": "b", "url": f"http://127.0.0.1:{b_port}"})
        done = reload(stack, both, tmp_path, "both")
        assert done.returncode == 0 and "engines" in done.stdout
        wait_for(lambda: clusters() == {"a", "b"}, what="engine b's cluster in Envoy")
        wait_for(lambda: stack.engines()["b"].ready, what="engine b probed")

        only_b = copy.deepcopy(both)
        only_b["engines"] = [e for e in only_b["engines"] if e["name"] == "b"]
        assert reload(stack, only_b, tmp_path, "only-b").returncode == 0
        wait_for(lambda: clusters() == {"b"}, what="engine a's cluster removed")
        assert set(stack.engines()) == {"b"}
        status, headers, _ = post(stack, "/chat/completions", BODY)
        assert status == 200 and headers["x-sluice-engine"] == "b"
    finally:
        stack.close()
        stop(b)
