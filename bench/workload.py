"""Shared pieces of the through-Envoy benchmarks: start a gateway (``sluice up`` on a generated config) or a bare simulator,
stream requests with aiohttp and time them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import free_port
from rig.waits import wait_healthy
from sluice.up import free_controlplane_ports, replicas_in


@dataclass
class Result:
    tag: str
    status: int
    started: float
    ttft_s: float | None = None
    total_s: float = 0.0
    completion_tokens: int = 0
    engine: str = ""
    parked_ms: int = 0
    headers: dict[str, str] = field(default_factory=dict)


@contextmanager
def gateway(engines: list[dict[str, Any]], *, up_args: tuple[str, ...] = (),
            **sections: Any) -> Iterator[dict[str, Any]]:
    """``sluice up`` on a config with free ports (``up_args``: more of its options, e.g. ``--store valkey``); yields the
    config (with its ports) while it runs."""
    config: dict[str, Any] = {
        "controlplane": free_controlplane_ports(replicas_in(up_args)),
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "engines": engines,
        **sections,
    }
    for engine in engines:
        engine.setdefault("url", f"http://127.0.0.1:{free_port()}")
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    up = subprocess.Popen([sys.executable, "-m", "sluice", "up", "--config", str(path), *up_args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        while "Ctrl-C stops everything." not in seen:
            assert up.stdout is not None  # stdout=PIPE
            line = up.stdout.readline()
            if not line:
                raise RuntimeError(f"sluice up failed:\n{seen}")
            seen += line
        config["base_url"] = f"http://127.0.0.1:{config['envoy']['listen_port']}"
        yield config
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(20)
        except subprocess.TimeoutExpired:
            up.kill()


@contextmanager
def bare_sim(profile: str, speed: float, name: str = "bare", flavor: str = "vllm-v1",
             extra: tuple[str, ...] = ()) -> Iterator[str]:
    """A ``sluice sim`` on a free port (``extra``: more of its options, e.g. ``--num-gpu-blocks 384``); yields its
    URL."""
    port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "sluice", "sim", "--profile", profile, "--port", str(port),
                            "--speed", str(speed), "--name", name, "--flavor", flavor, *extra],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 15.0, alive=lambda: sim.poll() is None)
        yield url
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.wait(10)


async def stream_chat(session: aiohttp.ClientSession, base: str, tag: str, model: str, content: str,
                      max_tokens: int | None, headers: dict[str, str] | None = None, t0: float = 0.0, *,
                      ignore_eos: bool = False, extra: dict[str, Any] | None = None) -> Result:
    """One streamed chat completion; TTFT is the first content chunk. ``ignore_eos`` (vLLM's sampling parameter, honoured
    by the simulator) generates exactly ``max_tokens``: for benches whose reference figures assume fixed lengths.
    ``max_tokens=None`` leaves it out of the body (the engine's own limit applies); ``extra`` adds body fields (e.g. the
    simulator's ``sim_output_tokens``)."""
    payload: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                               "stream_options": {"include_usage": True}, **(extra or {})}
    if max_tokens is not None:
        payload["max_tokens"] = max_tokens
    if ignore_eos:
        payload["ignore_eos"] = True
    started = time.perf_counter()
    result = Result(tag, 0, started - t0)
    async with session.post(base + "/v1/chat/completions", json=payload, headers=headers or {}) as response:
        result.status = response.status
        result.headers = {k.lower(): v for k, v in response.headers.items()}
        result.engine = result.headers.get("x-sluice-engine", "")
        result.parked_ms = int(result.headers.get("x-sluice-parked-ms", 0))
        if response.status != 200:
            await response.read()
            result.total_s = time.perf_counter() - started
            return result
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content") and result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
    result.total_s = time.perf_counter() - started
    return result


def unique_prompt(tokens: int) -> str:
    """``tokens`` tokens of filler text (4 characters a token, as the simulator counts) that shares no prefix with any
    other prompt: a random first block, so neither an engine's prefix cache nor sluice's prefix index finds it. For
    benches that measure prefill as work, not as a cache hit."""
    head = uuid.uuid4().hex
    return (head + "x" * max(0, tokens * 4 - len(head)))[:max(len(head), tokens * 4)]


def sim_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = _sim_json(url + "/sim/stats")
    return stats


def sim_log(url: str) -> list[dict[str, Any]]:
    """Every request the simulator has seen, in arrival order (emulated times: ``arrived_at``, ``finished_at``)."""
    log: list[dict[str, Any]] = _sim_json(url + "/sim/log", timeout=10)
    return log


def _sim_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


async def sample_stats(url: str, stop: asyncio.Event, out: list[tuple[float, dict[str, Any]]], t0: float,
                       period: float = 0.1) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(url + "/sim/stats") as response:
                out.append((time.perf_counter() - t0, await response.json()))
            await asyncio.sleep(period)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")
