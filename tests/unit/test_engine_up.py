"""``sluice_engine_up`` is set only when it changes (at 1000 engines a label lookup per engine on every staleness tick
stalled the Check loop), and still follows the engine: down at once on a failed request, up again once a probe after
the failure lands, even when both happen between two staleness ticks."""

from __future__ import annotations

from dataclasses import replace

from controlplane.config import parse_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.policy import Policy
from controlplane.metrics import SluiceMetrics
from controlplane.observation import Observation
from controlplane.observe.poller import EnginePoller
from tests.unit.test_route import engine


def up(metrics: SluiceMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value("sluice_engine_up", {"engine": name})


def test_engine_up_follows_a_failure_and_a_recovery_between_ticks() -> None:
    config = parse_config({"engines": [{"name": "thor", "url": "http://127.0.0.1:9000"}]})
    metrics = SluiceMetrics()
    now = [10.0]
    observation = Observation(config, AdmissionCore(Policy(), Ledger(lease_seconds=600)), metrics, lambda: now[0],
                              lambda view, rates: None)
    # A holder, as with the probe worker: it never probes, views reach it through ``adopt``.
    poller = EnginePoller(config.engines[0], config.observe, observation.probed, clock=lambda: now[0])
    observation.pollers = [poller]
    fresh = engine("thor")

    def probe_lands(at: float) -> None:
        assert fresh.sample is not None
        poller.adopt(replace(fresh, last_ok_at=at, sample=replace(fresh.sample, taken_at=at)))

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
