"""A ``/metrics`` scrape does not hold the event loop (issue 9: at 1000 engines, rendering about 17,000 per-engine lines on
the loop stalled every Check for 0.2-0.3 s), and every engine's series exist from its registration on."""

from __future__ import annotations

import asyncio

from controlplane.metrics import EngineState, SluiceMetrics

ENGINES = 2000


def _big_metrics() -> SluiceMetrics:
    states = [EngineState(f"e{i}", 3.0, 1.0, 0.5, 9000.0, 40.0, False) for i in range(ENGINES)]
    metrics = SluiceMetrics(open_tickets=lambda: {f"e{i}": i % 3 for i in range(ENGINES)}, engine_states=lambda: states)
    for i in range(ENGINES):
        series = metrics.engine(f"e{i}")
        series.ttft_error.observe(1.1)
        series.tickets_released.inc()
    return metrics


def test_the_event_loop_keeps_turning_while_a_large_exposition_renders() -> None:
    metrics = _big_metrics()

    async def scenario() -> tuple[int, str]:
        turns = 0
        scrape = asyncio.create_task(metrics.exposition())
        while not scrape.done():
            await asyncio.sleep(0)
            turns += 1
        return turns, (await scrape).decode()

    turns, text = asyncio.run(scenario())
    # Rendered on the loop, the scrape is one step and nothing else runs until it is over (0 turns meanwhile).
    assert turns > 10
    # Everything is there: the loop-side families (tickets, probe gauges, tasks) and the instruments.
    assert 'sluice_tickets_open{engine="e1999"} 1.0' in text
    assert 'sluice_engine_kv_usage_ratio{engine="e7"} 0.5' in text
    assert 'sluice_ttft_estimate_error_ratio_bucket{engine="e42",le="1.25"} 1.0' in text
    assert 'sluice_tickets_released_total{engine="e0"} 1.0' in text
    assert "sluice_event_loop_tasks " in text


def test_an_engine_has_its_series_from_registration_and_loses_them_when_removed() -> None:
    metrics = SluiceMetrics()
    metrics.engine("quiet")
    sample = metrics.registry.get_sample_value
    assert sample("sluice_tickets_expired_total", {"engine": "quiet"}) == 0
    assert sample("sluice_ttft_correction", {"engine": "quiet"}) == 1
    assert sample("sluice_ttft_estimate_error_ratio_count", {"engine": "quiet"}) == 0
    metrics.forget_engine("quiet")
    assert sample("sluice_tickets_expired_total", {"engine": "quiet"}) is None
    assert sample("sluice_ttft_correction", {"engine": "quiet"}) is None


def test_an_engine_never_probed_shows_no_probe_gauges() -> None:
    metrics = SluiceMetrics(engine_states=lambda: [EngineState("new", None, None, None, None, None, None)])
    assert metrics.registry.get_sample_value("sluice_engine_requests_running", {"engine": "new"}) is None
    assert metrics.registry.get_sample_value("sluice_observer_degraded", {"engine": "new"}) is None
