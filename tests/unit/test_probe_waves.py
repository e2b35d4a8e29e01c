"""Probe waves (observe/poller.py, ``observe.probe_wave_seconds``): in the probe worker, probes fall due on each engine's
own schedule and start together on the next wave, so that at fleet scale they share the event loop's turns (the probe
worker's CPU at 1000 engines went from 31% of a core to 17%), without any engine being probed less often than its
interval says. Probes on the control plane's own loop run without waves."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from controlplane.config import ConfigError, parse_config
from controlplane.observe.poller import EnginePoller, next_due, wave_start
from controlplane.observe.worker import WorkerSetup, decode_report, read_frame, run_worker


def test_a_probe_starts_on_the_first_wave_at_or_after_its_due_time() -> None:
    assert wave_start(1.23, 0.1) == pytest.approx(1.3)
    assert wave_start(1.3, 0.1) == pytest.approx(1.3)
    assert wave_start(1.23, 0.0) == 1.23  # no waves: each probe on its own


def test_waiting_for_waves_does_not_stretch_the_interval() -> None:
    """An interval that is no multiple of the wave (3.33 s at 1000 engines): each probe starts up to a wave late, and
    the engine is still probed once an interval on average."""
    interval, wave = 10 / 3, 0.1
    due = first = 0.05
    for _ in range(300):
        started = wave_start(due, wave) + 0.004  # the wave's turn of the loop comes a little late
        assert 0 <= started - due <= wave + 0.005
        due = next_due(due, started, interval)
    assert due - first == pytest.approx(300 * interval)


def test_a_probe_an_interval_late_is_not_followed_by_a_catch_up_probe() -> None:
    # A backoff or a slow probe: the next one is an interval after this one started, not at once.
    assert next_due(due=10.0, started=25.0, interval=1.0) == 26.0
    assert next_due(due=10.0, started=10.4, interval=1.0) == 11.0


_ENGINE = [{"name": "e", "url": "http://127.0.0.1:9", "models": ["m"]}]


def test_configured_wave_is_at_most_a_quarter_of_the_poll_interval() -> None:
    observe = parse_config({"observe": {"poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.1},
                            "engines": _ENGINE}).observe
    assert observe.probe_wave_seconds == 0.1  # the default
    assert observe.wave_s == pytest.approx(0.05)
    assert replace(observe, poll_interval_seconds=3.0).wave_s == pytest.approx(0.1)
    assert parse_config({"observe": {"probe_wave_seconds": 0}, "engines": _ENGINE}).observe.wave_s == 0
    with pytest.raises(ConfigError, match="probe_wave_seconds"):
        parse_config({"observe": {"probe_wave_seconds": -1}, "engines": _ENGINE})


def test_pollers_of_a_fleet_probe_together_on_the_waves_and_each_as_often_as_its_interval_says() -> None:
    interval, wave, engines, run_s = 0.2, 0.05, 20, 1.2
    config = parse_config({
        "observe": {"poll_interval_seconds": interval, "poll_timeout_seconds": 0.1, "probe_wave_seconds": wave},
        "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["m"]} for i in range(engines)],
    })
    starts: dict[str, list[float]] = {e.name: [] for e in config.engines}

    async def main() -> None:
        tasks = []
        for i, engine in enumerate(config.engines):
            poller = EnginePoller(engine, config.observe, lambda view, rates: None)

            async def probe(name: str = engine.name) -> None:  # stands in for the HTTP exchange
                starts[name].append(time.monotonic())
            setattr(poller, "poll_once", probe)
            tasks.append(asyncio.create_task(poller.run(interval * i / engines, config.observe.wave_s)))
        await asyncio.sleep(run_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    every = [t for times in starts.values() for t in times]
    assert _together(every) >= 3, "probes start together on the waves"  # 20 engines, 4 waves an interval: 5 a wave
    # Twenty engines staggered over the interval share its four waves: at most ~5 distinct start times per wave's worth.
    assert len({round(t / wave) for t in every}) <= run_s / wave + 2
    for name, times in starts.items():
        assert run_s / interval - 2 <= len(times) <= run_s / interval + 1, name  # no engine probed less (or more) often


def _probe_starts(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every probe's start time, with the HTTP exchange stood in for (``EnginePoller.poll_once``)."""
    starts: list[float] = []

    async def probe(self: EnginePoller) -> None:
        starts.append(time.monotonic())
    monkeypatch.setattr(EnginePoller, "poll_once", probe)
    return starts


