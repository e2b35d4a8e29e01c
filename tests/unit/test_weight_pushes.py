"""When the fallback weights are computed and pushed (``XdsPublisher.refresh_weights``): an engine leaving or joining the
route goes out at once; a drifting split is looked at, and pushed, at most once per ``MIN_PUSH_INTERVAL_S``. At 1000
engines computing the weights on every staleness tick stalled the Check loop by 10-20 ms twice a second."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import any_pb2

from controlplane.config import parse_config
from controlplane.core.fleet import Fleet
from controlplane.core.weights import MIN_PUSH_INTERVAL_S
from controlplane.metrics import SluiceMetrics
from controlplane.xds.publisher import XdsPublisher
from controlplane.xds.resources import CLUSTER_TYPE, ROUTE_TYPE
from controlplane.xds.snapshot import Snapshot, TypeResources
from tests.unit.coreinputs import engine


def fleet(thor_running: int, spark_running: int = 0, drained: str = "") -> Fleet:
    views = (engine("thor", thor_running, seqs=4, drained=drained == "thor"),
             engine("spark", spark_running, seqs=4, drained=drained == "spark"))
    return Fleet(views)


def test_drift_is_looked_at_once_an_interval_and_a_leaving_engine_at_once() -> None:
    config = parse_config({"engines": [{"name": "thor", "url": "http://127.0.0.1:9000"},
                                       {"name": "spark", "url": "http://127.0.0.1:9001"}]})
    config = replace(config, envoy=replace(config.envoy, weight_change_threshold=0.1))
    publisher = XdsPublisher(config, SluiceMetrics())
    publisher.start(fleet(0), {}, (), now=0.0)
    first = dict(publisher.weights["cortex"])
    assert first["thor"] == first["spark"]

    async def run() -> None:
        # Thor fills up: the split moves far past the threshold, and the first look pushes it.
        assert await publisher.refresh_weights(fleet(3), now=1.0)
        assert publisher.weights["cortex"]["spark"] > 2 * publisher.weights["cortex"]["thor"]
        # Thor empties a second later: drift, but it was looked at a second ago, so nothing is computed or pushed...
        assert not await publisher.refresh_weights(fleet(0), now=2.0)
        assert publisher.weights["cortex"]["spark"] > 2 * publisher.weights["cortex"]["thor"]
        # ...until the interval has passed.
        interval = MIN_PUSH_INTERVAL_S
        assert await publisher.refresh_weights(fleet(0), now=1.0 + interval)
        assert publisher.weights["cortex"]["spark"] == publisher.weights["cortex"]["thor"]
        # The clock is when drift was last looked at, not when it was last pushed: a look that found nothing to push
        # (2 + 2i) holds the next one off for an interval, though the last push (1 + i) is older than that.
        assert not await publisher.refresh_weights(fleet(0), now=2.0 + 2 * interval)
        assert not await publisher.refresh_weights(fleet(3), now=3.0 + 2 * interval)
        assert await publisher.refresh_weights(fleet(3), now=2.0 + 3 * interval)
        # An engine drained leaves the route at once, whatever the interval.
        assert await publisher.refresh_weights(fleet(3, drained="spark"), now=3.0 + 3 * interval)
        assert set(publisher.weights["cortex"]) == {"thor"}
        assert publisher.weight_pushes == 4

    asyncio.run(run())


def test_a_weights_push_rebuilds_only_the_routes_and_equals_a_full_build() -> None:
    """A drift push changes only the route table, so only it is rebuilt (at 1000 engines a full build held the event
    loop about 30 ms); the snapshot is the one a full build would give, every type's version included. After someone
    else set the cache (what the NACK tests do) the next push rebuilds everything, dropping what they added."""
    config = parse_config({"engines": [{"name": "thor", "url": "http://127.0.0.1:9000"},
                                       {"name": "spark", "url": "http://127.0.0.1:9001"}]})
    publisher = XdsPublisher(config, SluiceMetrics())
    publisher.start(fleet(0), {}, (), now=0.0)

    async def run() -> None:
        first = await publisher.publish()
        assert await publisher.refresh_weights(fleet(3), now=1.0)
        pushed = publisher.cache.snapshot
        assert pushed is not None and pushed is not first
        full = publisher.build()
        assert {t: pushed.version(t) for t in pushed.types} == {t: full.version(t) for t in full.types}
        assert pushed.types[CLUSTER_TYPE] is first.types[CLUSTER_TYPE]  # reused, not rebuilt
        assert pushed.version(ROUTE_TYPE) != first.version(ROUTE_TYPE)
        extra = any_pb2.Any()
        extra.Pack(cluster_pb2.Cluster(name="extra"))
        foreign = TypeResources("foreign", {**pushed.resources(CLUSTER_TYPE), "extra": extra})
        await publisher.cache.set_snapshot(Snapshot({**pushed.types, CLUSTER_TYPE: foreign}))
        assert await publisher.refresh_weights(fleet(0), now=1.0 + MIN_PUSH_INTERVAL_S)
        after = publisher.cache.snapshot
        assert after is not None and "extra" not in after.resources(CLUSTER_TYPE)

    asyncio.run(run())



def test_on_an_indexed_fleet_eligibility_is_recomputed_only_when_an_engine_moves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At scale the staleness tick reads which engines are eligible from the index's eligibility number instead of a
    pass over every engine; a drain (or staleness, a floor) still leaves the route at once."""
    from controlplane.core import weights
    from controlplane.core.admission import AdmissionCore
    from controlplane.core.ledger import Ledger
    from controlplane.core.policy import Policy
    from controlplane.xds import publisher as publisher_module

    config = parse_config({"engines": [{"name": "thor", "url": "http://127.0.0.1:9000"},
                                       {"name": "spark", "url": "http://127.0.0.1:9001"}]})
    core = AdmissionCore(Policy(), Ledger(600))
    core.set_engines(["thor", "spark"])
    for view in fleet(0).engines:
        core.note_view(view)
    passes: list[int] = []
    real = weights.eligible_engines

    def counted(fleet: Fleet, policy: Policy) -> dict[str, frozenset[str]]:
        passes.append(1)
        return real(fleet, policy)

    monkeypatch.setattr(publisher_module, "eligible_engines", counted)
    publisher = XdsPublisher(config, SluiceMetrics())
    publisher.start(core.indexed_fleet(0.0), {}, (), now=0.0)

    async def run() -> None:
        await publisher.refresh_weights(core.indexed_fleet(1.0), now=1.0)
        before = len(passes)
        core.note_view(fleet(2).engines[0])  # thor busier: not a change of eligibility
        assert not await publisher.refresh_weights(core.indexed_fleet(2.0), now=2.0)
        assert len(passes) == before
        core.note_view(fleet(2, drained="spark").engines[1])
        assert await publisher.refresh_weights(core.indexed_fleet(3.0), now=3.0)
        assert len(passes) == before + 1 and set(publisher.weights["cortex"]) == {"thor"}

    asyncio.run(run())


