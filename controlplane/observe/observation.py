"""Observation, the asyncio shell around the pollers: what the control plane knows about its engines and when.

It owns the pollers (one task per engine, started staggered after a first probe round), their shared HTTP session,
staleness (a heap of the moments views turn stale, and the fresh -> stale metrics), the rate book, operator drains and
request-failure marks. Every change of an engine's view is pushed to the decision core's fleet index (``note_view``), so a
Check copies a few rows instead of rebuilding every engine's view. What a probe means for admission (reaping, wakes) and
for xDS (caps) is not decided here: every good probe is handed to ``on_probe`` (the control plane wires it).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from controlplane.config import Config, EngineConfig, WorkerPriority
from controlplane.core.admission import AdmissionCore
from controlplane.core.engines import EngineRates, EngineView, ServedModel
from controlplane.core.fleet import Fleet
from controlplane.core.output_length import lengths_from_buckets
from controlplane.giveway import give_way
from controlplane.metrics import EngineState, SluiceMetrics
from controlplane.observe.poller import EnginePoller, first_round, first_round_bound_s
from controlplane.observe.rates import RateBook
from controlplane.observe.worker import WorkerSetup, decode_report, encode, read_frame

log = logging.getLogger("sluice.observe")

ProbeSink = Callable[[EngineView, "EngineRates | None"], None]

INDEX_MIN_ENGINES = 16
"""From this many engines on, Checks decide on the fleet index (measured crossover: about 10 engines)."""

WORKER_START_S = 5.0
"""Beyond the probe timeout, how long start-up waits for the probe worker's first round (a process to start)."""
WORKER_RESTART_S = 0.5
WORKER_IDLE_RETRY_S = 600.0
"""After the idle-priority probe worker reported itself starved (``observe.worker_priority``), its restarts run at nice
only for this long; then idle is tried again (a restart costs a first probe round, so not every few seconds)."""

FRAMES_PER_TURN = 4
"""Probe reports applied per turn of the event loop (about 0.3 ms of it on the bench machine). The worker sends a batch
every 10 ms, but a starved worker sends hundreds at once, and applied in one turn they would hold every Check. Slices
are separated by ``giveway.give_way``'s pause, not a bare turn of the loop. Why 4:
docs/decisions/0010-background-work-in-slices.md."""

OUTPUT_SAMPLES_PER_PROBE = 32
"""At most this many output-length samples per probe, so one busy engine cannot flush the whole ring at once."""


