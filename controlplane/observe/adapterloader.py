"""Dynamic LoRA loading's I/O (``adapters.dynamic_loading``): the core chooses the engine and what to unload
(core/adapterloads.py); this posts vLLM's ``/v1/unload_lora_adapter`` and ``/v1/load_lora_adapter`` (``{"lora_name",
"lora_path"}``, vLLM's ``LoadLoRAAdapterRequest``) and lists the result on the engine at once
(``Observation.note_adapter``), before its next discovery.

A Check for an adapter no engine lists waits for its load (``ensure``); one load is in flight per adapter, and every
Check for it waits on that one. Each request sent is counted (``sluice_adapter_loads{engine, action, outcome}``) and
logged; the rate limit is the core's (``LoadBook``). A failed load leaves the adapter unlisted: the Check is then
answered as the core decides (no engine serves it).
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
        view = self.observation.view_of(plan.engine, self.clock())
        if view is None:
            return
        timeout = aiohttp.ClientTimeout(total=self.core.policy.adapters.load_timeout_s)
        base = view.url.rstrip("/")
        async with aiohttp.ClientSession(timeout=timeout) as http:
            if plan.unload is not None and await self._post(http, base, plan.engine, "unload", plan.unload,
                                                            {"lora_name": plan.unload}):
                self.book.note_unload(plan.engine, plan.unload)
                self.observation.note_adapter(plan.engine, plan.unload, None)
            self.book.note_load(plan.engine, plan.adapter, self.clock())
            if await self._post(http, base, plan.engine, "load", plan.adapter,
                                {"lora_name": plan.adapter, "lora_path": plan.path}):
                self.observation.note_adapter(plan.engine, plan.adapter, ServedModel(plan.adapter, None, plan.base))

    async def _post(self, http: aiohttp.ClientSession, base: str, engine: str, action: str, adapter: str,
                    body: dict[str, str]) -> bool:
        """One load or unload request to the engine at ``base``: counted, logged; whether the engine accepted it."""
        try:
            async with http.post(f"{base}/v1/{action}_lora_adapter", json=body) as response:
                text = (await response.text())[:200]
                ok = response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, text = False, str(exc) or type(exc).__name__
        self.metrics.adapter_loads.labels(engine, action, "ok" if ok else "failed").inc()
        if ok:
            log.info("adapter %s: %sed on engine %s", adapter, action, engine)
        else:
            log.warning("adapter %s: %s on engine %s failed: %s", adapter, action, engine, text)
        return ok
