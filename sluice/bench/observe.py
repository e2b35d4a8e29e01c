"""``sluice bench observe``: poll N simulated engines' ``/metrics`` the way the control plane does, and report the
poll-cycle time (all N probed once, concurrently), the CPU each engine's probe costs, and how late the event loop that also
answers Checks ran meanwhile (so a slow cycle can be told apart from a blocked loop)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp

from controlplane.config import EngineConfig, ObserveConfig
from controlplane.observe.poller import EnginePoller
from sluice.bench.common import free_port, median, pct, write_report


async def _loop_lag(stop: asyncio.Event, lags: list[float], period: float = 0.01) -> None:
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - before - period)


async def _measure(port: int, engines: int, cycles: int, spread_seconds: float = 5.0) -> dict[str, list[float]]:
    observe = ObserveConfig(poll_interval_seconds=1.0, poll_timeout_seconds=5.0, stale_after_polls=3,
                            models_refresh_seconds=3600, max_backoff_seconds=10, on_stale="open", rate_ring_size=64,
                            rate_min_samples=5, prefill_sample_min_tokens=256)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        pollers = [
            EnginePoller(
                EngineConfig(f"e{i}", f"http://127.0.0.1:{port}/e/{i}", "127.0.0.1", port, 4, (), None, 1.0, "auto",
                             "v100", "vllm-v1"),
                observe, session, on_probe=lambda view, rates: None,
            )
            for i in range(engines)
        ]
        await asyncio.gather(*(p.poll_once() for p in pollers))  # warm-up: connections, discovery
        cycle_s, cpu_per_engine_ms, lags = [], [], []
        stop = asyncio.Event()
        lag_task = asyncio.create_task(_loop_lag(stop, lags))
        for _ in range(cycles):
            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(p.poll_once() for p in pollers))
            cycle_s.append(time.perf_counter() - t0)
            cpu_per_engine_ms.append((time.process_time() - cpu0) / engines * 1000)
            await asyncio.sleep(0.2)
        stop.set()
        await lag_task
        assert all(p.probes == cycles + 1 for p in pollers), "every engine answered every cycle"
        # As the control plane runs them: each engine on its own 1 s schedule, starts staggered over the interval.
        spread_lags: list[float] = []
        stop = asyncio.Event()
        lag_task = asyncio.create_task(_loop_lag(stop, spread_lags))
        probes0, cpu0, t0 = sum(p.probes for p in pollers), time.process_time(), time.perf_counter()
        tasks = [asyncio.create_task(p.run(i / engines)) for i, p in enumerate(pollers)]
        await asyncio.sleep(spread_seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        await lag_task
        spread_probes = sum(p.probes for p in pollers) - probes0
        return {
            "cycle_s": cycle_s, "cpu_ms": cpu_per_engine_ms, "lag_ms": [x * 1000 for x in lags],
            "spread_lag_ms": [x * 1000 for x in spread_lags],
            "spread_rate": [spread_probes / (time.perf_counter() - t0)],
            "spread_cpu": [(time.process_time() - cpu0) / (time.perf_counter() - t0)],
        }


def run_observe_bench(engines: int = 1000, cycles: int = 10) -> int:
    port = free_port()
    farm = subprocess.Popen([sys.executable, "-m", "sluice.bench.farm", "--engines", str(engines), "--port", str(port)])
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                import urllib.request

                urllib.request.urlopen(f"http://127.0.0.1:{port}/e/0/metrics", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        figures = asyncio.run(_measure(port, engines, cycles))
    finally:
        farm.terminate()
        farm.wait(5)
    cycle, cpu, lag = figures["cycle_s"], figures["cpu_ms"], figures["lag_ms"]
    spread_lag = figures["spread_lag_ms"]
    budget = 1.0 / (median(cpu) / 1000) if median(cpu) else float("inf")
    body = f"""{engines} simulated engines (vLLM V1 exposition, about {len(_sample_text())} bytes each) served by one
aiohttp process on loopback; the control plane's own `EnginePoller.poll_once` (aiohttp GET + prometheus_client parse +
normalisation + rates), all engines concurrently, {cycles} cycles after a warm-up. The farm shares the 2 cores.

| figure | median | p95 | max |
|---|---|---|---|
| poll-cycle time, all {engines} engines (s) | {median(cycle):.3f} | {pct(cycle, 95):.3f} | {max(cycle):.3f} |
| CPU per engine per probe (ms) | {median(cpu):.3f} | {pct(cpu, 95):.3f} | {max(cpu):.3f} |
| event-loop lag, all engines probed at once (ms, 10 ms ticker) | {median(lag):.2f} | {pct(lag, 95):.2f} | {max(lag):.2f} |

As the control plane runs them (every engine on its own 1 s schedule, starts staggered over the interval), for 5 s:
{figures["spread_rate"][0]:.0f} probes/s, {figures["spread_cpu"][0] * 100:.0f}% of one core, event-loop lag median
{median(spread_lag):.2f} ms, p95 {pct(spread_lag, 95):.2f} ms, max {max(spread_lag):.2f} ms.

At the default 1 s poll interval one core can probe about {budget:.0f} engines (1 s / median CPU per probe).
"""
    path = write_report("observe", "sluice bench observe: polling many engines", body)
    print(body)
    print(f"report: {path}")
    return 0


def _sample_text() -> bytes:
    from sluice.bench.farm import _variants

    return _variants(1)[0]
