"""A real-size vLLM V1 ``/metrics`` exposition (vLLM 0.11, every histogram bucket kept), for benchmarks.

Real vLLM renders its metrics with prometheus_client's ``generate_latest``; so does this generator, with the metric
names, help texts, label names and bucket boundaries of vLLM 0.11's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``
of vllm-project/vllm, read through the code index: the 0.11 revision in which ``time_per_output_token_seconds`` is deprecated
for ``inter_token_latency_seconds`` and the ``gpu_*`` cache names are hidden). Added, as the same HTTP server exposes them:
prometheus_client's process/platform/GC collectors and prometheus-fastapi-instrumentator's default HTTP metrics, which vLLM's
API server registers (their names and bucket lists recalled from the instrumentator's ``metrics.default()``, not read from its
source here). The ``vllm:cache_config_info`` label set approximates 0.11's CacheConfig fields. Values are drawn from a seeded
generator per ``level``, so variants differ like successive polls of a busy engine; ``_created`` series carry this process's
clock, as in vLLM.

With one data-parallel rank, ``max_model_len`` 131072 and a 33-character model name this is about 54 KB (the fleet-scale
issue measured 57 KB on a real server); vLLM's ``engine`` label repeats every vLLM series per data-parallel rank, so two
ranks give about 91 KB.
"""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                           480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
#: prometheus-fastapi-instrumentator's defaults (``metrics.default``): high-resolution unlabelled, coarse per handler.
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30, 60)
HTTP_BUCKETS = (0.1, 0.5, 1)
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


def vllm_v1_exposition(level: int = 0, data_parallel: int = 1, model: str = "meta-llama/Llama-3.1-70B-Instruct",
                       max_model_len: int = 131072, num_gpu_blocks: int = 20480, block_size: int = 16) -> bytes:
    """One ``/metrics`` body of a vLLM 0.11 V1 server with ``data_parallel`` engine cores after some traffic."""
    rng = random.Random(level)
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    labels = ["model_name", "engine"]
    engines = [str(i) for i in range(data_parallel)]

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, labels, registry=registry)

    def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels + list(extra), registry=registry)

    def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=registry)

    token_buckets = build_1_2_5_buckets(max_model_len)
    running, waiting, kv = gauge("vllm:num_requests_running", "Number of requests in model execution batches."), \
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."), \
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
    prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
    prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
    preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
    prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
    generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
    success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
    h_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
    h_generation = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
    h_iteration = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                            ITERATION_TOKENS_BUCKETS)
    h_max_generation = histogram("vllm:request_max_num_generation_tokens",
                                 "Histogram of maximum number of requested generation tokens.", token_buckets)
    h_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
    h_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                             token_buckets)
    h_ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
    h_tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."
                       "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS)
    h_itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
    phases = [histogram(f"vllm:{name}", doc, REQUEST_LATENCY_BUCKETS) for name, doc in (
        ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
        ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
        ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
        ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
        ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    )]
    for engine in engines:
        lv = (model, engine)
        running.labels(*lv).set(rng.randint(0, 64))
        waiting.labels(*lv).set(rng.randint(0, 16) if level % 3 else 0)
        kv.labels(*lv).set(rng.random())
        requests = 200 + 50 * level + rng.randint(0, 100)
        for reason in FINISH_REASONS:
            success.labels(model, engine, reason).inc(requests // (1 if reason == "stop" else 10))
        preemptions.labels(*lv).inc(rng.randint(0, 5))
        prompt_total = generation_total = 0
        for _ in range(requests):
            prompt, generated = rng.randint(16, 32000), rng.randint(1, 2048)
            prompt_total, generation_total = prompt_total + prompt, generation_total + generated
            h_prompt.labels(*lv).observe(prompt)
            h_generation.labels(*lv).observe(generated)
            h_max_generation.labels(*lv).observe(max(generated, 2048))
            h_max_tokens.labels(*lv).observe(4096)
            h_n.labels(*lv).observe(1)
            h_ttft.labels(*lv).observe(rng.lognormvariate(-1, 1))
            per_token = rng.lognormvariate(-3.5, 0.3)
            h_tpot.labels(*lv).observe(per_token)
            h_itl.labels(*lv).observe(per_token)
            for phase in phases:
                phase.labels(*lv).observe(rng.lognormvariate(2, 1))
        for _ in range(64):
            h_iteration.labels(*lv).observe(rng.randint(1, 16384))
        prompt_tokens.labels(*lv).inc(prompt_total)
        generation_tokens.labels(*lv).inc(generation_total)
        prefix_queries.labels(*lv).inc(prompt_total)
        prefix_hits.labels(*lv).inc(prompt_total // 3)
    info = {"block_size": str(block_size), "cache_dtype": "auto", "calculate_kv_scales": "False",
            "cpu_offload_gb": "0", "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
            "is_attention_free": "False", "kv_cache_memory_bytes": "None", "kv_sharing_fast_prefill": "False",
            "mamba_cache_dtype": "auto", "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "auto",
            "num_cpu_blocks": "None", "num_gpu_blocks": str(num_gpu_blocks), "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sha256", "sliding_window": "None", "swap_space": "4",
            "swap_space_bytes": "4294967296"}
    cache_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*info, "engine"],
                       registry=registry)
    for engine in engines:
        cache_info.labels(*info.values(), engine).set(1)
    http_total = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                         ["method", "status", "handler"], registry=registry)
    http_req_size = Summary("http_request_size_bytes", "Content length of incoming requests by handler. Only value of "
                            "header is respected. Otherwise ignored. No percentile calculated. ", ["handler"],
                            registry=registry)
    http_resp_size = Summary("http_response_size_bytes", "Content length of outgoing responses by handler. Only value "
                             "of header is respected. Otherwise ignored. No percentile calculated. ", ["handler"],
                             registry=registry)
    http_highr = Histogram("http_request_duration_highr_seconds", "Latency with many buckets but no API specific labels. "
                           "Made for more accurate percentile calculations. ", buckets=HTTP_HIGHR_BUCKETS,
                           registry=registry)
    http_duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler. Made to be "
                              "only used if aggregation by handler is important. ", ["method", "handler"],
                              buckets=HTTP_BUCKETS, registry=registry)
    for handler, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"),
                            ("/tokenize", "POST")):
        calls = rng.randint(10, 1000)
        http_total.labels(method, "2xx", handler).inc(calls)
        http_total.labels(method, "4xx", handler).inc(calls // 50)
        for _ in range(20):
            seconds = rng.lognormvariate(1, 1)
            http_req_size.labels(handler).observe(rng.randint(100, 100000))
            http_resp_size.labels(handler).observe(rng.randint(100, 10000))
            http_highr.observe(seconds)
            http_duration.labels(method, handler).observe(seconds)
    return generate_latest(registry)


def variants(count: int = 8, data_parallel: int = 1) -> list[bytes]:
    return [vllm_v1_exposition(level, data_parallel) for level in range(count)]


if __name__ == "__main__":
    import sys

    sys.stdout.buffer.write(vllm_v1_exposition())
