"""A ``/metrics`` scrape does not hold the event loop (issue 9: at 1000 engines, rendering about 17,000 per-engine lines on
the loop stalled every Check for 0.2-0.3 s), and every engine's series exist from its registration on."""

from __future__ import annotations

import asyncio
from typing import Any

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

    class Watched(EngineState):
        """An engine state that notes the thread reading its probe figures."""

        def __getattribute__(self, field: str) -> Any:
            if field != "name" and not field.startswith("_"):
                read_on.add(threading.get_ident())
            return super().__getattribute__(field)

    def watched(name: str) -> Watched:
        return Watched(name, running=2.0, waiting=0.0, kv_usage=0.0, prefill_tokens_per_s=0.0,
                       decode_tokens_per_s_each=0.0, degraded=False)

    states = [watched("a"), watched("b")]
    metrics = SluiceMetrics(engine_states=lambda: list(states))

    async def scenario() -> tuple[int, str]:
        scrape = asyncio.create_task(metrics.exposition())
        await asyncio.sleep(0)  # the scrape's loop-side step has run: its snapshot is taken
        states.append(watched("late"))
        return threading.get_ident(), (await scrape).decode()

    loop_thread, text = asyncio.run(scenario())
    assert 'sluice_engine_requests_running{engine="b"} 2.0' in text
    assert 'engine="late"' not in text
    assert read_on and loop_thread not in read_on


def test_the_per_engine_families_render_as_prometheus_client_would() -> None:
    """The per-engine families are rendered from plain values (``metrics.EngineHistogram``, ``EngineFamily``: at 1000
    engines prometheus_client's generic path was most of a scrape): their text is byte for byte what prometheus_client
    renders for the same events, escaped engine names, bucket edges and huge values included, without ``_created``
    series; and so is the rest of the exposition (``exposition_text``)."""
    import random

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    metrics = SluiceMetrics(open_tickets=lambda: {"e1": 2, 'odd"name\\with\nbreaks': 1},
                            engine_states=lambda: [EngineState("e2", 3.0, 0.0, 0.25, 1e7, 41.5, True)])
    registry = CollectorRegistry()
    error = Histogram("sluice_ttft_estimate_error_ratio", metrics.ttft_error.documentation, ["engine"],
                      buckets=metrics.ttft_error.bounds[:-1], registry=registry)
    families = {family.name: family for family in metrics._engine_families}
    reference = {name: (Counter if family.counter else Gauge)(name, family.documentation, ["engine"], registry=registry)
                 for name, family in families.items()}
    gauges = {name: instrument for name, instrument in reference.items() if isinstance(instrument, Gauge)}
    names = ["e1", "e2", 'odd"name\\with\nbreaks', "quiet"]
    for name in names:
        metrics.engine(name)
        error.labels(name)
        for family_name, instrument in reference.items():
            child = instrument.labels(name)
            if family_name == "sluice_ttft_correction":
                assert isinstance(child, Gauge)
                child.set(1.0)  # as the control plane starts it (no correction)
    rng = random.Random(7)
    for _ in range(3000):
        name = rng.choice(names[:-1])
        value = rng.choice([rng.uniform(0.0, 12.0), 0.1, 1.0, 10.0, 4.0, 3e7])
        series = metrics.engine(name)
        series.ttft_error.observe(value)
        error.labels(name).observe(value)
        series.tickets_released.inc()
        reference["sluice_tickets_released"].labels(name).inc()
        series.up.set(value > 1)
        gauges["sluice_engine_up"].labels(name).set(value > 1)
        series.ttft_correction.set(value / 3)
        gauges["sluice_ttft_correction"].labels(name).set(value / 3)
    metrics.engine("e2").retries.inc(2)
    reference["sluice_engine_retries"].labels("e2").inc(2)

    def lines(text: str) -> list[str]:
        """The per-engine families' lines, without prometheus_client's ``_created`` series (left out here)."""
        return sorted(line for line in text.splitlines() if "_created" not in line and any(
            name in line for name in ("sluice_ttft_estimate_error_ratio", *families)))

    ours = asyncio.run(metrics.exposition()).decode()
    assert lines(ours) == lines(generate_latest(registry).decode())
    assert len([line for line in lines(ours) if "error_ratio_bucket" in line]) == len(names) * len(
        metrics.ttft_error.bounds)
    assert "_created" not in ours
    assert metrics.registry.get_sample_value("sluice_ttft_estimate_error_ratio_count", {"engine": "quiet"}) == 0
    assert metrics.registry.get_sample_value("sluice_engine_retries_total", {"engine": "e2"}) == 2
    # The rest, rendered by exposition_text, is generate_latest's text too.
    from controlplane.metrics.exposition import Fixed, exposition_text

    rest = [family for family in metrics.registry.collect()
            if family.name not in families and family.name != "sluice_ttft_estimate_error_ratio"]
    for family in rest:
        family.samples = [sample for sample in family.samples if not sample.name.endswith("_created")]
    assert exposition_text(rest) == generate_latest(Fixed(rest)).decode()
