"""The control plane's Prometheus metrics (prefix ``sluice_``), on a registry per instance so tests can run several.

A scrape (``SluiceMetrics.exposition``) reads what lives on the event loop (the ledger's tickets, the engines' views, the
task count: ``collectors.py``) there, and renders the rest in a thread (``exposition.py``): at 1000 engines the
per-engine series are about 17,000 lines, and rendering them on the loop held every Check for 0.2-0.3 s at each scrape
(bench/results/README.md, 2026-12-02, 4838871). The instruments (counters, gauges, histograms) are thread-safe; the
loop-side collectors are only ever called on the loop.

Every per-engine child is created when the engine is registered (``engine``), at start-up before the control plane
freezes its start-up objects out of the collector's reach (app.py), not at the engine's first event: created later,
1000 engines' histogram children were most of what each full collection traversed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from controlplane.metrics.collectors import (
    NO_TENANT_LABEL, EngineState, EngineStates, EventLoopTasks, OpenTickets, PrefixIndex, TenantShares,
)
from controlplane.metrics.exposition import (
    EngineFamily, EngineHistogram, EngineHistogramChild, EngineValue, Fixed, ReadOnLoop, exposition_text,
)

__all__ = ["NO_TENANT_LABEL", "EngineSeries", "EngineState", "SluiceMetrics"]


@dataclass(frozen=True, slots=True)
class EngineSeries:
    """One engine's labelled children of the per-engine instruments (``SluiceMetrics.engine``)."""

    up: EngineValue
    stale: EngineValue
    ttft_error: EngineHistogramChild
    ttft_seconds: EngineHistogramChild
    end_to_end_error: EngineHistogramChild
    ttft_correction: EngineValue
    tickets_released: EngineValue
    tickets_expired: EngineValue
    retries: EngineValue


