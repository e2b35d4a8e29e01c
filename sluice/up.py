"""``sluice up``: the embedded default. Starts the simulated engines a config lists, the control plane and Envoy; waits until
Envoy answers; prints where to point a client; supervises until Ctrl-C/SIGTERM; then stops every child it started (Envoy
first, so no request is cut at an engine while Envoy still accepts new ones).

Supervision: the control plane and each simulator are restarted whenever they exit (even with code 0), after the
backoff ``next_restart`` computes (pure; ``Supervisor`` is the process loop around it); a crash-looping child, Envoy
exiting, or any child exiting before the stack first answers is fatal: everything stops and ``sluice up`` exits 1,
saying why. Every exit and restart is written to stderr and marked in the child's log. The config is validated whole
before anything starts; engine hostnames are resolved once; every port must be fixed (no port 0). What ``sluice up``
adds to the config is a rule (``Additions``), applied by every control plane to the user's file as it reads it, at
start-up and on every reload; SIGHUP to ``sluice up`` passes a reload on to every running control plane. Every child
runs in a process group of its own but in ``sluice up``'s session, so the kernel schedules them as one group (decision
0011). Only one ``sluice up`` per Envoy listen port (``acquire_lock``). In full: docs/architecture.md, Processes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from controlplane.config import Config, ConfigError, parse_config, read_raw, resolve_engines_blocking
from controlplane.ports import ReloadResult
from sluice.envoyrun import envoy_command, write_bootstrap
from sluice.simulated import with_profile_defaults

log = logging.getLogger("sluice.up")

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0

RESTART_INITIAL_DELAY_S = 0.5
"""Backoff before the first restart of a child that exited."""
RESTART_MAX_DELAY_S = 10.0
"""The backoff doubles per restart up to this."""
RESTART_RESET_AFTER_S = 30.0
"""A child up at least this long before it exited restarts after the initial delay again."""
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 60.0
"""More than ``CRASH_LOOP_RESTARTS`` restarts of one child within ``CRASH_LOOP_WINDOW_S``: give up, stop everything."""
SUPERVISE_TICK_S = 0.1
"""How often the supervisor looks at its children (and at Ctrl-C/SIGTERM)."""


class AlreadyRunning(RuntimeError):
    pass


class NotReady(RuntimeError):
    pass


# -- restart policy (pure) --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Backoff ``initial_delay_s`` doubling per restart up to ``max_delay_s``, back to the start once a child stayed up
    ``reset_after_s``; more than ``max_restarts`` restarts within ``window_s`` is a crash loop. Envoy is never
    restarted: its exit has cut every stream already, and a gateway that silently reappears on its port hides the
    failure from whoever runs it (run ``sluice up`` under a service manager to restart the whole stack)."""

    initial_delay_s: float = RESTART_INITIAL_DELAY_S
    max_delay_s: float = RESTART_MAX_DELAY_S
    reset_after_s: float = RESTART_RESET_AFTER_S
    max_restarts: int = CRASH_LOOP_RESTARTS
    window_s: float = CRASH_LOOP_WINDOW_S


@dataclass(frozen=True, slots=True)
class RestartHistory:
    """One child's restarts so far: ``streak`` counts the exits since it last stayed up ``reset_after_s``; ``restarts`` are
    the times (of the exits that caused them) of its restarts inside the crash-loop window."""

    streak: int = 0
    restarts: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class RestartDecision:
    attempt: int
    """1-based position in the current streak (the delay doubles with it)."""
    delay_s: float | None
    """Seconds to wait before starting the child again; ``None``: it is crash-looping, give up."""
    history: RestartHistory
    """The history to keep for the child's next exit."""

    @property
    def give_up(self) -> bool:
        return self.delay_s is None


def next_restart(policy: RestartPolicy, history: RestartHistory, up_since: float, now: float) -> RestartDecision:
    """A child started at ``up_since`` exited at ``now``: when to start it again, or to give up.

    ``delay = min(max_delay_s, initial_delay_s x 2^(attempt - 1))`` where ``attempt`` is 1 when the child stayed up at least
    ``reset_after_s``, else one more than last time. Give up when ``max_restarts`` restarts already happened within the last
    ``window_s`` (this exit would be one more)."""
    recent = tuple(t for t in history.restarts if now - t < policy.window_s)
    attempt = 1 if now - up_since >= policy.reset_after_s else history.streak + 1
    if len(recent) >= policy.max_restarts:
        return RestartDecision(attempt, None, RestartHistory(attempt, recent))
    delay = min(policy.max_delay_s, policy.initial_delay_s * 2.0 ** min(attempt - 1, 60))
    return RestartDecision(attempt, delay, RestartHistory(attempt, (*recent, now)))


