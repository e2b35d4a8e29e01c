"""``sluice up`` as a user runs it (``make run`` runs the same command on the bundled config): everything starts, the openai
client gets a streamed answer, a second ``sluice up`` refuses to start, and SIGTERM stops every child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import yaml

from rig.waits import free_port, wait_for


def _config(tmp_path: Path) -> Path:
    raw = {
        "controlplane": {"grpc_port": free_port(), "metrics_port": free_port(), "admin_port": free_port()},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "engines": [
            {"name": "thor", "url": f"http://127.0.0.1:{free_port()}", "sim": "thor", "speed": 20},
            {"name": "spark", "url": f"http://127.0.0.1:{free_port()}", "sim": "spark", "speed": 20},
        ],
    }
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_sluice_up_serves_streams_refuses_a_twin_and_stops_cleanly(tmp_path: Path) -> None:
    config = _config(tmp_path)
    port = yaml.safe_load(config.read_text())["envoy"]["listen_port"]
    up = subprocess.Popen([sys.executable, "-m", "sluice", "up", "--config", str(config)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert up.stdout is not None
    try:
        lines: list[str] = []
        while "Ctrl-C stops everything." not in "".join(lines):
            line = up.stdout.readline()
            assert line, f"sluice up ended early:\n{''.join(lines)}"
            lines.append(line)
        output = "".join(lines)
        assert f"base URL: http://127.0.0.1:{port}/v1" in output
        assert "model:    cortex" in output
        children = _children(up.pid)
        assert len(children) == 4  # two simulators, the control plane, Envoy

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="cortex", messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            "the quick river runs through a"

        # The printed admin command works as printed: sluice up made a token for this run (the config names none); a
        # change without it is refused and changes nothing.
        admin = next(line for line in lines if "admin:" in line).split("admin:", 1)[1].split()
        assert admin[:3] == ["sluice", "admin", "engines"] and "--token-file" in admin
        args = admin[3:]
        cli = [sys.executable, "-m", "sluice", "admin"]
        refused = subprocess.run([*cli, *[a for a in args if a != "--token-file" and not a.endswith("admin-token")],
                                  "drain", "thor"], capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0 and "missing or wrong bearer token" in refused.stderr
        drained = subprocess.run([*cli, *args, "drain", "thor"], capture_output=True, text=True, timeout=30)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        undrained = subprocess.run([*cli, *args, "undrain", "thor"], capture_output=True, text=True, timeout=30)
        assert undrained.returncode == 0, undrained.stdout + undrained.stderr

        twin = subprocess.run([sys.executable, "-m", "sluice", "up", "--config", str(config)],
                              capture_output=True, text=True, timeout=30)
        assert twin.returncode == 1
        assert "already running" in twin.stderr

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=20) == 0
        assert "sluice stopped." in up.stdout.read()
        wait_for(lambda: not any(_alive(pid) for pid in children), timeout=10, what="children to exit")
    finally:
        if up.poll() is None:
            up.kill()


def test_sluice_up_fronts_an_engine_already_running_elsewhere(tmp_path: Path) -> None:
    """An engine entry without ``sim:`` is not started by ``sluice up``: it is someone's running server, fronted as is."""
    from tests.harness import launch_sim, stop

    engine, engine_port = launch_sim("spark", "their-vllm", 20.0, tmp_path)
    raw: dict[str, Any] = {
        "controlplane": {"grpc_port": free_port(), "metrics_port": free_port(), "admin_port": free_port()},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "engines": [{"name": "their-vllm", "url": f"http://localhost:{engine_port}", "max_num_seqs": 2}],
    }
    config = tmp_path / "external.yaml"
    config.write_text(yaml.safe_dump(raw))
    up = subprocess.Popen([sys.executable, "-m", "sluice", "up", "--config", str(config)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert up.stdout is not None
    try:
        output = ""
        while "Ctrl-C stops everything." not in output:
            line = up.stdout.readline()
            assert line, f"sluice up ended early:\n{output}"
            output += line
        assert len(_children(up.pid)) == 2  # the control plane and Envoy only
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{raw['envoy']['listen_port']}/v1", api_key="unused",
                               max_retries=0)
        raw_response = client.chat.completions.with_raw_response.create(
            model="cortex", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert raw_response.headers["x-sluice-engine"] == "their-vllm"
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=20) == 0
        assert engine.poll() is None, "sluice up must not stop an engine it did not start"
    finally:
        if up.poll() is None:
            up.kill()
        stop(engine)
