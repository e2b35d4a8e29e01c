"""``sluice_event_loop_tasks`` (issue 8): the control plane's live asyncio task count, read at scrape time, on /metrics."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import generate_latest

from controlplane.app import ControlPlane
from controlplane.config import parse_config
from controlplane.metrics import SluiceMetrics


def _sample(text: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith("sluice_event_loop_tasks ")]
    assert len(lines) == 1, text
    return float(lines[0].split()[1])


def test_the_gauge_counts_the_tasks_alive_at_scrape_time() -> None:
    metrics = SluiceMetrics()

    async def scenario() -> tuple[float, float]:
        stop = asyncio.Event()
        sleepers = [asyncio.create_task(stop.wait()) for _ in range(25)]
        await asyncio.sleep(0)
        busy = _sample(generate_latest(metrics.registry).decode())
        stop.set()
        await asyncio.gather(*sleepers)
        return busy, _sample(generate_latest(metrics.registry).decode())

    busy, idle = asyncio.run(scenario())
    assert busy == idle + 25 and idle >= 1  # the scenario's own task is alive at both scrapes


def test_a_scrape_off_the_loop_before_any_on_it_leaves_the_gauge_out() -> None:
    assert "sluice_event_loop_tasks" not in generate_latest(SluiceMetrics().registry).decode()


def test_the_control_plane_exposes_it_on_metrics() -> None:
    config = parse_config({
        "controlplane": {"grpc_port": 0, "metrics_port": 0, "admin_port": 0},
        "envoy": {"listen_port": 0, "admin_port": 0},
        "engines": [{"name": "nowhere", "url": "http://127.0.0.1:9"}],  # discard: nothing answers
    })

    async def scenario() -> str:
        plane = ControlPlane(config)
        await plane.start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{plane.http.port}/metrics") as response:
                    return await response.text()
        finally:
            await plane.stop()

    assert _sample(asyncio.run(scenario())) >= 1
