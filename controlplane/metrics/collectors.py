"""The families read from event-loop state at scrape time (the ledger's tickets, the engines' views, the prefix index,
fair share, the loop's tasks), so they cannot drift from what decisions read. Called on the event loop only: a scrape
reads them there and hands the families read to the rendering thread (``exposition.Fixed``,
``EngineStates.as_of_now``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class OpenTickets(Collector):
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


class EngineStates(Collector):
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

    def as_of_now(self) -> EngineStates:
        """The same gauges over the engines' states read now (on the loop), to be built and rendered elsewhere: at 1000
        engines building the six families took about 10 ms, which held the loop on every scrape."""
        states = tuple(self._states())
        return EngineStates(lambda: states)


class PrefixIndex(Collector):
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


class TenantShares(Collector):
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


class EventLoopTasks(Collector):
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

