"""Engine /metrics texts (real captures, the simulator's output, hand-made edge cases) parse into the sample a reader expects."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from controlplane.core.engines import EngineSample, Flavor
from controlplane.observe.parse import detect_flavor, missing_gauges, parse_metrics, read_series

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-metrics"


def _fixture(name: str) -> str:
    path = FIXTURES / name
    if not path.exists():
        pytest.fail(f"fixture {path} missing (a copy of shared/fixtures/engine-metrics, see its SOURCES.md)")
    return path.read_text()


@pytest.mark.parametrize(
    ("fixture", "flavor", "expected", "missing"),
    [
        ("vllm-0.4.3-datadog-integrations-core.prom", Flavor.VLLM,
         EngineSample(1.0, running=0, waiting=0, kv_usage=0, kv_capacity_tokens=7281 * 16, preemptions_total=0,
                      prompt_tokens_total=5, generation_tokens_total=7, decode_seconds_total=0.19016313552856445,
                      decode_tokens_total=6, prefill_tokens_total=5, finished_requests_total=1,
                      finished_output_tokens_total=7, prefill_counts_cached=True,
                      finished_length_buckets=tuple((le, 0.0 if le < 10 else 1.0) for le in (
                          1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, math.inf))),
         ()),
        ("vllm-0.7.x-aibrix-runtime-docs-excerpt.prom", Flavor.VLLM,
         EngineSample(1.0, running=0, waiting=0, kv_usage=0, kv_capacity_tokens=81767 * 16, preemptions_total=0,
                      prompt_tokens_total=148, generation_tokens_total=955, lora_running=(), lora_waiting=()),
         ()),
        # A V1 fragment with only the new KV name: the load gauges are unknown (never 0) and the engine is degraded. Its
        # prefix-cache counters are read under both names (queries new, hits the deprecated gpu_ one).
        ("vllm-0.10.0-production-stack-issue617-fragment.prom", Flavor.VLLM,
         EngineSample(1.0, kv_usage=9.75010481363281e-06, prefix_cache_queries_total=32.0, prefix_cache_hits_total=0.0),
         ("vllm:num_requests_running", "vllm:num_requests_waiting")),
        ("sglang-0.4.x-sglang-docs-production-metrics.prom", Flavor.SGLANG,
         EngineSample(1.0, running=162, waiting=2826, kv_usage=0.28, kv_used_tokens=123859,
                      kv_capacity_tokens=round(123859 / 0.28), prompt_tokens_total=8.128902e06,
                      generation_tokens_total=7.557572e06, decode_seconds_total=866964.5791549598,
                      decode_tokens_total=7.400757e06, prefix_cache_queries_total=8.128902e06),
         ()),
        # An ik_llama.cpp fork still exposes KV gauges; capacity follows from tokens in use over the fraction in use.
        ("llamacpp-ik_llama.cpp-2025-08-pr695-comment.prom", Flavor.LLAMACPP,
         EngineSample(1.0, running=0, waiting=0, kv_usage=0.491063, kv_used_tokens=31428, kv_capacity_tokens=64000,
                      prompt_tokens_total=6886, generation_tokens_total=3469, decode_seconds_total=3544.27,
                      decode_tokens_total=3469, prefill_seconds_total=2903.63, prefill_tokens_total=6886),
         ()),
    ],
    ids=["vllm-0.4.3-v0", "vllm-0.7-v0", "vllm-0.10-v1-fragment", "sglang-0.4", "ik-llama.cpp"],
)
def test_fixtures(fixture: str, flavor: Flavor, expected: EngineSample, missing: tuple[str, ...]) -> None:
    text = _fixture(fixture)
    series = read_series(text)
    assert detect_flavor(series) is flavor
    assert parse_metrics(text, taken_at=1.0) == expected
    assert missing_gauges(series, flavor) == missing


def test_vllm_data_parallel_sums_load_maxes_kv_and_prefers_the_new_kv_name() -> None:
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} NaN
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.99
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",kv_cache_size_tokens="1234",engine="0"} 1.0
"""
    sample = parse_metrics(text, taken_at=0)
    assert (sample.running, sample.waiting, sample.kv_usage, sample.kv_capacity_tokens) == (5, 1, 0.75, 1234)


def test_vllm_all_nan_is_unknown() -> None:
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} NaN\n"
    assert parse_metrics(text, taken_at=0).running is None