def _together(starts: list[float], gap_s: float = 0.003) -> float:
    """How many probes start together, on average: starts split into groups wherever two consecutive ones are more than
    ``gap_s`` apart. A wave's probes start in one turn of the loop, however late a busy machine makes that turn, so the
    measure does not depend on the machine's load (a phase against the wave's clock did)."""
    ordered = sorted(starts)
    groups = 1 + sum(1 for a, b in zip(ordered, ordered[1:]) if b - a > gap_s)
    return len(ordered) / groups


def test_the_probe_worker_runs_its_probes_in_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_worker``, as the worker process runs it, hands its pollers the configured wave."""
    starts = _probe_starts(monkeypatch)
    config = parse_config({
        "observe": {"poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.1, "probe_wave_seconds": 0.05},
        "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["m"]} for i in range(20)],
    })

    class Out:
        def write(self, data: bytes) -> None:
            pass

    async def main() -> None:
        stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        worker = asyncio.create_task(run_worker(WorkerSetup(config.engines, config.observe), Out(), stop))
        await asyncio.sleep(1.4)
        stop.set_result(None)
        await worker

    asyncio.run(main())
    periodic = starts[20:]  # after the first round (every engine once, at start-up)
    assert len(periodic) >= 20 * 3
    assert _together(periodic) >= 3  # 20 engines, 4 waves an interval: 5 a wave


def test_a_batch_carries_each_report_pickled_on_its_own() -> None:
    """The control plane unpickles a report only when it applies it, a few per turn of its loop, so that a wave's batch
    never holds the loop in one piece: what the worker writes is batches of separately pickled reports, every one of
    them there (here: each engine's failed first probe, then ``ready``)."""
    config = parse_config({
        "observe": {"poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.1},
        "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["m"]} for i in range(5)],
    })
    written: list[bytes] = []

    class Out:
        def write(self, data: bytes) -> None:
            written.append(data)

    async def main() -> list[list[bytes]]:
        stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        worker = asyncio.create_task(run_worker(WorkerSetup(config.engines, config.observe), Out(), stop))
        await asyncio.sleep(0.5)
        stop.set_result(None)
        await worker
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(written))
        reader.feed_eof()
        batches = []
        while not reader.at_eof():
            batches.append(await read_frame(reader))
        return batches

    batches = asyncio.run(main())
    assert batches and all(isinstance(raw, bytes) for batch in batches for raw in batch)
    reports = [decode_report(raw) for batch in batches for raw in batch]
    kinds = [report[0] for report in reports]
    assert "ready" in kinds
    assert {report[1].name for report in reports[:kinds.index("ready")] if report[0] == "failed"} == {
        f"e{i}" for i in range(5)}


def test_pollers_on_the_control_planes_own_loop_run_without_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """``EnginePoller.run`` as observation.py starts it in the control plane's loop (no wave): a wave's probes would
    hold the loop that answers Checks, so each engine keeps its own staggered timer."""
    starts = _probe_starts(monkeypatch)
    config = parse_config({
        "observe": {"poll_interval_seconds": 0.2, "poll_timeout_seconds": 0.1, "probe_wave_seconds": 0.05},
        "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["m"]} for i in range(40)],
    })

    async def main() -> None:
        tasks = [asyncio.create_task(EnginePoller(e, config.observe, lambda view, rates: None).run(0.2 * i / 40))
                 for i, e in enumerate(config.engines)]
        await asyncio.sleep(0.8)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert _together(starts) < 2  # staggered 5 ms apart: each on its own


def test_the_idle_workers_watchdog_fires_only_when_its_timer_comes_late() -> None:
    """``starved_for`` (observe.worker_priority: idle): a timer on time never counts as starved; one held up past the bound
    returns how late it fired."""
    from controlplane.observe.worker import starved_for

    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        watch = asyncio.ensure_future(starved_for(0.15, tick_s=0.02))
        await asyncio.sleep(0.3)  # ticks on time
        on_time = not watch.done()
        loop.call_soon(time.sleep, 0.4)  # the whole process held up, as a starved SCHED_IDLE process is
        return on_time, await asyncio.wait_for(watch, 2.0)

    on_time, late = asyncio.run(main())
    assert on_time
    assert 0.15 < late < 0.45
