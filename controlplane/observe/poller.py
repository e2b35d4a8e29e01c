"""Engine pollers: one asyncio task per engine, so a slow or hung engine never delays another or the Check loop.

Each task probes ``/metrics`` every ``poll_interval_seconds``, each probe bounded by ``poll_timeout_seconds``; a failed probe is
retried with exponential backoff (from the poll interval, doubling, capped at ``max_backoff_seconds``), so a dead
engine costs little. Discovery (``/v1/models`` plus the flavour's own documents, see ``discovery.py``) runs at the first probe
and every ``models_refresh_seconds``. Mainline llama.cpp has no KV gauge, so its ``/slots`` is read on each probe when the
metrics lack one.

The first good probe is a self-check: if it lacks a load gauge the flavour needs, an ERROR names the missing metrics and the
engine is marked degraded (``sluice_observer_degraded{engine}`` = 1) until a probe has them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from controlplane.config import EngineConfig, ObserveConfig
from controlplane.core.engines import EngineRates, EngineSample, EngineView, Flavor, ServedModel
from controlplane.observe.discovery import DISCOVERY_PATHS, parse_discovery, parse_models, slots_kv_usage
from controlplane.observe.httpget import HttpError, HttpGet
from controlplane.observe.parse import (METRICS_PATH, Series, detect_flavor, metrics_path, missing_gauges, read_series,
                                        sample_from_series)
from controlplane.observe.rates import rates_between

log = logging.getLogger("sluice.observe")

FIRST_ROUND_CONCURRENCY = 64
"""First probes in flight at once (``first_round``). All at once, 1000 engines' first probes (discovery and a 54 KB
exposition each, about 1.5 ms of CPU) queued behind each other past the probe timeout: 969 of them failed together
(``sluice bench scale``), those engines stayed unknown until their next probe 3.3 s later, and requests parked meanwhile.
64 in flight keeps a loopback farm's round CPU-bound and still overlaps engines that answer slowly."""


async def first_round(pollers: list[EnginePoller], timeout: float,
                      failed: Callable[[EnginePoller], None] | None = None) -> None:
    """Every engine's first probe, at most ``FIRST_ROUND_CONCURRENCY`` at once, each bounded by ``timeout`` from its own
    start; ``failed`` is told of each engine whose probe failed. The control plane answers no Check before it ends."""
    gate = asyncio.Semaphore(FIRST_ROUND_CONCURRENCY)

    async def probe(poller: EnginePoller) -> None:
        async with gate:
            try:
                await asyncio.wait_for(poller.poll_once(), timeout)
            except (ProbeError, asyncio.TimeoutError) as exc:
                log.warning("engine %s: first probe failed: %s", poller.config.name,
                            str(exc) or f"no answer within {timeout:g} s (observe.poll_timeout_seconds)")
                if failed is not None:
                    failed(poller)

    await asyncio.gather(*(probe(p) for p in pollers))


def first_round_bound_s(engines: int, timeout: float) -> float:
    """The longest ``first_round`` takes: every wave of ``FIRST_ROUND_CONCURRENCY`` probes timing out."""
    return timeout * math.ceil(engines / FIRST_ROUND_CONCURRENCY)


def next_due(due: float, started: float, interval: float) -> float:
    """When the probe after one due at ``due`` (started at ``started``) is due: an interval later, so that waiting for
    a wave never adds up to a longer interval; an interval after ``started`` when the probe started an interval or more
    late (a slow probe, a backoff), so that a late engine is not probed twice in a row to catch up."""
    return due + interval if due + interval > started else started + interval


def wave_start(due: float, wave: float) -> float:
    """The start of the first probe wave at or after ``due`` (``ObserveConfig.wave_s``; 0: ``due`` itself)."""
    return math.ceil(due / wave) * wave if wave > 0 else due


class ProbeError(Exception):
    """A probe that failed for a reason the engine owns (HTTP error, timeout, refused connection, bad payload)."""


class AnswerError(ProbeError):
    """The engine answered, but not with what was asked: an HTTP error status or a body that does not read."""


