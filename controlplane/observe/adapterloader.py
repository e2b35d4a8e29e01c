"""Dynamic LoRA loading's I/O (``adapters.dynamic_loading``): the core chooses the engine and what to unload
(core/adapterloads.py); this posts vLLM's ``/v1/unload_lora_adapter`` and ``/v1/load_lora_adapter`` (``{"lora_name",
"lora_path"}``, vLLM's ``LoadLoRAAdapterRequest``) and lists the result on the engine at once
(``Observation.note_adapter``), before its next discovery.

A Check for an adapter no engine lists waits for its load (``ensure``), at most ``adapters.load_timeout_seconds`` for
the unload and the load together; one load is in flight per adapter, and every Check for it waits on that one. A plan
is booked the moment it is made (``LoadBook``: the rate limit counts it, its victim is no longer ours to unload) and its
victim is unlisted on the engine at once, before the unload is sent: concurrent plans never pick the same victim or
pass the rate limit, and no Check is admitted to the victim meanwhile. Each request sent is counted
(``sluice_adapter_loads{engine, action, outcome}``) and logged. A failed load (an error, a refusal, the deadline)
leaves the adapter unlisted: the Check is then answered as the core decides (no engine serves it). All of this is one
replica's: several replicas may each load an adapter (decision 0026).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from controlplane.config import Config
from controlplane.core.adapterloads import LoadBook, LoadPlan, plan_load
from controlplane.core.admission import AdmissionCore
from controlplane.core.engines import ServedModel
from controlplane.metrics import SluiceMetrics
from controlplane.observe.observation import Observation

log = logging.getLogger("sluice.adapters")


class AdapterLoader:
    def __init__(self, config: Config, core: AdmissionCore, observation: Observation, metrics: SluiceMetrics,
                 clock: Callable[[], float]) -> None:
        self.config = config
        """The current config (a reload replaces it): which engines allow runtime loading."""
        self.core = core
        self.observation = observation
        self.metrics = metrics
        self.clock = clock
        self.book = LoadBook()
        self._pending: dict[str, asyncio.Future[None]] = {}

    async def ensure(self, model: str) -> None:
        """Load ``model`` somewhere first if it is an adapter to load dynamically that no engine lists (returns at once
        otherwise). Cancelling the caller does not cancel the load."""
        policy = self.core.policy.adapters
        if not policy.dynamic_loading or model not in policy.paths or self.observation.serves(model):
            return
        pending = self._pending.get(model)
        if pending is None:
            now = self.clock()
            loadable = frozenset(e.name for e in self.config.engines if e.runtime_lora_updating)
            plan = plan_load(model, self.observation.fleet(now), self.core.policy, loadable, self.book, now)
            if plan is None:
                return
            self.book.note_load(plan.engine, plan.adapter, now)
            if plan.unload is not None:
                self.book.note_unload(plan.engine, plan.unload)
                self.observation.note_adapter(plan.engine, plan.unload, None)
            pending = asyncio.ensure_future(self._carry_out(plan))
            self._pending[model] = pending
            pending.add_done_callback(lambda _: self._pending.pop(model, None))
        try:
            await asyncio.shield(pending)
        except asyncio.CancelledError:
            if not pending.cancelled():
                raise  # the Check itself was cancelled; the load goes on

    async def stop(self) -> None:
        """Cancel the loads in flight (shutdown): their Checks are answered as if the load had failed."""
        pending = list(self._pending.values())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _carry_out(self, plan: LoadPlan) -> None:
        """The unload (its victim already unlisted and booked out) and the load, within one deadline; whatever goes
        wrong is a failed load, never an error for the Checks waiting on it."""
        view = self.observation.view_of(plan.engine, self.clock())
        loaded = False
        try:
            if view is not None:
                base = view.url.rstrip("/")
                async with asyncio.timeout(self.core.policy.adapters.load_timeout_s), aiohttp.ClientSession() as http:
                    if plan.unload is not None:
                        await self._post(http, base, plan.engine, "unload", plan.unload, {"lora_name": plan.unload})
                    loaded = await self._post(http, base, plan.engine, "load", plan.adapter,
                                              {"lora_name": plan.adapter, "lora_path": plan.path})
        except TimeoutError:
            self.metrics.adapter_loads.labels(plan.engine, "load", "failed").inc()
            log.warning("adapter %s: load on engine %s failed: past adapters.load_timeout_seconds", plan.adapter,
                        plan.engine)
        except Exception:  # an engine's odd answer must not become every waiting Check's 500
            self.metrics.adapter_loads.labels(plan.engine, "load", "failed").inc()
            log.exception("adapter %s: load on engine %s failed", plan.adapter, plan.engine)
        if loaded:
            self.observation.note_adapter(plan.engine, plan.adapter, ServedModel(plan.adapter, None, plan.base))
        else:
            self.book.note_unload(plan.engine, plan.adapter)  # not on the engine: never ours to unload (the load counts)

    async def _post(self, http: aiohttp.ClientSession, base: str, engine: str, action: str, adapter: str,
                    body: dict[str, str]) -> bool:
        """One load or unload request to the engine at ``base``: counted, logged; whether the engine accepted it."""
        try:
            async with http.post(f"{base}/v1/{action}_lora_adapter", json=body) as response:
                text = (await response.text())[:200]
                ok = response.status == 200
        except aiohttp.ClientError as exc:
            ok, text = False, str(exc) or type(exc).__name__
        self.metrics.adapter_loads.labels(engine, action, "ok" if ok else "failed").inc()
        if ok:
            log.info("adapter %s: %sed on engine %s", adapter, action, engine)
        else:
            log.warning("adapter %s: %s on engine %s failed: %s", adapter, action, engine, text)
        return ok
