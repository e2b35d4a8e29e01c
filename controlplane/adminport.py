"""The ``AdminPort`` (``ports.py``) over the running parts: what the admin servicer reads of the fleet and the control
plane, and the changes operators make (drain, version floor, reload).

A change of policy (floor, reload) goes to every part at once (``apply_config``, the wiring's fan-out) and to the core
through ``set_policy`` once; after every change the fallback weights are refreshed and the parked requests woken, so it
applies to them too. A reload is all or nothing: a file with a problem, or one whose changes need a restart, leaves the
running config as it was."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from controlplane.admission.quota import Quota, TenantUsage
from controlplane.admission.service import AdmissionService
from controlplane.admission.watch import Watcher
from controlplane.config import RELOADABLE, Config, ConfigError, OnStale, changed_sections, resolve_engines
from controlplane.core.admission import AdmissionCore
from controlplane.core.fairshare import FairStanding, TenantShare
from controlplane.core.feedback import TtftSummary
from controlplane.core.ledger import Ledger
from controlplane.core.model import Decision, InferenceRequest
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.core.policy import Policy, version_key
from controlplane.core.prompt_tokens import PromptTokenRules, PromptTokenSummary
from controlplane.metrics import SluiceMetrics
from controlplane.observe.observation import Observation
from controlplane.ports import FloorResult, ReloadResult, StatusFacts, XdsTypeStatus
from controlplane.xds.publisher import XdsPublisher

log = logging.getLogger("sluice.controlplane")

ConfigReader = Callable[[str | None], Config]
"""Reads and validates a config file (None: the bundled default) into an unresolved ``Config``; raises ``ConfigError``.
Runs in a worker thread."""
ReloadListener = Callable[[ReloadResult], None]
"""Told the result of every reload asked for through the admin API (not of a SIGHUP's)."""


class AdminAdapter:
    """Answers the admin port from the parts it is given; holds no state of its own beyond the config it last applied
    (``config``, kept current by the wiring's fan-out) and when it started."""

    def __init__(self, config: Config, *, version: str, ledger: Ledger, admission: AdmissionCore,
                 observation: Observation, service: AdmissionService, xds: XdsPublisher, quota: Quota,
                 metrics: SluiceMetrics, apply_config: Callable[[Config], None],
                 note_cache: Callable[[EngineView], None], clock: Callable[[], float], read_config: ConfigReader,
                 on_reload: ReloadListener | None) -> None:
        self.config = config
        self.version = version
        self.clock = clock
        self.started_at = clock()
        self.ledger = ledger
        self.admission = admission
        self.observation = observation
        self.service = service
        self.xds = xds
        self.quota = quota
        self.metrics = metrics
        self.apply_config = apply_config
        """Gives a new config to every part (this one included)."""
        self.note_cache = note_cache
        """The prefix index follows a view that changed (a drain forgets what the engine held)."""
        self.read_config = read_config
        """How a reload reads its file: the reader ``config`` itself was read with."""
        self.on_reload = on_reload
        """Told each admin-API reload's result (``sluice up`` passes an applied one on to the other replicas)."""

    @property
    def policy(self) -> Policy:
        return self.config.policy

    def now(self) -> float:
        return self.clock()

    def fleet(self, now: float) -> Fleet:
        return self.observation.fleet(now)

    def status(self, now: float) -> StatusFacts:
        snapshot, ads = self.xds.cache.snapshot, self.xds.ads
        xds = tuple(
            XdsTypeStatus(type_url, snapshot.version(type_url),
                          {s.node_id or "?": s.acked_version(type_url) or "" for s in ads.streams})
            for type_url in sorted(snapshot.types)
        ) if snapshot is not None else ()
        ledger = self.ledger
        return StatusFacts(self.version, now - self.started_at, ledger.open_tickets(), ledger.admitted_total,
                           ledger.released_total, ledger.expired_total, ads.nacks_total, xds, len(ads.streams))

    def open_tickets(self, engine: str) -> int:
        return self.ledger.open_tickets(engine)

    def medians(self, model: str, chip_class: str) -> tuple[float | None, float | None]:
        rates = self.observation.rates
        return rates.prefill_median(model, chip_class), rates.solo_decode_median(model, chip_class)

    def ttft_summary(self, engine: str) -> TtftSummary:
        return self.service.ttft_summary(engine)

    def prompt_summary(self, model: str, engine: str) -> PromptTokenSummary:
        return self.admission.prompt_tokens.summary(model, engine)

    def swap_samples(self, engine: str) -> int:
        return self.admission.swaps.samples(engine)

    @property
    def prompt_rules(self) -> PromptTokenRules:
        return self.service.prompt_rules

    async def set_drained(self, name: str, drained: bool) -> bool:
        if not self.observation.set_drained(name, drained):
            return False
        view = self.observation.view_of(name, self.clock())
        if view is not None:
            self.note_cache(view)
        await self._refresh_and_wake()
        return True

    def decide_for(self, request: InferenceRequest, now: float) -> tuple[Decision, int]:
        """What a Check of ``request`` would be decided right now (``AdmissionCore.preview``: nothing is admitted,
        parked or counted), and how many requests are parked ahead of it on this replica."""
        assert request.model is not None
        return (self.admission.preview(request, self.fleet(now), now),
                self.admission.queued_ahead(request.model, request.priority))

    def expected_cached(self, request: InferenceRequest) -> Mapping[str, int]:
        return self.admission.expected_cached(request)

    @property
    def config_source(self) -> str:
        return self.config.source

    def watch(self, model: str | None) -> Watcher:
        return self.service.feed.subscribe(model)

    def unwatch(self, watcher: Watcher) -> None:
        self.service.feed.unsubscribe(watcher)

    async def tenant_usage(self) -> tuple[TenantUsage, ...]:
        return await self.quota.usage()

    def tenant_shares(self) -> list[TenantShare]:
        """Each tenant's fair-share standing per model on this replica (core/fairshare.py)."""
        return self.admission.tenant_shares()

    def fair_standing(self, request: InferenceRequest, now: float) -> FairStanding:
        """Where ``request`` would stand in its parking class on this replica if it parked now (core/fairshare.py),
        and the slots held for other tenants' reserved shares (core/reserve.py)."""
        return self.admission.fair_standing(request, self.fleet(now), now)

    async def set_version_floor(self, pattern: str, version: str) -> FloorResult:
        """Set (empty ``version``: remove) one version floor, through the same door as a reload (``set_policy``)."""
        floors = dict(self.config.policy.version_floors)
        before = floors.get(pattern, "")
        if not pattern or (version and not version_key(version)):
            return FloorResult(False, (f"version_floors.{pattern or '?'}: need a model pattern and a version like "
                                       f"0.11.0, got {version!r}",), before, before)
        if version:
            floors[pattern] = version
        else:
            floors.pop(pattern, None)
        policy = replace(self.config.policy, version_floors=tuple(floors.items()))
        self.apply_config(replace(self.config, policy=policy))
        self.admission.set_policy(policy, admit_stale=self.admission.admit_stale)
        log.warning("version floor %s: %s -> %s", pattern, before or "none", version or "none")
        await self._refresh_and_wake()
        return FloorResult(True, (), before, version)

    def reload_allowed(self, path: str) -> bool:
        """A reload may name the running config file, or a file under ``admin.reload_dir``; nothing else the server can
        read (a file naming other engine URLs would redirect everyone's prompts)."""
        wanted = Path(path).resolve()
        if not self.config.source.startswith(("bundled:", "<")) and wanted == Path(self.config.source).resolve():
            return True
        root = self.config.admin.reload_dir
        return root is not None and wanted.is_relative_to(Path(root).resolve())

    async def reload(self, path: str | None = None, *, announce: bool = True) -> ReloadResult:
        """Apply a config file's policy (``path``, or the running file), read through ``read_config``, all or nothing.
        Every attempt is counted in ``sluice_config_reloads_total``. ``announce``: tell ``on_reload`` the result (an
        admin-API reload does; a SIGHUP's does not, as SIGHUP is how ``sluice up`` passes a reload on)."""
        result = await self._reload(path)
        self.metrics.config_reloads.labels("applied" if result.applied else "refused").inc()
        if not result.applied:
            log.error("reload of %s refused; the running policy stays:\n  %s", result.source,
                      "\n  ".join(result.problems))
        if announce and self.on_reload is not None:
            self.on_reload(result)
        return result

    async def _reload(self, path: str | None) -> ReloadResult:
        if path is not None and not self.reload_allowed(path):
            return ReloadResult(False, (f"(file): a reload may name only the running config file or a file under "
                                        f"admin.reload_dir ({self.config.admin.reload_dir or 'not set'}); not {path}",),
                                (), path)
        source = path or (None if self.config.source.startswith("bundled:") else self.config.source)
        if source == "<memory>":
            return ReloadResult(False, ("(file): this control plane was not started from a file; name one",), (),
                                source)
        try:
            # the file read in a thread, hostnames resolved asynchronously
            fresh = await resolve_engines(await asyncio.to_thread(self.read_config, source))
        except ConfigError as exc:
            return ReloadResult(False, tuple(exc.problems), (), str(source))
        restart = self.config.restart_needed(fresh)
        if restart:
            return ReloadResult(False, tuple(f"{name}: changed, which needs a restart (a reload applies only "
                                             f"{', '.join(RELOADABLE)})" for name in restart), (), fresh.source)
        changed = changed_sections(self.config, fresh)
        config = replace(self.config, policy=fresh.policy, observe=fresh.observe, engines=fresh.engines,
                         tenants=fresh.tenants, source=fresh.source)
        self.observation.apply_engines(config)
        self.admission.prefixes.keep(e.name for e in config.engines)
        self.apply_config(config)
        self.admission.set_policy(fresh.policy, admit_stale=fresh.observe.on_stale is OnStale.OPEN)
        log.warning("policy reloaded from %s; changed: %s", fresh.source, ", ".join(changed) or "nothing")
        if "engines" in changed:
            await self.xds.publish()  # clusters and endpoints first-class over CDS/EDS; the listener does not move
        await self._refresh_and_wake()
        return ReloadResult(True, (), tuple(changed), fresh.source)

    async def _refresh_and_wake(self) -> None:
        """After a change: the fallback weights follow the fleet as it now is, and the parked requests are looked at
        again under it."""
        now = self.clock()
        await self.xds.refresh_weights(self.fleet(now), now)
        self.service.wake()
