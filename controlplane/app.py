"""Wiring only: the control plane's parts, the Envoy-facing gRPC server (ADS, ext_authz, access log), the admin API's own
gRPC listener, the HTTP endpoint, and the process entry point (signals: SIGTERM stops, SIGHUP reloads).

How a config file is read is the caller's (``ConfigReader``): ``load_config`` for ``sluice controlplane --config F``;
under ``sluice up``, F with what ``sluice up`` adds to it (``sluice/up.py``, ``Additions``). Start-up and every reload
read through the same reader, so a reload never loses what was added at start."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import uuid
import random
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any
from importlib.metadata import PackageNotFoundError, version

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from controlplane.adminport import AdminAdapter, ConfigReader, ReloadListener
from controlplane.servicers.accesslog import AccessLogServicer
from controlplane.servicers.admin import AdminServicer
from controlplane.servicers.adminauth import AdminGuard, load_tokens
from controlplane.admission.service import AdmissionService
from controlplane.servicers.authz import AuthorizationServicer
from controlplane.servicers.preemption import PreemptionServicer
from controlplane.config import (
    Config, ConfigError, OnStale, ServerTls, StoreBackend, is_loopback, load_config, resolve_engines,
)
from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineRates, EngineView
from controlplane.giveway import give_way
from controlplane.servicers.httpendpoint import HttpEndpoint
from controlplane.metrics import SluiceMetrics
from controlplane.observe.observation import Observation
from controlplane.store.base import Store
from controlplane.store.memory import MemoryStore
from controlplane.store.valkey import ValkeyStore
from controlplane.tls import server_credentials
from controlplane.tracing import CheckTracing, TracedAuthorizationServicer
from controlplane.admission.quota import Quota, make_limiter
from controlplane.xds.publisher import XdsPublisher
from sluice.admin.v1 import admin_pb2_grpc

log = logging.getLogger("sluice.controlplane")

STALENESS_SLICE = 200
"""Engines looked at by the staleness tick between two yields to the event loop (``ControlPlane._watch_staleness``)."""

# Envoy pings its gRPC peers every 30 s; without these a grpc server answers GOAWAY too_many_pings and the ADS stream resets.
GRPC_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


def _version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "0+unknown"


class ControlPlane:
    """Wires the parts: ``Observation`` (pollers, staleness, rates), ``AdmissionService`` (parked Checks, wakes, leases)
    around the pure ``AdmissionCore``, ``XdsPublisher`` (snapshots and fallback weights), the HTTP endpoint (metrics and
    the retry redirector) and one gRPC server whose servicers each get only their port; the admin servicer's port is
    ``AdminAdapter`` (adminport.py), which applies reloads too."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic,
                 read_config: ConfigReader = load_config, on_reload: ReloadListener | None = None) -> None:
        self.config = config
        self.clock = clock
        self.version = _version()
        self.ledger = Ledger(config.tickets.lease_seconds)
        self.metrics = SluiceMetrics(
            open_tickets=lambda: {p.config.name: self.ledger.open_tickets(p.config.name) for p in self.observation.pollers},
            prefix_index=lambda: (self.admission.prefixes.held, self.admission.prefixes.limit_blocks),
            engine_states=lambda: self.observation.engine_states(),
            tenant_shares=lambda: [(self.observation.model_label(t.model), t.tenant, t.counter, t.served_tokens,
                                    t.waiting) for t in self.admission.tenant_shares()])
        self.admission = AdmissionCore(config.policy, self.ledger, admit_stale=config.observe.on_stale is OnStale.OPEN,
                                       draw=random.random)
        self.observation = Observation(config, self.admission, self.metrics, clock, self._on_probe)
        self.store = make_store(config)
        self.service = AdmissionService(config, self.admission, self.observation, self.metrics, clock, self.store)
        self.xds = XdsPublisher(config, self.metrics)
        self.quota = Quota(config, make_limiter(config), self.metrics)
        """Tenants' budgets (``tenants:``, ``ratelimit:``); a Check charges only a tenant's request."""
        self.http = HttpEndpoint(config.controlplane.host, config.controlplane.metrics_port, self.metrics,
                                 self.service, self.quota)
        self.tracing = CheckTracing(config.tracing, self.version) if config.tracing.enabled else None
        """OpenTelemetry traces of the Checks (``tracing.enabled``); None: off, and no Check pays for it."""
        if self.tracing is not None:
            self.service.trace_outcome = self.tracing.record
        self.admin = AdminAdapter(config, version=self.version, ledger=self.ledger, admission=self.admission,
                                  observation=self.observation, service=self.service, xds=self.xds, quota=self.quota,
                                  metrics=self.metrics, apply_config=self._set_config, note_cache=self._note_cache,
                                  clock=clock, read_config=read_config, on_reload=on_reload)
        """The admin API's port (``AdminPort``): what operators read, and the changes they make (reloads included)."""
        self.grpc_port = 0
        self.admin_port = 0
        self._server: grpc.aio.Server | None = None
        self._admin_server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    async def refresh_weights(self) -> bool:
        """Recompute the fallback weights from the fleet now and push them if they moved enough (``XdsPublisher``)."""
        now = self.clock()
        return await self.xds.refresh_weights(self.observation.fleet(now), now)

    # -- events between the parts ------------------------------------------------------------------------------------
    def _set_config(self, config: Config) -> None:
        """Every part that reads the config gets the new one at once (start-up's resolved one, a floor, a reload)."""
        self.config = self.service.config = self.xds.config = self.observation.config = self.quota.config = \
            self.admin.config = config

    def _on_probe(self, view: EngineView, rates: EngineRates | None) -> None:
        self._note_cache(view)
        self.service.on_probe(view)
        if self._server is not None and self.xds.caps_changed(view.name, view.discovered_concurrency):
            # The engine's circuit breaker follows the cap it reports (llama.cpp slots, SGLang max_running_requests).
            self._tasks.append(asyncio.create_task(self.xds.publish(), name="publish-caps"))

    def _note_cache(self, view: EngineView) -> None:
        """The prefix index follows the engine: its capacity, and nothing cached after a restart or a drain."""
        why = self.admission.note_cache_view(view)
        if why is not None:
            self.metrics.prefix_forgotten.labels(why).inc()
            log.info("prefix index: forgot what %s held (%s)", view.name, why)

    async def _watch_staleness(self) -> None:
        while True:
            # In slices, giving way between them (giveway.py): at 1000 engines the whole pass held the event loop for a
            # millisecond or two, twice a poll interval, and the Checks that arrived meanwhile waited it out.
            pollers = self.observation.pollers
            for start in range(0, len(pollers), STALENESS_SLICE):
                self.observation.check_staleness(self.clock(), pollers[start:start + STALENESS_SLICE])
                await give_way()
            self.service.decay_corrections()
            await self.refresh_weights()
            await asyncio.sleep(self.observation.observe.poll_interval_seconds / 2)

    # -- lifecycle -------------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resolve engine hostnames (asynchronously: ``ConfigError`` with the dotted path if one does not resolve), serve
        HTTP, probe every engine once, publish the first snapshot, then answer gRPC."""
        self._set_config(await resolve_engines(self.config))
        cfg = self.config
        guard = AdminGuard(load_tokens(cfg.admin), cfg.admin.require_token_for_reads, self.metrics)  # ConfigError
        # TLS files are read before anything starts (ConfigError with the dotted path if one cannot be read).
        grpc_tls = _credentials(cfg.controlplane.tls, "controlplane.tls")
        admin_tls = _credentials(cfg.admin.tls, "admin.tls")
        await self.http.start()  # its port is the retry redirector's endpoint in every engine cluster
        await self.observation.start()  # one probe round before any Check is answered or any weight published
        await self.service.open_store()  # the shared ledger learned (a restart picks it up) before any Check
        self.metrics.replica_info.labels(self.store.replica_id, cfg.store.backend.value).set(1)
        now = self.clock()
        redirectors = [(r.host, r.metrics_port) for r in cfg.controlplane.addresses(self.http.port)] \
            if cfg.envoy.retry_on_engine_failure else []
        self.xds.start(self.observation.fleet(now), self.observation.reported_caps(now), redirectors, now)
        await self.xds.publish()
        server = grpc.aio.server(options=grpc_options(cfg))
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.xds.ads, server)
        authz = (AuthorizationServicer(self.service, self.quota) if self.tracing is None
                 else TracedAuthorizationServicer(self.service, self.tracing, self.quota))
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(authz, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogServicer(self.service, self.quota), server)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(PreemptionServicer(self.service), server)
        self.grpc_port = _bind(server, f"{cfg.controlplane.host}:{cfg.controlplane.grpc_port}", grpc_tls)
        if not self.grpc_port:
            raise OSError(f"cannot bind gRPC on {cfg.controlplane.host}:{cfg.controlplane.grpc_port}")
        if not is_loopback(cfg.controlplane.host) and not (cfg.controlplane.tls and cfg.controlplane.tls.mutual):
            log.warning("the Envoy-facing gRPC port (ADS, ext_authz, access log) listens on %s, not loopback, without "
                        "mTLS: restrict who reaches it (deploy/ NetworkPolicy lets only Envoy in)", cfg.controlplane.host)
        # The admin API on a listener of its own (loopback by default), every call through the token guard.
        admin_server = grpc.aio.server(options=GRPC_OPTIONS)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.admin, guard), admin_server)
        self.admin_port = _bind(admin_server, f"{cfg.controlplane.admin_host}:{cfg.controlplane.admin_port}", admin_tls)
        if not self.admin_port:
            raise OSError(f"cannot bind the admin API on {cfg.controlplane.admin_host}:{cfg.controlplane.admin_port}")
        await server.start()
        self._server = server
        await admin_server.start()
        self._admin_server = admin_server
        self.service.start()
        self._tasks.append(asyncio.create_task(self._watch_staleness(), name="staleness"))
        log.info(
            "control plane on %s:%d (ADS, ext_authz, ALS; %s), admin on %s:%d (%s), metrics on :%d, %d engines",
            cfg.controlplane.host, self.grpc_port, _tls_mode(cfg.controlplane.tls), cfg.controlplane.admin_host,
            self.admin_port, _tls_mode(cfg.admin.tls), self.http.port, len(cfg.engines),
        )

    async def stop(self) -> None:
        """Shut down step by step, each step bounded by ``controlplane.stop_step_seconds`` and independent of the others:
        a store that stopped answering mid-run once held a test's teardown past 30 s, and a process told to stop must
        stop (a step that overruns or fails is logged and the next one runs)."""
        for task in self._tasks:
            task.cancel()
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("background tasks", lambda: asyncio.gather(*self._tasks, return_exceptions=True)),
            ("admission service and store", self.service.stop),
            ("observation", self.observation.stop),
        ]
        if self._admin_server is not None:
            steps.append(("admin server", partial(self._admin_server.stop, grace=0.2)))
        if self._server is not None:
            steps.append(("gRPC server", partial(self._server.stop, grace=0.5)))
        steps += [("HTTP endpoint", self.http.stop), ("tenant limiter", self.quota.close)]
        if self.tracing is not None:  # after the gRPC server: the last Checks' spans are ended and go out with the flush
            steps.append(("tracing", self.tracing.shutdown))
        for what, step in steps:
            await _bounded(what, step(), self.config.controlplane.stop_step_seconds)
        self._tasks.clear()


async def _bounded(what: str, step: Awaitable[object], seconds: float) -> None:
    """Run one shutdown step for at most ``seconds``: past that it is cancelled and left behind, not awaited (a step that
    swallows its cancellation must not hold the stop either)."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        log.warning("stop: %s took over %g s (controlplane.stop_step_seconds); left behind", what, seconds)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("stop: %s failed: %r", what, task.exception())


