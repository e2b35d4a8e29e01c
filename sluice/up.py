"""``sluice up``: the embedded default. Starts the simulated engines a config lists, the control plane and Envoy; waits until
Envoy answers; prints where to point a client; supervises until Ctrl-C/SIGTERM or until any child dies; then stops every child
it started (Envoy first, so no request is cut at an engine while Envoy still accepts new ones).

Only one ``sluice up`` per Envoy listen port: a second one fails at once with a message naming the first (an exclusive
``flock`` on a lock file in ``$XDG_RUNTIME_DIR`` or the temp dir, released by the kernel however the first one dies).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from controlplane.config import Config, ConfigError, load_config
from sluice.envoyrun import envoy_command, write_bootstrap

log = logging.getLogger("sluice.up")

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


class AlreadyRunning(RuntimeError):
    pass


class NotReady(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]


def _lock_path(config: Config) -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"sluice-up-{config.envoy.listen_port}.lock"


def acquire_lock(config: Config) -> IO[str]:
    path = _lock_path(config)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise AlreadyRunning(
            f"sluice up is already running for port {config.envoy.listen_port} ({holder}); stop it (Ctrl-C) first"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}, config {config.source}")
    handle.flush()
    return handle


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_ports(config: Config) -> None:
    wanted = [
        ("Envoy listener", config.envoy.listen_host, config.envoy.listen_port),
        ("Envoy admin", "127.0.0.1", config.envoy.admin_port),
        ("control plane gRPC", config.controlplane.host, config.controlplane.grpc_port),
        ("control plane metrics", config.controlplane.host, config.controlplane.metrics_port),
        *((f"simulated engine {e.name}", e.host, e.port) for e in config.engines if e.sim),
    ]
    busy = [f"{what} port {port} on {host}" for what, host, port in wanted if not _port_free(host, port)]
    if busy:
        raise AlreadyRunning("ports already in use: " + "; ".join(busy))


def _spawn(name: str, command: list[str], log_dir: Path) -> Child:
    out = (log_dir / f"{name}.log").open("wb")
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    log.info("started %s (pid %d), log %s", name, process.pid, out.name)
    return Child(name, process)


def _fetch_models(base: str) -> list[str]:
    try:
        with urllib.request.urlopen(base + "/models", timeout=2) as response:
            listing = json.load(response)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise NotReady(str(exc)) from None
    models = [m["id"] for m in listing.get("data", [])]
    if not models:
        raise NotReady("no engine ready yet")
    return models


def wait_ready(base: str, children: list[Child], timeout: float = READY_TIMEOUT_S) -> list[str]:
    """Until Envoy answers ``GET /v1/models`` with at least one model served by a ready engine."""

    def attempt() -> list[str]:
        for child in children:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.process.returncode} during start-up")
        return _fetch_models(base)

    try:
        for retry in Retrying(
            stop=stop_after_delay(timeout), wait=wait_fixed(0.2), retry=retry_if_exception_type(NotReady)
        ):
            with retry:
                return attempt()
    except RetryError as exc:
        raise NotReady(f"Envoy did not answer at {base} within {timeout:g} s: {exc.last_attempt.exception()}") from None
    raise AssertionError("unreachable")


def stop_children(children: list[Child]) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %g s; killing it", child.name, STOP_GRACE_S)
            child.process.kill()
            child.process.wait()


def start_stack(config: Config, config_path: str | None, work_dir: Path) -> list[Child]:
    """Start sims, control plane, Envoy; returned in the order they should be stopped (Envoy first)."""
    py = sys.executable
    children: list[Child] = []
    try:
        for engine in config.engines:
            if engine.sim:
                # A configured max_num_seqs is the simulated engine's own cap too (it defaults to the profile's).
                cap = ["--max-num-seqs", str(engine.max_num_seqs)] if engine.max_num_seqs else []
                cap += ["--model", engine.sim_model] if engine.sim_model else []
                children.append(_spawn(f"sim-{engine.name}", [
                    py, "-m", "sluice", "sim", "--profile", engine.sim, "--host", engine.host, "--port", str(engine.port),
                    "--name", engine.name, "--speed", str(engine.sim_speed), "--flavor", engine.sim_flavor, *cap,
                ], work_dir))
        cp_args = [py, "-m", "sluice", "controlplane"] + (["--config", config_path] if config_path else [])
        children.append(_spawn("controlplane", cp_args, work_dir))
        bootstrap = write_bootstrap(config, work_dir)
        children.append(_spawn("envoy", envoy_command(config, bootstrap), work_dir))
    except BaseException:
        stop_children(list(reversed(children)))
        raise
    return list(reversed(children))


def run_up(config_path: str | None) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"sluice up: {exc}", file=sys.stderr)
        return 2
    try:
        lock = acquire_lock(config)
        check_ports(config)
    except AlreadyRunning as exc:
        print(f"sluice up: {exc}", file=sys.stderr)
        return 1

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    work_dir = Path(tempfile.mkdtemp(prefix="sluice-up-"))
    children = start_stack(config, config_path, work_dir)
    base = f"http://{config.envoy.listen_host}:{config.envoy.listen_port}/v1"
    code = 0
    try:
        models = wait_ready(base, children)
        print(f"sluice is up.\n  base URL: {base}\n  model:    {', '.join(models)}\n"
              f"  admin:    sluice admin engines --target {config.controlplane.host}:{config.controlplane.grpc_port}\n"
              f"  logs:     {work_dir}\nCtrl-C stops everything.", flush=True)
        while not stopping:
            dead = [c for c in children if c.process.poll() is not None]
            if dead:
                print(f"sluice up: {dead[0].name} exited with {dead[0].process.returncode} "
                      f"(log: {work_dir / (dead[0].name + '.log')}); stopping everything", file=sys.stderr)
                code = 1
                break
            time.sleep(0.2)
    except (NotReady, RuntimeError) as exc:
        print(f"sluice up: {exc} (logs: {work_dir})", file=sys.stderr)
        code = 1
    finally:
        stop_children(children)
        lock.close()
    print("sluice stopped.", flush=True)
    return code