def shown_path(path: str) -> str:
    """A probe's path as errors and logs name it: the filtered probe's query (``parse.metrics_path``: about 1.2 KB of
    ``name[]=`` pairs) is summarised, since it would otherwise fill every stale warning and ``last_error``."""
    base, sep, query = path.partition("?")
    if not sep or len(path) <= 120:
        return path
    return f"{base}?<{query.count('&') + 1} filter parameters>"


ProbeCallback = Callable[[EngineView, EngineRates | None], None]


class EnginePoller:
    """Keeps the latest ``EngineView`` of one engine; ``on_probe(view, rates)`` runs after every good ``/metrics`` probe."""

    def __init__(
        self,
        engine: EngineConfig,
        observe: ObserveConfig,
        on_probe: ProbeCallback,
        clock: Callable[[], float] = time.monotonic,
        on_failure: Callable[[EngineView], None] | None = None,
    ) -> None:
        self.config = engine
        self.observe = observe
        self._http = HttpGet(engine.url)
        self._on_probe = on_probe
        self._on_failure = on_failure
        """A failed probe's view (the probe worker forwards it: ``last_error`` for the operators)."""
        self._clock = clock
        self._configured_flavor = engine.flavor.configured
        self._view = EngineView(
            name=engine.name,
            url=engine.url,
            max_num_seqs=engine.max_num_seqs,
            models=tuple(ServedModel(m) for m in engine.models),
            flavor=self._configured_flavor,
            chip_class=engine.chip_class,
            anchor_prefill_tokens_per_s=engine.prefill_tokens_per_s,
            anchor_decode_tokens_per_s=engine.decode_tokens_per_s,
            max_loras=engine.max_loras,
        )
        self._previous: EngineSample | None = None
        """The last good probe's sample, whole: the next probe's rates are taken against it."""
        self._next_discovery = 0.0
        self._failed_at: float | None = None
        self._failure = ""
        self._self_checked = False
        self._filter_refused = False
        """A filtered probe (``parse.metrics_path``, ``observe.filter_metrics``) was refused (an HTTP error status, a body
        that does not read) or lacked a required gauge: whole expositions only, from then on (``poll_once``)."""
        self.failures = 0
        self.probes = 0
        self._runtime: dict[str, tuple[ServedModel | None, float]] = {}
        """Adapters loaded (their card) or unloaded (None) at runtime, and when, until the engine's model list agrees."""

    @property
    def flavor(self) -> Flavor | None:
        return self._configured_flavor or self._view.flavor

    @property
    def latest(self) -> EngineView:
        """The view as the last probe left it, without a staleness judgement (what the per-engine gauges show)."""
        return self._view

    def serves(self, model: str) -> bool:
        """Whether the engine lists ``model`` (no staleness judgement: cheap enough for every Check's metrics label)."""
        return self._view.serves(model)

    def set_drained(self, drained: bool) -> None:
        self._view = replace(self._view, drained=drained)

    def set_runtime_model(self, model_id: str, card: ServedModel | None) -> None:
        """An adapter sluice loaded (``card``) or unloaded (None) on this engine: listed so at once, until the
        engine's own model list (discovery here, or the probe worker's) agrees."""
        self._runtime[model_id] = (card, self._clock())
        self._view = self._with_runtime(self._view)

    def _with_runtime(self, view: EngineView, listed_since: float | None = None) -> EngineView:
        """``view`` with the runtime loads and unloads its model list does not show yet; those it shows, and those
        older than ``listed_since`` (when the listing that ``view`` carries was asked for), are dropped."""
        listed = {m.model_id for m in view.models}
        for model_id, (card, at) in list(self._runtime.items()):
            if (card is not None) == (model_id in listed) or (listed_since is not None and at < listed_since):
                del self._runtime[model_id]
        if not self._runtime:
            return view
        kept = tuple(m for m in view.models if m.model_id not in self._runtime)
        return replace(view, models=kept + tuple(c for c, _ in self._runtime.values() if c is not None))

    def note_failure(self, at: float, why: str) -> None:
        """A request to this engine failed before its first byte (seen by Envoy): treat the engine as stale at once, not
        after ``stale_after_polls`` missed probes, until a probe sent after the failure succeeds."""
        if self._failed_at is None:
            log.warning("engine %s failed a request (%s): out of the candidates until a probe succeeds", self.config.name,
                        why)
        self._failed_at = at
        self._failure = why

    @property
    def failing(self) -> bool:
        return self._failed_at is not None

    def view(self, now: float) -> EngineView:
        """The engine as of ``now``: staleness is judged here, against the clock the caller passes."""
        v = self._view
        stale = v.last_ok_at is None or now - v.last_ok_at > self.observe.stale_after_s or self.failing
        if self.failing and v.last_error != self._failure:
            v = replace(v, last_error=self._failure)
        return v if v.stale == stale else replace(v, stale=stale)

    async def run(self, start_offset: float = 0.0, wave: float = 0.0) -> None:
        """Poll forever. ``start_offset`` (seconds, < the interval) staggers engines so their probes, and the CPU that
        parsing costs, spread over the interval instead of landing on the event loop all at once. ``wave`` (seconds, 0:
        none): each probe starts on the next multiple of it, with the others due in it (``ObserveConfig.wave_s``; the
        probe worker only, whose loop answers no Check)."""
        interval = self.observe.poll_interval_seconds
        due = self._clock() + start_offset
        await asyncio.sleep(max(0.0, wave_start(due, wave) - self._clock()))
        while True:
            started = self._clock()
            try:
                await self.poll_once()
            except ProbeError as exc:
                # A plain loop, not tenacity: a retry object per probe was most of the cyclic garbage at 200+ engines,
                # and the collector's full passes stalled every Check behind them (bench/results/scale.md).
                self._record_failure(exc)
                await asyncio.sleep(self.backoff_s())
                continue
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in our parsing must not end observation of this engine
                log.exception("engine %s: probe crashed", self.config.name)
                self._view = replace(self._view, last_error="internal error while probing (see log)")
            else:
                self.failures = 0
            due = next_due(due, started, interval)
            await asyncio.sleep(max(0.0, wave_start(due, wave) - self._clock()))

    def backoff_s(self) -> float:
        """Delay before the next probe after ``failures`` failures in a row: the interval, doubling, at most
        ``max_backoff_seconds``."""
        interval = self.observe.poll_interval_seconds
        return min(max(interval * 2.0 ** (self.failures - 1), interval), self.observe.max_backoff_seconds)

    def _record_failure(self, exc: ProbeError) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning("engine %s: probe failed: %s", self.config.name, exc)
        self._view = replace(self._view, last_error=str(exc))
        if self._on_failure is not None:
            self._on_failure(self._view)

    def adopt(self, view: EngineView) -> None:
        """The probe worker's view of this engine (``observe/worker.py``): taken whole, except what only this process
        knows: the operator's drain, and a request failure newer than the view's probe."""
        if self._failed_at is not None and view.sample is not None and view.sample.taken_at > self._failed_at:
            log.info("engine %s answers probes again after a failed request", self.config.name)
            self._failed_at = None
        if view.last_ok_at is not None and view.last_ok_at != self._view.last_ok_at:
            self.probes += 1
        view = self._with_runtime(view)
        self._view = view if view.drained == self._view.drained else replace(view, drained=self._view.drained)

    async def _get(self, path: str, *, as_json: bool, optional: bool = False) -> Any:
        shown = shown_path(path)
        try:
            status, body = await self._http.get(path, self.observe.poll_timeout_seconds)
        except (HttpError, TimeoutError) as exc:
            if optional and not isinstance(exc, TimeoutError):
                return None
            raise ProbeError(f"GET {shown}: {type(exc).__name__} {exc}".rstrip()) from None
        if optional and status in (404, 405, 501):
            return None
        if status != 200:
            raise AnswerError(f"GET {shown}: HTTP {status}")
        text = body.decode("utf-8", errors="replace")
        if not as_json:
            return text
        try:
            return json.loads(text)
        except ValueError as exc:
            if optional:
                return None
            raise AnswerError(f"GET {shown}: not JSON: {exc}") from None

    def close(self) -> None:
        """Closes the engine's kept-alive connection (the poller's task has ended)."""
        self._http.close()

    async def _read_metrics(self, path: str) -> tuple[Series, Flavor | None, tuple[str, ...]]:
        """The probe's series, the engine's flavour (configured, else detected) and the required gauges it lacks."""
        text = await self._get(path, as_json=False)
        try:
            series = read_series(text)
        except ValueError as exc:
            raise AnswerError(f"GET /metrics: unparseable exposition: {exc}") from None
        flavor = self._configured_flavor or detect_flavor(series)
        return series, flavor, missing_gauges(series, flavor) if flavor else ("no engine metrics recognised",)

    async def poll_once(self) -> None:
        sent_at = self._clock()
        path = metrics_path(self.flavor) if self.observe.filter_metrics and not self._filter_refused else METRICS_PATH
        # The engine (or a proxy before it) may refuse the filtered probe (an HTTP error, a body that does not read) or
        # answer it without a gauge sluice requires: whatever it did with the query, the whole exposition is the one to
        # read, in this probe and from now on. An engine whose whole exposition fails or lacks the gauge too is treated
        # as it would have been (a failed probe; degraded). A timeout or a refused connection is the engine's, not the
        # query's: it fails the probe as before.
        try:
            series, flavor, missing = await self._read_metrics(path)
            refused = f"lacked {', '.join(missing)}" if missing and path != METRICS_PATH else ""
        except AnswerError as exc:
            if path == METRICS_PATH:
                raise
            refused = f"failed ({exc})"
        if refused:
            log.warning("engine %s: a filtered /metrics probe %s; probing the whole exposition from now on",
                        self.config.name, refused)
            self._filter_refused = True
            series, flavor, missing = await self._read_metrics(METRICS_PATH)
        if flavor is not None and sent_at >= self._next_discovery:
            await self._discover(flavor)
            self._next_discovery = sent_at + self.observe.models_refresh_seconds
        sample = sample_from_series(series, sent_at, flavor)
        if self._failed_at is not None and sent_at > self._failed_at:
            log.info("engine %s answers probes again after a failed request", self.config.name)
            self._failed_at = None
        if flavor is Flavor.LLAMACPP and sample.kv_usage is None:
            sample = replace(sample, kv_usage=slots_kv_usage(await self._get("/slots", as_json=True, optional=True)))
        if not self._self_checked or bool(missing) != bool(self._view.degraded):
            self._report_health(flavor, missing)
        previous, self._previous = self._previous, sample
        rates = rates_between(previous, sample, self.observe.prefill_sample_min_tokens) if previous is not None else None
        if sample.finished_length_buckets is not None:
            # The buckets are for the next probe's rates (``rates.finished_by_length`` says what they showed), not for
            # the view every Check reads: they were 15 of a view's 27 objects, and at 1000 engines the control plane's
            # collector traversed 20,000 such objects a pass, 10-15 ms each (issue 9, item 5).
            sample = replace(sample, finished_length_buckets=None)
        self._view = replace(
            self._view, sample=sample, last_ok_at=self._clock(), last_error="", stale=False,
            flavor=flavor, degraded=missing, rates=rates or self._view.rates,
        )
        self.probes += 1
        self._on_probe(self._view, rates)

    def _report_health(self, flavor: Flavor | None, missing: tuple[str, ...]) -> None:
        name = self.config.name
        if missing:
            log.error(
                "engine %s (%s): observation degraded, missing %s; its load is unknown, not zero",
                name, flavor.value if flavor else "unknown flavour", ", ".join(missing),
            )
        elif self._self_checked:
            log.info("engine %s: observation healthy again", name)
        self._self_checked = True

    async def _discover(self, flavor: Flavor) -> None:
        asked_at = self._clock()
        listing = await self._get("/v1/models", as_json=True, optional=flavor is Flavor.TGI)
        documents = {}
        for path in DISCOVERY_PATHS[flavor]:
            document = await self._get(path, as_json=True, optional=True)
            if isinstance(document, (dict, list)):
                documents[path] = document
        found = parse_discovery(flavor, parse_models(listing), documents)
        known = {m.model_id for m in found.models}
        configured = tuple(ServedModel(m) for m in self.config.models if m not in known)
        self._view = replace(
            self._view,
            models=found.models + configured,
            version=found.version or self._view.version,
            discovered_capacity_tokens=found.kv_capacity_tokens,
            discovered_concurrency=found.max_concurrency,
            lora_adapters=found.lora_adapters,
        )
        self._view = self._with_runtime(self._view, asked_at)  # the engine's own list wins over older runtime changes
