"""vLLM /metrics texts (real captures and the simulator's own output) parse into the sample a reader would expect."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.core.model import EngineSample
from controlplane.observe.parse import parse_metrics

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "engine-metrics"


def _fixture(name: str) -> str:
    path = FIXTURES / name
    if not path.exists():  # CI lays shared/ beside the clone; a bare checkout elsewhere cannot run these
        pytest.fail(f"fixture {path} missing: shared/ must sit beside the repository")
    return path.read_text()


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("vllm-0.4.3-datadog-integrations-core.prom",
         EngineSample(1.0, running=0, waiting=0, kv_usage=0, kv_capacity_tokens=7281 * 16, preemptions_total=0,
                      prompt_tokens_total=5, generation_tokens_total=7)),
        ("vllm-0.7.x-aibrix-runtime-docs-excerpt.prom",
         EngineSample(1.0, running=0, waiting=0, kv_usage=0, kv_capacity_tokens=81767 * 16, preemptions_total=0,
                      prompt_tokens_total=148, generation_tokens_total=955)),
        # A V1 fragment with only the new KV name and none of the load gauges: unknown, never 0.
        ("vllm-0.10.0-production-stack-issue617-fragment.prom",
         EngineSample(1.0, running=None, waiting=None, kv_usage=9.75010481363281e-06, kv_capacity_tokens=None)),
    ],
    ids=["vllm-0.4.3-v0", "vllm-0.7-v0", "vllm-0.10-v1-fragment"],
)
def test_vllm_fixtures(fixture: str, expected: EngineSample) -> None:
    assert parse_metrics(_fixture(fixture), taken_at=1.0) == expected


def test_data_parallel_series_sum_load_and_max_kv() -> None:
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
"""
    sample = parse_metrics(text, taken_at=0)
    assert (sample.running, sample.waiting, sample.kv_usage) == (5, 1, 0.75)
