"""The EPP-like arm's policy, pure: how the Gateway API Inference Extension's default endpoint picker (the EPP, also
llm-d's) scores engines and keeps its prefix index. No I/O, no clock; the proxy around it is ``bench/epp_arm.py``.

Read from kubernetes-sigs/gateway-api-inference-extension at tag ``v1.5.0`` (commit
df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849, 2026-04-18), the last release that carries the EPP (commit a70292c1,
2026-06-16, moved ``pkg/epp`` out of that repository). Files (``P`` = ``pkg/epp/framework/plugins``):

- Default configuration, ``pkg/epp/config/loader/defaults.go`` ``loadDefaultConfig`` and the Helm chart's
  ``config/charts/epplib/templates/_config.yaml``: one profile ``default`` with ``queue-scorer`` weight 2,
  ``kv-cache-utilization-scorer`` weight 2, ``prefix-cache-scorer`` weight 3, no filter; ``ensureSchedulingLayer`` adds
  the ``max-score-picker`` and the single-profile handler. The prefix scorer brings its data producer
  ``approx-prefix-cache-producer`` with it (``configloader.go``).
- ``pkg/epp/scheduling/scheduler_profile.go`` ``runScorerPlugins``: an endpoint's score is
  ``sum(weight_i x clamp(score_i, 0, 1))``.
- ``P/scheduling/scorer/queuedepth/queue.go``: ``(max_waiting - waiting) / (max_waiting - min_waiting)`` over the
  candidates, 1 for all when every waiting queue is equal (``vllm:num_requests_waiting``).
- ``P/scheduling/scorer/kvcacheutilization/kvcache_utilization.go``: ``1 - vllm:kv_cache_usage_perc``.
- ``P/scheduling/scorer/prefix/plugin.go``: ``matched blocks / prompt blocks`` (0 for all when the prompt has no
  block).
- ``P/scheduling/picker/max_score_picker.go``, ``picker/common.go``: shuffle, stable sort by score, take the first
  (``maxNumOfEndpoints`` 1): the highest score, uniformly at random among equal ones.
- ``P/requestcontrol/dataproducer/approximateprefix/{hashing,indexer,plugin,types}.go``: the prompt's bytes (chat:
  the JSON of ``messages``; completions: ``prompt``) cut into blocks of ``block_size x 4`` characters (block size in
  tokens from ``vllm:cache_config_info``'s ``block_size`` label, ``autoTune`` on; 16 without it), at most 256 blocks (a
  longer prompt is truncated, a shorter remainder dropped, a prompt shorter than one block has no block); a chain of
  64-bit hashes, the first seeded with the model name (and ``cache_salt``), each over its block and the previous hash.
  The index: per engine an LRU of block hashes whose capacity is the engine's ``num_gpu_blocks`` (the same label set;
  31,250 without it), plus hash -> engines; an eviction takes the engine off that hash. Matching walks the prompt's
  hashes in order and stops at the first one no engine holds; each engine holding a hash before that stop counts it.
  After the pick (``PreRequest``) the prompt's hashes are added for the chosen engine; nothing is removed when the
  request ends.
- Metrics: ``P/datalayer/extractor/metrics/factories.go`` (vLLM: ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``), scraped every 50 ms
  (``pkg/epp/datalayer/runtime.go`` ``defaultRefreshInterval``, ``pkg/epp/server/options.go``
  ``RefreshMetricsInterval``). The running count is read but no default scorer uses it.
- Admission: ``pkg/epp/requestcontrol/admission.go`` ``LegacyAdmissionController`` (flow control is a feature gate,
  off by default) rejects only sheddable requests (priority < 0) when the pool is saturated; requests without an
  ``InferenceObjective`` have priority 0, so the default EPP never sheds: every request is routed.

- LoRA (not in the default profile; ``bench lora`` adds it): ``lora-affinity-scorer`` as llm-d's EPP has it
  (llm-d/llm-d-router ``pkg/epp/framework/plugins/scheduling/scorer/loraaffinity``; the same scorer was in
  ``pkg/epp/scheduling/framework/plugins/scorer`` of the GIE before the move): 1 when the requested model is among the
  engine's active adapters, 0.8 when the union of its active and waiting adapters is below ``max_lora``, 0.6 when it is
  only waiting, else 0; the sets and ``max_lora`` come from ``vllm:lora_requests_info`` (the series with the newest
  value, ``core-metrics-extractor``).

Where this departs from the real one, and why: the hash is BLAKE2b-64 rather than xxhash64 (no xxhash here; any 64-bit
hash with negligible collisions gives the same matches); the chat bytes are Python's compact ``json.dumps`` of the
messages as sent rather than Go's re-marshalled structs (the same text up to escaping, which shifts block boundaries
alike for every request); an engine without ``vllm:kv_cache_usage_perc`` is read from ``vllm:gpu_cache_usage_perc``
(the pre-V1 name, for the simulator's older flavours). The I/O differences are the proxy's (``bench/epp_arm.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SOURCE = ("kubernetes-sigs/gateway-api-inference-extension v1.5.0 "
          "(df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849), pkg/epp")
"""What this arm reimplements, for the reports."""
SCRAPE_INTERVAL_S = 0.05
"""The EPP's default metrics refresh interval (``RefreshMetricsInterval``), wall seconds."""
DEFAULT_BLOCK_SIZE_TOKENS = 16
"""``defaultBlockSizeTokens``: the block size when the engines do not report one."""
MAX_PREFIX_BLOCKS = 256
"""``defaultMaxPrefixBlocks``: blocks of a prompt considered at most."""
DEFAULT_LRU_CAPACITY = 31250
"""``defaultLRUCapacityPerServer``: an engine's index capacity in blocks when it does not report ``num_gpu_blocks``."""
CHARS_PER_TOKEN = 4
"""``averageCharactersPerToken``: the prompt is cut in characters, ``block_size x`` this a block."""


