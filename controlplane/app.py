"""Wiring: one grpc.aio server (ADS, ext_authz, access log, admin), the engine pollers, the lease reaper, /metrics."""

from __future__ import annotations

import asyncio
import gc
import heapq
import logging
import random
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version

import aiohttp
import grpc
from aiohttp import web
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.accesslog import AccessLogServicer
from controlplane.admin import AdminServicer
from controlplane.authz import AuthorizationServicer
from controlplane.config import RELOADABLE, Config, ConfigError, EngineConfig, load_config
from controlplane.core.admission import AdmissionCore, Outcome
from controlplane.core.ledger import Ledger
from controlplane.core.model import EngineRates, EngineView, Fleet, Ticket, Verdict
from controlplane.core.weights import Weights, compute_weights, eligible_engines, should_push
from controlplane.metrics import SluiceMetrics
from controlplane.observe.poller import EnginePoller, ProbeError
from controlplane.observe.rates import RateBook
from controlplane.xds.resources import (
    AVOID_PARAM, ENGINE_HEADER, TICKET_HEADER, build_cluster, build_listener, build_load_assignment, build_routes,
    openai_error_json,
)
from controlplane.xds.server import AdsServicer
from controlplane.xds.snapshot import Snapshot, SnapshotCache, make_snapshot
from sluice.admin.v1 import admin_pb2_grpc

log = logging.getLogger("sluice.controlplane")

# Envoy pings its gRPC peers every 30 s; without these a grpc server answers GOAWAY too_many_pings and the ADS stream resets.
GRPC_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


OUTPUT_SAMPLES_PER_PROBE = 32
"""At most this many output-length samples per probe, so one busy engine cannot flush the whole ring at once."""


def _version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "0+unknown"


