"""The simulator's ``/metrics`` in each engine's own dialect: names, types and labels as the real engines publish them
(../shared/docs/engine-metrics.md). Rendered by prometheus_client from one set of numbers, so every flavour describes the
same simulated engine.

- ``vllm-v1`` (0.10-style): ``model_name`` + data-parallel ``engine`` labels, both KV names (``kv_cache_usage_perc`` and the
  deprecated ``gpu_cache_usage_perc``), ``cache_config_info`` with ``engine``, the prefix cache's
  ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens) and the newer
  ``request_prefill_kv_computed_tokens`` histogram (prompt tokens a request computed, cache hits excluded).
- LoRA (both vLLM dialects, only with adapter slots): ``lora_requests_info`` with the labels ``max_lora``,
  ``waiting_lora_adapters``, ``running_lora_adapters`` (comma-joined names) and no ``model_name``/``engine``, its value the
  Unix time it was last set (``set_to_current_time``); one series per label set ever recorded, as prometheus_client keeps
  every child of a labelled gauge (vLLM V1 ``PrometheusStatLogger.record``).
- ``vllm-v0``: no ``engine`` label, ``gpu_cache_usage_perc`` only, ``num_requests_swapped``.
- ``sglang`` (0.5-style): ``sglang:`` names; gauges repeated for two tensor-parallel ranks, as a TP=2 server does;
  ``cached_tokens_total`` and ``cache_hit_rate`` for its prefix cache.
- ``llamacpp`` (mainline): ``llamacpp:`` names, no labels, no KV gauges (removed upstream in PR #13660).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from enginesim.batcher import Batcher
from enginesim.hist import LATENCY_BUCKETS, TOKEN_BUCKETS, Hist

class Dialect(enum.StrEnum):
    """The metric dialect (and discovery endpoints) a simulator speaks: the config's ``sim_flavor``."""

    VLLM_V1 = "vllm-v1"
    VLLM_V0 = "vllm-v0"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"

    @property
    def vllm(self) -> bool:
        return self in (Dialect.VLLM_V1, Dialect.VLLM_V0)

    @property
    def filters(self) -> bool:
        """Whether ``/metrics?name[]=...`` answers only those samples, as a real vLLM with one API server does (its
        ``/metrics`` is prometheus_client's ``make_asgi_app`` over the default registry, where every metric is a named
        collector). The other dialects answer the whole exposition, as llama.cpp's own server does; a real SGLang
        answers nothing (its registry's only collector, the multiprocess one, has no names to match), and sluice never
        sends it the query (``controlplane/observe/parse.py``, ``FILTERING_FLAVORS``)."""
        return self.vllm

    @classmethod
    def of(cls, flavor: str) -> Dialect:
        """``flavor`` as a dialect; ValueError naming the known ones otherwise."""
        if flavor not in {d.value for d in cls}:
            raise ValueError(f"unknown flavour {flavor!r}; known: {', '.join(cls)}")
        return cls(flavor)


@dataclass
class RequestStats:
    """Per-request histograms the shell fills as requests finish."""

    ttft: Hist = field(default_factory=lambda: Hist(LATENCY_BUCKETS))
    e2e: Hist = field(default_factory=lambda: Hist(LATENCY_BUCKETS))
    prefill_time: Hist = field(default_factory=lambda: Hist(LATENCY_BUCKETS))
    prompt_tokens: Hist = field(default_factory=lambda: Hist(TOKEN_BUCKETS))
    prefill_computed: Hist = field(default_factory=lambda: Hist(TOKEN_BUCKETS))
    """Prompt tokens each request computed (not found in the prefix cache)."""
    generation_tokens: Hist = field(default_factory=lambda: Hist(TOKEN_BUCKETS))
    success: int = 0
    """Requests that ran to their end (``finished``'s stop and length)."""
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    """Requests by how they ended, as vLLM V1 counts them (``vllm:request_success_total{finished_reason}``): ``stop``
    (end of sequence), ``length`` (``max_tokens``) or ``abort`` (the client went away: the engine stopped it)."""


