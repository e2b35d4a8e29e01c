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


def test_the_probe_gauges_are_built_off_the_event_loop_from_a_snapshot_taken_on_it() -> None:
    """At 1000 engines building the six per-engine probe families took about 10 ms: the loop only takes the engines'
    states (a snapshot), and the families are built in the rendering thread from that snapshot."""
    import threading

    read_on: set[int] = set()

    class Watched:
        """An engine state that notes the thread reading it."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __getattr__(self, field: str) -> float:
            read_on.add(threading.get_ident())
            return 2.0 if field == "running" else 0.0

    states = [Watched("a"), Watched("b")]
    metrics = SluiceMetrics(engine_states=lambda: list(states))

    async def scenario() -> tuple[int, str]:
        scrape = asyncio.create_task(metrics.exposition())
        await asyncio.sleep(0)  # the scrape's loop-side step has run: its snapshot is taken
        states.append(Watched("late"))
        return threading.get_ident(), (await scrape).decode()

    loop_thread, text = asyncio.run(scenario())
    assert 'sluice_engine_requests_running{engine="b"} 2.0' in text
    assert 'engine="late"' not in text
    assert read_on and loop_thread not in read_on


def test_the_per_engine_ttft_error_histogram_renders_as_prometheus_client_would() -> None:
    """``sluice_ttft_estimate_error_ratio`` is rendered from plain counts (``metrics.EngineHistogram``: at 1000 engines
    prometheus_client's generic path was most of a scrape): its text is byte for byte what prometheus_client renders for
    the same observations, escaped engine names, bucket edges and huge values included, with no ``_created`` series."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    metrics = SluiceMetrics()
    registry = CollectorRegistry()
    reference = Histogram("sluice_ttft_estimate_error_ratio", metrics.ttft_error.documentation, ["engine"],
                          buckets=metrics.ttft_error.bounds[:-1], registry=registry)
    names = ["e1", "e2", 'odd"name\\with\nbreaks', "quiet"]
    rng = random.Random(7)
    for name in names:
        metrics.engine(name)
        reference.labels(name)
    for _ in range(3000):
        name = rng.choice(names[:-1])
        value = rng.choice([rng.uniform(0.0, 12.0), 0.1, 1.0, 10.0, 4.0, 3e7])
        metrics.engine(name).ttft_error.observe(value)
        reference.labels(name).observe(value)

    def family(text: str) -> list[str]:
        """The family's lines, without prometheus_client's ``_created`` series (which the control plane leaves out)."""
        return [line for line in text.splitlines() if "_created" not in line and line.startswith((
            "sluice_ttft_estimate_error_ratio", "# HELP sluice_ttft_estimate_error_ratio",
            "# TYPE sluice_ttft_estimate_error_ratio"))]

    ours = asyncio.run(metrics.exposition()).decode()
    assert family(ours) == family(generate_latest(registry).decode())
    assert len(family(ours)) == 2 + len(names) * (len(metrics.ttft_error.bounds) + 2)
    assert "_created" not in ours
    metrics.engine("e1").tickets_released.inc()
    assert "_created" not in asyncio.run(metrics.exposition()).decode()  # nor any instrument's
    assert metrics.registry.get_sample_value("sluice_ttft_estimate_error_ratio_count", {"engine": "quiet"}) == 0
