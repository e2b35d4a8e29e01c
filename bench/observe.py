"""``sluice bench observe``: poll N simulated engines' ``/metrics`` the way the control plane does, and report the CPU each
probe costs (parsing alone, and the whole probe through the real poller), the poll-cycle time (all N probed once,
concurrently), how late the event loop that also answers Checks ran meanwhile, and what ``RateBook.tables()`` costs per
Check. The last arm asks each engine for only the samples sluice reads (``observe.filter_metrics``), the others read the
whole exposition. It measures the code as it is: the readers and tables this code replaced were measured against it in
the report of 2026-12-03 (``bench/results/observe.md`` at 338793e), not kept here."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from controlplane.config import EngineConfig, EngineFlavor, ObserveConfig, OnStale, SimFlavor
from controlplane.core.engines import EngineRates, Flavor
from controlplane.observe.parse import metrics_path, read_series
from controlplane.observe.poller import EnginePoller
from controlplane.observe.rates import RateBook
from enginesim.exposition import restrict
from bench.common import free_port, median, pct, write_report
from bench.vllm_exposition import vllm_v1_exposition

NO_WAVES = "each probe on its own timer"
WAVES = "probe waves"

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "engine-metrics"
LARGEST_REAL = "vllm-0.4.3-datadog-integrations-core.prom"

# --- measurements -------------------------------------------------------------------------------------------------------
def _cpu_us(fn: Callable[[], object], seconds: float = 0.6) -> float:
    """Median CPU microseconds per call over a few batches (the machine is shared: process time, not wall)."""
    fn()
    per_batch: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(per_batch) < 3:
        n, t0 = 0, time.process_time()
        while n < 20 or time.process_time() - t0 < 0.05:
            fn()
            n += 1
        per_batch.append((time.process_time() - t0) / n * 1e6)
    return median(per_batch)


def _parse_figures() -> list[tuple[str, int, float]]:
    texts = [
        (f"largest real capture ({LARGEST_REAL})", (FIXTURES / LARGEST_REAL).read_text()),
        ("real-size vLLM 0.11 V1 (generated, 1 data-parallel rank)", vllm_v1_exposition(0).decode()),
        ("real-size vLLM 0.11 V1 (generated, 2 data-parallel ranks)", vllm_v1_exposition(0, data_parallel=2).decode()),
    ]
    out = []
    for label, text in texts:
        out.append((label, len(text.encode()), _cpu_us(partial(read_series, text))))
    return out


def _tables_figures(engines: int = 200, batch_sizes: int = 8) -> tuple[float, float]:
    book, rng = RateBook(64, 5), random.Random(1)
    for e in range(engines):
        for b in range(1, batch_sizes + 1):
            for _ in range(64):
                book.record("m", "gb10", EngineRates(1, prefill_tokens_per_s=rng.uniform(1000, 5000),
                                                     decode_tokens_per_s_each=rng.uniform(10, 60), solo=b == 1, batch=b),
                            f"e{e}")
    i = [0]

    def record_then_tables() -> None:
        i[0] += 1
        book.record("m", "gb10", EngineRates(1, decode_tokens_per_s_each=rng.uniform(10, 60), batch=3), f"e{i[0] % engines}")
        book.tables()

    return _cpu_us(book.tables), _cpu_us(record_then_tables)


async def _loop_lag(stop: asyncio.Event, lags: list[float], period: float = 0.01) -> None:
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - before - period)


FILTERED = "probe waves, filtered probes"
ARMS = ((NO_WAVES, 0.0, False), (WAVES, 0.1, False), (FILTERED, 0.1, True))
"""Probe wave (``observe.probe_wave_seconds``; it matters only to the spread figures) and whether the probe asks
for only the samples sluice reads (``observe.filter_metrics``, ``parse.metrics_path``) per arm."""


async def _measure(port: int, engines: int, cycles: int, spread_s: float) -> dict[str, dict[str, list[float]]]:
    observe = ObserveConfig(poll_interval_seconds=1.0, poll_timeout_seconds=5.0, stale_after_polls=3,
                            models_refresh_seconds=3600, max_backoff_seconds=10, on_stale=OnStale.OPEN, rate_ring_size=64,
                            rate_min_samples=5, prefill_sample_min_tokens=256)
    out: dict[str, dict[str, list[float]]] = {}
    pollers = [
        EnginePoller(
            EngineConfig(f"e{i}", f"http://127.0.0.1:{port}/e/{i}", "127.0.0.1", port, 4, (), None, 1.0, EngineFlavor.AUTO,
                         "v100", SimFlavor.VLLM_V1),
            observe, on_probe=lambda view, rates: None,
        )
        for i in range(engines)
    ]
    await asyncio.gather(*(p.poll_once() for p in pollers))  # warm-up: connections, discovery
    for arm, wave, filtered in ARMS:
        for p in pollers:
            p.observe = replace(observe, probe_wave_seconds=wave, filter_metrics=filtered)
        cycle_s: list[float] = []
        cpu_per_engine_ms: list[float] = []
        lags: list[float] = []
        stop = asyncio.Event()
        lag_task = asyncio.create_task(_loop_lag(stop, lags))
        for _ in range(cycles):
            probes0 = sum(p.probes for p in pollers)
            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(p.poll_once() for p in pollers))
            cycle_s.append(time.perf_counter() - t0)
            cpu_per_engine_ms.append((time.process_time() - cpu0) / engines * 1000)
            assert sum(p.probes for p in pollers) - probes0 == engines, "every engine answered every cycle"
            await asyncio.sleep(0.2)
        stop.set()
        await lag_task
        # As the control plane runs them: each engine on its own 1 s schedule, starts staggered over the interval.
        spread_lags: list[float] = []
        stop = asyncio.Event()
        lag_task = asyncio.create_task(_loop_lag(stop, spread_lags))
        probes0, cpu0, t0 = sum(p.probes for p in pollers), time.process_time(), time.perf_counter()
        tasks = [asyncio.create_task(p.run(i / engines, p.observe.wave_s)) for i, p in enumerate(pollers)]
        await asyncio.sleep(spread_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.perf_counter() - t0
        stop.set()
        await lag_task
        out[arm] = {
            "cycle_s": cycle_s, "cpu_ms": cpu_per_engine_ms, "lag_ms": [x * 1000 for x in lags],
            "spread_lag_ms": [x * 1000 for x in spread_lags],
            "spread_rate": [(sum(p.probes for p in pollers) - probes0) / elapsed],
            "spread_cpu": [(time.process_time() - cpu0) / elapsed],
        }
        await asyncio.sleep(0.5)
    return out


def _start_farm(engines: int, data_parallel: int) -> tuple[subprocess.Popen[bytes], int]:
    import urllib.request

    port = free_port()
    farm = subprocess.Popen([sys.executable, "-m", "bench.farm", "--engines", str(engines), "--port", str(port),
                             "--exposition", "vllm-v1", "--data-parallel", str(data_parallel)])
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/e/0/metrics", timeout=1).read()
            return farm, port
        except OSError:
            if time.monotonic() > deadline:
                farm.terminate()
                raise
            time.sleep(0.2)


def run_observe_bench(engines: int = 1000, cycles: int = 10, spread_s: float = 4.0) -> int:
    parse = _parse_figures()
    tables_new, tables_changed = _tables_figures()
    farm, port = _start_farm(engines, 1)
    try:
        figures = asyncio.run(_measure(port, engines, cycles, spread_s))
    finally:
        farm.terminate()
        farm.wait(5)
    size = len(vllm_v1_exposition(0))
    rows = "\n".join(f"| {label} | {size_b / 1000:.1f} KB | {new:.0f} |" for label, size_b, new in parse)
    probe_rows = []
    for arm, *_ in ARMS:
        f = figures[arm]
        cycle, cpu, lag, spread_lag = f["cycle_s"], f["cpu_ms"], f["lag_ms"], f["spread_lag_ms"]
        probe_rows.append(
            f"| {arm} | {median(cpu):.3f} | {max(cpu):.3f} | {median(cycle):.3f} | {max(cycle):.3f} | "
            f"{pct(lag, 95):.1f} / {max(lag):.0f} | {f['spread_rate'][0]:.0f} | {f['spread_cpu'][0] * 100:.0f}% | "
            f"{pct(spread_lag, 95):.1f} / {max(spread_lag):.0f} |")
    new_cpu, filtered_cpu = median(figures[WAVES]["cpu_ms"]), median(figures[FILTERED]["cpu_ms"])
    filtered_size = len(restrict(vllm_v1_exposition(0), parse_qs(urlsplit(metrics_path(Flavor.VLLM)).query)["name[]"]))
    body = f"""Every figure below is CPU time of the measuring process (`time.process_time`), so the farm and the other engineers'
