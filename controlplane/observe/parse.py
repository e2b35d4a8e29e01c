"""Turn an engine's ``/metrics`` text into an ``EngineSample``: scan for the few sample lines sluice reads, read only those.

The lines are read as prometheus_client's parser reads them (the usual shape by a small exact reader, anything unusual by
prometheus_client itself, line by line); tests/unit/test_parse_scan.py holds the two to the same result.

Rules (../shared/docs/engine-metrics.md, learned from other routers' breakages):

- a metric the engine did not expose is ``None`` (unknown), never 0; ``nan`` is unknown too;
- aliases resolve in order of preference (vLLM ``kv_cache_usage_perc`` before ``gpu_cache_usage_perc``,
  ``inter_token_latency_seconds`` before ``time_per_output_token_seconds``);
- vLLM data-parallel ``engine`` series: running and waiting are summed, KV usage is the max;
- SGLang: one tensor-parallel (and pipeline) rank, the ``priority=""`` total, data-parallel ranks summed (KV: max);
- ``*_created`` series are ignored; histograms contribute their ``_sum`` and ``_count`` for rates between polls;
- vLLM's ``lora_requests_info`` keeps one series per label set it ever recorded, its value the Unix time it was last set
  (``set_to_current_time``): the series with the largest value is the current state (``max_lora``, and the adapters
  running and waiting, comma-joined), the others are history.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlencode

from prometheus_client.parser import text_string_to_metric_families

from controlplane.core.engines import EngineSample, Flavor

Series = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True, slots=True)
class FlavorSpec:
    """Where each ``EngineSample`` field comes from in one engine flavour's metrics (names in order of preference)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    kv_used_tokens: tuple[str, ...] = ()
    kv_capacity_tokens: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    prompt_tokens: tuple[str, ...] = ()
    generation_tokens: tuple[str, ...] = ()
    decode_latency_histograms: tuple[str, ...] = ()
    """Per-token latency histograms: ``_count`` tokens over ``_sum`` seconds is one request's decode rate."""
    decode_counters: tuple[str, str] | None = None
    """(tokens counter, seconds counter) where the engine keeps decode time as plain counters (llama.cpp)."""
    prefill_histograms: tuple[str, str] | None = None
    """(prompt-tokens histogram, prefill-seconds histogram): their ``_sum`` deltas give prefill tokens/s."""
    prefill_computed_histogram: str | None = None
    """Prompt tokens each request computed, prefix-cache hits excluded: preferred over the prompt-tokens histogram (which
    counts the hits too) when the engine has it."""
    prefill_counters: tuple[str, str] | None = None
    output_length_histograms: tuple[str, ...] = ()
    """Per finished request, the tokens it generated: ``_sum`` over ``_count`` is the real mean answer length."""
    prefix_cache_queries: tuple[str, ...] = ()
    """Prompt tokens looked up in the engine's prefix cache (counter)."""
    prefix_cache_hits: tuple[str, ...] = ()
    """Prompt tokens found there (counter): prefill skipped them."""
    required: tuple[str, ...] = ()
    """Load gauges this flavour must expose; missing ones make the engine degraded (the startup self-check)."""