def test_weights_are_computed_a_slice_at_a_time_and_the_newest_fleet_wins() -> None:
    """At fleet scale the weights are computed ``WEIGHTS_SLICE`` engines a turn of the loop (a Check arriving meanwhile
    is answered between slices), to the same numbers as ``compute_weights``; two refreshes in flight at once (the
    staleness tick, and a drain's) finish in the order they started, so the drained fleet's weights are the ones left."""
    from controlplane.core.weights import compute_weights
    from controlplane.xds.publisher import WEIGHTS_SLICE

    names = [f"e{i}" for i in range(2 * WEIGHTS_SLICE + 50)]
    config = parse_config({"engines": [{"name": n, "url": f"http://127.0.0.1:{9000 + i}"} for i, n in enumerate(names)]})
    # The tick's fleet has two slices more (engines since removed), so unserialized it would finish last.
    busy = Fleet(tuple(engine(n, i % 4, seqs=4) for i, n in enumerate(names + [f"x{i}" for i in range(2 * WEIGHTS_SLICE)])))
    drained = Fleet(tuple(engine(n, i % 4, seqs=4, drained=n == "e7") for i, n in enumerate(names)))
    publisher = XdsPublisher(config, SluiceMetrics())
    publisher.start(Fleet(tuple(engine(n) for n in names)), {}, (), now=0.0)

    async def run() -> int:
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        counter = asyncio.ensure_future(count_turns())
        tick = asyncio.ensure_future(publisher.refresh_weights(busy, now=20.0))
        drain = asyncio.ensure_future(publisher.refresh_weights(drained, now=20.1))
        await asyncio.gather(tick, drain)
        counter.cancel()
        return turns

    turns = asyncio.run(run())
    assert turns >= 3  # the loop ran other work between slices
    assert publisher.weights == compute_weights(drained, config.policy)
    assert "e7" not in publisher.weights["cortex"]