work sharing this 2-core machine inflate wall times but not these CPU figures much; figures of one run, not an average.

**Parsing alone** (`read_series` on one exposition: it finds the kept lines with one compiled regex and reads only
those), CPU µs per probe:

| exposition | size | µs |
|---|---|---|
{rows}

**Whole probe through the real poller** (`EnginePoller.poll_once`: HTTP GET (`observe/httpget.py`) + read + normalisation + rates), {engines}
engines served by one aiohttp farm process on loopback, each answering real-size vLLM 0.11 V1 text (about {size} bytes,
every bucket; 8 pre-rendered variants), every arm in this same run against the same farm. Cycle: all {engines} probed
concurrently, {cycles} cycles after a warm-up. Spread: as the control plane runs them (every engine on its own 1 s schedule,
starts staggered over the interval) for {spread_s:.0f} s, each probe starting on the next 100 ms probe wave as the probe
worker runs them (`observe.probe_wave_seconds`), except in the "{NO_WAVES}" arm, which is how probes run on the control
plane's own loop (`probe_process: off` or a fleet below 64 engines) and how the worker ran them before 896116a
(2026-12-03).

| arm | CPU per probe, median (ms) | max | cycle time, median (s) | max | loop lag during cycles p95 / max (ms) | spread: probes/s | spread: CPU of one core | spread: loop lag p95 / max (ms) |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(probe_rows)}

The "{FILTERED}" arm asks each engine for only the samples sluice reads (`/metrics?name[]=...`, prometheus_client's own
filter, which a real vLLM applies; `observe.filter_metrics`, on by default): {filtered_size} bytes a probe instead of {size}.

At the default 1 s poll interval one core can probe about {1000 / filtered_cpu:.0f} engines with filtered probes (the default
for vLLM) and {1000 / new_cpu:.0f} with whole expositions (1 s / median CPU per probe; beyond the reader, a probe is its HTTP
exchange, the sample's normalisation and the rates).

**`RateBook.tables()`** per Check, 200 engines x 8 batch sizes (1600 decode rings of 64, plus prefill and solo rings):
{tables_new:.2f} µs per call (cached); a `record` that changes one median followed by `tables()`: {tables_changed:.1f} µs.

What this code replaced (the reader of 345f6f1, which filtered lines in Python before prometheus_client parsed them, and
tables that recomputed every median on every call) was measured beside it in the report of 2026-12-03 (338793e's
`bench/results/observe.md`); those copies of retired code are no longer kept in the bench.
"""
    path = write_report("observe", "sluice bench observe: polling many engines", body)
    print(body)
    print(f"report: {path}")
    return 0