# -- processes ----------------------------------------------------------------------------------------------------------------
@dataclass
class Child:
    name: str
    command: list[str]
    log_path: Path
    restart: bool = True
    """False: its exit ends ``sluice up`` (Envoy)."""
    reloads: bool = False
    """It takes SIGHUP as "re-read your config" (a control plane); SIGHUP to ``sluice up`` is passed on to it."""
    process: subprocess.Popen[bytes] | None = None
    """None while waiting out a restart backoff."""
    started_at: float = 0.0
    history: RestartHistory = field(default_factory=RestartHistory)
    restart_at: float | None = None
    """When a pending restart is due (monotonic)."""
    restarts: int = 0

    def start(self, clock: Callable[[], float] = time.monotonic, marker: str = "") -> None:
        with self.log_path.open("ab" if marker else "wb") as out:
            if marker:
                out.write(marker.encode())
                out.flush()
            # A process group of its own, so Ctrl-C at the terminal reaches ``sluice up`` alone (it stops the children
            # in order), but not a session of its own: Linux schedules each session as one group (autogroup), and
            # the probe worker's ``SCHED_IDLE`` yields only within its group. With the control plane in a session of
            # its own, the worker's bursts (10-30 probes at once at 1000 engines) competed with Envoy's as an equal
            # and held Envoy's and the engines' wake-ups for up to a scheduler tick (4 ms at HZ=250). Module docstring.
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, process_group=0)
        self.started_at = clock()
        self.restart_at = None
        log.info("started %s (pid %d), log %s", self.name, self.process.pid, self.log_path)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


def _say(message: str) -> None:
    print(f"sluice up: {message}", file=sys.stderr, flush=True)


class Supervisor:
    """Restarts children that exit (``Child.restart``) by ``next_restart``; ``check`` is one pass, ``run`` loops it."""

    def __init__(
        self, children: list[Child], policy: RestartPolicy = RestartPolicy(),
        clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = _say,
    ) -> None:
        self.children = children
        self.policy = policy
        self.clock = clock
        self.say = say

    def check(self) -> str | None:
        """Notice exits, schedule restarts, start the ones due. Returns why supervision must end, or None."""
        for child in self.children:
            now = self.clock()
            if child.process is not None and child.process.poll() is not None:
                fatal = self._exited(child, child.process.returncode, now)
                if fatal:
                    return fatal
            if child.process is None and child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                try:
                    child.start(self.clock, marker=f"\n--- sluice up: restart {child.restarts} of {child.name} ---\n")
                except OSError as exc:
                    return f"cannot restart {child.name}: {exc}; stopping everything"
                self.say(f"{child.name} restarted (pid {child.pid}, attempt {child.history.streak})")
        return None

    def _exited(self, child: Child, returncode: int, now: float) -> str | None:
        how = describe_exit(returncode)
        up_for = now - child.started_at
        child.process = None
        if not child.restart:
            return (f"{child.name} exited with {how} after {up_for:.1f} s (log: {child.log_path}); it is the data plane, so "
                    "every stream through it is gone; stopping everything")
        decision = next_restart(self.policy, child.history, child.started_at, now)
        child.history = decision.history
        if decision.give_up:
            return (f"{child.name} exited with {how} after {up_for:.1f} s, after {self.policy.max_restarts} restarts "
                    f"within {self.policy.window_s:g} s: it is crash-looping (log: {child.log_path}); giving up, stopping "
                    "everything")
        assert decision.delay_s is not None
        child.restart_at = now + decision.delay_s
        self.say(f"{child.name} exited with {how} after {up_for:.1f} s; restart attempt {decision.attempt} in "
                 f"{decision.delay_s:g} s (log: {child.log_path})")
        return None

    def run(self, stopping: Callable[[], bool], tick: float = SUPERVISE_TICK_S,
            reloading: Callable[[], bool] = lambda: False) -> int:
        """Supervise until ``stopping()`` (0) or a fatal exit (1, said). Stopping the children is the caller's job.
        ``reloading()`` true (it resets itself): pass a reload on to the children (``pass_on_reload``)."""
        while not stopping():
            fatal = self.check()
            if fatal:
                self.say(fatal)
                return 1
            if reloading():
                self.pass_on_reload()
            time.sleep(tick)
        return 0

    def pass_on_reload(self) -> list[str]:
        """SIGHUP to every running child that ``reloads`` and already catches SIGHUP (one that does not yet has not read
        its config yet either: it will read the file as it is now); returns their names, and says so."""
        told = []
        for child in self.children:
            if child.reloads and child.process is not None and child.process.poll() is None \
                    and catches_sighup(child.process.pid):
                child.process.send_signal(signal.SIGHUP)
                told.append(child.name)
        self.say(f"reload: SIGHUP passed to {', '.join(told)}" if told else "reload: no control plane running to pass "
                 "it to (a control plane starting reads the file as it is)")
        return told


