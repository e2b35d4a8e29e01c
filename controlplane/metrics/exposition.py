"""The Prometheus text the control plane serves, rendered directly: prometheus_client's exact text format, with each
label set formatted once per scrape (``exposition_text``) and the per-engine families rendered from line prefixes built
when the engine is registered (``EngineHistogram``, ``EngineFamily``): at 1000 engines prometheus_client's generic path
made a scrape 0.25-0.4 s of GIL-holding Python, this one 30-50 ms. Per-engine children are written on the event loop
only; a scrape copies them there (``snapshot``) and renders the copy in a thread."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

from prometheus_client import generate_latest
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


class Fixed(Collector):
    """Families already read."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


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
            out.append(generate_latest(Fixed([metric])).decode())
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


class ReadOnLoop(Collector):
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