def test_sglang_takes_one_tp_rank_the_priority_total_and_sums_dp_ranks() -> None:
    rows = []
    for dp in ("0", "1"):
        for tp in ("0", "1"):
            rows.append(f'sglang:num_running_reqs{{model_name="m",tp_rank="{tp}",dp_rank="{dp}",priority=""}} 4')
            rows.append(f'sglang:num_running_reqs{{model_name="m",tp_rank="{tp}",dp_rank="{dp}",priority="1"}} 3')
            rows.append(f'sglang:token_usage{{model_name="m",tp_rank="{tp}",dp_rank="{dp}",priority=""}} 0.{dp}5')
    text = "# TYPE sglang:num_running_reqs gauge\n" + "\n".join(r for r in rows if "running" in r) + \
        "\n# TYPE sglang:token_usage gauge\n" + "\n".join(r for r in rows if "usage" in r) + "\n"
    sample = parse_metrics(text, taken_at=0)
    assert sample.running == 8  # 4 per dp rank, counted once per tp rank, totals only
    assert sample.kv_usage == 0.15
    assert sample.waiting is None


def test_mainline_llamacpp_has_no_kv_gauges_and_is_not_degraded() -> None:
    text = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""
    series = read_series(text)
    sample = parse_metrics(text, taken_at=0)
    assert (sample.running, sample.waiting, sample.kv_usage) == (2, 1, None)
    assert missing_gauges(series, Flavor.LLAMACPP) == ()


def test_tgi() -> None:
    text = """# TYPE tgi_queue_size gauge
tgi_queue_size 3
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 5
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 9000
"""
    sample = parse_metrics(text, taken_at=0)
    assert (sample.running, sample.waiting, sample.kv_used_tokens) == (5, 3, 9000)


def test_flavour_mismatch_is_reported_as_missing_gauges() -> None:
    """An engine configured as vLLM that serves SGLang metrics has none of the gauges vLLM needs."""
    series = read_series(_fixture("sglang-0.4.x-sglang-docs-production-metrics.prom"))
    assert missing_gauges(series, Flavor.VLLM) == (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
    )


def test_no_engine_metrics_at_all() -> None:
    series = read_series("# TYPE process_open_fds gauge\nprocess_open_fds 12\n")
    assert detect_flavor(series) is None
    assert parse_metrics("process_open_fds 12\n", taken_at=3) == EngineSample(3)


def test_vllm_lora_state_is_the_newest_series() -> None:
    """vLLM keeps every label set its LoRA gauge ever recorded, each valued the Unix time it was last set: the newest
    is now. ``max_lora`` 0 (the real capture above) is no slot count."""
    text = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="legal"} 1.7650e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="chat",waiting_lora_adapters=""} 1.7651e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7649e+09
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""
    sample = parse_metrics(text, taken_at=1.0)
    assert (sample.lora_max, sample.lora_running, sample.lora_waiting) == (4, ("chat",), ())
    assert parse_metrics(text.replace("1.7651e+09", "1.7640e+09"), 1.0).lora_running == ("sql", "chat")
    assert parse_metrics(text.replace("1.7651e+09", "1.7640e+09"), 1.0).lora_waiting == ("legal",)
    without = parse_metrics('vllm:num_requests_running{engine="0",model_name="m"} 1.0\n', 1.0)
    assert (without.lora_max, without.lora_running) == (None, None)


def test_the_simulators_lora_gauge_reads_back() -> None:
    from enginesim.batcher import Batcher, SimRequest
    from enginesim.exposition import RequestStats, SimCollector, render
    from enginesim.profiles import PROFILES

    batcher = Batcher(PROFILES["spark"], max_loras=2, lora_swap_s=0.1)
    collector = SimCollector("vllm-v1", "cortex", batcher, RequestStats())
    for i, adapter in enumerate(("a", "b", "c")):
        batcher.submit(SimRequest(str(i), prompt_tokens=10, max_tokens=5, arrived_at=0, adapter=adapter))
    batcher.schedule(0.0)
    collector.record_lora(1_765_000_000.0)
    sample = parse_metrics(render(collector).decode(), taken_at=1.0)
    assert (sample.lora_max, sample.lora_running, sample.lora_waiting) == (2, ("a", "b"), ("c",))
