"""Probes in a worker process (``observe.probe_process: on``, issue 9 item 5), through the real Envoy: engines are
observed and served as with in-loop probes; a drain set in the control plane survives the worker's views; a killed worker
is restarted and its probes land again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai

from rig.waits import wait_for
from tests.harness import start_stack


def _worker_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "controlplane.observe.worker"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_probe_worker_observes_serves_keeps_drains_and_comes_back(tmp_path: Path) -> None:
    before = set(_worker_pids())
    stack = start_stack([("thor", "thor"), ("spark", "spark")], tmp_path, speed=20.0,
                        observe={"probe_process": "on", "poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.2})
    try:
        assert stack.controlplane is not None
        plane = stack.controlplane.plane
        mine = [p for p in _worker_pids() if p not in before]
        assert len(mine) == 1, "one probe worker process for the fleet"
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        served = {client.chat.completions.with_raw_response.create(
            model="cortex", messages=[{"role": "user", "content": "hi"}], max_tokens=3).headers["x-sluice-engine"]
            for _ in range(8)}
        assert served <= {"thor", "spark"} and served

        # A drain lives in the control plane; the worker's next views do not undo it.
        assert stack.controlplane.call(plane.admin.set_drained("spark", True))
        spark = next(p for p in plane.observation.pollers if p.config.name == "spark")
        drained_at = spark.probes
        wait_for(lambda: spark.probes >= drained_at + 3, timeout=10, what="several probes of spark after the drain")
        views = {v.name: v for v in plane.observation.fleet(plane.clock()).engines}
        assert views["spark"].drained and not views["spark"].stale
        for _ in range(4):
            reply = client.chat.completions.with_raw_response.create(
                model="cortex", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert reply.headers["x-sluice-engine"] == "thor"

        # kill -9 the worker: a new one starts and probes land again (the engines never went stale for long).
        os.kill(mine[0], signal.SIGKILL)
        wait_for(lambda: [p for p in _worker_pids() if p not in before and p != mine[0]], timeout=10,
                 what="a new probe worker")
        probes = sum(p.probes for p in plane.observation.pollers)
        wait_for(lambda: sum(p.probes for p in plane.observation.pollers) > probes + 4, timeout=10, what="probes after the restart")
        views = {v.name: v for v in plane.observation.fleet(plane.clock()).engines}
        assert not views["thor"].stale and views["spark"].drained
    finally:
        stack.close()
    wait_for(lambda: not [p for p in _worker_pids() if p not in before], timeout=10, what="the worker stopped with it")


def test_the_probe_worker_runs_idle_and_comes_back_at_nice_when_every_core_is_busy(tmp_path: Path) -> None:
    """``observe.worker_priority: idle`` (the default): the worker probes under SCHED_IDLE. Every core busy with other work
    (two spinning processes per core), it is starved: it says so and stops, and the control plane restarts it as a normal
    process at nice 10, whose probes land although the cores stay busy; the starvation is counted."""
    before = set(_worker_pids())
    stack = start_stack([("thor", "thor"), ("spark", "spark")], tmp_path, speed=20.0, with_envoy=False,
                        observe={"probe_process": "on", "poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.2,
                                 "worker_starved_after_seconds": 0.3})
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        assert stack.controlplane is not None
        plane = stack.controlplane.plane
        first = [p for p in _worker_pids() if p not in before]
        assert len(first) == 1 and os.sched_getscheduler(first[0]) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, first[0]) == 10
        # Two spinning processes per core until the worker reports starving: with one per core the kernel still gave the
        # idle worker a slice about every 0.3 s, about the bound, and the report sometimes never came. Then one per core.
        cores = os.cpu_count() or 2
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores)]
        wait_for(lambda: plane.observation.worker_starvations >= 1, timeout=30, what="the idle worker to report starving")
        for hog in hogs[cores:]:
            hog.kill()
            hog.wait()
        hogs = hogs[:cores]
        wait_for(lambda: [p for p in _worker_pids() if p not in before and p != first[0]], timeout=10,
                 what="a worker restarted at nice")
        second = [p for p in _worker_pids() if p not in before and p != first[0]]
        probes = sum(p.probes for p in plane.observation.pollers)
        wait_for(lambda: sum(p.probes for p in plane.observation.pollers) > probes + 4, timeout=15,
                 what="probes from the nice worker while every core is busy")
        # It probes, so it has read its setup and chosen its scheduling: a normal process at nice 10.
        assert os.sched_getscheduler(second[0]) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, second[0]) == 10
        assert plane.metrics.registry.get_sample_value("sluice_probe_worker_starved_total") == 1
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        stack.close()
    wait_for(lambda: not [p for p in _worker_pids() if p not in before], timeout=10, what="the worker stopped with it")
