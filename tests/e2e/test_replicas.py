"""Two control-plane replicas on one Valkey, end to end (issue 11): ``sluice up --replicas 2 --store valkey`` starts a real
valkey-server, both replicas and Envoy, whose ext_authz Checks go to either replica. A burst larger than the fleet's slots
never runs more than an engine's cap; killing one replica (kill -9) mid-burst leaves no request unanswered; a replica
restarted by ``sluice up`` picks up the open tickets from the store."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai

from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
from sluice.up import REPLICA_PORT_STRIDE
from tests.e2e.sluiceup import Up
from rig.waits import wait_for

CAP = 2


def _stats(up: Up, engine: int) -> dict[str, Any]:
    url = up.raw["engines"][engine]["url"] + "/sim/stats"
    with urllib.request.urlopen(url, timeout=5) as response:
        return dict(json.load(response))


def _xds_versions(admin_port: int) -> dict[str, str]:
    with grpc.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
        reply = admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
    return {x.type_url: x.current_version for x in reply.xds}


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_two_replicas_hold_one_cap_survive_a_kill_and_remember_tickets(tmp_path: Path) -> None:
    engines = [{"name": n, "sim": "spark", "speed": 4.0, "max_num_seqs": CAP} for n in ("a", "b")]
    up = Up(tmp_path, engines, ("--replicas", "2", "--store", "valkey"))
    try:
        children = up.children()
        assert {"store", "controlplane-0", "controlplane-1", "envoy"} <= set(children)
        metrics_ports = [up.raw["controlplane"]["metrics_port"] + REPLICA_PORT_STRIDE * i for i in range(2)]
        admin_ports = [up.raw["controlplane"]["admin_port"] + REPLICA_PORT_STRIDE * i for i in range(2)]
        # Both replicas serve the same xDS resources: every type at the same version (content hashes).
        versions = [_xds_versions(port) for port in admin_ports]
        assert versions[0] == versions[1] and len(versions[0]) == 4, versions

        def ask(_: int) -> str:
            try:
                reply = up.complete("cortex", max_tokens=40)
                return f"200 {reply.headers.get('x-sluice-engine')}"
            except openai.APIStatusError as error:
                return f"{error.status_code} {error.body}"

        # A burst of 24 against 2 x 2 slots, through both replicas: each admission was checked against one ledger.
        with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
            answers = list(pool.map(ask, range(24)))
        assert all(a.startswith("200 ") for a in answers), answers
        assert all(_stats(up, i)["max_running_seen"] <= CAP for i in range(2)), [_stats(up, i) for i in range(2)]
        decided = [_metric(p, "sluice_admission_decisions_total") for p in metrics_ports]
        assert all(d > 0 for d in decided), f"both replicas answer Checks: {decided}"

        # kill -9 one replica in the middle of a second burst: every request still gets an answer (none hangs); the
        # survivor's caps hold.
        with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
            futures = [pool.submit(ask, i) for i in range(24)]
            wait_for(lambda: _metric(metrics_ports[1], "sluice_admission_decisions_total") > decided[1], timeout=30,
                     what="replica 1 deciding Checks of the burst")
            os.kill(children["controlplane-1"], signal.SIGKILL)
            answers = [f.result(timeout=120) for f in futures]
        assert len(answers) == 24 and all(a.split(" ", 1)[0] in ("200", "503") for a in answers), answers
        assert sum(a.startswith("200 ") for a in answers) >= 12, answers

        # A long request holds a ticket; then both replicas are killed and restarted by sluice up: the ticket is
        # still known (the store kept it) by the restarted replicas.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            long = pool.submit(lambda: up.client.chat.completions.with_raw_response.create(
                model="cortex", messages=[{"role": "user", "content": "a long story"}], max_tokens=3000,
                extra_body={"ignore_eos": True}))
            wait_for(lambda: _metric(metrics_ports[0], "sluice_tickets_open") >= 1, timeout=30,
                     what="the long request holding a ticket")
            wait_for(lambda: "controlplane-1" in up.children(), timeout=30, what="replica 1 restarted")
            killed = {name: up.children()[name] for name in ("controlplane-0", "controlplane-1")}
            for pid in killed.values():
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: all(up.children().get(name) not in (None, pid) for name, pid in killed.items()),
                     timeout=60, what="both replicas started again")

            def both_back() -> bool:
                try:
                    return all(_metric(p, "sluice_replica_info") == 1 for p in metrics_ports)
                except OSError:
                    return False
            wait_for(both_back, timeout=60, what="both replicas restarted")
            open_tickets = [_metric(p, "sluice_tickets_open") for p in metrics_ports]
            assert all(n >= 1 for n in open_tickets), f"a restarted replica forgot the open ticket: {open_tickets}"
            assert long.result(timeout=120).http_response.status_code == 200
    finally:
        up.close()
