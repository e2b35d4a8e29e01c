"""The xDS publisher: a pure ``build_snapshot(config, weights, caps, redirectors)`` and the little state around it.

The state is what was last pushed: the fallback weights (and which engines were eligible, and when), and the concurrency
caps engines report (their circuit breakers follow them). ``refresh_weights`` pushes a new route table only on a real
change (``weights.should_push``): an engine or model appearing or leaving at once, a drift of the split past the threshold
at most every 10 s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence


from controlplane.config import Config
from controlplane.core.fleet import Fleet
from controlplane.core.policy import Policy
from controlplane.core.weights import (
    MIN_PUSH_INTERVAL_S, Weights, compute_weights, eligible_engines, should_push, weight_steps,
)
from controlplane.giveway import give_way
from controlplane.metrics import SluiceMetrics
from controlplane.xds.resources import build_cluster, build_listener, build_load_assignment, build_routes
from controlplane.xds.server import AdsServicer
from controlplane.xds.snapshot import Snapshot, SnapshotCache, make_snapshot, with_routes

log = logging.getLogger("sluice.xds")

WEIGHTS_SLICE = 100
"""Engines whose fallback weights are computed per turn of the event loop (about half a millisecond of it)."""


def build_snapshot(config: Config, weights: Weights, caps: Mapping[str, int | None],
                   redirectors: Sequence[tuple[str, int]]) -> Snapshot:
    """Everything Envoy gets, from data alone: the listener, the routes with the fallback ``weights``, a cluster per
    engine (its circuit breaker from the configured or reported cap) and its endpoints (every replica's retry
    ``redirectors`` at priority 1 when retries are on)."""
    return make_snapshot(
        listeners=[build_listener(config)],
        routes=[build_routes(config, weights)],
        clusters=[build_cluster(e, config, caps.get(e.name)) for e in config.engines],
        endpoints=[build_load_assignment(e, redirectors) for e in config.engines],
    )


class XdsPublisher:
    def __init__(self, config: Config, metrics: SluiceMetrics) -> None:
        self.config = config
        self.cache = SnapshotCache()
        self.ads = AdsServicer(self.cache, metrics)
        self.redirectors: tuple[tuple[str, int], ...] = ()
        self.weights: Weights = {}
        self.caps: dict[str, int | None] = {}
        self._eligible: dict[str, frozenset[str]] | None = None
        self._pushed_at: float | None = None
        self._drift_checked_at: float | None = None
        self._eligible_seen: tuple[int, bool, Policy, dict[str, frozenset[str]]] | None = None
        """(index eligibility number, fail-open, policy, the eligible engines then): ``_eligible_now``'s memo."""
        self._built: tuple[Snapshot, Config, dict[str, int | None], tuple[tuple[str, int], ...]] | None = None
        """The snapshot this publisher last built and set, and the (config, caps, redirectors) it was built from: a
        weights push rebuilds only the routes while the cache still holds it and they have not changed."""
        self.weight_pushes = 0
        """Route tables pushed because fallback weights changed (benchmarks count them)."""
        self._refreshing = asyncio.Lock()

    def start(self, fleet: Fleet, caps: Mapping[str, int | None], redirectors: Sequence[tuple[str, int]],
              now: float) -> None:
        """What the first snapshot carries: the weights and caps of the first probe round."""
        self.caps = dict(caps)
        self.redirectors = tuple(redirectors)
        self.weights = compute_weights(fleet, self.config.policy)
        self._eligible = eligible_engines(fleet, self.config.policy)
        # The first push sets no push clock (the next drift past the threshold goes out when next looked at), and the
        # first refresh looks.
        del now

    def build(self) -> Snapshot:
        return build_snapshot(self.config, self.weights, self.caps, self.redirectors)

    async def publish(self) -> Snapshot:
        snapshot = self.build()
        await self.cache.set_snapshot(snapshot)
        self._built = (snapshot, self.config, dict(self.caps), self.redirectors)
        return snapshot

    async def _publish_weights(self) -> None:
        """Push new fallback weights: only the routes are rebuilt when the cache holds the snapshot this publisher last
        built, from this config, these caps and redirectors (else everything is, as ``publish``)."""
        current, built = self.cache.snapshot, self._built
        if (current is None or built is None or built[0] is not current or built[1] is not self.config
                or built[2] != self.caps or built[3] != self.redirectors):
            await self.publish()
            return
        snapshot = with_routes(current, [build_routes(self.config, self.weights)])
        await self.cache.set_snapshot(snapshot)
        self._built = (snapshot, *built[1:])

    def caps_changed(self, engine: str, cap: int | None) -> bool:
        """Record an engine's reported cap; True when it moved (its circuit breaker must be republished)."""
        if self.caps.get(engine) == cap:
            return False
        self.caps[engine] = cap
        return True

    def _eligible_now(self, fleet: Fleet) -> dict[str, frozenset[str]]:
        """``eligible_engines``, recomputed only when the fleet index says an engine's eligibility may have moved: at
        1000 engines the pass took about 2 ms of the event loop twice a second (the staleness tick), in the way of
        Checks. Small fleets (no index) compute it every time."""
        index, policy = fleet.index, self.config.policy
        seen = self._eligible_seen
        if (index is not None and seen is not None and seen[0] == index.eligibility and seen[1] == fleet.admit_stale
                and seen[2] is policy):
            return seen[3]
        eligible = eligible_engines(fleet, policy)
        if index is not None:
            self._eligible_seen = (index.eligibility, fleet.admit_stale, policy, eligible)
        return eligible

    async def _weights_in_slices(self, fleet: Fleet) -> Weights:
        """``compute_weights``, ``WEIGHTS_SLICE`` engines a turn of the event loop (``weight_steps``), so Checks that
        arrive meanwhile wait at most a slice (why: docs/decisions/0010-background-work-in-slices.md). The fleet is a
        snapshot, so the slices read one moment's fleet."""
        for step in weight_steps(fleet, self.config.policy, WEIGHTS_SLICE):
            if step is not None:
                return step
            await give_way()
        raise AssertionError("unreachable: the last step is the weights")

    async def refresh_weights(self, fleet: Fleet, now: float) -> bool:
        """Recompute the fallback weights; push a new route table only on a real change.

        The weights themselves are computed when the eligible engines changed (pushed at once), and otherwise at most
        once per ``MIN_PUSH_INTERVAL_S``: drift is looked at on that clock, so a split that drifts past the threshold goes
        out within that interval. At 1000 engines computing them took 10-20 ms of the event loop, and this runs twice
        a poll interval."""
        async with self._refreshing:  # one at a time: an older fleet's weights never land after a newer one's
            return await self._refresh_weights(fleet, now)

    async def _refresh_weights(self, fleet: Fleet, now: float) -> bool:
        eligible = self._eligible_now(fleet)
        if (eligible == self._eligible and self._drift_checked_at is not None
                and now - self._drift_checked_at < MIN_PUSH_INTERVAL_S):
            return False
        self._drift_checked_at = now
        fresh = await self._weights_in_slices(fleet)
        if not should_push(self.weights, fresh, self.config.envoy.weight_change_threshold, now, self._pushed_at,
                           eligible_before=self._eligible, eligible_now=eligible):
            return False
        self.weights = fresh
        self._eligible = eligible
        self._pushed_at = now
        self.weight_pushes += 1
        await self._publish_weights()
        entries = sum(map(len, fresh.values()))
        log.info("fallback weights now %s", fresh if entries <= 20 else f"{entries} entries over {len(fresh)} models")
        return True
