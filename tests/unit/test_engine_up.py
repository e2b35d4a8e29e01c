"""``sluice_engine_up`` is set only when it changes (at 1000 engines a label lookup per engine on every staleness tick
stalled the Check loop), and still follows the engine: down at once on a failed request, up again once a probe after
the failure lands, even when both happen between two staleness ticks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane.config import parse_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineView
from controlplane.core.policy import Policy
from controlplane.metrics import SluiceMetrics
from controlplane.observe.observation import Observation
from controlplane.observe.poller import EnginePoller
from tests.unit.coreinputs import engine


def up(metrics: SluiceMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value("sluice_engine_up", {"engine": name})


def probed_at(name: str, at: float) -> EngineView:
    """``name``'s healthy view as a probe landing at ``at`` leaves it."""
    fresh = engine(name)
    assert fresh.sample is not None
    return replace(fresh, last_ok_at=at, sample=replace(fresh.sample, taken_at=at))


def test_engine_up_follows_a_failure_and_a_recovery_between_ticks() -> None:
    config = parse_config({"engines": [{"name": "thor", "url": "http://127.0.0.1:9000"}]})
    metrics = SluiceMetrics()
    now = [10.0]
    observation = Observation(config, AdmissionCore(Policy(), Ledger(lease_seconds=600)), metrics, lambda: now[0],
                              lambda view, rates: None)
    # A holder, as with the probe worker: it never probes, views reach it through ``adopt``.
    poller = EnginePoller(config.engines[0], config.observe, observation.probed, clock=lambda: now[0])
    observation.pollers = [poller]

    def probe_lands(at: float) -> None:
        poller.adopt(probed_at("thor", at))

    probe_lands(10.0)
    observation.check_staleness(10.0)
    assert up(metrics, "thor") == 1
    # A request fails and a probe sent after it succeeds, both before the next tick: down, then up again.
    now[0] = 10.1
    observation.note_failure("thor", "connection refused")
    assert up(metrics, "thor") == 0
    probe_lands(10.2)
    observation.check_staleness(10.3)
    assert up(metrics, "thor") == 1
    # Probes stop: the tick that finds it stale puts it down.
    later = 10.3 + config.observe.stale_after_s + 1
    observation.check_staleness(later)
    assert up(metrics, "thor") == 0


def test_a_large_fleet_is_polled_within_the_probe_budget_and_goes_stale_by_it() -> None:
    """Issue 9: 1000 engines probed every second were most of two cores (bench scale). ``observe.max_probes_per_second``
    (300) stretches each engine's interval instead, and staleness follows the stretched interval."""
    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(1000)]
    config = parse_config({"engines": engines})
    now = [100.0]
    observation = Observation(config, AdmissionCore(Policy(), Ledger(lease_seconds=600)), SluiceMetrics(),
                              lambda: now[0], lambda view, rates: None)
    assert observation.observe.poll_interval_seconds == pytest.approx(1000 / 300)
    assert observation.observe.stale_after_s == pytest.approx(3 * 1000 / 300)
    # Discovery (two more requests a probe) stretches with the interval: the same share of the probe budget.
    assert observation.observe.models_refresh_seconds == pytest.approx(10 * 1000 / 300)
    poller = observation._holder(config.engines[0])
    poller.adopt(probed_at("e0", 100.0))
    assert not poller.view(100.0 + 9.0).stale       # three stretched intervals are 10 s: not stale at 9 s
    assert poller.view(100.0 + 10.5).stale
    # A small fleet keeps the configured interval; a budget of 0 lifts the bound.
    assert parse_config({"engines": engines[:200]}).observe.for_fleet(200) == parse_config(
        {"engines": engines[:200]}).observe
    unbounded = parse_config({"engines": engines, "observe": {"max_probes_per_second": 0}})
    assert unbounded.observe.for_fleet(1000).poll_interval_seconds == 1.0


def test_a_large_fleet_goes_stale_on_time_however_many_probes_landed_before() -> None:
    """The staleness heap keeps one entry per engine (a Check at 1000 engines popped 16 superseded ones): an engine
    probed many times goes stale one window after its last probe, not after its first, and the others stay fresh."""
    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(40)]
    config = parse_config({"engines": engines})
    now = [100.0]
    observation = Observation(config, AdmissionCore(Policy(), Ledger(lease_seconds=600)), SluiceMetrics(),
                              lambda: now[0], lambda view, rates: None)
    observation.pollers = [observation._holder(e) for e in config.engines]
    window = observation.observe.stale_after_s

    def probe_lands(name: str, at: float) -> None:
        poller = observation._by_name.get(name) or observation._find(name)
        assert poller is not None
        now[0] = at
        poller.adopt(probed_at(name, at))
        observation.probed(poller.view(at), None)

    def stale(at: float) -> set[str]:
        return {e.name for e in observation.fleet(at).engines if e.stale}

    observation.fleet(100.0)  # the index takes the fleet
    # Every engine probed every half second for one window, then only e0 for another window.
    ticks = int(window / 0.5)
    for step in range(2 * ticks + 1):
        at = 100.0 + step * 0.5
        for i in range(40) if step <= ticks else (0,):
            probe_lands(f"e{i}", at)
        assert stale(at) == set()  # the others' last probe is at most one window old
    assert len(observation._stale_at) <= 40  # one entry an engine, not one a probe
    others_last, e0_last = 100.0 + ticks * 0.5, 100.0 + 2 * ticks * 0.5
    everyone_else = {f"e{i}" for i in range(1, 40)}
    assert stale(others_last + window + 0.1) == everyone_else
    assert stale(e0_last + window - 0.1) == everyone_else  # e0: fresh until its last probe's window ends
    assert stale(e0_last + window + 0.1) == everyone_else | {"e0"}
    probe_lands("e7", e0_last + window + 0.2)
    assert "e7" not in stale(e0_last + window + 0.3)
    assert "e7" in stale(e0_last + 2 * window + 0.5)
