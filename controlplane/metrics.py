"""The control plane's Prometheus metrics (prefix ``sluice_``), on a registry per instance so tests can run several.

A scrape (``SluiceMetrics.exposition``) reads what lives on the event loop (the ledger's tickets, the engines' views, the
task count) there, and renders the rest in a thread: at 1000 engines the per-engine series are about 17,000 lines, and
rendering them on the loop held every Check for 0.2-0.3 s at each scrape (bench/results/README.md, 2026-12-02,
4838871). The instruments (counters, gauges, histograms) are thread-safe; the loop-side collectors are only ever
called on the loop.

Every per-engine child is created when the engine is registered (``engine``), at start-up before the control plane
freezes its start-up objects out of the collector's reach (app.py), not at the engine's first event: created later,
1000 engines' histogram children were most of what each full collection traversed. The per-engine families are plain
values rendered from pre-built line prefixes (``EngineHistogram``, ``EngineFamily``) and the rest with each label set
formatted once (``exposition_text``), in prometheus_client's exact text: at 1000 engines its generic path made a scrape
0.25-0.4 s of GIL-holding Python, now 30-50 ms."""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_go_float = cast(Callable[[float], str], floatToGoString)
"""prometheus_client's number format (untyped there)."""


def _label_value(text: str) -> str:
    """A label value escaped as prometheus_client's text format escapes it."""
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _head(name: str, documentation: str, kind: str) -> str:
    """A family's ``# HELP`` and ``# TYPE`` lines, as generate_latest writes them."""
    documentation = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {documentation}\n# TYPE {name} {kind}\n"


class _OpenTickets(Collector):
    """``sluice_tickets_open{engine}`` read from the ledger at scrape time, so it can never drift from it."""

    def __init__(self, open_tickets: Callable[[], dict[str, int]]) -> None:
        self._open_tickets = open_tickets

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("sluice_tickets_open", "Admission tickets not yet released.", labels=["engine"])
        for engine, count in sorted(self._open_tickets().items()):
            family.add_metric([engine], count)
        yield family


@dataclass(frozen=True, slots=True)
class EngineState:
    """What one engine's last probe showed, for the per-engine gauges (None: not reported, the series is left out)."""

    name: str
    running: float | None
    waiting: float | None
    kv_usage: float | None
    prefill_tokens_per_s: float | None
    """The last interval that measured one (an idle interval measures nothing and keeps the previous figure)."""
    decode_tokens_per_s_each: float | None
    degraded: bool | None
    """None until the engine's first good probe."""


class _EngineStates(Collector):
    """The per-engine probe gauges, read from the engines' current views at scrape time: a probe sets nothing (at 1000
    engines, six gauge writes per probe were 6,000 locked writes a second), and they cannot drift from what decisions
    read."""

    def __init__(self, states: Callable[[], Iterable[EngineState]]) -> None:
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = (
            ("sluice_engine_requests_running", "Running requests from the engine's last probe.", "running"),
            ("sluice_engine_requests_waiting", "Waiting requests from the engine's last probe.", "waiting"),
            ("sluice_engine_kv_usage_ratio", "KV-cache usage from the engine's last probe (0..1).", "kv_usage"),
            ("sluice_engine_prefill_tokens_per_second", "Prefill tokens per second of prefill, last interval.",
             "prefill_tokens_per_s"),
            ("sluice_engine_decode_tokens_per_second_each", "One request's decode rate, last interval.",
             "decode_tokens_per_s_each"),
            ("sluice_observer_degraded", "1 when the engine lacks a load gauge its flavour needs.", "degraded"),
        )
        states = list(self._states())
        for name, documentation, field in families:
            family = GaugeMetricFamily(name, documentation, labels=["engine"])
            for state in states:
                value = getattr(state, field)
                if value is not None:
                    family.add_metric([state.name], float(value))
            yield family

    def as_of_now(self) -> _EngineStates:
        """The same gauges over the engines' states read now (on the loop), to be built and rendered elsewhere: at 1000
        engines building the six families took about 10 ms, which held the loop on every scrape."""
        states = tuple(self._states())
        return _EngineStates(lambda: states)


class _Fixed(Collector):
    """Families already read."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


class _PrefixIndex(Collector):
    """The prefix index's size, read at scrape time: ``sluice_prefix_index_blocks`` (entries held) and its bound."""

    def __init__(self, usage: Callable[[], tuple[int, int]]) -> None:
        self._usage = usage

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held, limit = self._usage()
        yield GaugeMetricFamily("sluice_prefix_index_blocks", "Entries (engine, prompt block) the prefix index holds.",
                                value=held)
        yield GaugeMetricFamily("sluice_prefix_index_limit_blocks",
                                "Bound on the prefix index's entries (admission.prefix_index_blocks).", value=limit)


NO_TENANT_LABEL = "-"
"""The ``tenant`` label of requests without a tenant (one tenant for fair share; no configured name can be ``-``)."""