def catches_sighup(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGHUP (bit 0 of ``SigCgt`` in Linux's ``/proc/<pid>/status``). True
    when that cannot be read: the signal is sent, and a process it ends is restarted."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGHUP - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


def _lock_path(config: Config) -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"sluice-up-{config.envoy.listen_port}.lock"


def acquire_lock(config: Config) -> IO[str]:
    """An exclusive ``flock`` on a lock file per Envoy listen port, in ``$XDG_RUNTIME_DIR`` or the temp dir, released by
    the kernel however its holder dies; a second ``sluice up`` on the port fails at once naming the first."""
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
        ("control plane admin", config.controlplane.admin_host, config.controlplane.admin_port),
        ("control plane metrics", config.controlplane.host, config.controlplane.metrics_port),
        *((f"simulated engine {e.name}", e.host, e.port) for e in config.engines if e.sim),
    ]
    busy = [f"{what} port {port} on {host}" for what, host, port in wanted if not _port_free(host, port)]
    if busy:
        raise AlreadyRunning("ports already in use: " + "; ".join(busy))


def _spawn(name: str, command: list[str], log_dir: Path, *, restart: bool = True, reloads: bool = False) -> Child:
    child = Child(name, command, log_dir / f"{name}.log", restart=restart, reloads=reloads)
    child.start()
    return child


TENANTS_ONLY = "(tenants are configured: list the models with a tenant's key)"


def _engines_up(metrics_url: str) -> bool:
    """Whether the control plane reports a fresh engine (``sluice_engine_up`` 1 on its metrics port)."""
    with urllib.request.urlopen(metrics_url, timeout=2) as response:
        text = response.read().decode()
    return any(line.startswith("sluice_engine_up{") and line.rstrip().endswith(" 1.0") for line in text.splitlines())


def _fetch_models(base: str, metrics_url: str | None = None) -> list[str]:
    try:
        with urllib.request.urlopen(base + "/models", timeout=2) as response:
            listing = json.load(response)
    except urllib.error.HTTPError as exc:
        # With tenants configured the listing needs a key sluice up does not have; a 401 invalid_api_key from the Check
        # shows the path works (Envoy, ext_authz, the control plane), and its metrics show whether an engine is ready.
        if exc.code == 401 and metrics_url is not None and b"invalid_api_key" in exc.read():
            try:
                if _engines_up(metrics_url):
                    return [TENANTS_ONLY]
            except OSError as down:
                raise NotReady(str(down)) from None
            raise NotReady("no engine ready yet") from None
        raise NotReady(str(exc)) from None
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise NotReady(str(exc)) from None
    models = [m["id"] for m in listing.get("data", [])]
    if not models:
        raise NotReady("no engine ready yet")
    return models


def wait_ready(base: str, children: list[Child], timeout: float = READY_TIMEOUT_S,
               metrics_url: str | None = None) -> list[str]:
    """Until Envoy answers ``GET /v1/models`` with at least one model served by a ready engine (with tenants: until it
    answers 401 and the control plane's ``metrics_url`` shows a ready engine)."""

    def attempt() -> list[str]:
        for child in children:
            if child.process is not None and child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {describe_exit(child.process.returncode)} during start-up "
                                   f"(log: {child.log_path})")
        return _fetch_models(base, metrics_url)

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
    """SIGTERM every running child in order, then wait for each (SIGKILL after ``STOP_GRACE_S``). A child waiting out a
    restart backoff has no process: its restart is simply dropped."""
    for child in children:
        child.restart_at = None
        if child.process is not None and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %g s; killing it", child.name, STOP_GRACE_S)
            child.process.kill()
            child.process.wait()


