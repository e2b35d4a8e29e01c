"""``sluice up`` supervises: a crashed control plane or simulator is restarted (with backoff) while Envoy keeps serving;
Envoy dying ends everything. The restart policy (``next_restart``) and the process loop (``Supervisor``) are also tested
alone, on tiny delays and stand-in processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from rig.upprocess import alive
from sluice.up import Child, RestartHistory, RestartPolicy, Supervisor, next_restart, stop_children
from rig.waits import wait_for
from tests.e2e.sluiceup import Up

# -- the policy, pure ------------------------------------------------------------------------------------------------------


def _crash_quickly(policy: RestartPolicy, times: list[float]) -> list[float | None]:
    """Delays chosen for a child that exits 0.1 s after each start, at the given times."""
    history, delays = RestartHistory(), []
    for now in times:
        decision = next_restart(policy, history, now - 0.1, now)
        history = decision.history
        delays.append(decision.delay_s)
    return delays


def test_backoff_doubles_from_half_a_second_to_a_cap_of_ten() -> None:
    policy = RestartPolicy(max_restarts=100)
    assert _crash_quickly(policy, [float(t) for t in range(8)]) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_a_child_that_stayed_up_thirty_seconds_starts_the_backoff_over() -> None:
    policy = RestartPolicy()
    history = RestartHistory()
    for now in (0.0, 1.0, 3.0):
        history = next_restart(policy, history, now - 0.1, now).history
    assert history.streak == 3
    decision = next_restart(policy, history, up_since=10.0, now=40.0)  # up 30 s
    assert (decision.attempt, decision.delay_s) == (1, 0.5)
    decision = next_restart(policy, history, up_since=10.0, now=39.9)  # up 29.9 s: still the same streak
    assert (decision.attempt, decision.delay_s) == (4, 4.0)


def test_the_sixth_exit_within_sixty_seconds_gives_up_and_old_restarts_are_forgotten() -> None:
    policy = RestartPolicy()
    delays = _crash_quickly(policy, [0.0, 1.0, 2.0, 4.0, 8.0, 16.0])
    assert delays[:5] == [0.5, 1.0, 2.0, 4.0, 8.0] and delays[5] is None
    # The same five restarts, but the sixth exit comes when the first has left the 60 s window: restarted.
    history = RestartHistory()
    for now in (0.0, 1.0, 2.0, 4.0, 8.0):
        history = next_restart(policy, history, now - 0.1, now).history
    late = next_restart(policy, history, 59.9, 60.0)
    assert not late.give_up and late.history.restarts == (1.0, 2.0, 4.0, 8.0, 60.0)
    assert next_restart(policy, history, 59.8, 59.9).give_up


def test_the_policy_is_pure() -> None:
    policy, history = RestartPolicy(), RestartHistory(streak=2, restarts=(5.0, 6.0))
    first = next_restart(policy, history, 6.5, 7.0)
    assert first == next_restart(policy, history, 6.5, 7.0)
    assert history == RestartHistory(streak=2, restarts=(5.0, 6.0))


# -- the process loop, on stand-in processes -------------------------------------------------------------------------------

FAST = RestartPolicy(initial_delay_s=0.02, max_delay_s=0.05, reset_after_s=30.0, max_restarts=3, window_s=60.0)


def test_supervisor_restarts_a_child_that_exits_and_logs_each_restart(tmp_path: Path) -> None:
    child = Child("worker", ["sleep", "60"], tmp_path / "worker.log")
    said: list[str] = []
    supervisor = Supervisor([child], FAST, say=said.append)
    child.start()
    try:
        first = child.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)

        def restarted() -> bool:
            assert supervisor.check() is None
            return child.pid not in (None, first)

        wait_for(restarted, timeout=10, what="a restarted worker")
        assert said[0].startswith("worker exited with signal 9 (SIGKILL) after ")
        assert "restart attempt 1 in 0.02 s" in said[0]
        assert said[1] == f"worker restarted (pid {child.pid}, attempt 1)"
        assert "--- sluice up: restart 1 of worker ---" in child.log_path.read_text()
    finally:
        stop_children([child])


def test_supervisor_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    child = Child("flaky", ["sh", "-c", "exit 3"], tmp_path / "flaky.log")
    said: list[str] = []
    supervisor = Supervisor([child], FAST, say=said.append)
    child.start()
    try:
        fatal = wait_for(supervisor.check, timeout=10, what="the supervisor to give up")
        assert "flaky exited with code 3" in fatal and "crash-looping" in fatal and "giving up" in fatal
        assert child.restarts == 3
        assert [m.split("restart attempt ")[1][:1] for m in said if "restart attempt" in m] == ["1", "2", "3"]
    finally:
        stop_children([child])


def test_supervisor_ends_when_a_child_without_restart_exits(tmp_path: Path) -> None:
    envoy = Child("envoy", ["sh", "-c", "exit 1"], tmp_path / "envoy.log", restart=False)
    envoy.start()
    supervisor = Supervisor([envoy], FAST, say=lambda _: None)
    fatal = wait_for(supervisor.check, timeout=10, what="a fatal exit")
    assert fatal.startswith("envoy exited with code 1") and "data plane" in fatal
    assert envoy.restarts == 0


def test_stopping_drops_a_restart_still_waiting_out_its_backoff(tmp_path: Path) -> None:
    child = Child("cp", ["sh", "-c", "exit 2"], tmp_path / "cp.log")
    supervisor = Supervisor([child], RestartPolicy(initial_delay_s=60.0), say=lambda _: None)
    child.start()
    try:
        wait_for(lambda: supervisor.check() is None and child.restart_at is not None, timeout=10, what="a backoff")
        assert child.process is None
        stopped = time.monotonic()
        assert supervisor.run(lambda: True) == 0  # Ctrl-C seen: the loop ends at once
        stop_children([child])
        assert time.monotonic() - stopped < 1.0
        assert child.restart_at is None and child.process is None and child.restarts == 0
    finally:
        stop_children([child])


# -- sluice up, end to end -------------------------------------------------------------------------------------------------


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


STREAM_TOKENS = 150
"""thor at speed 1 decodes 18 tokens/s alone (25 each with two running): the stream lasts 6-8 s, outliving the restart."""


def test_a_killed_control_plane_is_restarted_while_envoy_keeps_serving(tmp_path: Path) -> None:
    up = Up(tmp_path, [{"name": "thor", "sim": "thor", "speed": 1.0}])
    try:
        before = up.children()
        assert set(before) == {"controlplane", "envoy", "sim-thor"}

        stream: dict[str, Any] = {"tokens": 0}
        flowing = threading.Event()

        def consume() -> None:
            try:
                with up.client.chat.completions.with_streaming_response.create(
                    model="cortex", messages=[{"role": "user", "content": "tell me a long story"}],
                    max_tokens=STREAM_TOKENS, stream=True, stream_options={"include_usage": True},
                ) as response:
                    stream["engine"] = response.headers.get("x-sluice-engine")
                    for chunk in response.parse():
                        if chunk.choices and chunk.choices[0].delta.content:
                            stream["tokens"] += 1
                            flowing.set()
                        if chunk.choices and chunk.choices[0].finish_reason:
                            stream["finish"] = chunk.choices[0].finish_reason
                        if chunk.usage is not None:
                            stream["usage"] = chunk.usage.completion_tokens
            except Exception as exc:  # reported by the assertions below
                stream["error"] = exc
            finally:
                flowing.set()

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        assert flowing.wait(30) and "error" not in stream, stream
        assert stream["engine"] == "thor"

        # Fail-open needs the weights the control plane pushes after its first probes (within a second of start-up).
        wait_for(lambda: up.has_fallback_route("cortex"), timeout=10, what="Envoy's fallback route for cortex")
        os.kill(before["controlplane"], signal.SIGKILL)
        # The restart waits at least 0.5 s (backoff) plus the control plane's start-up: this request meets no control
        # plane. Fail-open: Envoy routes it by the last capacity weights, and nothing sets sluice's response headers.
        down = up.complete("cortex")
        assert down.http_response.status_code == 200
        assert "x-sluice-engine" not in down.headers and "x-sluice-route-reason" not in down.headers
        assert down.parse().choices[0].message.content
        assert _accepts(up.port)

        restarted = wait_for(lambda: up.children().get("controlplane") not in (None, before["controlplane"]),
                             timeout=20, what="a restarted control plane")
        assert restarted
        new_pid = up.children()["controlplane"]
        wait_for(lambda: f"controlplane restarted (pid {new_pid}, attempt 1)" in up.output, timeout=10,
                 what="the restart in the log")
        assert "controlplane exited with signal 9 (SIGKILL)" in up.output
        assert "restart attempt 1 in 0.5 s" in up.output

        def admitted() -> Any:
            response = up.complete("cortex")  # a never-probed engine serves nothing yet (404): wait_for retries
            return response if "x-sluice-route-reason" in response.headers else None

        response = wait_for(admitted, timeout=20, what="an admitted request after the restart")
        assert response.headers["x-sluice-engine"] == "thor"
        assert response.headers["x-sluice-route-reason"] == "finish_soonest"

        # Reconciliation: the new ledger knows nothing of the pre-crash stream (no open ticket once the request above
        # is logged); only the engine's probe shows it, and the load counts it.
        def reconciled() -> bool:
            thor = up.admin_engines()["thor"]
            return thor.open_tickets == 0 and thor.running >= 1 and thor.effective_load >= 1

        wait_for(reconciled, timeout=10, what="the restarted control plane to count the pre-crash stream")
        assert reader.is_alive(), f"the stream ended before the check could see it (machine too slow?): {stream}"

        reader.join(60)
        assert not reader.is_alive()
        assert "error" not in stream, stream
        assert (stream["tokens"], stream.get("usage"), stream.get("finish")) == (STREAM_TOKENS, STREAM_TOKENS, "length")

        after = up.children()
        assert after["envoy"] == before["envoy"] and after["sim-thor"] == before["sim-thor"]
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(timeout=20) == 0
        wait_for(lambda: not any(alive(pid) for pid in up.seen), timeout=10, what="every child to exit")
    finally:
        up.close()


def test_a_killed_simulator_is_restarted_and_a_dead_envoy_stops_everything(tmp_path: Path) -> None:
    up = Up(tmp_path, [{"name": "thor", "sim": "thor", "speed": 20.0}])
    try:
        before = up.children()
        os.kill(before["sim-thor"], signal.SIGKILL)
        wait_for(lambda: up.children().get("sim-thor") not in (None, before["sim-thor"]), timeout=20,
                 what="a restarted simulator")
        wait_for(lambda: "sim-thor restarted" in up.output, timeout=10, what="the restart in the log")
        assert "sim-thor exited with signal 9 (SIGKILL)" in up.output

        def served() -> Any:
            response = up.complete("cortex")
            return response if response.headers.get("x-sluice-engine") == "thor" else None

        assert wait_for(served, timeout=20, what="the restarted simulator to serve").http_response.status_code == 200
        after = up.children()
        assert after["controlplane"] == before["controlplane"] and after["envoy"] == before["envoy"]

        os.kill(after["envoy"], signal.SIGKILL)
        assert up.process.wait(timeout=20) == 1
        up._reader.join(5)
        assert "envoy exited with signal 9 (SIGKILL)" in up.output and "stopping everything" in up.output
        assert "sluice stopped." in up.output
        wait_for(lambda: not any(alive(pid) for pid in up.seen), timeout=10, what="every child to exit")
    finally:
        up.close()



def test_children_share_the_session_so_the_idle_probe_worker_yields_to_envoy(tmp_path: Path) -> None:
    """Each child has a process group of its own (a terminal's Ctrl-C reaches only ``sluice up``, which stops them in
    order) and ``sluice up``'s session: with autogroup scheduling a session is one scheduling group, and the probe
    worker's ``SCHED_IDLE`` gives way only inside its group. In a session of its own the control plane's worker competed
    with Envoy as an equal (``sluice/up.py``, Scheduling)."""
    up = Up(tmp_path, [{"name": "thor", "sim": "thor", "speed": 20.0}], sections={"observe": {"probe_process": "on"}})
    try:
        children = up.children()
        session = os.getsid(up.process.pid)
        for name, pid in children.items():
            assert os.getpgid(pid) == pid, name
            assert os.getsid(pid) == session, name

        def worker() -> int | None:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(children["controlplane"])], capture_output=True,
                                 text=True).stdout
            for pid in map(int, out.split()):
                if b"controlplane.observe.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            return None

        probe_worker = wait_for(worker, timeout=10, what="the control plane's probe worker")
        assert probe_worker is not None  # wait_for raises rather than return a falsy value
        assert os.getsid(probe_worker) == session
        assert os.sched_getscheduler(probe_worker) == os.SCHED_IDLE
        assert up.complete("cortex").headers["x-sluice-engine"] == "thor"
    finally:
        up.close()