class _TenantShares(Collector):
    """Fair share per model and tenant (core/fairshare.py), read from the admission core at scrape time: each tenant's
    virtual token counter, the tokens served to it and its parked requests. Tenants are the config's, so the label's
    cardinality is too (``-``: requests without a tenant)."""

    def __init__(self, shares: Callable[[], Iterable[tuple[str, str, float, float, int]]]) -> None:
        self._shares = shares

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model", "tenant"]
        counter = GaugeMetricFamily(
            "sluice_tenant_fair_counter", "A tenant's virtual token counter for a model (weighted tokens served / its "
            "weight; only differences between tenants matter): the lowest is served next within a class.", labels=labels)
        served = GaugeMetricFamily(
            "sluice_tenant_served_tokens", "Tokens (prompt + output) this replica's admissions served a tenant for a "
            "model: the admission's estimate until the access log settles the real usage.", labels=labels)
        waiting = GaugeMetricFamily("sluice_tenant_waiting_requests", "A tenant's requests parked for a model now.",
                                    labels=labels)
        rows: dict[tuple[str, str], tuple[float, float, int]] = {}
        for model, tenant, value, tokens, parked in self._shares():
            key = (model, tenant or NO_TENANT_LABEL)  # models no engine serves share the label "-": summed
            before = rows.get(key, (0.0, 0.0, 0))
            rows[key] = (before[0] + value, before[1] + tokens, before[2] + parked)
        for (model, tenant), (value, tokens, parked) in sorted(rows.items()):
            counter.add_metric([model, tenant], value)
            served.add_metric([model, tenant], tokens)
            waiting.add_metric([model, tenant], parked)
        yield counter
        yield served
        yield waiting


class _EventLoopTasks(Collector):
    """``sluice_event_loop_tasks``: ``len(asyncio.all_tasks())`` on the control plane's event loop at scrape time (a
    task leak shows as growth). The loop is the one the last in-loop scrape ran on (``/metrics`` is served on it); a
    scrape from another thread before any in-loop one finds no loop and leaves the gauge out."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass
        if self._loop is None or self._loop.is_closed():
            return
        yield GaugeMetricFamily("sluice_event_loop_tasks", "Tasks alive on the control plane's event loop.",
                                value=len(asyncio.all_tasks(self._loop)))


class EngineHistogramChild:
    """One engine's buckets (``EngineHistogram``): observed on the event loop only."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        """Per bucket, not cumulative (the last is +Inf's)."""
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus's ``le``
        self.total += value


class EngineValue:
    """One engine's counter or gauge (``EngineFamily``): written on the event loop only."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value


class EngineFamily(Collector):
    """A counter or a gauge labelled by engine, its text rendered directly (``EngineHistogram`` says why): a scrape
    takes the engines' children on the loop (one list) and reads their values in the rendering thread (a float read is
    atomic under the GIL). ``collect`` gives the same family as prometheus_client objects (``get_sample_value``)."""

    def __init__(self, name: str, documentation: str, counter: bool, initial: float = 0.0) -> None:
        self.name = name
        self.documentation = documentation
        self.counter = counter
        self.initial = initial
        self.exposed = f"{name}_total" if counter else name
        self._children: dict[str, tuple[str, EngineValue]] = {}

    def labels(self, engine: str) -> EngineValue:
        held = self._children.get(engine)
        if held is None:
            held = self._children[engine] = (f'{self.exposed}{{engine="{_label_value(engine)}"}} ',
                                             EngineValue(self.initial))
        return held[1]

    def remove(self, engine: str) -> None:
        self._children.pop(engine, None)

    def snapshot(self) -> list[tuple[str, EngineValue]]:
        return list(self._children.values())

    def text(self, snapshot: list[tuple[str, EngineValue]]) -> str:
        head = _head(self.exposed, self.documentation, "counter" if self.counter else "gauge")
        return head + "".join([f"{prefix}{_go_float(child.value)}\n" for prefix, child in snapshot])

    def collect(self) -> Iterator[Metric]:
        family = (CounterMetricFamily if self.counter else GaugeMetricFamily)(self.name, self.documentation,
                                                                              labels=["engine"])
        for engine, (_, child) in self._children.items():
            family.add_metric([engine], child.value)
        yield family


