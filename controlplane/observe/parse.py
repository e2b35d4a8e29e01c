"""Turn an engine's ``/metrics`` text into an ``EngineSample`` (prometheus_client's parser, never by hand).

Rules (from engine-metrics.md): a metric the engine did not expose is ``None`` (unknown), never 0; aliases resolve in order of
preference (vLLM's ``kv_cache_usage_perc`` before ``gpu_cache_usage_perc``); vLLM data-parallel ``engine`` series are summed
for running/waiting and maxed for KV usage; ``nan`` counts as unknown.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from controlplane.core.model import EngineSample

# sample name -> how to combine several series of it
_SUM = "sum"
_MAX = "max"

_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PREEMPTIONS = ("vllm:num_preemptions_total",)
_PROMPT = ("vllm:prompt_tokens_total",)
_GENERATION = ("vllm:generation_tokens_total",)


def _series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[sample.name].append((sample.labels, sample.value))
    return out


def _pick(series: dict[str, list[tuple[dict[str, str], float]]], names: Iterable[str], how: str) -> float | None:
    for name in names:
        values = [v for _, v in series.get(name, ()) if not math.isnan(v)]
        if values:
            return sum(values) if how == _SUM else max(values)
    return None


def _kv_capacity(series: dict[str, list[tuple[dict[str, str], float]]]) -> int | None:
    for labels, _ in series.get("vllm:cache_config_info", ()):
        tokens = labels.get("kv_cache_size_tokens")
        if tokens and tokens.isdigit():
            return int(tokens)
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit():
            return int(blocks) * int(size)
    return None


def parse_metrics(text: str, taken_at: float) -> EngineSample:
    series = _series(text)
    return EngineSample(
        taken_at=taken_at,
        running=_pick(series, _RUNNING, _SUM),
        waiting=_pick(series, _WAITING, _SUM),
        kv_usage=_pick(series, _KV_USAGE, _MAX),
        kv_capacity_tokens=_kv_capacity(series),
        preemptions_total=_pick(series, _PREEMPTIONS, _SUM),
        prompt_tokens_total=_pick(series, _PROMPT, _SUM),
        generation_tokens_total=_pick(series, _GENERATION, _SUM),
    )