@dataclass(frozen=True, slots=True)
class Weights:
    """The default profile's scorer weights (``loadDefaultConfig``)."""

    queue: float = 2.0
    kv_cache: float = 2.0
    prefix: float = 3.0
    lora: float = 0.0
    """``lora-affinity-scorer`` (0: not in the profile, the default)."""


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """What the EPP reads from one engine's ``/metrics`` (vLLM names)."""

    waiting: int
    """``vllm:num_requests_waiting``."""
    running: int
    """``vllm:num_requests_running`` (read, unused by the default scorers)."""
    kv_usage: float
    """``vllm:kv_cache_usage_perc``, a fraction 0..1."""
    block_size: int = 0
    """``vllm:cache_config_info{block_size}`` in tokens; 0 when absent."""
    num_gpu_blocks: int = 0
    """``vllm:cache_config_info{num_gpu_blocks}``; 0 when absent."""
    active_adapters: frozenset[str] = frozenset()
    """``vllm:lora_requests_info{running_lora_adapters}`` of the newest series."""
    waiting_adapters: frozenset[str] = frozenset()
    """``...{waiting_lora_adapters}``."""
    max_adapters: int = 0
    """``...{max_lora}``; 0 when absent."""


def _gauge(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([-+0-9.eEinfINFaN]+)$", text, re.M)
    return float(match.group(1)) if match else None


def parse_metrics(text: str) -> EndpointMetrics:
    """The ``EndpointMetrics`` in a Prometheus text exposition (the first series of each name; absent gauges read 0)."""
    kv = _gauge(text, "vllm:kv_cache_usage_perc")
    if kv is None:
        kv = _gauge(text, "vllm:gpu_cache_usage_perc")
    info = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1))) if info else {}

    def whole(key: str) -> int:
        value = labels.get(key, "")
        return int(value) if value.isdigit() else 0

    lora: dict[str, str] = {}
    newest = -math.inf
    for block, value in re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.M):
        if float(value) > newest:
            newest, lora = float(value), dict(re.findall(r'(\w+)="([^"]*)"', block))

    def names(key: str) -> frozenset[str]:
        return frozenset(n for n in lora.get(key, "").split(",") if n)

    slots = lora.get("max_lora", "")
    return EndpointMetrics(int(_gauge(text, "vllm:num_requests_waiting") or 0),
                           int(_gauge(text, "vllm:num_requests_running") or 0), kv or 0.0,
                           whole("block_size"), whole("num_gpu_blocks"), names("running_lora_adapters"),
                           names("waiting_lora_adapters"), int(slots) if slots.isdigit() else 0)