class EngineHistogram(Collector):
    """A histogram labelled by engine, its text rendered directly: at 1000 engines ``sluice_ttft_estimate_error_ratio``
    is 15,000 lines, and prometheus_client's generic path (a locked read and a sample object per line, then a format per
    line) took about 150 ms of a 224 ms scrape, in a thread that holds the GIL, so the loop waited up to a switch
    interval at each wake-up meanwhile. Here the loop copies each engine's counts (``snapshot``) and the thread joins
    pre-built line prefixes. ``collect`` gives the same family as prometheus_client objects (``get_sample_value``)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds: tuple[float, ...] = (*(float(b) for b in buckets), math.inf)
        self._children: dict[str, tuple[tuple[str, ...], EngineHistogramChild]] = {}
        """engine -> its line prefixes (each bucket's, then ``_count``'s and ``_sum``'s) and its buckets."""

    def labels(self, engine: str) -> EngineHistogramChild:
        held = self._children.get(engine)
        if held is None:
            label = f'engine="{_label_value(engine)}"'
            prefixes = (*(f'{self.name}_bucket{{{label},le="{_go_float(b)}"}} ' for b in self.bounds),
                        f"{self.name}_count{{{label}}} ", f"{self.name}_sum{{{label}}} ")
            held = self._children[engine] = (prefixes, EngineHistogramChild(self.bounds))
        return held[1]

    def remove(self, engine: str) -> None:
        self._children.pop(engine, None)

    def snapshot(self) -> list[tuple[tuple[str, ...], list[int], float]]:
        """Each engine's line prefixes and a copy of its counts and sum, taken on the loop (where they are written): read
        from the thread, an observation landing between a bucket's count and the sum would tear them."""
        return [(prefixes, child.counts[:], child.total) for prefixes, child in self._children.values()]

    def text(self, snapshot: list[tuple[tuple[str, ...], list[int], float]]) -> str:
        lines = [_head(self.name, self.documentation, "histogram")]
        for prefixes, counts, total in snapshot:
            cumulative = 0
            for prefix, count in zip(prefixes, counts):
                cumulative += count
                lines.append(f"{prefix}{_go_float(cumulative)}\n")
            lines.append(f"{prefixes[-2]}{_go_float(cumulative)}\n{prefixes[-1]}{_go_float(total)}\n")
        return "".join(lines)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["engine"])
        for engine, (_, child) in self._children.items():
            cumulative, buckets = 0, []
            for bound, count in zip(self.bounds, child.counts[:]):
                cumulative += count
                buckets.append((_go_float(bound), cumulative))
            family.add_metric([engine], buckets, child.total)
        yield family


_PLAIN_TYPES = frozenset({"counter", "gauge", "histogram"})


def exposition_text(families: Iterable[Metric]) -> str:
    """prometheus_client's text format (``generate_latest``), the same bytes, for the families the control plane
    exposes, with each label set rendered once per scrape instead of once per sample: at 1000 engines a scrape's 14,000
    per-engine gauge and counter lines repeat the same 1000 ``{engine="..."}`` (generate_latest sorts, escapes and
    formats every sample's labels: about 4.5 us a line). Families of another type, or with timestamps or exemplars,
    go through generate_latest itself. Names are the control plane's own (always valid legacy names: no escaping)."""
    labels_text: dict[tuple[tuple[str, str], ...], str] = {}
    out: list[str] = []
    for metric in families:
        samples = metric.samples
        if metric.type not in _PLAIN_TYPES or any(s.timestamp is not None or s.exemplar for s in samples):
            out.append(generate_latest(_Fixed([metric])).decode())
            continue
        out.append(_head(metric.name + "_total" if metric.type == "counter" else metric.name, metric.documentation,
                         metric.type))
        for sample in samples:
            key = tuple(sample.labels.items())
            text = labels_text.get(key)
            if text is None:
                text = labels_text[key] = ("{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(key)) + "}"
                                           if key else "")
            out.append(f"{sample.name}{text} {_go_float(sample.value)}\n")
    return "".join(out)


class _Read(Collector):
    """What was read on the loop (collectors over a snapshot), handed to the rendering thread with the instruments."""

    def __init__(self, instruments: Collector, read: Sequence[Collector]) -> None:
        self._instruments = instruments
        self._read = read

    def collect(self) -> Iterator[Metric]:
        for collector in self._read:
            yield from collector.collect()
        for metric in self._instruments.collect():
            # No ``*_created`` series (prometheus_client's timestamp per counter and histogram child, which nothing here
            # reads): at 1000 engines they were 5,000 of a scrape's 27,000 lines. Dropped here rather than with
            # prometheus_client's process-wide switch, which would also drop them from the vLLM exposition the engine
            # simulator and the bench farm render (real vLLM sends them).
            metric.samples = [sample for sample in metric.samples if not sample.name.endswith("_created")]
            yield metric


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
        self._on_loop: tuple[Collector, ...] = (_OpenTickets(open_tickets), _EngineStates(engine_states),
                                                _PrefixIndex(prefix_index), _EventLoopTasks(),
                                                _TenantShares(tenant_shares))
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
        read = [c.as_of_now() if isinstance(c, _EngineStates) else _Fixed(list(c.collect())) for c in self._on_loop]
        histograms = [(histogram, histogram.snapshot()) for histogram in (self.ttft_error, self.engine_ttft,
                                                                                     self.end_to_end_error)]
        values = [(family, family.snapshot()) for family in self._engine_families]

        def render() -> bytes:
            return (exposition_text(_Read(self._instruments, read).collect())
                    + "".join(histogram.text(snapshot) for histogram, snapshot in histograms)
                    + "".join(family.text(snapshot) for family, snapshot in values)).encode()
        return await asyncio.to_thread(render)