def make_store(config: Config) -> Store:
    """The store ``store.backend`` names: memory (one process) or Valkey/Redis at ``store.url``."""
    st = config.store
    replica = st.replica_id or f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    if st.backend is StoreBackend.MEMORY:
        return MemoryStore(replica_id=replica)
    if st.url is None:
        raise ConfigError(["store.url: the valkey backend needs a server URL (sluice up --store valkey starts one)"])
    return ValkeyStore(st.url, replica, st.prefix, st.timeout_seconds, st.session_ttl_seconds, st.max_connections)


def _credentials(tls: ServerTls | None, section: str) -> grpc.ServerCredentials | None:
    return None if tls is None else server_credentials(tls, section)


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``address``: plaintext without credentials, TLS (mutual when they ask for a client certificate) with them."""
    return server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)


def _tls_mode(tls: ServerTls | None) -> str:
    return "plaintext" if tls is None else ("mutual TLS" if tls.mutual else "TLS")


def grpc_options(config: Config) -> list[tuple[str, int]]:
    return [
        *GRPC_OPTIONS,
        ("grpc.max_receive_message_length", config.envoy.max_request_bytes + 1024 * 1024),
        # grpc-core cancels calls it cannot hand to Python in time (more pending than these limits, 1000/3000 by
        # default, or unrequested for 30 s) and Envoy fails a cancelled Check open. Raised so that a backlog reaches the
        # handler, which answers it 503 controlplane_overloaded (authz.py) instead. The unrequested limit is in seconds:
        # a day, longer than any Check's deadline.
        ("grpc.server.max_pending_requests", config.controlplane.max_pending_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", config.controlplane.max_pending_rpcs),
        ("grpc.server_max_unrequested_time_in_server", 24 * 3600),
    ]



async def serve_until_signalled(config: Config, read_config: ConfigReader = load_config,
                                on_reload: ReloadListener | None = None,
                                hangups: Callable[[], bool] = lambda: False) -> None:
    """Run a control plane on ``config`` until SIGINT/SIGTERM; SIGHUP reloads its file. ``hangups``: whether a SIGHUP
    came before this loop's handler was installed (then one reload follows start-up)."""
    plane = ControlPlane(config, read_config=read_config, on_reload=on_reload)
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

    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(plane.admin.reload(announce=False)))
    if hangups():
        await plane.admin.reload(announce=False)
    await stop.wait()
    log.info("stopping control plane")
    await plane.stop()


def run_controlplane(config_path: str | None, read_config: ConfigReader = load_config,
                     on_reload: ReloadListener | None = None) -> int:
    """The process: read ``config_path`` with ``read_config``, serve until SIGINT/SIGTERM. SIGHUP is caught from before
    the file is read: one arriving during start-up is a reload once started, never the end of the process (a supervisor
    passing a reload on cannot tell how far a control plane it just restarted has come)."""
    hangups: list[int] = []
    signal.signal(signal.SIGHUP, lambda signum, frame: hangups.append(signum))
    try:
        config = read_config(config_path)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    try:
        asyncio.run(serve_until_signalled(config, read_config, on_reload, lambda: bool(hangups)))
    except ConfigError as exc:  # an engine hostname that does not resolve
        log.error("%s", exc)
        return 2
    return 0