def user_input(body: Mapping[str, Any]) -> bytes | None:
    """The bytes the EPP hashes (``getUserInputBytes``): chat completions, the JSON of ``messages``; completions, the
    ``prompt`` text; None for a body of neither kind."""
    if "messages" in body:
        return json.dumps(body["messages"], separators=(",", ":"), ensure_ascii=False).encode()
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode()
    return None


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def hash_prompt(model: str, data: bytes, block_size_tokens: int, max_blocks: int = MAX_PREFIX_BLOCKS,
                cache_salt: str = "") -> tuple[int, ...]:
    """The prompt's chained block hashes (``hashPrompt``): blocks of ``block_size_tokens x CHARS_PER_TOKEN`` bytes, at
    most ``max_blocks`` of them, the trailing partial block dropped; the first block's hash is chained to a hash of the
    model name and ``cache_salt``, so equal prompts to different models never match. Empty for a prompt shorter than
    one block."""
    size = block_size_tokens * CHARS_PER_TOKEN
    if size <= 0 or len(data) < size:
        return ()
    data = data[:size * max_blocks]
    previous = _hash64(model.encode() + cache_salt.encode())
    out: list[int] = []
    for start in range(0, len(data) - size + 1, size):
        previous = _hash64(data[start:start + size] + previous.to_bytes(8, "little"))
        out.append(previous)
    return tuple(out)


@dataclass
class PrefixIndex:
    """The approximate prefix index (``indexer.go``): per engine an LRU of block hashes, and hash -> engines.

    Invariants: an engine's LRU never holds more than its capacity (fixed when the engine is first added); a hash maps
    to an engine only after that engine was added with it, and an eviction from the engine's LRU removes the engine
    from the hash (as ``makeEvictionFn``). As in ``Add``, every hash of a call is put in the LRU first and then mapped,
    so a call with more hashes than the capacity leaves its earliest ones mapped but no longer in the LRU."""

    default_capacity: int = DEFAULT_LRU_CAPACITY
    _lru: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    _capacity: dict[str, int] = field(default_factory=dict)
    _holders: dict[int, set[str]] = field(default_factory=dict)

    def add(self, hashes: Sequence[int], engine: str, capacity: int = 0) -> None:
        """Record that ``engine`` now caches ``hashes`` (most recent last). ``capacity``: its LRU size in blocks when
        this is its first add (<= 0: ``default_capacity``)."""
        lru = self._lru.get(engine)
        if lru is None:
            lru = self._lru[engine] = OrderedDict()
            self._capacity[engine] = capacity if capacity > 0 else self.default_capacity
        limit = self._capacity[engine]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            if len(lru) > limit:
                evicted, _ = lru.popitem(last=False)
                holders = self._holders.get(evicted)
                if holders is not None:
                    holders.discard(engine)
                    if not holders:
                        del self._holders[evicted]
        for h in hashes:
            self._holders.setdefault(h, set()).add(engine)

    def matches(self, hashes: Iterable[int]) -> dict[str, int]:
        """Blocks each engine is credited with (``matchLongestPrefix``): walking ``hashes`` in order up to the first
        one no engine holds, one per hash an engine holds."""
        out: dict[str, int] = {}
        for h in hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            for engine in holders:
                out[engine] = out.get(engine, 0) + 1
        return out

    def size(self, engine: str) -> int:
        """Hashes in ``engine``'s LRU."""
        return len(self._lru.get(engine, ()))


