"""The admin API on its own listener: changes need the bearer token (refused UNAUTHENTICATED otherwise, nothing changed), a
reload may name only an allowed file, and ``WatchDecisions`` sees the decision a Check through the real Envoy makes."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import yaml

from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
from rig.waits import wait_for
from tests.harness import post, start_stack

BODY = json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


def test_admin_changes_need_the_token_and_watch_sees_a_check(tmp_path: Path) -> None:
    stack = start_stack([("thor", "thor")], tmp_path)
    try:
        assert stack.config.controlplane.admin_port != stack.config.controlplane.grpc_port
        # Not on the Envoy-facing port any more.
        envoy_side = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{stack.config.controlplane.grpc_port}"))
        with pytest.raises(grpc.RpcError) as caught:
            envoy_side.GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED

        for stub in (stack.admin(token=None), stack.admin(token="not-the-secret")):
            with pytest.raises(grpc.RpcError) as caught:
                stub.DrainEngine(admin_pb2.DrainEngineRequest(name="thor", drained=True), timeout=5)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as caught:
                stub.SetVersionFloor(admin_pb2.SetVersionFloorRequest(model_pattern="cortex", version="9.0"), timeout=5)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=5).engines_total == 1  # reads stay open
        assert not stack.engines()["thor"].drained
        assert "version_floors: {}" in stack.admin().GetPolicy(admin_pb2.GetPolicyRequest(), timeout=5).yaml
        assert post(stack, "/chat/completions", BODY)[0] == 200
        assert stack.controlplane is not None
        metrics = stack.controlplane.plane.metrics.registry
        assert metrics.get_sample_value("sluice_admin_refused_total", {"method": "DrainEngine"}) == 2

        # A reload may not name a file outside admin.reload_dir (one pointing thor elsewhere, say).
        elsewhere = Path(tmp_path.parent / f"{tmp_path.name}-evil.yaml")
        evil = {**stack.raw, "engines": [{**stack.raw["engines"][0], "url": "http://127.0.0.1:9"}]}
        elsewhere.write_text(yaml.safe_dump(evil))
        refused = stack.admin().ReloadConfig(admin_pb2.ReloadConfigRequest(path=str(elsewhere)), timeout=10)
        assert not refused.applied and "admin.reload_dir" in refused.problems[0]

        # Watch, then make a Check through Envoy: the decision arrives with its verdict, engine and model.
        events: queue.Queue[admin_pb2.DecisionEvent] = queue.Queue()
        stream = stack.admin().WatchDecisions(admin_pb2.WatchDecisionsRequest())

        def tail() -> None:
            try:
                for event in stream:
                    events.put(event)
            except grpc.RpcError:
                pass

        threading.Thread(target=tail, daemon=True).start()
        assert stack.controlplane is not None
        feed = stack.controlplane.plane.service.feed
        wait_for(lambda: feed.watchers, what="the watcher subscribed")
        assert post(stack, "/chat/completions", BODY)[0] == 200
        event = events.get(timeout=10)
        assert (event.verdict, event.engine, event.model, event.dropped_since_last) == ("admit", "thor", "cortex", 0)
        # The request id is Envoy's x-request-id, the one the engine received.
        assert event.request_id and event.request_id in {e["x_request_id"] for e in stack.sim_log("thor")}
        stream.cancel()

        # With the token: a floor applies (and is audited), the CLI shows it.
        floor = subprocess.run([sys.executable, "-m", "sluice", "admin", "floor", "cortex", "9.0", *stack.admin_args()],
                               capture_output=True, text=True, timeout=30)
        assert floor.returncode == 0 and "none -> 9.0" in floor.stdout, floor.stderr
        assert post(stack, "/chat/completions", BODY)[0] == 503
        policy = subprocess.run([sys.executable, "-m", "sluice", "admin", "policy", *stack.admin_args()],
                                capture_output=True, text=True, timeout=30)
        assert yaml.safe_load(policy.stdout)["version_floors"] == {"cortex": "9.0"}
        no_token = subprocess.run([sys.executable, "-m", "sluice", "admin", "drain", "thor", "--target",
                                   stack.admin_target], capture_output=True, text=True, timeout=30,
                                  env={k: v for k, v in __import__("os").environ.items() if k != "SLUICE_ADMIN_TOKEN"})
        assert no_token.returncode == 1 and "bearer token" in no_token.stderr
    finally:
        stack.close()