SPECS: dict[Flavor, FlavorSpec] = {
    Flavor.VLLM: FlavorSpec(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        preemptions=("vllm:num_preemptions_total",),
        prompt_tokens=("vllm:prompt_tokens_total",),
        generation_tokens=("vllm:generation_tokens_total",),
        decode_latency_histograms=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        prefill_histograms=("vllm:request_prompt_tokens", "vllm:request_prefill_time_seconds"),
        prefill_computed_histogram="vllm:request_prefill_kv_computed_tokens",
        output_length_histograms=("vllm:request_generation_tokens",),
        prefix_cache_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        prefix_cache_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        required=("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    ),
    Flavor.SGLANG: FlavorSpec(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        kv_used_tokens=("sglang:num_used_tokens",),
        kv_capacity_tokens=("sglang:max_total_num_tokens",),
        prompt_tokens=("sglang:prompt_tokens_total",),
        generation_tokens=("sglang:generation_tokens_total",),
        decode_latency_histograms=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        prefix_cache_queries=("sglang:prompt_tokens_total",),
        prefix_cache_hits=("sglang:cached_tokens_total",),
        required=("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
    ),
    Flavor.LLAMACPP: FlavorSpec(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        kv_used_tokens=("llamacpp:kv_cache_tokens",),
        prompt_tokens=("llamacpp:prompt_tokens_total",),
        generation_tokens=("llamacpp:tokens_predicted_total",),
        decode_counters=("llamacpp:tokens_predicted_total", "llamacpp:tokens_predicted_seconds_total"),
        prefill_counters=("llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total"),
        required=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ),
    Flavor.TGI: FlavorSpec(
        running=("tgi_batch_current_size",),
        waiting=("tgi_queue_size",),
        kv_used_tokens=("tgi_batch_current_max_tokens",),
        prompt_tokens=("tgi_request_input_length_sum",),
        generation_tokens=("tgi_request_generated_tokens_sum",),
        output_length_histograms=("tgi_request_generated_tokens",),
        decode_latency_histograms=("tgi_request_mean_time_per_token_duration",),
        required=("tgi_batch_current_size", "tgi_queue_size"),
    ),
}

_PREFIXES = (("vllm:", Flavor.VLLM), ("sglang:", Flavor.SGLANG), ("llamacpp:", Flavor.LLAMACPP), ("tgi_", Flavor.TGI))


def _wanted_samples() -> frozenset[str]:
    names: set[str] = {"vllm:cache_config_info", LORA_INFO}
    for spec in SPECS.values():
        for group in (spec.running, spec.waiting, spec.kv_usage, spec.kv_used_tokens, spec.kv_capacity_tokens,
                      spec.preemptions, spec.prompt_tokens, spec.generation_tokens, spec.decode_counters or (),
                      spec.prefill_counters or (), spec.prefix_cache_queries, spec.prefix_cache_hits):
            names.update(group)
        for histogram in (*spec.decode_latency_histograms, *(spec.prefill_histograms or ()),
                          *spec.output_length_histograms, *filter(None, (spec.prefill_computed_histogram,))):
            names.update((histogram + "_sum", histogram + "_count"))
        for histogram in spec.output_length_histograms:  # its buckets too: the shape of answer lengths (rates.py)
            names.add(histogram + "_bucket")
    return frozenset(names)


LORA_INFO = "vllm:lora_requests_info"
"""vLLM's LoRA gauge (V0 0.6.4+, V1 0.8.0+; ``vllm/v1/metrics/loggers.py``): labels ``max_lora``,
``waiting_lora_adapters``, ``running_lora_adapters``; present only when the engine runs with ``--enable-lora``."""

_WANTED = _wanted_samples()

FILTERING_FLAVORS = frozenset({Flavor.VLLM})
"""Flavours asked for only the samples sluice reads. vLLM's API server mounts prometheus_client's ``make_asgi_app`` over
the default registry, which answers ``/metrics?name[]=a&name[]=b`` with only the samples named (``restricted_registry``:
the named collectors are collected, every other sample is left out). Not SGLang: it mounts the same app over a registry
whose only collector is the multiprocess one, which has no names to match, so the filtered answer is empty (so is
vLLM's when it runs several API servers over ``PROMETHEUS_MULTIPROC_DIR``: the poller then falls back to the whole
exposition). llama.cpp's and TGI's servers ignore the query."""

METRICS_PATH = "/metrics"


def _filtered_path(flavor: Flavor) -> str:
    prefix = next(p for p, f in _PREFIXES if f is flavor)
    return METRICS_PATH + "?" + urlencode([("name[]", name) for name in sorted(_WANTED) if name.startswith(prefix)])


_FILTERED_PATHS = {flavor: _filtered_path(flavor) for flavor in FILTERING_FLAVORS}


def metrics_path(flavor: Flavor | None) -> str:
    """The probe's path for an engine of ``flavor``: for vLLM, ``/metrics`` asking for only the samples
    sluice reads (``FILTERING_FLAVORS``); otherwise (and while the flavour is unknown) the whole exposition.

    Why: a real vLLM 0.11 exposition is about 54 KB with every histogram bucket; the samples sluice reads are about 6 KB
    of it (``sluice bench observe``). The engine renders, sends and the probe worker receives and scans a ninth of the
    bytes, and prometheus_client collects only the named metrics, so the engine's own API server (the process that
    also answers its requests) spends less on every probe. The answer is read by the same scanner either way: an
    engine or proxy that ignores the query costs the full read, nothing else (``poller.EnginePoller`` falls back to the
    whole exposition for good if the filtered probe is refused or its answer lacks a gauge sluice requires)."""
    return _FILTERED_PATHS.get(flavor, METRICS_PATH) if flavor is not None else METRICS_PATH


_Trie = dict[str, "_Trie"]
"""One node of a trie: next character -> node ("" marks the end of a word)."""


def _trie_pattern(words: list[str]) -> str:
    """A regex alternation of ``words`` as a trie, so a line that matches none fails within a few characters."""
    root: _Trie = {}
    for word in words:
        node = root
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: _Trie) -> str:
        alternatives = [re.escape(ch) + emit(sub) for ch, sub in sorted(node.items()) if ch]
        if not alternatives:
            return ""
        if len(alternatives) == 1 and "" not in node:
            return alternatives[0]
        return "(?:" + "|".join(alternatives) + ")" + ("?" if "" in node else "")

    return emit(root)


def _scanner() -> re.Pattern[str]:
    r"""One regex matching exactly the sample lines sluice reads: ``\n`` + a wanted name + ``{`` or a blank, to the end of
    the line (names as a trie per engine prefix). ``# HELP``/``# TYPE`` lines, buckets (but the answer-length histogram's),
    ``_created`` series and every other family never match; the regex engine tests each line start in C and gives up
    within a few characters."""
    alternatives = []
    for prefix, _ in _PREFIXES:
        names = sorted(n[len(prefix):] for n in _WANTED if n.startswith(prefix))
        alternatives.append(re.escape(prefix) + _trie_pattern(names))
    assert sum(1 for n in _WANTED for p, _ in _PREFIXES if n.startswith(p)) == len(_WANTED), "a name without prefix"
    return re.compile("\n((?:" + "|".join(alternatives) + "))([{ \t][^\n]*)")


_SCANNER = _scanner()
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*(?:\\.[^"\\\n]*)*"'
#: The usual shape of a kept line after its name: labels (escaped quotes allowed), a value, an optional timestamp.
_SAMPLE_TAIL = re.compile(r"(?:\{((?:" + _LABEL + r")(?:," + _LABEL + r")*,?)?\})?[ \t]+([^ \t\r]+)(?:[ \t]+[^ \t\r]+)?"
                          r"[ \t\r]*")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\\n]*(?:\\.[^"\\\n]*)*)"')
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group(0)]


def _value(token: str) -> float:
    """prometheus_client's rule: no underscores, an int if it reads as one, else a float (``NaN``, ``+Inf``, ``1e+09``)."""
    if "_" in token:
        raise ValueError(f"Invalid value: {token!r}")
    return int(token) if token.isascii() and token.isdigit() else float(token)


_LABEL_SETS: dict[str, dict[str, str]] = {}
"""A label block (the text between a kept line's braces) -> its labels, for blocks the full read accepted. An engine
sends the same label blocks on every probe with new values, so after the first probe a kept line costs a dictionary
lookup and a float instead of two regular expressions (a fifth of the probe worker's CPU at 1000 engines). The dicts are
shared: nothing downstream writes to a sample's labels. Bounded by ``LABEL_SETS_MAX`` (emptied when full)."""
LABEL_SETS_MAX = 65536
"""About 30 MB at most: a vLLM engine has a few dozen kept label blocks, most shared by every engine serving a model."""


def _parse_line(name: str, tail: str) -> list[tuple[dict[str, str], float]]:
    """One kept sample line (``name`` + ``tail``) as prometheus_client would read it. The common shape is read here; anything
    else (exemplars, several values, blanks in the label set, duplicate or reserved label names) goes to prometheus_client's
    own parser, that line alone."""
    if tail.startswith("{"):
        end = tail.rfind("}")
        labels = _LABEL_SETS.get(tail[1:end])
        if labels is not None:
            rest = tail[end + 1:]
            tokens = rest.split()
            if 1 <= len(tokens) <= 2 and rest[:1] in (" ", "\t"):
                return [(labels, _value(tokens[0]))]
    m = _SAMPLE_TAIL.fullmatch(tail)
    if m is not None:
        labels = {}
        block = m.group(1)
        for key, raw in _LABEL_PAIR.findall(block) if block else ():
            if key in labels or key.startswith("__"):
                break
            labels[key] = _ESCAPE.sub(_unescape, raw) if "\\" in raw else raw
        else:
            if block and tail.startswith("{" + block + "}"):
                if len(_LABEL_SETS) >= LABEL_SETS_MAX:
                    _LABEL_SETS.clear()
                _LABEL_SETS[block] = labels
            return [(labels, _value(m.group(2)))]
    out: list[tuple[dict[str, str], float]] = []
    for family in text_string_to_metric_families(name + tail + "\n"):
        out.extend((sample.labels, sample.value) for sample in family.samples if sample.name == name)
    return out


def read_series(text: str) -> Series:
    r"""The samples sluice reads, by name: ``{name: [(labels, value), ...]}`` in text order.

    Cost is a scan of the text, not a parse of it: one compiled regex finds the wanted lines in C, and only those lines (a
    few dozen of the ~560 in a vLLM V1 exposition, the answer-length histogram's buckets among them: every other bucket,
    ``# HELP``/``# TYPE`` and unrelated families are most of it)
    become Python objects. Values and labels read exactly as prometheus_client reads them (escaped quotes, ``NaN``, ``+Inf``,
    exponents); a malformed kept line raises ValueError. The usual line (a label block read before, one value, perhaps a
    timestamp) is read inline here: at 1000 engines a call per kept line was a sixth of the probe worker's CPU."""
    out: Series = {}
    known = _LABEL_SETS
    for name, tail in _SCANNER.findall("\n" + text):
        found: list[tuple[dict[str, str], float]] | None = None
        if tail[0] == "{":
            end = tail.rfind("}")
            labels = known.get(tail[1:end])
            if labels is not None:
                rest = tail[end + 1:]
                tokens = rest.split()
                if 0 < len(tokens) < 3 and rest[0] in " \t":
                    found = [(labels, _value(tokens[0]))]
        if found is None:
            found = _parse_line(name, tail)
        samples = out.get(name)
        if samples is None:
            out[name] = found
        else:
            samples.extend(found)
    return out


def detect_flavor(series: Series) -> Flavor | None:
    """The flavour whose metric prefix appears most often; None when no engine metric is present at all."""
    counts = {flavor: sum(1 for name in series if name.startswith(prefix)) for prefix, flavor in _PREFIXES}
    best = max(counts, key=lambda f: counts[f])
    return best if counts[best] else None


def _rank_filter(flavor: Flavor, series: list[tuple[dict[str, str], float]]) -> list[tuple[dict[str, str], float]]:
    """SGLang repeats gauges per tensor/pipeline rank and per priority: keep the lowest TP/PP rank and the total."""
    if flavor is not Flavor.SGLANG:
        return series
    kept = [(labels, v) for labels, v in series if labels.get("priority", "") == ""]
    for rank in ("tp_rank", "pp_rank"):
        ranks = {labels[rank] for labels, _ in kept if rank in labels}
        if ranks:
            lowest = min(ranks, key=lambda r: (len(r), r))
            kept = [(labels, v) for labels, v in kept if labels.get(rank, lowest) == lowest]
    return kept


def _values(flavor: Flavor, series: Series, name: str) -> list[float]:
    samples = series.get(name)
    if not samples:
        return []
    return [v for _, v in _rank_filter(flavor, samples) if v == v]  # v != v: NaN, unknown


def _pick(flavor: Flavor, series: Series, names: tuple[str, ...], combine: str = "sum") -> float | None:
    for name in names:
        values = _values(flavor, series, name)
        if values:
            return sum(values) if combine == "sum" else max(values)
    return None


def _histogram(flavor: Flavor, series: Series, names: tuple[str, ...]) -> tuple[float | None, float | None]:
    """(_sum, _count) of the first histogram in ``names`` the engine exposes."""
    for name in names:
        total, count = _pick(flavor, series, (name + "_sum",)), _pick(flavor, series, (name + "_count",))
        if total is not None and count is not None:
            return total, count
    return None, None


def _buckets(flavor: Flavor, series: Series, names: tuple[str, ...]) -> tuple[tuple[float, float], ...] | None:
    """The first histogram in ``names`` with buckets: (``le``, cumulative count) ascending, summed over label sets (a
    data-parallel vLLM repeats the histogram per engine index)."""
    for name in names:
        by_le: dict[float, float] = {}
        for labels, value in _rank_filter(flavor, series.get(name + "_bucket", [])):
            le = labels.get("le")
            if le is None or math.isnan(value):
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            by_le[bound] = by_le.get(bound, 0.0) + value
        if by_le:
            return tuple(sorted(by_le.items()))
    return None


def _vllm_capacity(series: Series) -> int | None:
    for labels, _ in series.get("vllm:cache_config_info", ()):
        tokens = labels.get("kv_cache_size_tokens", "")
        if tokens.isdigit():
            return int(tokens)
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit():
            return int(blocks) * int(size)
    return None


def _adapters(text: str) -> tuple[str, ...]:
    return tuple(name for name in text.split(",") if name)


def lora_state(series: Series) -> tuple[int | None, tuple[str, ...] | None, tuple[str, ...] | None]:
    """``(max_lora, running adapters, waiting adapters)`` from the newest ``lora_requests_info`` series (the largest
    value: the time it was last set); all None when the engine exposes none (LoRA off, or no step recorded yet)."""
    samples = [(labels, value) for labels, value in series.get(LORA_INFO, ()) if value == value]
    if not samples:
        return None, None, None
    labels, _ = max(samples, key=lambda s: s[1])
    slots = labels.get("max_lora", "")
    return (int(slots) if slots.isdigit() and int(slots) > 0 else None,
            _adapters(labels.get("running_lora_adapters", "")), _adapters(labels.get("waiting_lora_adapters", "")))


def missing_gauges(series: Series, flavor: Flavor) -> tuple[str, ...]:
    """Required load gauges this text lacks (an alias counts: vLLM's old ``gpu_cache_usage_perc`` serves for KV)."""
    spec = SPECS[flavor]
    missing = []
    for name in spec.required:
        aliases = next((group for group in (spec.running, spec.waiting, spec.kv_usage) if name in group), (name,))
        if all(not _values(flavor, series, alias) for alias in aliases):
            missing.append(name)
    return tuple(missing)


def parse_metrics(text: str, taken_at: float, flavor: Flavor | None = None) -> EngineSample:
    """Parse ``text``; ``flavor`` None means detect it from the metric names."""
    series = read_series(text)
    return sample_from_series(series, taken_at, flavor or detect_flavor(series))


def sample_from_series(series: Series, taken_at: float, flavor: Flavor | None) -> EngineSample:
    if flavor is None:
        return EngineSample(taken_at=taken_at)
    spec = SPECS[flavor]
    kv_usage = _pick(flavor, series, spec.kv_usage, "max")
    kv_used = _pick(flavor, series, spec.kv_used_tokens)
    capacity = _pick(flavor, series, spec.kv_capacity_tokens)
    if capacity is None and flavor is Flavor.VLLM:
        capacity = _vllm_capacity(series)
    if capacity is None and kv_used is not None and kv_usage:
        capacity = round(kv_used / kv_usage)  # llama.cpp forks: tokens in use over the fraction in use
    decode_seconds, decode_tokens = _histogram(flavor, series, spec.decode_latency_histograms)
    if spec.decode_counters is not None:
        decode_tokens = _pick(flavor, series, spec.decode_counters[:1])
        decode_seconds = _pick(flavor, series, spec.decode_counters[1:])
    prefill_tokens = prefill_seconds = None
    prefill_counts_cached = False
    if spec.prefill_histograms is not None:
        computed = None
        if spec.prefill_computed_histogram is not None:
            computed, _ = _histogram(flavor, series, (spec.prefill_computed_histogram,))
        if computed is not None:
            prefill_tokens = computed
        else:
            prefill_tokens, _ = _histogram(flavor, series, spec.prefill_histograms[:1])
            prefill_counts_cached = prefill_tokens is not None
        prefill_seconds, _ = _histogram(flavor, series, spec.prefill_histograms[1:])
    if spec.prefill_counters is not None:
        prefill_tokens = _pick(flavor, series, spec.prefill_counters[:1])
        prefill_seconds = _pick(flavor, series, spec.prefill_counters[1:])
    output_tokens, finished = _histogram(flavor, series, spec.output_length_histograms)
    lora_max, lora_running, lora_waiting = lora_state(series) if flavor is Flavor.VLLM else (None, None, None)
    return EngineSample(
        taken_at=taken_at,
        finished_requests_total=finished,
        finished_output_tokens_total=output_tokens,
        finished_length_buckets=_buckets(flavor, series, spec.output_length_histograms),
        running=_pick(flavor, series, spec.running),
        waiting=_pick(flavor, series, spec.waiting),
        kv_usage=kv_usage,
        kv_used_tokens=kv_used,
        kv_capacity_tokens=None if capacity is None else int(capacity),
        preemptions_total=_pick(flavor, series, spec.preemptions),
        prompt_tokens_total=_pick(flavor, series, spec.prompt_tokens),
        generation_tokens_total=_pick(flavor, series, spec.generation_tokens),
        decode_seconds_total=decode_seconds,
        decode_tokens_total=decode_tokens,
        prefill_seconds_total=prefill_seconds,
        prefill_tokens_total=prefill_tokens,
        prefill_counts_cached=prefill_counts_cached,
        prefix_cache_queries_total=_pick(flavor, series, spec.prefix_cache_queries),
        prefix_cache_hits_total=_pick(flavor, series, spec.prefix_cache_hits),
        lora_max=lora_max,
        lora_running=lora_running,
        lora_waiting=lora_waiting,
    )
