"""``sluice bench overhead``: what sluice adds to a request. The same engine is reached through Envoy with sluice (Lua
header strip, json_to_metadata, ext_authz Check on the control plane, access log) and through a plain Envoy route; at
50, 200 and 500 requests/s (open loop, fixed intervals) each path's end-to-end latency is measured by the client, and the
Check's own latency by the control plane's ``sluice_authz_check_seconds`` histogram (the difference of two scrapes).

The engine is the simulator at x1000 with 64 slots and one-token answers, so nearly all of a request's time is the path's.
Client, Envoys, control plane and engine share this machine's 2 cores: figures include that contention."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import aiohttp

from sluice.bench.common import median, pct, pyplot, save_figure, write_report
from sluice.bench.plain import plain_envoy
from sluice.bench.workload import gateway

RATES = (50, 200, 500)
SECONDS = 8.0
BODY = {"model": "cortex", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}


async def open_loop(url: str, rate: int, seconds: float) -> tuple[list[float], int]:
    """Send ``rate`` requests/s for ``seconds``; return latencies (ms) of the successes and the failure count."""
    latencies: list[float] = []
    failures = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        started = time.perf_counter()
        try:
            async with session.post(url, json=BODY) as response:
                await response.read()
                if response.status == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    failures += 1
        except aiohttp.ClientError:
            failures += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(20):  # warm the connection pool and both paths' caches
            await one(session)
        latencies.clear()
        tasks = []
        t0 = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    return latencies, failures


def _histogram(metrics_url: str) -> dict[float, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out = {}
    for le, count in re.findall(r'sluice_authz_check_seconds_bucket\{le="([^"]+)"\} (\S+)', text):
        out[float("inf") if le == "+Inf" else float(le)] = float(count)
    return out


def _quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Quantile (ms) of the observations between two scrapes of a cumulative histogram, interpolated in the bucket."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return float("nan")
    target = q * total
    lower, previous = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= target:
            if bound == float("inf"):
                return lower * 1000
            share = (target - previous) / (cumulative - previous) if cumulative > previous else 1.0
            return (lower + (bound - lower) * share) * 1000
        lower, previous = bound, cumulative
    return lower * 1000


def run_overhead_bench() -> int:
    engine = {"name": "fast", "sim": "spark", "speed": 1000, "max_num_seqs": 64}
    rows, checks = [], []
    series: dict[str, list[tuple[int, float, float]]] = {"plain Envoy": [], "Envoy + sluice": []}
    with gateway([engine], observe={"poll_interval_seconds": 1.0}) as config:
        engine_port = int(config["engines"][0]["url"].rsplit(":", 1)[1])
        with plain_envoy([engine_port]) as plain_base:
            plain_url = plain_base + "/v1/chat/completions"
            sluice_url = config["base_url"] + "/v1/chat/completions"
            metrics_url = f"http://127.0.0.1:{config['controlplane']['metrics_port']}/metrics"
            for rate in RATES:
                plain_ms, plain_failed = asyncio.run(open_loop(plain_url, rate, SECONDS))
                before = _histogram(metrics_url)
                sluice_ms, sluice_failed = asyncio.run(open_loop(sluice_url, rate, SECONDS))
                after = _histogram(metrics_url)
                check = (_quantile(before, after, 0.5), _quantile(before, after, 0.99))
                checks.append((rate, check))
                series["plain Envoy"].append((rate, median(plain_ms), pct(plain_ms, 99)))
                series["Envoy + sluice"].append((rate, median(sluice_ms), pct(sluice_ms, 99)))
                rows.append(
                    f"| {rate} | {median(plain_ms):.2f} / {pct(plain_ms, 99):.2f} | "
                    f"{median(sluice_ms):.2f} / {pct(sluice_ms, 99):.2f} | "
                    f"**{median(sluice_ms) - median(plain_ms):.2f}** | {check[0]:.3f} / {check[1]:.3f} | "
                    f"{plain_failed} / {sluice_failed} |"
                )
    at200 = dict(checks)[200]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        rates = [p[0] for p in points]
        ax.plot(rates, [p[1] for p in points], marker="o", label=f"{label} p50")
        ax.plot(rates, [p[2] for p in points], marker="x", linestyle="--", label=f"{label} p99")
    ax.set_xlabel("requests/s")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title("what sluice adds to a one-token request")
    ax.legend()
    plot = save_figure(fig, "overhead")
    body = f"""Open loop, {SECONDS:g} s per rate and path, non-streaming chat completions answered with one token.

| requests/s | plain Envoy p50 / p99 (ms) | Envoy + sluice p50 / p99 (ms) | added p50 (ms) | Check p50 / p99 (ms, server) | failures plain / sluice |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Targets at 200 requests/s: Check p50 <= 1 ms ({at200[0]:.3f}), p99 <= 5 ms ({at200[1]:.3f}); added end-to-end p50 <= 2 ms.
For scale, llm-d's endpoint picker reports P50 0.69 ms / P95 ~4.5 ms with a random picker at 500 QPS.

![latency by rate]({plot})
"""
    path = write_report("overhead", "sluice bench overhead: what the gateway adds", body)
    print(body)
    print(f"report: {path}")
    return 0
