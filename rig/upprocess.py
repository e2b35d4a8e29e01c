"""``sluice up`` as a subprocess, for the tests and benchmarks that drive the whole stack the way a user starts it (the
supervision tests, ``bench chaos``, ``bench replicas``, the replica and tenant end-to-end tests).

One ``UpProcess``: the config written to a file, ``sluice up --config F [args]`` started with its combined output
collected by a thread, ready once it prints that Ctrl-C stops everything, its live children found by command line
(``children``), and a ``close`` that never leaves a child behind (SIGTERM, then SIGKILL for every child ever seen).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from rig.waits import wait_for

READY_LINE = "Ctrl-C stops everything."
"""What ``sluice up`` prints once Envoy serves (sluice/up.py)."""


class UpProcess:
    def __init__(self, raw: dict[str, Any], config_path: Path, args: tuple[str, ...] = (),
                 ready_timeout: float = 60.0, stop_timeout: float = 20.0) -> None:
        """Start ``sluice up`` on ``raw`` (written to ``config_path``) and wait until it serves; ``RuntimeError`` with
        its output if it ends first."""
        self.raw = raw
        self.stop_timeout = stop_timeout
        config_path.write_text(yaml.safe_dump(raw))
        self.lines: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "sluice", "up", "--config", str(config_path), *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.seen: set[int] = set()
        """Every child pid ``children`` ever found: ``close`` kills those still alive."""
        try:
            wait_for(lambda: READY_LINE in self.output or self.process.poll() is not None, timeout=ready_timeout,
                     what="sluice up to be ready")
            if self.process.poll() is not None:
                raise RuntimeError(f"sluice up ended early:\n{self.output}")
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def port(self) -> int:
        """Envoy's listener."""
        return int(self.raw["envoy"]["listen_port"])

    def children(self) -> dict[str, int]:
        """Live children by name: ``controlplane`` (or ``controlplane-<i>`` with ``--replicas``), ``store``,
        ``sim-<engine>``, ``envoy``."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.process.pid)], capture_output=True,
                             text=True).stdout
        found: dict[str, int] = {}
        for pid in map(int, out.split()):
            try:
                argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            except OSError:
                continue
            if not alive(pid):
                continue
            if "controlplane" in argv:
                # one replica: "controlplane"; several: "controlplane-<i>": its additions file's name (sluice/up.py)
                added = argv[argv.index("--additions") + 1] if "--additions" in argv else ""
                found[Path(added).name.partition(".")[0] or "controlplane"] = pid
            elif "valkey-server" in argv[0]:  # `sluice store` execs it (and Valkey retitles itself "... host:port")
                found["store"] = pid
            elif "sim" in argv and "--name" in argv:
                found[f"sim-{argv[argv.index('--name') + 1]}"] = pid
            elif Path(argv[0]).name == "envoy":
                found["envoy"] = pid
            # else: forked but not yet exec'd (still sluice up's command line)
        self.seen.update(found.values())
        return found

    def close(self) -> None:
        """SIGTERM (sluice up stops its children); if that fails, kill every child ever seen, then sluice up."""
        if self.process.poll() is None:
            self.children()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self.seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._reader.join(5)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