def prepare_config(config_path: str | None) -> Config:
    """The config ``sluice up`` runs, validated (simulator profiles checked, their defaults written in) and resolved,
    every port it needs fixed. Raises ``ConfigError``."""
    raw, source = read_raw(config_path)
    config = resolve_engines_blocking(parse_config(with_profile_defaults(raw, source), source))
    fixed = [("controlplane.grpc_port", config.controlplane.grpc_port),
             ("controlplane.metrics_port", config.controlplane.metrics_port),
             ("controlplane.admin_port", config.controlplane.admin_port),
             ("envoy.listen_port", config.envoy.listen_port), ("envoy.admin_port", config.envoy.admin_port)]
    zero = [f"{path}: sluice up needs a fixed port (0, any free port, is for processes that report what they bound)"
            for path, port in fixed if port == 0]
    if zero:
        raise ConfigError(zero)
    return config


def start_stack(config: Config, config_path: str | None, additions: list[Path], work_dir: Path,
                log_format: str = "text", store_port: int | None = None) -> list[Child]:
    """Start the store (``store_port``: a valkey-server ``sluice up`` runs), sims, control plane(s), Envoy; returned in
    the order they should be stopped (Envoy first). ``config_path`` is the file every control plane reads (None: the
    bundled default), ``additions`` one ``Additions`` file per control plane (``controlplane``, or ``controlplane-<i>``
    with several); ``log_format``: the control planes'."""
    py = sys.executable
    children: list[Child] = []
    try:
        if store_port is not None:
            store = _spawn("store", [py, "-m", "sluice", "store", "--port", str(store_port)], work_dir)
            children.append(store)
            wait_for_port("127.0.0.1", store_port, store)
        for engine in config.engines:
            if engine.sim:
                # A configured max_num_seqs is the simulated engine's own cap too (it defaults to the profile's).
                cap = ["--max-num-seqs", str(engine.max_num_seqs)] if engine.max_num_seqs else []
                cap += ["--model", engine.sim_model] if engine.sim_model else []
                children.append(_spawn(f"sim-{engine.name}", [
                    py, "-m", "sluice", "sim", "--profile", engine.sim, "--host", engine.host, "--port", str(engine.port),
                    "--name", engine.name, "--speed", str(engine.sim_speed), "--flavor", engine.sim_flavor, *cap,
                ], work_dir))
        for i, added in enumerate(additions):
            cp_args = [py, "-m", "sluice", "controlplane", "--log-format", log_format, "--additions", str(added)] + (
                ["--config", config_path] if config_path else [])
            children.append(_spawn(controlplane_name(i, len(additions)), cp_args, work_dir, reloads=True))
        bootstrap = write_bootstrap(config, work_dir)
        children.append(_spawn("envoy", envoy_command(config, bootstrap), work_dir, restart=False))
    except BaseException:
        stop_children(list(reversed(children)))
        raise
    return list(reversed(children))


REPLICA_PORT_STRIDE = 10
"""``--replicas N``: replica i (from 0) listens on each of ``controlplane``'s ports + i x this."""


def free_controlplane_ports(replicas: int = 1) -> dict[str, int]:
    """A ``controlplane`` section's three ports for tests and benches, each free for every replica ``--replicas``
    starts on it (``free_port_run``)."""
    from controlplane.store.valkeyserver import free_port_run

    return {name: free_port_run(replicas, REPLICA_PORT_STRIDE) for name in ("grpc_port", "metrics_port", "admin_port")}


def replicas_in(args: tuple[str, ...] | list[str]) -> int:
    """The ``--replicas`` a ``sluice up`` command line asks for (1 without)."""
    return int(args[args.index("--replicas") + 1]) if "--replicas" in args else 1


def controlplane_name(i: int, replicas: int) -> str:
    """Control plane ``i``'s child name (its log file, its ``Additions`` file): ``controlplane`` alone, else
    ``controlplane-<i>``."""
    return "controlplane" if replicas == 1 else f"controlplane-{i}"