class SluiceMetrics:
    def __init__(self, open_tickets: Callable[[], dict[str, int]] = dict,
                 prefix_index: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 engine_states: Callable[[], Iterable[EngineState]] = tuple,
                 tenant_shares: Callable[[], Iterable[tuple[str, str, float, float, int]]] = tuple) -> None:
        r = self._instruments = CollectorRegistry()
        self._on_loop: tuple[Collector, ...] = (OpenTickets(open_tickets), EngineStates(engine_states),
                                                PrefixIndex(prefix_index), EventLoopTasks(),
                                                TenantShares(tenant_shares))
        """Collectors that read event-loop state: called on the loop only."""
        self.registry = CollectorRegistry()
        """Everything (what tests and ``get_sample_value`` read): the instruments and the loop-side collectors."""
        self.registry.register(r)
        for collector in self._on_loop:
            self.registry.register(collector)
        self._engines: dict[str, EngineSeries] = {}
        self.xds_nacks = Counter("sluice_xds_nacks", "xDS responses Envoy rejected.", ["type_url"], registry=r)
        self.xds_streams = Gauge("sluice_xds_streams", "Open ADS streams.", registry=r)
        self.xds_responses = Counter("sluice_xds_responses", "xDS responses sent.", ["type_url"], registry=r)
        self.admission_decisions = Counter(
            "sluice_admission_decisions", "Final answer to every Check.", ["model", "verdict", "reason"], registry=r
        )
        self.adapter_loads = Counter(
            "sluice_adapter_loads", "LoRA adapter loads and unloads sent to engines (adapters.dynamic_loading).",
            ["engine", "action", "outcome"], registry=r,
        )
        self.admission_parked = Counter(
            "sluice_admission_parked", "Requests that had to park before their answer.", ["model"], registry=r
        )
        self.admission_rejected = Counter(
            "sluice_admission_rejected", "Requests refused (4xx) or shed (503).", ["reason"], registry=r
        )
        self.park_seconds = Histogram(
            "sluice_park_seconds", "Time parked requests waited before admit or shed.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300), registry=r,
        )
        self.parked_now = Gauge("sluice_parked_requests", "Requests parked right now.", registry=r)
        self.ttft_error = EngineHistogram(
            "sluice_ttft_estimate_error_ratio",
            "A served stream's TTFT (its first token passing Envoy, from the request fully sent to its engine) over the "
            "TTFT the decision estimated.",
            buckets=(0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 10),
        )
        self.registry.register(self.ttft_error)
        self.engine_ttft = EngineHistogram(
            "sluice_engine_ttft_seconds",
            "Time from a served request fully sent to its engine to its first token passing Envoy (a non-streaming "
            "response's whole body): the TTFT clients saw, less the gateway's part (sluice_gateway_seconds).",
            buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60),
        )
        self.registry.register(self.engine_ttft)
        self.end_to_end_error = EngineHistogram(
            "sluice_end_to_end_estimate_error_ratio",
            "A served request's time at its engine (request fully sent to last byte) over the admission's estimate for "
            "an answer of its real length (estimated TTFT + (tokens - 1) / estimated decode rate); only requests whose "
            "length is known (usage, or a tenant's counted deltas) and that this replica admitted.",
            buckets=(0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 10),
        )
        self.registry.register(self.end_to_end_error)
        self.tokenize_requests = Counter(
            "sluice_tokenize_requests", "Long prompts a Check asked an engine's tokenizer to count "
            "(admission.tokenize_above_chars), by outcome: ok, timeout, failed, no_engine (the estimate stood).",
            ["outcome"], registry=r,
        )
        self.prompt_tokens_error = Histogram(
            "sluice_prompt_tokens_estimate_error_ratio", "A served request's prompt tokens as its engine counted them "
            "(usage.prompt_tokens) over the Check's estimate.", ["model"],
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2, 4), registry=r,
        )
        self.gateway_seconds = Histogram(
            "sluice_gateway_seconds", "Time from a served request's arrival at Envoy to its being fully sent to its "
            "engine: the Check, any park and the body.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r,
        )
        self.ttft_correction = EngineFamily(
            "sluice_ttft_correction",
            "What the engine's TTFT estimates (prefill and first token) are multiplied by, from the measured TTFTs "
            "against the estimates (1: none).", counter=False, initial=1.0,
        )
        self.preempted = Counter(
            "sluice_preempted", "Sheddable streams ended for a critical request (fairness.preempt_sheddable): each "
            "counted when the control plane ends it.", ["model", "engine"], registry=r)
        self.park_cancelled = Counter(
            "sluice_admission_park_cancelled", "Parked requests whose client went away.", registry=r
        )
        self.config_reloads = Counter(
            "sluice_config_reloads", "Policy reloads (admin ReloadConfig or SIGHUP), applied or refused.", ["result"],
            registry=r,
        )
        self.engine_retries = EngineFamily(
            "sluice_engine_retries", "Requests whose engine failed before the first byte and were retried elsewhere.",
            counter=True,
        )
        self.engine_failures = Counter(
            "sluice_engine_request_failures",
            "Requests Envoy could not get a first byte for from an engine (connect failure, reset, 503).",
            ["engine", "flags"], registry=r,
        )
        self.authz_seconds = Histogram(
            "sluice_authz_check_seconds",
            "Time to answer one ext_authz Check (server side).",
            buckets=(0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01,
                     0.025, 0.05, 0.1, 0.5, 1, 5, 30, 130),
            registry=r,
        )
        self.admin_refused = Counter(
            "sluice_admin_refused", "Admin API calls refused UNAUTHENTICATED (no token, or a wrong one).", ["method"],
            registry=r,
        )
        self.watch_dropped = Counter(
            "sluice_admin_watch_dropped", "Decision events a WatchDecisions watcher lost because it read too slowly.",
            registry=r,
        )
        self.authz_internal_errors = Counter(
            "sluice_authz_internal_errors",
            "Checks that failed inside the control plane, answered 500 internal_error (never left to Envoy's fail-open).",
            registry=r,
        )
        self.authz_overloaded = Counter(
            "sluice_authz_overloaded",
            "Checks that waited longer than controlplane.max_check_queue_ms before their handler ran, answered 503 "
            "controlplane_overloaded at once.",
            registry=r,
        )
        self.tickets_released = EngineFamily(
            "sluice_tickets_released", "Tickets released by an access-log entry.", counter=True
        )
        self.tickets_expired = EngineFamily(
            "sluice_tickets_expired", "Tickets reaped by lease expiry (their access-log entry was lost).", counter=True
        )
        self.access_log_entries = Counter(
            "sluice_access_log_entries", "HTTP access-log entries received from Envoy.", ["outcome"], registry=r
        )
        self.probe_worker_starved = Counter(
            "sluice_probe_worker_starved", "Times the idle-priority probe worker got too little CPU and was restarted at "
            "nice (observe.worker_priority).", registry=r,
        )
        self.engine_up = EngineFamily("sluice_engine_up", "1 when the engine's last probe is fresh.", counter=False)
        self.engine_stale = EngineFamily(
            "sluice_engine_state_stale", "Transitions of an engine from fresh to stale.", counter=True
        )
        self._engine_families = (self.engine_up, self.engine_stale, self.ttft_correction, self.tickets_released,
                                 self.tickets_expired, self.engine_retries)
        for family in self._engine_families:
            self.registry.register(family)
        # The shared store (controlplane/store/): every replica exports its own; ``replica`` names which one it is.
        self.replica_info = Gauge("sluice_replica_info", "1, labelled with this control plane's replica id and store "
                                  "backend.", ["replica", "backend"], registry=r)
        self.store_seconds = Histogram(
            "sluice_store_seconds", "Time one call to the shared store took (reserve, release, park, ...).", ["op"],
            buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.store_errors = Counter("sluice_store_errors", "Store calls that failed or timed out (store.on_failure "
                                    "applied).", ["op"], registry=r)
        self.store_refusals = Counter(
            "sluice_store_refusals", "Admissions the shared store refused because another replica was first (cap, kv, "
            "queued); the request was decided again.", ["refusal"], registry=r)
        self.line_strays_removed = Counter(
            "sluice_line_strays_removed", "Members of this replica in a shared line that its lot no longer held, taken "
            "out by the line audit (each one had blocked its model's admissions; it should stay 0).", registry=r)
        self.store_fail_open = Counter(
            "sluice_store_fail_open", "Admissions made on this replica's own ledger while the store was unreachable "
            "(store.on_failure: open).", registry=r)
        self.store_up = Gauge("sluice_store_up", "1 while the shared store answers this replica.", registry=r)
        # Tenants (controlplane/admission/quota.py): the label is a configured tenant's name, so its cardinality is the config's.
        self.ratelimit_decisions = Counter(
            "sluice_ratelimit_decisions", "Tenants' pre-charges by result: allowed, over_limit, concurrency, too_large "
            "(refused 429), store_error (the limiter's store did not answer; ratelimit.on_failure applied).",
            ["tenant", "result"], registry=r)
        self.ratelimit_errors = Counter(
            "sluice_ratelimit_errors", "Limiter calls that failed or timed out (charge: ratelimit.on_failure applied; "
            "settle: the pre-charge stands; peek).", ["op"], registry=r)
        self.tenant_tokens = Counter(
            "sluice_tenant_tokens", "Tokens tenants' finished requests used (prompt, completion): the engine's usage, "
            "else the prompt estimate and the streamed deltas.", ["tenant", "kind"], registry=r)
        self.tenant_park_seconds = Histogram(
            "sluice_tenant_park_seconds", "Time a tenant's requests waited in the parking lot before their answer: "
            "every admission (0 when admitted at once) and every shed after parking (tenant -: requests without one).",
            ["tenant"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300), registry=r)
        self.auth_refusals = Counter(
            "sluice_auth_refusals", "Requests refused for who sent them: invalid_api_key (401), model_not_allowed "
            "(403).", ["reason"], registry=r)
        self.prefix_forgotten = Counter(
            "sluice_prefix_index_forgotten", "Times the prefix index forgot everything an engine held (restart, drained).",
            ["reason"], registry=r)
        self.prefix_cached_tokens = Counter(
            "sluice_prefix_cached_tokens_expected",
            "Prompt tokens admitted requests were expected to find in their engine's prefix cache.", registry=r)
        self.prefix_prompt_tokens = Counter(
            "sluice_prefix_prompt_tokens", "Prompt tokens (estimated) of admitted requests: the expected hit ratio's "
            "denominator.", registry=r)

    def engine(self, name: str) -> EngineSeries:
        """``name``'s per-engine children, created at its first call (the control plane calls it when the engine is
        registered: observation.py)."""
        series = self._engines.get(name)
        if series is None:
            series = self._engines[name] = EngineSeries(
                self.engine_up.labels(name), self.engine_stale.labels(name), self.ttft_error.labels(name),
                self.engine_ttft.labels(name), self.end_to_end_error.labels(name), self.ttft_correction.labels(name),
                self.tickets_released.labels(name), self.tickets_expired.labels(name),
                self.engine_retries.labels(name))
        return series

    def forget_engine(self, name: str) -> None:
        """An engine left the config: its series leave the exposition (a later engine of that name starts afresh)."""
        self._engines.pop(name, None)
        self.ttft_error.remove(name)
        self.engine_ttft.remove(name)
        self.end_to_end_error.remove(name)
        for family in self._engine_families:
            family.remove(name)

    async def exposition(self) -> bytes:
        """The Prometheus text of everything: the loop-side state read here (the engines' states as a snapshot), the
        families built and rendered in a thread."""
        read = [c.as_of_now() if isinstance(c, EngineStates) else Fixed(list(c.collect())) for c in self._on_loop]
        histograms = [(histogram, histogram.snapshot()) for histogram in (self.ttft_error, self.engine_ttft,
                                                                                     self.end_to_end_error)]
        values = [(family, family.snapshot()) for family in self._engine_families]

        def render() -> bytes:
            return (exposition_text(ReadOnLoop(self._instruments, read).collect())
                    + "".join(histogram.text(snapshot) for histogram, snapshot in histograms)
                    + "".join(family.text(snapshot) for family, snapshot in values)).encode()
        return await asyncio.to_thread(render)
