"""A control-plane replica killed mid-burst, end to end: ``sluice up --replicas 2 --store valkey`` in front of two
simulated engines of 2 slots each (thor and spark). Every Check the dead replica held (parked ones included) is asked
again of the survivor by Envoy's ext_authz retry policy (controlplane/xds/resources.py ``_check_retry``), so the
survivor decides every request: none goes through Envoy's fail-open path while a replica is reachable.

One run: 24 chat requests at once; 1 s in, one replica is killed with SIGKILL (alternately replica 0 and 1); every
answer is read; then ``sluice up`` restarts the killed replica and the next run waits for it. Five runs. Asserted:

- every 200 carries ``x-sluice-engine`` (admitted by a Check, none unchecked);
- every other answer is a 503 a Check gave when it shed the request (``SHED_BY_CHECK``, with ``retry-after``): never
  ``controlplane_unavailable`` (fail-closed), ``engine_overloaded`` (the fail-open path's circuit breaker),
  ``upstream_unavailable``, ``not_admitted`` or ``internal_error``, none of which a surviving replica should produce
  here;
- no engine ever ran more than its cap (the simulator's ``max_running_seen``);
- at the end no ticket is open on either replica (``sluice_tickets_open``), and Envoy retried Checks (its control-plane
  cluster's ``upstream_rq_retry``) without a retry overflowing its circuit breaker.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from sluice.up import REPLICA_PORT_STRIDE
from tests.e2e.sluiceup import Up
from rig.waits import wait_for

CAP = 2
BURST = 24
KILL_AFTER_S = 1.0
RUNS = 5
SHED_BY_CHECK = frozenset({"queue_full", "park_timeout", "overloaded", "saturated"})
"""The 503 codes a Check answers when it sheds a request (each with retry-after): decisions, not failures."""


@dataclass(frozen=True)
class Answer:
    status: int
    engine: str | None
    """``x-sluice-engine`` of a 200 (None: not admitted by a Check)."""
    code: str | None
    """A non-200's OpenAI error code."""
    retry_after: str | None


def _ask(up: Up) -> Answer:
    try:
        reply = up.complete("cortex", max_tokens=40)
        return Answer(reply.http_response.status_code, reply.headers.get("x-sluice-engine"), None, None)
    except openai.APIStatusError as error:
        body = error.body if isinstance(error.body, dict) else {}
        code = body.get("code") or (body.get("error") or {}).get("code")
        return Answer(error.status_code, None, str(code), error.response.headers.get("retry-after"))


def _label(answer: Answer) -> str:
    if answer.status == 200:
        return "200 admitted" if answer.engine else "200 unchecked"
    return f"{answer.status} {answer.code}"


def _json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return dict(json.load(response))


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _envoy_counter(up: Up, name: str) -> int:
    admin = f"http://127.0.0.1:{up.raw['envoy']['admin_port']}"
    stats = _json(f"{admin}/stats?format=json&filter=^cluster.sluice_controlplane.")
    return sum(int(s.get("value", 0)) for s in stats["stats"] if s.get("name") == f"cluster.sluice_controlplane.{name}")


def _ready(metrics_port: int) -> bool:
    try:
        return _metric(metrics_port, "sluice_replica_info") == 1
    except OSError:
        return False


def test_a_replica_killed_mid_burst_leaves_every_check_to_the_survivor(tmp_path: Path) -> None:
    engines = [{"name": name, "sim": name, "speed": 4.0, "max_num_seqs": CAP} for name in ("thor", "spark")]
    up = Up(tmp_path, engines, ("--replicas", "2", "--store", "valkey"))
    try:
        metrics_ports = [up.raw["controlplane"]["metrics_port"] + REPLICA_PORT_STRIDE * i for i in range(2)]
        figures: list[str] = []
        failures: list[str] = []
        for run in range(RUNS):
            victim = f"controlplane-{run % 2}"
            wait_for(lambda: all(_ready(p) for p in metrics_ports) and {"controlplane-0", "controlplane-1"}
                     <= set(up.children()), timeout=30, what="both replicas serving")
            pid = up.children()[victim]
            with concurrent.futures.ThreadPoolExecutor(max_workers=BURST) as pool:
                futures = [pool.submit(_ask, up) for _ in range(BURST)]
                time.sleep(KILL_AFTER_S)
                os.kill(pid, signal.SIGKILL)
                answers = [f.result(timeout=60) for f in futures]
            outcomes = Counter(_label(a) for a in answers)
            figures.append(f"run {run + 1} ({victim} killed): {dict(outcomes)}")
            for a in answers:
                if a.status == 200 and a.engine is None:
                    failures.append(f"run {run + 1}: a 200 without x-sluice-engine (admitted without a Check)")
                elif a.status != 200 and not (a.status == 503 and a.code in SHED_BY_CHECK and a.retry_after):
                    failures.append(f"run {run + 1}: {a.status} {a.code} is not a Check's shed")
            wait_for(lambda: victim in up.children() and up.children()[victim] != pid, timeout=30,
                     what=f"{victim} restarted by sluice up")
        stats = [_json(up.raw["engines"][i]["url"] + "/sim/stats") for i in range(2)]
        retried = _envoy_counter(up, "upstream_rq_retry")
        overflowed = _envoy_counter(up, "upstream_rq_retry_overflow")
        exhausted = _envoy_counter(up, "upstream_rq_retry_limit_exceeded")
        print("\n".join([*figures, f"Envoy: {retried} Checks retried, {overflowed} overflowed, {exhausted} out of "
                         f"retries", f"max running seen: {[s['max_running_seen'] for s in stats]}"]))
        assert not failures, "\n".join([*failures, *figures])
        assert all(s["max_running_seen"] <= CAP for s in stats), stats
        assert retried > 0 and overflowed == 0 and exhausted == 0, (retried, overflowed, exhausted)
        wait_for(lambda: all(_ready(p) for p in metrics_ports), timeout=30, what="both replicas serving")

        def tickets_open() -> list[float]:
            return [_metric(p, "sluice_tickets_open") for p in metrics_ports]
        wait_for(lambda: tickets_open() == [0.0, 0.0], timeout=20, what="every ticket released")
    finally:
        up.close()