def replica_configs(completed: dict[str, Any], config: Config, replicas: int, store: str | None,
                    store_url: str | None) -> list[dict[str, Any]]:
    """One control-plane config per replica (``--replicas``, ``--store``, the URL of a store ``sluice up`` started): its
    own ports, every replica's address (Envoy lists them all), and the shared store. With one replica, no ``--store``
    and no ``store_url``, the config as it is."""
    cp = config.controlplane
    if replicas <= 1 and store is None and store_url is None:
        return [completed]
    addresses = [{"host": cp.host, "grpc_port": cp.grpc_port + i * REPLICA_PORT_STRIDE,
                  "metrics_port": cp.metrics_port + i * REPLICA_PORT_STRIDE} for i in range(replicas)]
    section = {**(completed.get("store") or {})}
    if store is not None:
        section["backend"] = store
    if store_url is not None:
        section["url"] = store_url
    out = []
    for i in range(replicas):
        plane = {**(completed.get("controlplane") or {}),
                 "grpc_port": addresses[i]["grpc_port"], "metrics_port": addresses[i]["metrics_port"],
                 "admin_port": cp.admin_port + i * REPLICA_PORT_STRIDE}
        if replicas > 1:
            plane["replicas"] = addresses
        out.append({**completed, "controlplane": plane, "store": section})
    return out


@dataclass(frozen=True, slots=True)
class Additions:
    """What ``sluice up`` adds to the config file for one control plane, as a rule applied to the file as it is each
    time it is read (docs/architecture.md, Config and reloads under ``sluice up``). ``apply``, in order:

    - each simulated engine's profile defaults (``sluice/simulated.py``) for the engines the file lists then;
    - ``admin.token_file``: ``token_file`` (the run's admin token) while the file names no token source of its own;
    - replica ``replica`` of ``replicas`` (with several, or a ``store``, or a ``store_url``): its ports, every replica's
      address, the store backend ``store`` (``--store``) and, while the file names no ``store.url``, ``store_url`` (the
      valkey-server ``sluice up`` started) (``replica_configs``).

    Each addition is derived from the file as read, so editing what one is derived from (a port, the store, a token
    source) is a change needing a restart, refused by a reload as it would be without ``sluice up``, never masked."""

    source: str | None
    """The file every control plane of the run reads (absolute); None: the bundled default."""
    token_file: str | None = None
    replica: int = 0
    replicas: int = 1
    store: str | None = None
    store_url: str | None = None
    supervisor_pid: int | None = None
    """With several replicas: ``sluice up``'s pid, sent SIGHUP when this replica applied an admin-API reload
    (``pass_on``)."""

    def apply(self, raw: Any, source: str) -> dict[str, Any]:
        """The config mapping this control plane runs: ``raw`` (read from ``source``) with the additions. Raises
        ``ConfigError`` with every problem of ``raw``."""
        completed = with_profile_defaults(raw, source)
        config = parse_config(completed, source)
        if self.token_file is not None and not config.admin.has_token_source:
            completed = {**completed, "admin": {**(completed.get("admin") or {}), "token_file": self.token_file}}
        store_url = self.store_url if config.store.url is None else None
        return replica_configs(completed, config, self.replicas, self.store, store_url)[self.replica]

    def read(self, path: str | None) -> Config:
        """A ``ConfigReader`` (``controlplane/adminport.py``): the file at ``path`` (None: the bundled default) with the
        additions, validated. With several replicas only the run's own file may be read."""
        if self.replicas > 1 and path is not None and (
                self.source is None or Path(path).resolve() != Path(self.source).resolve()):
            raise ConfigError([f"(file): every one of sluice up's {self.replicas} replicas runs "
                               f"{self.source or 'the bundled config'}; edit that and reload it, not {path}"])
        raw, source = read_raw(path)
        return parse_config(self.apply(raw, source), source)

    def pass_on(self, result: ReloadResult) -> None:
        """A ``ReloadListener``: after an applied admin-API reload, SIGHUP to ``sluice up`` (still this process's
        parent) so every replica applies it too."""
        if result.applied and self.supervisor_pid is not None and os.getppid() == self.supervisor_pid:
            os.kill(self.supervisor_pid, signal.SIGHUP)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str) -> Additions:
        return cls(**json.loads(Path(path).read_text()))


def run_controlplane_with_additions(config_path: str | None, additions_path: str) -> int:
    """``sluice controlplane --config F --additions A``: a control plane of ``sluice up``'s run, reading F through the
    additions at start-up and on every reload."""
    from controlplane.app import run_controlplane

    additions = Additions.load(additions_path)
    return run_controlplane(config_path, read_config=additions.read, on_reload=additions.pass_on)


