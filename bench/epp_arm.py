"""The EPP-like arm's I/O shell: an HTTP proxy that scrapes every engine's ``/metrics`` as the EPP does, asks
``bench.epp.decide`` for each request and streams the request to the chosen engine and its answer (SSE included) back
unchanged. It runs as its own process (``python -m bench.epp_arm``), as Envoy does for the other arms, so its event loop
never shares a core's time slice with the load generator's.

Each engine has its own collector, as the EPP's data layer does: it fetches ``/metrics`` every ``interval_s`` (the
EPP's 50 ms by default) and replaces that engine's snapshot; a request is scored on the snapshots of that moment. The
EPP keeps no count of its own in-flight requests: between two scrapes every request sees the same queue and KV figures.

Departures from the real EPP, and why:
- It is the data path itself (one aiohttp hop), not an Envoy ``ext_proc`` server beside it: the benches compare routing
  policies, and an ext_proc hop in front of Envoy would add its own latency. The hop costs this Python process's time
  per request and per streamed chunk, which Envoy would spend in C++; the engines answer in the same bytes.
- Collectors pause after ``IDLE_PAUSE_S`` without a request in flight, so this arm does not load the simulators while
  another arm runs (the benches run arms one after another on the same engines); the first request after a pause waits
  for one fresh scrape of every engine before it is scored.
- The 50 ms are wall time. Under a simulator running at speed x``s``, that is ``s`` x 50 ms of emulated time: the
  benches state their speed (``bench steady`` x10, ``bench prefix`` x1).
- Routing only: no ``InferenceObjective``, no flow control, no shedding (the default EPP sheds only requests of negative
  priority), no retries. An engine that fails a scrape keeps its last snapshot (the EPP's staleness threshold, 2 s,
  only matters to its saturation detector).

Response header ``x-epp-endpoint``: the engine that served the request (the benches count placements with it).
``GET /epp/stats``: requests routed per engine, scrapes done and the measured scrape period (p50 / p90 / max, wall ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from bench.common import free_port
from rig.waits import wait_healthy
from bench.epp import SCRAPE_INTERVAL_S, SOURCE, EndpointMetrics, PrefixIndex, Weights, decide, parse_metrics

ENDPOINT_HEADER = "x-epp-endpoint"
IDLE_PAUSE_S = 1.0
"""Wall seconds without a request in flight after which the collectors pause (see the module docstring)."""
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


class EppProxy:
    """The proxy's state: the engines (name -> base URL), their latest snapshots, the prefix index and counters."""

    def __init__(self, engines: Mapping[str, str], interval_s: float = SCRAPE_INTERVAL_S, seed: int = 0,
                 weights: Weights = Weights()) -> None:
        self.engines = dict(engines)
        self.interval_s = interval_s
        self.weights = weights
        self.rng = random.Random(seed)
        self.index = PrefixIndex()
        self.metrics: dict[str, EndpointMetrics] = {}
        self.routed: Counter[str] = Counter()
        self.scrape_periods: list[float] = []
        self.in_flight = 0
        self.last_activity = 0.0
        self.active = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._collectors: list[asyncio.Task[None]] = []

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "EppProxy.start() first"
        return self._session

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              connector=aiohttp.TCPConnector(limit=0))
        await self.scrape_all()
        self._collectors = [asyncio.create_task(self._collect(name)) for name in self.engines]

    async def stop(self) -> None:
        for task in self._collectors:
            task.cancel()
        await asyncio.gather(*self._collectors, return_exceptions=True)
        await self.session.close()

    async def scrape(self, name: str) -> None:
        try:
            async with self.session.get(self.engines[name] + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=2)) as response:
                text = await response.text()
            self.metrics[name] = parse_metrics(text)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.metrics.setdefault(name, EndpointMetrics(0, 0, 0.0))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(name) for name in self.engines))

    def _idle(self) -> bool:
        return self.in_flight == 0 and time.monotonic() - self.last_activity > IDLE_PAUSE_S

    async def _collect(self, name: str) -> None:
        last = None
        while True:
            if self._idle():
                self.active.clear()
                await self.active.wait()
                last = None
            began = time.monotonic()
            await self.scrape(name)
            if last is not None:
                self.scrape_periods.append(began - last)
            last = began
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - began)))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body is not a JSON object"}}, status=400)
        if self._idle():
            await self.scrape_all()  # the collectors were paused: score on fresh figures
        self.in_flight += 1
        self.last_activity = time.monotonic()
        self.active.set()
        answer: web.StreamResponse | None = None
        try:
            engine = decide(body, self.metrics, self.index, self.rng, self.weights).engine
            self.routed[engine] += 1
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS | {"host"}}
            async with self.session.post(self.engines[engine] + request.path, data=raw, headers=headers) as upstream:
                answer = web.StreamResponse(status=upstream.status)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_HEADERS:
                        answer.headers[key] = value
                answer.headers[ENDPOINT_HEADER] = engine
                await answer.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
                return answer
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if answer is not None and answer.prepared:  # the engine failed mid-stream: end the client's stream there
                return answer
            return web.json_response({"error": {"message": f"upstream: {type(exc).__name__}"}}, status=502)
        finally:
            self.in_flight -= 1
            self.last_activity = time.monotonic()

    async def stats(self, _: web.Request) -> web.Response:
        periods = sorted(self.scrape_periods)

        def at(q: float) -> float:
            return 1000 * periods[min(len(periods) - 1, int(q * len(periods)))] if periods else 0.0

        return web.json_response({"routed": dict(self.routed), "scrapes": len(periods),
                                  "period_ms": {"p50": at(0.5), "p90": at(0.9), "max": at(1.0),
                                                "mean": 1000 * statistics.fmean(periods) if periods else 0.0},
                                  "index_blocks": {e: self.index.size(e) for e in self.engines}})