class Observation:
    def __init__(self, config: Config, core: AdmissionCore, metrics: SluiceMetrics, clock: Callable[[], float],
                 on_probe: ProbeSink) -> None:
        self.config = config
        self.observe = config.observe.for_fleet(len(config.engines))
        """The observe settings as this fleet runs them (the poll interval within ``observe.max_probes_per_second``)."""
        self.core = core
        self.metrics = metrics
        self.clock = clock
        self._on_probe_sink = on_probe
        self.rates = RateBook(config.observe.rate_ring_size, config.observe.rate_min_samples)
        self.pollers: list[EnginePoller] = []
        self._by_name: dict[str, EnginePoller] = {}
        self._indexed: list[EnginePoller] | None = None
        self._stale_at: list[tuple[float, str]] = []
        self._watched: set[str] = set()
        """Engines with an entry on ``_stale_at``."""
        self._was_stale: dict[str, bool] = {}
        self._up: dict[str, int] = {}
        """engine -> the value ``sluice_engine_up`` was last set to (``_set_up``)."""
        self._shown_rates: dict[str, tuple[float | None, float | None]] = {}
        """engine -> the last prefill and decode rates an interval measured (``sluice_engine_*_tokens_per_second*``)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._worker_task: asyncio.Task[None] | None = None
        self._idle_again_at = -math.inf
        """Until then the probe worker starts at nice only: it was starved at idle priority (``WORKER_IDLE_RETRY_S``)."""
        self.worker_starvations = 0
        for engine in config.engines:
            # Each engine's series exist from the start (a scrape lists every configured engine) and are made here, not
            # at the engine's first release or staleness flip: at 1000 engines making them costs 0.1-0.4 ms each, which
            # would land on Checks and releases, and they are then in place before ``gc.freeze()``.
            self.metrics.engine(engine.name)

    # -- what others read ------------------------------------------------------------------------------------------------
    def fleet(self, now: float) -> Fleet:
        """The fleet as of ``now``, with its index. Views reach the core when they change (a probe, a drain, a failure
        mark, a staleness flip found on the heap), so this copies a few rows instead of rebuilding every engine's view.

        Below ``INDEX_MIN_ENGINES`` the index costs more than it saves (numpy's per-call overhead: about 140 us a Check
        against 37 us for a plain fleet and a full scan with two engines), so small fleets are built plainly."""
        if len(self.pollers) < INDEX_MIN_ENGINES:
            return self.core.fleet((p.view(now) for p in self.pollers), now, self.rates.tables())
        if self._indexed is not self.pollers or len(self._by_name) != len(self.pollers):
            self._sync_engines(now)
        heap = self._stale_at
        while heap and heap[0][0] < now:
            _, name = heapq.heappop(heap)
            poller = self._by_name.get(name)
            if poller is None:
                self._watched.discard(name)
                continue
            view = poller.view(now)
            current = self.core.index.views.get(name)
            if current is None or current.stale != view.stale or current.last_error != view.last_error:
                self.core.note_view(view)
            if view.stale:
                # A stale engine's failures keep changing its last error (operators read it): looked at once a poll.
                heapq.heappush(heap, (now + self.observe.poll_interval_seconds, name))
            elif view.last_ok_at is not None:
                # Probes landed since this entry was pushed: the engine's deadline moved on, look again then.
                heapq.heappush(heap, (view.last_ok_at + self.observe.stale_after_s, name))
            else:
                self._watched.discard(name)
        return self.core.indexed_fleet(now, self.rates.tables())

    def refresh_rows(self, now: float) -> None:
        """Redo the index rows of engines whose views changed, now, between Checks, instead of in the next Check's
        snapshot (``FleetIndex.refresh``): the probe worker's reader calls it after each slice of reports."""
        if self._indexed is self.pollers and len(self.pollers) >= INDEX_MIN_ENGINES:
            self.core.refresh_index(now, self.rates.tables())

    def engine_states(self) -> list[EngineState]:
        """Every engine's last probe as the per-engine gauges show it (read at scrape time, on the loop)."""
        states = []
        for poller in self.pollers:
            view = poller.latest
            sample = view.sample
            prefill, decode = self._shown_rates.get(view.name, (None, None))
            states.append(EngineState(
                view.name, sample.running if sample else None, sample.waiting if sample else None,
                sample.kv_usage if sample else None, prefill, decode,
                None if view.last_ok_at is None else bool(view.degraded)))
        return states

    def model_label(self, model: str | None) -> str:
        """A metrics label for ``model``: only models some engine serves, so clients cannot grow label cardinality."""
        return model if model and self.serves(model) else "-"

    def serves(self, model: str) -> bool:
        """Whether some engine lists ``model`` (no staleness judgement; cheap enough for every Check)."""
        return self.core.index.serves(model) if self._indexed is self.pollers else any(
            p.serves(model) for p in self.pollers)

    def view_of(self, engine: str, now: float) -> EngineView | None:
        poller = self._by_name.get(engine) or self._find(engine)
        return None if poller is None else poller.view(now)

    def knows(self, engine: str) -> bool:
        return engine in self._by_name or any(p.config.name == engine for p in self.pollers)

    def reported_caps(self, now: float) -> dict[str, int | None]:
        """Each engine's own concurrency cap as it reports it (SGLang, llama.cpp); None where it reports none."""
        return {p.config.name: p.view(now).discovered_concurrency for p in self.pollers}

    # -- events ------------------------------------------------------------------------------------------------------
    def note_adapter(self, engine: str, model_id: str, card: ServedModel | None) -> None:
        """An adapter loaded (``card``) or unloaded (None) on ``engine`` at runtime: its model list shows it now."""
        poller = self._by_name.get(engine) or self._find(engine)
        if poller is not None:
            poller.set_runtime_model(model_id, card)
            self._note_view(poller, self.clock())

    def set_drained(self, name: str, drained: bool) -> bool:
        poller = self._find(name)
        if poller is None:
            return False
        poller.set_drained(drained)
        self._note_view(poller, self.clock())
        log.warning("engine %s %s by an operator", name, "drained" if drained else "undrained")
        return True

    def note_failure(self, engine: str, why: str) -> None:
        """A request to ``engine`` failed before its first byte: it leaves the candidates until a later probe succeeds."""
        poller = self._find(engine)
        if poller is not None:
            poller.note_failure(self.clock(), why)
            self._note_view(poller, self.clock())
            self._set_up(engine, 0)

    def _set_up(self, engine: str, value: int) -> None:
        """``sluice_engine_up`` for ``engine``, touched only when its value changes: a label lookup per engine on every
        staleness tick was most of a 20-40 ms stall of the event loop at 1000 engines."""
        if self._up.get(engine) != value:
            self._up[engine] = value
            self.metrics.engine(engine).up.set(value)

    def check_staleness(self, now: float, pollers: Sequence[EnginePoller] | None = None) -> None:
        """Count every fresh -> stale transition (``sluice_engine_state_stale_total``) and keep ``sluice_engine_up``,
        for ``pollers`` (default: every engine's)."""
        for poller in self.pollers if pollers is None else pollers:
            view = poller.view(now)
            self._set_up(view.name, 0 if view.stale else 1)
            was = self._was_stale.get(view.name)
            if view.stale and was is False:
                self.metrics.engine(view.name).stale.inc()
                log.warning("engine %s is stale (last error: %s); on_stale=%s", view.name, view.last_error or "none",
                            self.config.observe.on_stale)
            elif not view.stale and was:
                log.info("engine %s is fresh again", view.name)
            self._was_stale[view.name] = view.stale

    def probed(self, view: EngineView, rates: EngineRates | None) -> None:
        """A good probe landed (every poller's callback)."""
        poller = self._by_name.get(view.name)
        if poller is not None:
            self._note_view(poller, self.clock())
        if rates is not None and (rates.prefill_tokens_per_s is not None or rates.decode_tokens_per_s_each is not None):
            prefill, decode = self._shown_rates.get(view.name, (None, None))
            self._shown_rates[view.name] = (rates.prefill_tokens_per_s or prefill, rates.decode_tokens_per_s_each or decode)
        if rates is not None and view.models:
            # Rates are booked under the engine's first model: engine metrics are per process, not per model.
            model = view.models[0].model_id
            self.rates.record(model, view.chip_class, rates, view.name)
            if rates.finished_requests and rates.mean_output_tokens is not None:
                # What the engine really generated per finished request (end of sequence included): spread as its length
                # histogram's buckets spread them (the book's tail needs the shape, output_length.py), else each at the
                # interval's mean.
                lengths = lengths_from_buckets(rates.finished_by_length, rates.mean_output_tokens,
                                               OUTPUT_SAMPLES_PER_PROBE)
                self.core.record_outputs(model, lengths or [round(rates.mean_output_tokens)] * min(
                    rates.finished_requests, OUTPUT_SAMPLES_PER_PROBE))
        self._on_probe_sink(view, rates)

    # -- lifecycle -------------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe every engine once (bounded by the probe timeout), then poll on schedule, staggered over the interval.

        The first round comes before the control plane answers any Check or publishes any weights: a restarted control
        plane's ledger is empty, and without it an engine not yet probed serves no models (404 ``model_not_found``) and
        its pre-crash streams count as zero load."""
        engines = self.config.engines
        if self.observe is not self.config.observe:
            log.info("%d engines: each polled every %.2fs (observe.max_probes_per_second %g)", len(engines),
                     self.observe.poll_interval_seconds, self.observe.max_probes_per_second)
        if self.config.observe.probes_in_worker(len(engines)):
            self.pollers = [self._holder(e) for e in engines]
            await self._start_worker()
            return
        interval, timeout = self.observe.poll_interval_seconds, self.observe.poll_timeout_seconds
        # The periodic probes start once the first round cannot still be running: two probes of one engine at once
        # would share its one kept-alive connection.
        start = max(interval, first_round_bound_s(len(engines), timeout))
        for index, engine in enumerate(engines):
            self._start_poller(engine, start + interval * index / len(engines))
        await first_round(self.pollers, timeout)

    def apply_engines(self, config: Config) -> None:
        """A reload: start pollers for engines it added, stop those it removed, restart those it changed. A removed
        engine's open tickets stay in the ledger until their log entries (or leases) close them."""
        old = {e.name: e for e in self.config.engines}
        new = {e.name: e for e in config.engines}
        self.config = config
        observe = config.observe.for_fleet(len(config.engines))
        if observe != self.observe:  # the fleet's size moved its poll interval: every poller judges staleness by it
            log.info("%d engines: each polled every %.2fs", len(config.engines), observe.poll_interval_seconds)
            for poller in self.pollers:
                poller.observe = observe
        self.observe = observe
        for name in new.keys() - old.keys():
            self.metrics.engine(name)
        if self._worker_task is not None:  # the worker probes the new set from a fresh start; views carry over
            for name, engine in old.items():
                if new.get(name) != engine:
                    self._stop_poller(name)
            self.pollers = [*self.pollers, *(self._holder(e) for e in config.engines if old.get(e.name) != e)]
            order = {e.name: i for i, e in enumerate(config.engines)}
            self.pollers = sorted(self.pollers, key=lambda p: order[p.config.name])
            self._restart_worker()
            return
        for name, engine in old.items():
            if new.get(name) != engine:
                self._stop_poller(name)
        for engine in config.engines:
            if old.get(engine.name) != engine:
                self._start_poller(engine, 0.0)
        order = {e.name: i for i, e in enumerate(config.engines)}
        self.pollers = sorted(self.pollers, key=lambda p: order[p.config.name])

    async def stop(self) -> None:
        if self._worker_task is not None:
            self._worker_task.cancel()
            await asyncio.gather(self._worker_task, return_exceptions=True)
            self._worker_task = None
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for poller in self.pollers:
            poller.close()

    # -- the probe worker (observe/worker.py) --------------------------------------------------------------------------
    def _holder(self, engine: EngineConfig) -> EnginePoller:
        """A poller that never probes: it holds the views the worker sends (and this process's drains and failures)."""
        return EnginePoller(engine, self.observe, self.probed, clock=self.clock)

    async def _start_worker(self) -> None:
        """Start the worker and wait for its first probe round (bounded), then keep reading it in a task."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._worker_task = asyncio.create_task(self._run_worker(ready), name="probe-worker")
        wait = first_round_bound_s(len(self.pollers), self.observe.poll_timeout_seconds) + WORKER_START_S
        try:
            await asyncio.wait_for(asyncio.shield(ready), wait)
        except asyncio.TimeoutError:
            log.warning("the probe worker's first round did not finish within %.1fs; serving meanwhile", wait)

    def _restart_worker(self) -> None:
        if self._worker_task is not None:
            self._worker_task.cancel()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._worker_task = asyncio.create_task(self._run_worker(ready), name="probe-worker")

    async def _run_worker(self, ready: asyncio.Future[None]) -> None:
        """Run the worker, apply its frames; restart it (after ``WORKER_RESTART_S``) whenever it exits: at idle priority
        (``observe.worker_priority``) unless it reported itself starved within ``WORKER_IDLE_RETRY_S``."""
        while True:
            idle = self.observe.worker_priority is WorkerPriority.IDLE and self.clock() >= self._idle_again_at
            setup = WorkerSetup(tuple(p.config for p in self.pollers), self.observe,
                                logging.getLogger().getEffectiveLevel(), idle)
            starvations = self.worker_starvations
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "controlplane.observe.worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE)
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write(encode(setup))
                await process.stdin.drain()
                while self.worker_starvations == starvations:
                    batch = await read_frame(process.stdout)
                    for start in range(0, len(batch), FRAMES_PER_TURN):
                        for raw in batch[start:start + FRAMES_PER_TURN]:
                            self._apply_frame(decode_report(raw), ready)
                        self.refresh_rows(self.clock())
                        # One slice, then a pause: Checks that arrived meanwhile go first (FRAMES_PER_TURN, giveway.py).
                        await give_way()
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                log.error("the probe worker exited (%s); restarting it in %.1fs", exc, WORKER_RESTART_S)
            finally:
                if process.returncode is None and self.worker_starvations != starvations:
                    process.kill()  # starved, it could take seconds of busy cores to exit by itself
                    await process.wait()
                elif process.returncode is None:
                    process.stdin.close()
                    try:
                        await asyncio.wait_for(process.wait(), 2.0)
                    except (asyncio.TimeoutError, asyncio.CancelledError):
                        process.kill()
                        await process.wait()
            await asyncio.sleep(WORKER_RESTART_S)

    def _apply_frame(self, frame: tuple[Any, ...], ready: asyncio.Future[None]) -> None:
        kind = frame[0]
        if kind == "ready":
            if not ready.done():
                ready.set_result(None)
            return
        if kind == "starved":
            self.worker_starvations += 1
            self._idle_again_at = self.clock() + WORKER_IDLE_RETRY_S
            self.metrics.probe_worker_starved.inc()
            log.warning("the probe worker was starved of CPU at idle priority (its timer fired %.1f s late: every core "
                        "busy); restarting it at nice for %.0f s", frame[1], WORKER_IDLE_RETRY_S)
            return
        view: EngineView = frame[1]
        poller = self._by_name.get(view.name) or self._find(view.name)
        if poller is None:  # removed by a reload since the worker started
            return
        poller.adopt(view)
        if kind == "probed":
            self.probed(poller.view(self.clock()), frame[2])

    def _start_poller(self, engine: EngineConfig, offset: float) -> None:
        poller = EnginePoller(engine, self.observe, self.probed, clock=self.clock)
        self.pollers = [*self.pollers, poller]
        self._tasks[engine.name] = asyncio.create_task(poller.run(offset), name=f"poll-{engine.name}")

    def _stop_poller(self, name: str) -> None:
        stopped = self._find(name)
        self.pollers = [p for p in self.pollers if p.config.name != name]
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
            if stopped is not None:  # its connection closes once the cancelled probe has let go of it
                close = stopped.close
                task.add_done_callback(lambda _: close())
        self._up.pop(name, None)  # an engine added again under this name gets its gauges set afresh
        self._shown_rates.pop(name, None)
        if name not in {e.name for e in self.config.engines}:
            self.metrics.forget_engine(name)

    def _find(self, name: str) -> EnginePoller | None:
        return next((p for p in self.pollers if p.config.name == name), None)

    def _sync_engines(self, now: float) -> None:
        """Pollers were added, removed or reordered (start, reload): the index follows, every view noted afresh."""
        self._indexed = self.pollers
        self._by_name = {p.config.name: p for p in self.pollers}
        self.core.set_engines(self._by_name)
        for poller in self.pollers:
            self._note_view(poller, now)

    def _note_view(self, poller: EnginePoller, now: float) -> None:
        view = poller.view(now)
        self.core.note_view(view)
        if view.last_ok_at is not None and not view.stale and view.name not in self._watched:
            # When this view turns stale unless a probe lands first (EnginePoller.view: strictly older than the window).
            # One entry per engine: a later probe does not push another, the entry is pushed again when it comes due
            # (``fleet``), so the heap holds the fleet, not every probe of the last staleness window (at 1000 engines a
            # second, a Check popped 16 superseded entries).
            self._watched.add(view.name)
            heapq.heappush(self._stale_at, (view.last_ok_at + self.observe.stale_after_s, view.name))