def wait_for_port(host: str, port: int, child: Child, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.process is not None and child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited during start-up (log: {child.log_path})")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{child.name} did not listen on {host}:{port} within {timeout:g} s (log: {child.log_path})")


def write_run_token(work_dir: Path) -> Path:
    """A fresh admin token for this run (``operator:<secret>``), in a file only this user can read."""
    path = work_dir / "admin-token"
    path.touch(mode=0o600)
    path.write_text(f"operator:{secrets.token_urlsafe(24)}\n")
    return path


def run_up(config_path: str | None, log_format: str = "text", replicas: int = 1, store: str | None = None) -> int:
    if config_path is not None:  # the control planes and `sluice admin reload F` name it from wherever they run
        config_path = str(Path(config_path).absolute())
    try:
        config = prepare_config(config_path)
        if replicas < 1:
            raise ConfigError(["--replicas: must be at least 1"])
        if replicas > 1 and (store or config.store.backend.value) == "memory":
            raise ConfigError(["--replicas: several control planes share one ledger only in a store: add --store valkey"])
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
    reload_asked = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def on_hangup(signum: int, frame: object) -> None:
        nonlocal reload_asked
        reload_asked = True

    def reloading() -> bool:
        nonlocal reload_asked
        asked, reload_asked = reload_asked, False
        return asked

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)  # before any child: a replica may pass a reload on as soon as it serves
    work_dir = Path(tempfile.mkdtemp(prefix="sluice-up-"))
    token_file = config.admin.token_file
    run_token = None
    if not config.admin.has_token_source:
        # Changes through the admin API need a token; a config that names none gets one made for this run, readable by
        # this user only, so `sluice admin drain|reload|floor` work on `make run` without ever being open to anyone.
        token_file = run_token = str(write_run_token(work_dir))
    store_port: int | None = None
    store_url = None
    if (store or config.store.backend.value) == "valkey" and config.store.url is None:
        from controlplane.store.valkeyserver import free_port

        store_port = free_port()
        store_url = f"redis://127.0.0.1:{store_port}/0"
    additions = [Additions(config_path, token_file=run_token, replica=i, replicas=replicas, store=store,
                           store_url=store_url, supervisor_pid=os.getpid() if replicas > 1 else None)
                 for i in range(replicas)]
    additions_paths = []
    try:
        raw, source = read_raw(config_path)
        for i, added in enumerate(additions):
            additions_paths.append(added.write(work_dir / f"{controlplane_name(i, replicas)}.additions.json"))
            # a snapshot for reading (what replica i started on: its ports, the store's URL); the control planes read F
            (work_dir / f"controlplane-{i}.yaml").write_text(yaml.safe_dump(added.apply(raw, source), sort_keys=False))
        if replicas > 1:  # Envoy's bootstrap names every replica
            config = resolve_engines_blocking(parse_config(additions[0].apply(raw, source), source))
    except ConfigError as exc:  # the file changed since it was validated above
        print(f"sluice up: {exc}", file=sys.stderr)
        lock.close()
        return 2
    children = start_stack(config, config_path, additions_paths, work_dir, log_format, store_port)
    base = f"http://{config.envoy.listen_host}:{config.envoy.listen_port}/v1"
    code = 0
    try:
        cp = config.controlplane
        models = wait_ready(base, children, metrics_url=f"http://{cp.host}:{cp.metrics_port}/metrics")
        admin = f"--target {cp.admin_host}:{cp.admin_port}" + (f" --token-file {token_file}" if token_file else "")
        print(f"sluice is up.\n  base URL: {base}\n  model:    {', '.join(models)}\n"
              f"  admin:    sluice admin engines {admin}\n"
              + (f"  reload:   edit {config_path}, then sluice admin reload {admin} (or kill -HUP {os.getpid()})\n"
                 if config_path else "") +
              f"  logs:     {work_dir}\n"
              "The control plane and simulators are restarted if they exit; Envoy keeps serving meanwhile.\n"
              "Ctrl-C stops everything.", flush=True)
        code = Supervisor(children).run(lambda: stopping, reloading=reloading)
    except (NotReady, RuntimeError) as exc:
        print(f"sluice up: {exc} (logs: {work_dir})", file=sys.stderr)
        code = 1
    finally:
        stop_children(children)
        lock.close()
    print("sluice stopped.", flush=True)
    return code
