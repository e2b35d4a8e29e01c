"""The scanning reader (``read_series``) reads exactly what prometheus_client reads for every metric sluice uses, on the real
captures, the real-size vLLM V1 exposition and hand-made edge cases; it skips everything else."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.observe import parse
from controlplane.observe.parse import _WANTED, Series, parse_metrics, read_series
from bench.vllm_exposition import vllm_v1_exposition

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-metrics"


def _norm(series: Series) -> dict[str, list[tuple[dict[str, str], float | str]]]:
    """nan != nan: compare values by repr; ints and floats by value."""
    return {name: [(labels, "nan" if math.isnan(v) else float(v)) for labels, v in rows] for name, rows in series.items()
            if rows}


def _reference(text: str) -> Series:
    """prometheus_client's full parse, restricted to the names sluice reads."""
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _WANTED:
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.prom")))
def test_real_captures_read_as_prometheus_client_reads_them(fixture: str) -> None:
    text = (FIXTURES / fixture).read_text()
    assert _norm(read_series(text)) == _norm(_reference(text))


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_real_size_vllm_v1_exposition(data_parallel: int) -> None:
    text = vllm_v1_exposition(level=3, data_parallel=data_parallel).decode()
    assert len(text) > 50_000 * data_parallel * 0.9  # every bucket kept, like a real server
    series = read_series(text)
    assert _norm(series) == _norm(_reference(text))
    assert not any(name.endswith("_created") for name in series)
    # One histogram's buckets are read (the spread of answer lengths, rates.py); every other bucket is skipped.
    assert {name for name in series if name.endswith("_bucket")} == {"vllm:request_generation_tokens_bucket"}
    assert len(series["vllm:num_requests_running"]) == data_parallel
    sample = parse_metrics(text, taken_at=1.0)
    assert sample.kv_capacity_tokens == 20480 * 16
    assert sample.decode_tokens_total is not None and sample.prefill_seconds_total is not None


EDGE = r"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a \"quoted\" } model, with {braces}"} 3
vllm:num_requests_running{engine="1",model_name="back\\slash\nnewline"} 4.0 1700000000000
vllm:num_requests_running{model_name="trailing-comma",} +Inf
vllm:num_requests_running{ engine = "2" , model_name="spaces" } -Inf
vllm:num_requests_running	7
vllm:num_requests_running{} 1.5e+09
vllm:num_requests_running_bucket{le="1"} 99
vllm:num_requests_running_created 1.7e9
vllm:num_requests_waiting{model_name="m"} nan
vllm:num_requests_waiting{model_name="m2"} NaN
vllm:kv_cache_usage_perc{model_name="m"} 1E-3
vllm:generation_tokens_total{model_name="m"} 12   
vllm:prompt_tokens_total 0x10
"""


def test_edge_cases_read_as_prometheus_client_reads_them() -> None:
    text = EDGE.replace("vllm:prompt_tokens_total 0x10\n", "")
    assert _norm(read_series(text)) == _norm(_reference(text))
    running = read_series(text)["vllm:num_requests_running"]
    assert running[0][0]["model_name"] == 'a "quoted" } model, with {braces}'
    assert running[1] == ({"engine": "1", "model_name": "back\\slash\nnewline"}, 4.0)
    assert [v for _, v in running][2:] == [math.inf, -math.inf, 7, 1.5e9]


def test_crlf_and_a_first_line_without_comments() -> None:
    text = 'vllm:num_requests_running{model_name="m"} 2\r\nvllm:num_requests_waiting{model_name="m"} 1\r\n'
    series = read_series(text)
    assert series["vllm:num_requests_running"] == [({"model_name": "m"}, 2)]
    assert series["vllm:num_requests_waiting"] == [({"model_name": "m"}, 1)]


@pytest.mark.parametrize("line", [
    "vllm:num_requests_running 0x10",
    "vllm:num_requests_running 1_000",
    'vllm:num_requests_running{a="1",a="2"} 1',
    'vllm:num_requests_running{a="1} 1',
])
def test_a_malformed_line_that_sluice_reads_is_an_error(line: str) -> None:
    with pytest.raises(ValueError):
        next(iter(text_string_to_metric_families(line + "\n")))  # the reference rejects it too
    with pytest.raises(ValueError):
        read_series(f"# TYPE vllm:num_requests_running gauge\n{line}\n")


def test_a_malformed_line_sluice_does_not_read_is_skipped() -> None:
    text = 'vllm:unrelated{a="1} 1\nvllm:num_requests_running 2\nnot a metric line at all {{{\n'
    assert dict(read_series(text)) == {"vllm:num_requests_running": [({}, 2)]}


def test_label_blocks_read_again_from_the_cache_read_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe reads the label blocks the previous probe cached: every line read twice reads as the reference reads it,
    and lines that only share a cached block's opening (a second value, an exemplar) still take the full read."""
    text = EDGE.replace("vllm:prompt_tokens_total 0x10\n", "")
    read_series(text)
    assert _norm(read_series(text)) == _norm(_reference(text))
    read_series('vllm:num_requests_running{engine="0",model_name="m"} 3\n')
    for odd in ('vllm:num_requests_running{engine="0",model_name="m"} 3 4 5\n',
                'vllm:num_requests_running{engine="0",model_name="m"}3\n'):
        assert _norm(read_series(odd)) == _norm(_reference(odd))
    monkeypatch.setattr(parse, "LABEL_SETS_MAX", 3)
    lines = "".join(f'vllm:num_requests_running{{engine="{i}"}} {i}\n' for i in range(10))
    assert [v for _, v in read_series(lines)["vllm:num_requests_running"]] == list(range(10))
    assert len(parse._LABEL_SETS) <= 3
