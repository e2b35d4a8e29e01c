"""The parts of a real-engine stack the real tests share: mainline llama.cpp ``llama-server`` processes (``Engine``,
built by ``make test-real``, see rig/llama.py; ``PARALLEL`` slots sharing ``CTX`` tokens each), sluice's real control
plane and the real Envoy in front of them (``start_real_stack``), and ``post`` to either."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controlplane.config import parse_config
from rig import llama
from rig.threaded import ThreadedControlPlane
from tests.harness import Stack, admin_section, http_json, stack_raw, stop

#: Per server: 2 slots sharing 4,096 tokens of context; one thread each (two servers on this 2-core machine).
PARALLEL = 2
CTX = 4096


@dataclass
class Engine:
    name: str
    port: int
    log: Path
    threads: int = 1
    process: subprocess.Popen[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = llama.start_server(self.port, self.log, threads=self.threads, parallel=PARALLEL, ctx=CTX)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)

    def props(self) -> dict[str, Any]:
        props: dict[str, Any] = http_json(self.url + "/props")
        return props

    def slots(self) -> list[dict[str, Any]]:
        slots: list[dict[str, Any]] = http_json(self.url + "/slots")
        return slots

    def metrics(self) -> dict[str, float]:
        """The engine's own ``llamacpp:*`` samples (no labels in mainline)."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, value = line.split()[:2]
                out[name] = float(value)
        return out


def require_built() -> None:
    if not llama.is_built():
        pytest.exit(f"llama-server is not built in {llama.cache_dir()}: run `make test-real` (it builds it first, about "
                    "15 minutes on 2 cores) or `python -m rig.llama build`", returncode=2)


def start_real_stack(engines: list[Engine], work_dir: Path, **sections: Any) -> Stack:
    """Control plane (in this process) + Envoy in front of already-running llama-servers."""
    raw = stack_raw([{"name": e.name, "url": e.url, "flavor": "llamacpp"} for e in engines],
                    **{"admin": admin_section(work_dir), **sections})
    stack = Stack(parse_config(raw), work_dir, raw)
    try:
        stack.controlplane = ThreadedControlPlane(stack.config)
        stack.start_envoy()
        stack.wait_serving()
    except BaseException:
        stack.close()
        raise
    return stack


def post(base_url: str, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()