class ControlPlane:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.version = _version()
        self.ledger = Ledger(config.tickets.lease_seconds)
        self.metrics = SluiceMetrics(
            open_tickets=lambda: {p.config.name: self.ledger.open_tickets(p.config.name) for p in self.pollers})
        self.admission = AdmissionCore(config.policy, self.ledger, admit_stale=config.observe.on_stale == "open",
                                       draw=random.random)
        self._parked: dict[str, asyncio.Future[Outcome]] = {}
        self.cache = SnapshotCache()
        self.ads = AdsServicer(self.cache, self.metrics)
        self.pollers: list[EnginePoller] = []
        self.published_weights: Weights = {}
        self.rates = RateBook(config.observe.rate_ring_size, config.observe.rate_min_samples)
        self._was_stale: dict[str, bool] = {}
        self.started_at = clock()
        self.grpc_port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._session: aiohttp.ClientSession | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._poll_tasks: dict[str, asyncio.Task[None]] = {}
        self._published_caps: dict[str, int | None] = {}
        self._by_name: dict[str, EnginePoller] = {}
        self._indexed_pollers: list[EnginePoller] | None = None
        self._stale_at: list[tuple[float, str]] = []
        self._weights_pushed_at: float | None = None
        self._published_eligible: dict[str, frozenset[str]] | None = None
        self.weight_pushes = 0
        """Route tables pushed because fallback weights changed (benchmarks count them)."""

    # -- state the servicers read ----------------------------------------------------------------------------------------
    def fleet(self, now: float) -> Fleet:
        """The fleet as of ``now``, with its index. Views are pushed to the core when they change (a probe, a drain, a
        failure mark, a staleness flip found on ``_stale_at``), so a Check copies a few dicts instead of rebuilding every
        engine's view and ledger view (issue 9: 17 ms a Check at 200 engines)."""
        if self._indexed_pollers is not self.pollers or len(self._by_name) != len(self.pollers):
            self._sync_engines(now)
        heap = self._stale_at
        while heap and heap[0][0] < now:
            _, name = heapq.heappop(heap)
            poller = self._by_name.get(name)
            if poller is not None:
                view = poller.view(now)
                current = self.admission.index.views.get(name)
                if current is None or current.stale != view.stale or current.last_error != view.last_error:
                    self.admission.note_view(view)
                if view.stale:
                    # A stale engine's failures keep changing its last error (operators read it): looked at once a poll.
                    heapq.heappush(heap, (now + self.config.observe.poll_interval_seconds, name))
        return self.admission.indexed_fleet(now, self.rates.tables())

    def _sync_engines(self, now: float) -> None:
        """Pollers were added, removed or reordered (start, reload): the index follows, every view noted afresh."""
        self._indexed_pollers = self.pollers
        self._by_name = {p.config.name: p for p in self.pollers}
        self.admission.set_engines(self._by_name)
        for poller in self.pollers:
            self._note_view(poller, now)

    def _note_view(self, poller: EnginePoller, now: float) -> None:
        view = poller.view(now)
        self.admission.note_view(view)
        if view.last_ok_at is not None and not view.stale:
            # When this view turns stale unless a probe lands first (EnginePoller.view: strictly older than the window).
            heapq.heappush(self._stale_at, (view.last_ok_at + self.config.observe.stale_after_seconds, view.name))

    def model_label(self, model: str | None) -> str:
        """A metrics label for ``model``: only models some engine serves, so clients cannot grow label cardinality."""
        if model and (self.admission.index.serves(model) if self._indexed_pollers is self.pollers
                      else any(p.serves(model) for p in self.pollers)):
            return model
        return "-"

    # -- admission events --------------------------------------------------------------------------------------------
    async def wait_parked(self, request_id: str) -> Outcome:
        """Hold a parked Check until a wake admits it or its deadline sheds it; a cancelled Check leaves nothing."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._parked[request_id] = future
        self.metrics.parked_now.set(self.admission.depth())
        try:
            return await future
        except asyncio.CancelledError:
            self._parked.pop(request_id, None)
            if self.admission.cancel(request_id):
                self.metrics.park_cancelled.inc()
            elif future.done() and not future.cancelled() and future.result().ticket is not None:
                # Admitted in the same instant the client left: Envoy never forwards it, so no log entry will come.
                self.release_ticket(future.result().ticket.ticket_id)  # type: ignore[union-attr]
            self.metrics.parked_now.set(self.admission.depth())
            raise

    def _resolve(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            future = self._parked.pop(outcome.request_id, None)
            if future is not None and not future.done():
                future.set_result(outcome)
            elif outcome.ticket is not None:
                self.release_ticket(outcome.ticket.ticket_id)
        if outcomes:
            self.metrics.parked_now.set(self.admission.depth())

    async def reload(self, path: str | None = None) -> tuple[bool, list[str], list[str], str]:
        """Apply a config file's policy, all or nothing: (applied, problems, changed sections, source read). Every attempt
        is counted in ``sluice_config_reloads_total{result}``."""
        outcome = await self._reload(path)
        self.metrics.config_reloads.labels("applied" if outcome[0] else "refused").inc()
        return outcome

    async def _reload(self, path: str | None) -> tuple[bool, list[str], list[str], str]:
        source = path or (None if self.config.source.startswith("bundled:") else self.config.source)
        if source == "<memory>":
            return False, ["(file): this control plane was not started from a file; name one"], [], source
        try:
            fresh = load_config(source)
        except ConfigError as exc:
            return False, exc.problems, [], str(source)
        restart = self.config.restart_needed(fresh)
        if restart:
            problems = [f"{name}: changed, which needs a restart (a reload applies only {', '.join(RELOADABLE)})"
                        for name in restart]
            return False, problems, [], fresh.source
        old = self.config
        changed = [name for name in ("admission", "models", "version_floors", "boxes") if _policy_section(old, name)
                   != _policy_section(fresh, name)]
        if old.observe.on_stale != fresh.observe.on_stale:
            changed.append("observe.on_stale")
        if old.engines != fresh.engines:
            changed.append("engines")
        self.config = replace(old, policy=fresh.policy, observe=fresh.observe, engines=fresh.engines,
                              source=fresh.source)
        self._apply_engines(old.engines, fresh.engines)
        self.admission.policy = fresh.policy
        self.admission.admit_stale = fresh.observe.on_stale == "open"
        self.admission.serves.half_life_s = fresh.policy.serve_half_life_s
        log.warning("policy reloaded from %s; changed: %s", fresh.source, ", ".join(changed) or "nothing")
        if "engines" in changed:
            await self.publish()  # clusters and endpoints first-class over CDS/EDS; the listener does not move
        await self.refresh_weights()
        self.wake()
        return True, [], changed, fresh.source

    def _apply_engines(self, before: tuple[EngineConfig, ...], after: tuple[EngineConfig, ...]) -> None:
        """Start pollers for engines a reload added, stop those it removed, restart those it changed. A removed engine's
        open tickets stay in the ledger until their log entries (or leases) close them."""
        old = {e.name: e for e in before}
        new = {e.name: e for e in after}
        for name, engine in old.items():
            if new.get(name) != engine:
                self._stop_poller(name)
        for engine in after:
            if old.get(engine.name) != engine:
                self._start_poller(engine, 0.0)
        order = {e.name: i for i, e in enumerate(after)}
        self.pollers.sort(key=lambda p: order[p.config.name])

    async def set_drained(self, name: str, drained: bool) -> bool:
        poller = next((p for p in self.pollers if p.config.name == name), None)
        if poller is None:
            return False
        poller.set_drained(drained)
        self._note_view(poller, self.clock())
        log.warning("engine %s %s by an operator", name, "drained" if drained else "undrained")
        await self.refresh_weights()
        self.wake()
        return True

    def wake(self, models: list[str] | None = None) -> None:
        """Capacity may have freed: admit whatever parked requests now fit, in order."""
        if not self.admission.depth():
            return
        now = self.clock()
        if models is not None:
            models = [m for m in models if self.admission.depth(m)]  # a probe of an engine whose models have no queue
            if not models:
                return
        self._resolve(self.admission.wake(lambda: self.fleet(now), now, models))

    def release_ticket(self, ticket_id: str) -> Ticket | None:
        ticket = self.admission.release(ticket_id, self.clock())
        if ticket is not None:
            self.metrics.tickets_released.labels(ticket.engine).inc()
            self.wake([ticket.model])
        return ticket

    def record_outcome(self, model: str | None, outcome: Outcome) -> None:
        d = outcome.decision
        m = self.metrics
        m.admission_decisions.labels(self.model_label(model), d.verdict.value, d.reason.value).inc()
        if d.verdict in (Verdict.SHED, Verdict.REJECT):
            m.admission_rejected.labels(d.reason.value).inc()
        if outcome.parked_for > 0:
            m.park_seconds.observe(outcome.parked_for)

    async def _expire_parked(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if self.admission.depth():
                now = self.clock()
                self._resolve(self.admission.expire_parked(self.fleet(now), now))

    def _on_probe(self, view: EngineView, rates: EngineRates | None) -> None:
        assert view.sample is not None
        s = view.sample
        if s.running == 0 and s.waiting == 0:
            self._expired(self.ledger.reap_idle(view.name, s.taken_at, self.config.tickets.idle_reap_grace_seconds),
                          "its engine is idle")
        self.ledger.note_probe(view.name, s.taken_at)
        poller = self._by_name.get(view.name)
        if poller is not None:
            self._note_view(poller, self.clock())
        if self._published_caps.get(view.name) != view.discovered_concurrency and self._server is not None:
            # The engine's circuit breaker follows the cap it reports (llama.cpp slots, SGLang max_running_requests).
            self._published_caps[view.name] = view.discovered_concurrency
            self._tasks.append(asyncio.create_task(self.publish(), name="publish-caps"))
        m = self.metrics
        for gauge, value in (
            (m.engine_running, s.running),
            (m.engine_waiting, s.waiting),
            (m.engine_kv_usage, s.kv_usage),
            (m.engine_prefill_rate, rates.prefill_tokens_per_s if rates else None),
            (m.engine_decode_rate, rates.decode_tokens_per_s_each if rates else None),
        ):
            if value is not None:
                gauge.labels(view.name).set(value)
        m.observer_degraded.labels(view.name).set(1 if view.degraded else 0)
        if rates is not None and view.models:
            # Rates are booked under the engine's first model: engine metrics are per process, not per model.
            self.rates.record(view.models[0].model_id, view.chip_class, rates, view.name)
            if rates.finished_requests and rates.mean_output_tokens is not None:
                # What the engine really generated per finished request (end of sequence included): each finished
                # request counts once, at the interval's mean (the book averages, so the mean is what matters).
                for _ in range(min(rates.finished_requests, OUTPUT_SAMPLES_PER_PROBE)):
                    self.admission.record_output(view.models[0].model_id, round(rates.mean_output_tokens))
        self.wake([model.model_id for model in view.models])

    def check_staleness(self, now: float) -> None:
        """Count every fresh -> stale transition (``sluice_engine_state_stale_total``) and keep ``sluice_engine_up``."""
        for poller in self.pollers:
            view = poller.view(now)
            self.metrics.engine_up.labels(view.name).set(0 if view.stale else 1)
            was = self._was_stale.get(view.name)
            if view.stale and was is False:
                self.metrics.engine_stale.labels(view.name).inc()
                log.warning("engine %s is stale (last error: %s); on_stale=%s", view.name, view.last_error or "none",
                            self.config.observe.on_stale)
            elif not view.stale and was:
                log.info("engine %s is fresh again", view.name)
            self._was_stale[view.name] = view.stale

    async def _watch_staleness(self) -> None:
        while True:
            self.check_staleness(self.clock())
            await self.refresh_weights()
            await asyncio.sleep(self.config.observe.poll_interval_seconds / 2)

    async def refresh_weights(self) -> bool:
        """Recompute the fallback weights; push a new route table only on a real change (weights.should_push): an engine
        or model appearing or leaving at once, a drift of the split past the threshold at most every 10 s."""
        now = self.clock()
        fleet = self.fleet(now)
        fresh = compute_weights(fleet, self.config.policy)
        eligible = eligible_engines(fleet, self.config.policy)
        if not should_push(self.published_weights, fresh, self.config.envoy.weight_change_threshold, now,
                           self._weights_pushed_at, eligible_before=self._published_eligible, eligible_now=eligible):
            return False
        self.published_weights = fresh
        self._published_eligible = eligible
        self._weights_pushed_at = now
        self.weight_pushes += 1
        await self.publish()
        entries = sum(map(len, fresh.values()))
        log.info("fallback weights now %s", fresh if entries <= 20 else f"{entries} entries over {len(fresh)} models")
        return True

    # -- xDS -------------------------------------------------------------------------------------------------------------
    def build_snapshot(self, extra_clusters: Iterable[cluster_pb2.Cluster] = ()) -> Snapshot:
        cfg = self.config
        redirector = (cfg.controlplane.host, self.metrics_port) if cfg.envoy.retry_on_engine_failure else None
        return make_snapshot(
            listeners=[build_listener(cfg)],
            routes=[build_routes(cfg, self.published_weights)],
            clusters=[*(build_cluster(e, cfg, self._published_caps.get(e.name)) for e in cfg.engines), *extra_clusters],
            endpoints=[build_load_assignment(e, redirector) for e in cfg.engines],
        )

    async def publish(self, extra_clusters: Iterable[cluster_pb2.Cluster] = ()) -> Snapshot:
        snapshot = self.build_snapshot(extra_clusters)
        await self.cache.set_snapshot(snapshot)
        return snapshot

    # -- lifecycle -------------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        await self._start_metrics_http()  # its port is the retry redirector's endpoint in every engine cluster
        # One pooled session for every poller, unbounded: a poller holds at most one connection, so none waits on another.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        interval = cfg.observe.poll_interval_seconds
        for index, engine in enumerate(cfg.engines):
            # The regular schedule starts one interval after the first round, staggered over the interval.
            self._start_poller(engine, interval * (1 + index / len(cfg.engines)))
        await self._first_probe_round()
        await self.publish()
        server = grpc.aio.server(
            options=[
                *GRPC_OPTIONS,
                ("grpc.max_receive_message_length", cfg.envoy.max_request_bytes + 1024 * 1024),
                # grpc-core cancels calls it cannot hand to Python in time (more pending than these limits, 1000/3000 by
                # default, or unrequested for 30 s) and Envoy fails a cancelled Check open. Raised so that a backlog reaches
                # the handler, which answers it 503 controlplane_overloaded (authz.py) instead. The unrequested limit is in
                # seconds: a day, longer than any Check's deadline.
                ("grpc.server.max_pending_requests", cfg.controlplane.max_pending_rpcs),
                ("grpc.server.max_pending_requests_hard_limit", cfg.controlplane.max_pending_rpcs),
                ("grpc.server_max_unrequested_time_in_server", 24 * 3600),
            ]
        )
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.ads, server)
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(AuthorizationServicer(self), server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogServicer(self), server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self), server)
        self.grpc_port = server.add_insecure_port(f"{cfg.controlplane.host}:{cfg.controlplane.grpc_port}")
        if not self.grpc_port:
            raise OSError(f"cannot bind gRPC on {cfg.controlplane.host}:{cfg.controlplane.grpc_port}")
        await server.start()
        self._server = server
        self._tasks.append(asyncio.create_task(self._reap_leases(), name="lease-reaper"))
        self._tasks.append(asyncio.create_task(self._watch_staleness(), name="staleness"))
        self._tasks.append(asyncio.create_task(self._expire_parked(), name="park-deadlines"))
        log.info(
            "control plane on %s:%d (ADS, ext_authz, ALS, admin), metrics on :%d, %d engines",
            cfg.controlplane.host, self.grpc_port, self.metrics_port, len(cfg.engines),
        )

    async def _first_probe_round(self) -> None:
        """Probe every engine once (bounded by the probe timeout) before the first Check is answered and the first
        weights are published. A restarted control plane's ledger is empty: without this round an engine not yet probed
        serves no models (404 ``model_not_found`` for its models) and its pre-crash streams count as zero load, and Envoy
        gets a snapshot with no fallback weights. While the round runs Envoy keeps failing open on its old weights."""
        timeout = self.config.observe.poll_timeout_seconds

        async def probe(poller: EnginePoller) -> None:
            try:
                await asyncio.wait_for(poller.poll_once(), timeout)
            except (ProbeError, asyncio.TimeoutError) as exc:
                log.warning("engine %s: first probe failed: %s", poller.config.name, exc or "timed out")

        await asyncio.gather(*(probe(p) for p in self.pollers))
        now = self.clock()
        self._published_caps = {p.config.name: p.view(now).discovered_concurrency for p in self.pollers}
        self.published_weights = compute_weights(self.fleet(now), self.config.policy)
        self._published_eligible = eligible_engines(self.fleet(now), self.config.policy)

    def _start_poller(self, engine: EngineConfig, offset: float) -> None:
        assert self._session is not None
        poller = EnginePoller(engine, self.config.observe, self._session, self._on_probe, clock=self.clock)
        self.pollers.append(poller)
        self._poll_tasks[engine.name] = asyncio.create_task(poller.run(offset), name=f"poll-{engine.name}")

    def _stop_poller(self, name: str) -> None:
        self.pollers = [p for p in self.pollers if p.config.name != name]
        task = self._poll_tasks.pop(name, None)
        if task is not None:
            task.cancel()
        m = self.metrics
        for gauge in (m.engine_running, m.engine_waiting, m.engine_kv_usage, m.engine_up, m.observer_degraded,
                      m.engine_prefill_rate, m.engine_decode_rate):
            try:
                gauge.remove(name)
            except KeyError:
                pass  # never set for this engine

    async def _start_metrics_http(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.metrics.registry), headers={"content-type": CONTENT_TYPE_LATEST})

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_route("*", "/v1/{tail:.*}", self._retry_redirect)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, self.config.controlplane.host, self.config.controlplane.metrics_port)
        await site.start()
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _retry_redirect(self, request: web.Request) -> web.Response:
        """Envoy's retry of a request whose engine failed before its first byte lands here (the priority-1 endpoint of
        every engine cluster). The failed attempt's ticket is released, the engine leaves the candidates until a probe
        succeeds, and a 307 to the same URL with ``sluice_avoid=<engine>`` makes Envoy run the request again through a
        new Check (an internal redirect) that will not choose that engine.

        Only a request carrying an open ticket of that engine counts as a failure: the ticket id is never shown to
        clients, so nobody can mark an engine failing by calling this port."""
        engine = request.headers.get(ENGINE_HEADER, "")
        ticket = self.release_ticket(request.headers.get(TICKET_HEADER, ""))
        if ticket is None or ticket.engine != engine:
            # Not a retry this control plane admitted (a restart forgot the ticket, or a stray caller): the engine's
            # failure stands as the answer, with the shape Envoy gives it.
            return web.Response(status=503, content_type="application/json", headers={"retry-after": "1"},
                                text=openai_error_json("No engine could take the request (upstream unavailable)",
                                                       "server_error", "upstream_unavailable"))
        self.note_engine_failure(engine, "failed before its first byte; retried elsewhere")
        self.metrics.engine_retries.labels(engine).inc()
        separator = "&" if request.query_string else "?"
        location = f"http://{request.host}{request.path_qs}{separator}{AVOID_PARAM}={engine}"
        return web.Response(status=307, headers={"location": location})

    def note_engine_failure(self, engine: str, why: str) -> None:
        poller = next((p for p in self.pollers if p.config.name == engine), None)
        if poller is not None:
            poller.note_failure(self.clock(), why)
            self._note_view(poller, self.clock())
            self.metrics.engine_up.labels(engine).set(0)

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.tickets.reap_interval_seconds)
            self._expired(self.ledger.expire(self.clock()), "its lease ran out")

    def _expired(self, tickets: list[Ticket], why: str) -> None:
        """Tickets closed without their access-log entry (counted in sluice_tickets_expired_total)."""
        for ticket in tickets:
            log.warning("ticket %s on %s reaped (%s): its access-log entry never arrived", ticket.ticket_id,
                        ticket.engine, why)
            self.metrics.tickets_expired.labels(ticket.engine).inc()
        if tickets:
            self.wake()

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._poll_tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._poll_tasks.clear()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._session is not None:
            await self._session.close()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()


def _policy_section(config: Config, name: str) -> object:
    p = config.policy
    if name == "models":
        return p.models
    if name == "version_floors":
        return p.version_floors
    if name == "boxes":
        return p.boxes
    return replace(p, models={}, version_floors=(), boxes=())


async def serve_until_signalled(config: Config) -> None:
    plane = ControlPlane(config)
    await plane.start()
    # Everything built at start-up (config, pollers, xDS resources, index) lives for the process: move it out of the
    # collector's reach, so full passes scan only what requests create (they stalled Checks by 100-400 ms at 200
    # engines, bench/results/scale.md).
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def reload_on_hup() -> None:
        applied, problems, _, source = await plane.reload()
        if not applied:
            log.error("reload of %s refused; the running policy stays:\n  %s", source, "\n  ".join(problems))

    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(reload_on_hup()))
    await stop.wait()
    log.info("stopping control plane")
    await plane.stop()


def run_controlplane(config_path: str | None) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    asyncio.run(serve_until_signalled(config))
    return 0