def _hist(name: str, doc: str, labels: dict[str, str], h: Hist) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), h.cumulative(), h.total)
    return family


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class SimCollector(Collector):
    def __init__(self, flavor: str, model: str, batcher: Batcher, stats: RequestStats) -> None:
        self.flavor = Dialect.of(flavor)
        self.model = model
        self.b = batcher
        self.stats = stats
        self.lora_series: dict[tuple[str, str, str], float] = {}
        """``(max_lora, waiting_lora_adapters, running_lora_adapters)`` -> Unix time that label set was last recorded."""

    def record_lora(self, wall_now: float) -> None:
        """After an engine step: set the series of the current running and waiting adapters to ``wall_now``."""
        if self.b.max_loras:
            key = (str(self.b.max_loras), ",".join(self.b.waiting_adapters()), ",".join(self.b.running_adapters()))
            self.lora_series[key] = wall_now

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        if self.flavor.vllm:
            yield from self._vllm(v1=self.flavor is Dialect.VLLM_V1)
        elif self.flavor is Dialect.SGLANG:
            yield from self._sglang()
        else:
            yield from self._llamacpp()

    def _vllm(self, *, v1: bool) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        b, st, p = self.b, self.stats, self.b.profile
        lab = {"model_name": self.model, **({"engine": "0"} if v1 else {})}
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lab, len(b.running))
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lab, len(b.waiting))
        if v1:
            yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lab, b.kv_usage)
        else:
            yield _gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", lab, 0)
        yield _gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", lab, b.kv_usage)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", lab, b.preemptions)
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab, b.prompt_tokens_total)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", lab, b.generation_tokens_total)
        if v1:  # V1's names since 0.9.2 (gpu_prefix_cache_* before; V0 had only a hit-rate gauge)
            yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                           lab, b.prefix.queries)
            yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lab,
                           b.prefix.hits)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*lab, "finished_reason"])
        for reason, count in st.finished.items():
            success.add_metric([*lab.values(), reason], count)
        yield success
        yield _hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lab, st.ttft)
        yield _hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", lab,
                    b.inter_token)
        yield _hist("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", lab, st.e2e)
        yield _hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", lab,
                    st.prefill_time)
        yield _hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lab, st.prompt_tokens)
        if v1:  # newer V1 (vLLM's metrics docs, December 2025): prefill work without the cache hits
            yield _hist("vllm:request_prefill_kv_computed_tokens",
                        "Histogram of new KV tokens computed during prefill (excluding cached tokens).", lab,
                        st.prefill_computed)
        yield _hist("vllm:request_generation_tokens", "Number of generation tokens processed.", lab, st.generation_tokens)
        info = {"block_size": str(p.block_size), "cache_dtype": "auto", "enable_prefix_caching": "True",
                "gpu_memory_utilization": "0.9", "num_gpu_blocks": str(p.num_gpu_blocks), "sliding_window": "None",
                **({"engine": "0"} if v1 else {})}
        yield _gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info, 1)
        if b.max_loras:
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            for key, stamp in self.lora_series.items():
                lora.add_metric(list(key), stamp)
            yield lora

    def _sglang(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        b, st, p = self.b, self.stats, self.b.profile
        used = p.kv_capacity_tokens - b.free_blocks * p.block_size
        gauges = (
            ("sglang:num_running_reqs", "The number of running requests.", len(b.running)),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", len(b.waiting)),
            ("sglang:token_usage", "The token usage.", b.kv_usage),
            ("sglang:num_used_tokens", "The number of used tokens.", used),
            ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.", p.kv_capacity_tokens),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name", "engine_type", "tp_rank", "pp_rank"])
            for tp in ("0", "1"):  # a TP=2 server repeats every gauge per rank: the scraper must not double it
                family.add_metric([self.model, "unified", tp, "0"], value)
            yield family
        lab = {"model_name": self.model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        yield _counter("sglang:prompt_tokens", "Number of prefill tokens processed.", lab, b.prompt_tokens_total)
        yield _counter("sglang:generation_tokens", "Number of generation tokens processed.", lab, b.generation_tokens_total)
        yield _counter("sglang:num_requests", "The number of processed requests.", lab, st.success)
        yield _counter("sglang:cached_tokens", "The number of prefix cached tokens.", lab, b.prefix.hits)
        yield _gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", lab,
                     b.prefix.hits / b.prefix.queries if b.prefix.queries else 0.0)
        yield _hist("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lab, st.ttft)
        yield _hist("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", lab, b.inter_token)
        yield _hist("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", lab, st.e2e)

    def _llamacpp(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        b = self.b
        none: dict[str, str] = {}
        yield _counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", none, b.prompt_tokens_total)
        yield _counter("llamacpp:prompt_seconds", "Prompt process time", none, b.prefill_seconds_total)
        yield _counter("llamacpp:tokens_predicted", "Number of generation tokens processed.", none,
                       b.generation_tokens_total)
        yield _counter("llamacpp:tokens_predicted_seconds", "Predict process time", none, b.decode_seconds_total)
        yield _counter("llamacpp:n_decode", "Total number of llama_decode() calls", none, b.inter_token.count)
        prompt_tps = b.prompt_tokens_total / b.prefill_seconds_total if b.prefill_seconds_total else 0.0
        predicted_tps = b.generation_tokens_total / b.decode_seconds_total if b.decode_seconds_total else 0.0
        yield _gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.", none, prompt_tps)
        yield _gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.", none,
                     predicted_tps)
        yield _gauge("llamacpp:requests_processing", "Number of requests processing.", none, len(b.running))
        yield _gauge("llamacpp:requests_deferred", "Number of requests deferred.", none, len(b.waiting))


def render(collector: Collector, names: Sequence[str] = ()) -> bytes:
    """The exposition as prometheus_client writes it; with ``names``, only those samples, by prometheus_client's own
    ``restricted_registry`` (what a real vLLM with one API server answers to ``/metrics?name[]=...``)."""
    # Collectors without names are filtered sample by sample, as a real vLLM's named collectors are.
    registry = CollectorRegistry(support_collectors_without_names=True)
    registry.register(collector)
    return generate_latest(registry.restricted_registry(names) if names else registry)


class _Parsed(Collector):
    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def restrict(exposition: bytes, names: Sequence[str]) -> bytes:
    """An exposition already rendered (``sluice bench``'s pre-rendered vLLM texts), restricted to ``names`` as a real
    server restricts its own: parsed back into families and rendered through ``render``."""
    return render(_Parsed(exposition.decode()), names)
