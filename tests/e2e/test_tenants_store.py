"""Tenants' budgets where they are kept (issue 12), end to end through the real Envoy: two control-plane replicas on one
Valkey (``sluice up --replicas 2 --store valkey``) enforce one budget; a Valkey stopped mid-run fails open or closed as
``ratelimit.on_failure`` says and the budgets come back with it; a hot reload changes limits and keys and keeps what was
used; ``sluice admin tenants`` shows usage against limits."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.core.tenants import key_digest
from controlplane.store.valkeyserver import ValkeyServer
from sluice.up import REPLICA_PORT_STRIDE
from tests.e2e.sluiceup import Up
from rig.waits import wait_for
from tests.harness import Stack, start_stack


def post(base_url: str, key: str, max_tokens: int = 2) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": "cortex", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    request = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.load(error)


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_replicas_on_one_valkey_enforce_one_budget(tmp_path: Path) -> None:
    tenants = {"acme": {"keys": [key_digest("sk-acme")], "limits": {"requests_per_minute": 10}}}
    engines = [{"name": n, "sim": "spark", "speed": 20.0, "max_num_seqs": 8} for n in ("a", "b")]
    up = Up(tmp_path, engines, ("--replicas", "2", "--store", "valkey"), sections={"tenants": tenants},
            api_key="sk-acme")
    try:
        base = f"http://127.0.0.1:{up.port}/v1"
        wait_for(lambda: post(base, "sk-acme", 1)[0] == 200, timeout=60, what="serving")  # 1 of the 10
        with concurrent.futures.ThreadPoolExecutor(max_workers=30) as pool:
            answers = list(pool.map(lambda _: post(base, "sk-acme"), range(30)))
        statuses = sorted(a[0] for a in answers)
        assert statuses == [200] * 9 + [429] * 21, statuses
        ports = [up.raw["controlplane"]["metrics_port"] + REPLICA_PORT_STRIDE * i for i in range(2)]
        decided = [metric(p, "sluice_ratelimit_decisions_total", tenant="acme") for p in ports]
        assert all(d > 0 for d in decided) and sum(decided) == 31, f"both replicas charge: {decided}"
    finally:
        up.close()


@pytest.mark.parametrize("on_failure", ["open", "closed"])
def test_a_valkey_stopped_mid_run_fails_as_configured_and_the_budget_returns(tmp_path: Path, on_failure: str) -> None:
    valkey = ValkeyServer().start()
    stack: Stack | None = None
    try:
        stack = start_stack(
            [("thor", "thor")], tmp_path, api_key="sk-acme",
            store={"backend": "valkey", "url": valkey.url},
            ratelimit={"on_failure": on_failure, "timeout_seconds": 0.3, "failure_retry_after_seconds": 2},
            tenants={"acme": {"keys": [key_digest("sk-acme")], "limits": {"requests_per_minute": 3}}})
        base, metrics_port = stack.base_url, stack.config.controlplane.metrics_port
        # start_stack's readiness probe was a model listing (never charged): the budget is whole.
        assert [post(base, "sk-acme")[0] for _ in range(4)] == [200, 200, 200, 429]
        valkey.stop()
        status, headers, body = post(base, "sk-acme")
        if on_failure == "open":
            assert status == 200, body  # admitted uncharged
        else:
            assert (status, body["error"]["code"], headers["retry-after"]) == (503, "ratelimit_unavailable", "2")
        assert metric(metrics_port, "sluice_ratelimit_errors_total", op="charge") >= 1
        assert metric(metrics_port, "sluice_ratelimit_decisions_total", result="store_error") >= 1
        valkey.start()  # the same port, empty (not persistent): the budget starts whole again
        # Charged again once the limiter reaches it (failing open, a 200 alone would not tell): it carries the limits.
        wait_for(lambda: "x-ratelimit-limit-requests" in post(base, "sk-acme")[1], timeout=20, what="the limiter back")
        assert [post(base, "sk-acme")[0] for _ in range(3)] == [200, 200, 429]
    finally:
        if stack is not None:
            stack.close()
        valkey.close()


def test_a_reload_changes_limits_and_keys_and_keeps_what_was_used(tmp_path: Path) -> None:
    tenants = {"acme": {"keys": [key_digest("sk-old")], "limits": {"requests_per_minute": 5}}}
    stack = start_stack([("thor", "thor")], tmp_path, api_key="sk-old", tenants=tenants)
    try:
        for _ in range(3):
            assert post(stack.base_url, "sk-old")[0] == 200
        raw = copy.deepcopy(stack.raw)
        raw["tenants"] = {"acme": {"keys": [key_digest("sk-new")], "limits": {"requests_per_minute": 10}}}
        path = tmp_path / "rotated.yaml"
        path.write_text(yaml.safe_dump(raw))
        done = subprocess.run([sys.executable, "-m", "sluice", "admin", "reload", str(path), *stack.admin_args()],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "changed: tenants" in done.stdout, done.stdout + done.stderr
        assert post(stack.base_url, "sk-old")[0] == 401  # the old key is gone
        status, headers, _ = post(stack.base_url, "sk-new")
        # 3 of 5 used is 6 of 10: this one leaves 3 (4 if a request's share drained meanwhile), not 9.
        assert status == 200 and headers["x-ratelimit-limit-requests"] == "10"
        assert headers["x-ratelimit-remaining-requests"] in ("3", "4"), headers

        shown = subprocess.run([sys.executable, "-m", "sluice", "admin", "tenants", "--json", *stack.admin_args()],
                               capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        (acme,) = json.loads(shown.stdout)["tenants"]
        assert (acme["name"], acme["keys"], acme["defaultPriority"], acme["maxPriority"]) == (
            "acme", 1, "standard", "standard")
        (requests,) = acme["limits"]
        assert (requests["scope"], requests["kind"], requests["limit"]) == ("acme", "requests", "10")
        assert int(requests["used"]) in (6, 7) and int(requests["used"]) + int(requests["remaining"]) == 10
        table = subprocess.run([sys.executable, "-m", "sluice", "admin", "tenants", *stack.admin_args()],
                               capture_output=True, text=True, timeout=30)
        lines = table.stdout.splitlines()
        assert lines[0].split() == ["TENANT", "KEYS", "PRIORITY", "MODELS", "SCOPE", "KIND", "USED", "LIMIT",
                                    "REMAINING", "RESET"]
        assert lines[1].split()[:8] == ["acme", "1", "standard..standard", "all", "acme", "requests",
                                        requests["used"], "10/min"]
        assert key_digest("sk-new") not in table.stdout + shown.stdout
    finally:
        stack.close()