def queue_scores(waiting: Mapping[str, int]) -> dict[str, float]:
    """``queue-scorer``: ``(max - waiting) / (max - min)``; 1 for every engine when all wait the same."""
    low, high = min(waiting.values()), max(waiting.values())
    return {e: 1.0 if high == low else (high - w) / (high - low) for e, w in waiting.items()}


def kv_cache_scores(usage: Mapping[str, float]) -> dict[str, float]:
    """``kv-cache-utilization-scorer``: ``1 - kv_cache_usage_perc``."""
    return {e: 1.0 - u for e, u in usage.items()}


def prefix_scores(matched: Mapping[str, int], total: int, engines: Iterable[str]) -> dict[str, float]:
    """``prefix-cache-scorer``: matched blocks over the prompt's blocks (0 when it has none)."""
    return {e: matched.get(e, 0) / total if total else 0.0 for e in engines}


def lora_affinity_scores(model: str, metrics: Mapping[str, EndpointMetrics]) -> dict[str, float]:
    """``lora-affinity-scorer``: 1 active, 0.8 room for one more adapter, 0.6 waiting, else 0."""
    out: dict[str, float] = {}
    for e, m in metrics.items():
        if model in m.active_adapters:
            out[e] = 1.0
        elif len(m.active_adapters | m.waiting_adapters) < m.max_adapters:
            out[e] = 0.8
        elif model in m.waiting_adapters:
            out[e] = 0.6
        else:
            out[e] = 0.0
    return out


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def weighted_scores(metrics: Mapping[str, EndpointMetrics], matched: Mapping[str, int], total: int,
                    weights: Weights = Weights(), model: str = "") -> dict[str, float]:
    """Each engine's ``sum(weight x clamp(score, 0, 1))`` over the three default scorers (and the LoRA one when
    weighted)."""
    queue = queue_scores({e: m.waiting for e, m in metrics.items()})
    kv = kv_cache_scores({e: m.kv_usage for e, m in metrics.items()})
    prefix = prefix_scores(matched, total, metrics)
    lora = lora_affinity_scores(model, metrics) if weights.lora else {}
    return {e: weights.queue * _clamp(queue[e]) + weights.kv_cache * _clamp(kv[e])
            + weights.prefix * _clamp(prefix[e]) + weights.lora * _clamp(lora.get(e, 0.0)) for e in metrics}


def pick(scores: Mapping[str, float], rng: random.Random) -> str:
    """``max-score-picker``: the highest score, uniformly at random among equal ones."""
    best = max(scores.values())
    return rng.choice(sorted(e for e, s in scores.items() if s == best))


@dataclass(frozen=True, slots=True)
class Decision:
    """One scheduling cycle's outcome."""

    engine: str
    hashes: tuple[int, ...]
    matched: dict[str, int]
    scores: dict[str, float]


def block_size_of(metrics: Mapping[str, EndpointMetrics]) -> int:
    """``GetBlockSize`` with ``autoTune``: the first engine's reported block size, else
    ``DEFAULT_BLOCK_SIZE_TOKENS``."""
    first = next(iter(metrics.values()), None)
    return first.block_size if first is not None and first.block_size > 0 else DEFAULT_BLOCK_SIZE_TOKENS


def decide(body: Mapping[str, Any], metrics: Mapping[str, EndpointMetrics], index: PrefixIndex, rng: random.Random,
           weights: Weights = Weights()) -> Decision:
    """Score ``metrics``' engines for ``body`` and pick one, then record the prompt's blocks for it in ``index``
    (``PrepareRequestData``, the profile run, ``PreRequest``). ``metrics`` must not be empty."""
    data = user_input(body)
    model = str(body.get("model", ""))
    salt = body.get("cache_salt")
    hashes = (hash_prompt(model, data, block_size_of(metrics), cache_salt=salt if isinstance(salt, str) else "")
              if data is not None else ())
    matched = index.matches(hashes)
    scores = weighted_scores(metrics, matched, len(hashes), weights, model)
    engine = pick(scores, rng)
    index.add(hashes, engine, metrics[engine].num_gpu_blocks)
    return Decision(engine, hashes, matched, scores)
