"""``sluice up --config F`` takes an edited F without a restart, as the README tells a user to do it: ``sluice admin
reload`` (naming F or not) and SIGHUP to ``sluice up``. What ``sluice up`` adds to F (its run's admin token, the
simulators' profile defaults, replica ports and the store) is applied again on every reload, a control plane restarted
after a crash starts from F as it is, and with ``--replicas 2`` a reload asked of one replica reaches both."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import openai
import yaml

from sluice.admin.v1 import admin_pb2, admin_pb2_grpc
from sluice.up import REPLICA_PORT_STRIDE
from tests.e2e.sluiceup import Up
from rig.waits import wait_for

FLOOR = {"cortex": "99.0"}
"""Above every simulator's version: a request for cortex is then answered 503 version_floor."""
ENGINES = [{"name": "thor", "sim": "thor", "speed": 20}]
"""A vLLM-flavoured simulator: ``sluice up`` writes its profile's ``max_num_seqs`` in (F states none)."""


def _write(path: Path, raw: dict[str, Any], **sections: Any) -> None:
    path.write_text(yaml.safe_dump({**raw, **sections}))


def _admin_options(up: Up) -> list[str]:
    """``--target H:P --token-file T`` as ``sluice up`` printed them (the token is the one it made for the run)."""
    found = re.search(r"admin:\s+sluice admin engines (--target \S+ --token-file \S+)", up.output)
    assert found, up.output
    return found[1].split()


def _admin(options: list[str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice", "admin", *options, *args], capture_output=True, text=True,
                          timeout=30, cwd=cwd)


def _answer(up: Up) -> str:
    """What a request for cortex through Envoy gets: ``200`` or ``<status> <error code>``."""
    try:
        up.complete("cortex")
    except openai.APIStatusError as error:
        return f"{error.status_code} {error.code}"
    return "200"


def _floors(admin_port: int) -> dict[str, str]:
    """The version floors a control plane runs (``GetPolicy``: a read, no token)."""
    with grpc.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
        policy = admin_pb2_grpc.AdminStub(channel).GetPolicy(admin_pb2.GetPolicyRequest(), timeout=5)
    return dict(yaml.safe_load(policy.yaml)["version_floors"] or {})


def test_sluice_up_applies_an_edited_config_on_reload_and_sighup(tmp_path: Path) -> None:
    up = Up(tmp_path, ENGINES)
    try:
        path, options = tmp_path / "sluice.yaml", _admin_options(up)
        assert _answer(up) == "200"

        # `sluice admin reload`, naming no file: F is re-read. Only the floor changed: the run's token (F names none)
        # and thor's profile max_num_seqs were added again (without them: "admin" needs a restart, "engines" changed).
        _write(path, up.raw, version_floors=FLOOR)
        done = _admin(options, "reload")
        assert (done.returncode, done.stdout.strip()) == (0, f"reloaded {path}; changed: version_floors"), done.stderr
        assert _answer(up) == "503 version_floor"

        # Naming F, relative to where the command runs.
        _write(path, up.raw)
        done = _admin(options, "reload", path.name, cwd=tmp_path)
        assert (done.returncode, done.stdout.strip()) == (0, f"reloaded {path}; changed: version_floors"), done.stderr
        assert _answer(up) == "200"

        # An edit with a problem is refused whole; the running policy stays.
        _write(path, up.raw, version_floors={"cortex": "not a version"})
        refused = _admin(options, "reload", str(path))
        assert refused.returncode == 1 and "version_floors.cortex" in refused.stderr, refused.stderr
        assert _answer(up) == "200"

        # SIGHUP to sluice up: passed on to the control plane, which re-reads F.
        _write(path, up.raw, version_floors=FLOOR)
        up.process.send_signal(signal.SIGHUP)
        wait_for(lambda: _answer(up) == "503 version_floor", timeout=10, what="the floor applied after SIGHUP")
        assert "reload: SIGHUP passed to controlplane" in up.output

        # A control plane restarted after a crash starts from F as it is now (edited, not reloaded): neither from what
        # sluice up started it on (no floor) nor from what it ran (99.0).
        _write(path, up.raw, version_floors={"cortex": "98.0"})
        victim = up.children()["controlplane"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: up.children().get("controlplane") not in (None, victim), timeout=10, what="a restart")
        wait_for(lambda: _floors(up.raw["controlplane"]["admin_port"]) == {"cortex": "98.0"}, timeout=20,
                 what="the restarted control plane to run F as edited")
    finally:
        up.close()


def test_every_replica_applies_a_reload(tmp_path: Path) -> None:
    # admin.reload_dir allows other files in general: under --replicas sluice up still refuses them.
    up = Up(tmp_path, ENGINES, ("--replicas", "2", "--store", "valkey"), {"admin": {"reload_dir": str(tmp_path)}})
    try:
        path, options = tmp_path / "sluice.yaml", _admin_options(up)
        admin_ports = [up.raw["controlplane"]["admin_port"] + REPLICA_PORT_STRIDE * i for i in range(2)]
        assert {"store", "controlplane-0", "controlplane-1", "envoy"} <= set(up.children())
        assert [_floors(port) for port in admin_ports] == [{}, {}]

        # A reload asked of replica 1, naming F: it applies it (its own ports and the store kept) and sluice up passes
        # it on to replica 0; every Check, whichever replica Envoy sends it to, sees the floor.
        _write(path, up.raw, version_floors=FLOOR)
        replica1 = [options[0], f"127.0.0.1:{admin_ports[1]}", *options[2:]]
        done = _admin(replica1, "reload", str(path))
        assert (done.returncode, done.stdout.strip()) == (0, f"reloaded {path}; changed: version_floors"), done.stderr
        wait_for(lambda: all(_floors(port) == FLOOR for port in admin_ports), timeout=10, what="both replicas floored")
        assert [_answer(up) for _ in range(4)] == ["503 version_floor"] * 4

        # A file other than F is refused: replicas running different files would split the Checks between policies.
        other = tmp_path / "other.yaml"
        _write(other, up.raw)
        refused = _admin(options, "reload", str(other))
        assert refused.returncode == 1 and f"runs {path}" in refused.stderr, refused.stderr

        # SIGHUP to sluice up: every replica re-reads F.
        _write(path, up.raw)
        up.process.send_signal(signal.SIGHUP)
        wait_for(lambda: all(_floors(port) == {} for port in admin_ports), timeout=10, what="both floors removed")
        assert [_answer(up) for _ in range(4)] == ["200"] * 4
    finally:
        up.close()