def application(proxy: EppProxy) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", lambda _: _ok())
    app.router.add_get("/epp/stats", proxy.stats)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_post("/v1/completions", proxy.handle)

    async def lifecycle(_: web.Application) -> Any:
        await proxy.start()
        yield
        await proxy.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


async def _ok() -> web.Response:
    return web.Response(text="ok")


def describe(interval_s: float = SCRAPE_INTERVAL_S, weights: Weights = Weights()) -> str:
    """The arm's configuration in one line, for the reports."""
    return (f"`EPP`: the default endpoint picker of {SOURCE} reimplemented (bench/epp.py, bench/epp_arm.py): "
            f"`queue-scorer` x{weights.queue:g} + `kv-cache-utilization-scorer` x{weights.kv_cache:g} + "
            f"`prefix-cache-scorer` x{weights.prefix:g}"
            + (f" + `lora-affinity-scorer` x{weights.lora:g}" if weights.lora else "")
            + ", `max-score-picker` (random among ties), no filter, no "
            f"shedding; `/metrics` scraped every {interval_s * 1000:g} ms wall per engine; prefix index: 64-bit "
            "chained hashes of the prompt's JSON in blocks of 4 x `block_size` characters (at most 256 blocks), an "
            "LRU per engine of `num_gpu_blocks` entries; its own asyncio proxy process in the data path (no Envoy)")


@dataclass(frozen=True, slots=True)
class EppArm:
    base: str
    """The proxy's base URL (``/v1/chat/completions`` below it)."""
    description: str

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + "/epp/stats", timeout=5) as response:
            out: dict[str, Any] = json.load(response)
            return out


@contextmanager
def epp_arm(engines: Mapping[str, str], interval_s: float = SCRAPE_INTERVAL_S, seed: int = 0,
            lora_weight: float = 0.0) -> Iterator[EppArm]:
    """A running EPP-like proxy (its own process) in front of ``engines`` (name -> base URL), ready when yielded (at
    most 15 s, else RuntimeError), stopped on the way out. ``lora_weight``: the ``lora-affinity-scorer``'s weight."""
    port = free_port()
    command = [sys.executable, "-m", "bench.epp_arm", "--port", str(port), "--interval-ms", f"{interval_s * 1000:g}",
               "--seed", str(seed), "--lora-weight", f"{lora_weight:g}",
               *(f"--engine={name}={url}" for name, url in engines.items())]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 15.0, alive=lambda: process.poll() is None)
        yield EppArm(base, describe(interval_s, Weights(lora=lora_weight)))
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.epp_arm", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine", action="append", required=True, metavar="NAME=URL")
    p.add_argument("--interval-ms", type=float, default=SCRAPE_INTERVAL_S * 1000,
                   help="metrics scrape period per engine, wall ms (the EPP's default 50)")
    p.add_argument("--seed", type=int, default=0, help="the picker's tie-breaking random seed")
    p.add_argument("--lora-weight", type=float, default=0.0,
                   help="weight of the lora-affinity-scorer (0, the default profile: not used)")
    args = p.parse_args(argv)
    engines = dict(item.split("=", 1) for item in args.engine)
    if args.interval_ms <= 0:
        p.error("--interval-ms must be positive")
    weights = Weights(lora=args.lora_weight)
    web.run_app(application(EppProxy(engines, args.interval_ms / 1000, args.seed, weights)), host="127.0.0.1",
                port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
