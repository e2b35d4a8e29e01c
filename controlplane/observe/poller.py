"""Engine pollers: one asyncio task per engine, so a slow or hung engine never delays another or the Check loop.

Each task probes ``/metrics`` every ``poll_interval_seconds`` (bounded by ``poll_timeout_seconds``) and refreshes discovery
(``/v1/models``, ``/version``) every ``models_refresh_seconds``. After a failure it backs off exponentially (doubling from the
poll interval, capped at ``max_backoff_seconds``), so a dead engine costs little; the engine turns stale when its last good
probe is older than ``stale_after_polls`` intervals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from controlplane.config import EngineConfig, ObserveConfig
from controlplane.core.model import EngineSample, EngineView, ServedModel
from controlplane.observe.parse import parse_metrics

log = logging.getLogger("sluice.observe")


class EnginePoller:
    """Keeps the latest ``EngineView`` of one engine; ``on_probe`` is called after every good ``/metrics`` probe."""

    def __init__(
        self,
        engine: EngineConfig,
        observe: ObserveConfig,
        session: aiohttp.ClientSession,
        on_probe: Callable[[EngineView], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = engine
        self.observe = observe
        self._session = session
        self._on_probe = on_probe
        self._clock = clock
        self._view = EngineView(
            name=engine.name,
            url=engine.url,
            max_num_seqs=engine.max_num_seqs,
            models=tuple(ServedModel(m) for m in engine.models),
        )
        self._next_discovery = 0.0
        self.failures = 0

    def view(self, now: float) -> EngineView:
        """The engine as of ``now``: staleness is judged here, against the clock the caller passes."""
        v = self._view
        stale = v.last_ok_at is None or now - v.last_ok_at > self.observe.stale_after_seconds
        return v if v.stale == stale else replace(v, stale=stale)

    async def run(self) -> None:
        while True:
            started = self._clock()
            try:
                await self.poll_once()
                self.failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is the engine's, reported and retried
                self.failures += 1
                message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if self.failures == 1:
                    log.warning("engine %s: probe failed: %s", self.config.name, message)
                self._view = replace(self._view, last_error=message)
            delay = self.observe.poll_interval_seconds
            if self.failures:
                delay = min(self.observe.max_backoff_seconds, delay * 2 ** (self.failures - 1))
            await asyncio.sleep(max(0.0, started + delay - self._clock()))

    async def poll_once(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.observe.poll_timeout_seconds)
        sent_at = self._clock()
        if sent_at >= self._next_discovery:
            await self._discover(timeout)
            self._next_discovery = sent_at + self.observe.models_refresh_seconds
        async with self._session.get(self.config.url + "/metrics", timeout=timeout) as response:
            response.raise_for_status()
            text = await response.text()
        sample: EngineSample = parse_metrics(text, taken_at=sent_at)
        self._view = replace(self._view, sample=sample, last_ok_at=self._clock(), last_error="", stale=False)
        self._on_probe(self._view)

    async def _discover(self, timeout: aiohttp.ClientTimeout) -> None:
        async with self._session.get(self.config.url + "/v1/models", timeout=timeout) as response:
            response.raise_for_status()
            listing = await response.json(content_type=None)
        discovered = [
            ServedModel(m["id"], m.get("max_model_len"), m.get("parent"))
            for m in listing.get("data", [])
            if isinstance(m, dict) and isinstance(m.get("id"), str)
        ]
        configured = [ServedModel(m) for m in self.config.models if m not in {d.model_id for d in discovered}]
        version = self._view.version
        try:
            async with self._session.get(self.config.url + "/version", timeout=timeout) as response:
                if response.status == 200:
                    version = str((await response.json(content_type=None)).get("version") or "") or None
        except (aiohttp.ClientError, ValueError, asyncio.TimeoutError):
            pass  # version is optional; an engine without /version keeps an unknown version
        self._view = replace(self._view, models=tuple(discovered + configured), version=version)
