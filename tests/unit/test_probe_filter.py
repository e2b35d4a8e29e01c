"""Filtered probes (``parse.metrics_path``): a vLLM engine is asked for only the samples sluice reads, and what it answers
reads to the very sample the whole exposition gives; an engine that refuses the filtered query, or answers it without
what sluice needs, is probed whole from then on, in the same probe; the operator can turn filtering off.

The filtered answers here are prometheus_client's own ``restricted_registry`` output (``enginesim.exposition.restrict``),
the code a real vLLM runs for ``/metrics?name[]=...``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from controlplane.config import parse_config
from controlplane.core.engines import EngineSample, EngineView, Flavor
from controlplane.observe.parse import metrics_path, missing_gauges, read_series, sample_from_series
from controlplane.observe.poller import EnginePoller
from enginesim.exposition import restrict
from bench.vllm_exposition import vllm_v1_exposition
from tests.unit.scriptedhttp import Server, ok

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-metrics"
VLLM_NAMES = parse_qs(urlsplit(metrics_path(Flavor.VLLM)).query)["name[]"]


def _read(text: bytes, flavor: Flavor) -> tuple[EngineSample, tuple[str, ...]]:
    series = read_series(text.decode())
    return sample_from_series(series, 1.0, flavor), missing_gauges(series, flavor)


@pytest.mark.parametrize("source", ["real-size-v1", "real-size-v1-dp2",
                                    *sorted(p.name for p in FIXTURES.glob("vllm-*.prom"))])
def test_a_filtered_vllm_answer_reads_as_the_whole_exposition(source: str) -> None:
    if source.startswith("real-size"):
        whole = vllm_v1_exposition(level=3, data_parallel=2 if source.endswith("dp2") else 1)
    else:
        whole = (FIXTURES / source).read_bytes()
    filtered = restrict(whole, VLLM_NAMES)
    assert _read(filtered, Flavor.VLLM) == _read(whole, Flavor.VLLM)
    if source == "real-size-v1":
        # What a probe moves and scans: 54 KB -> about 6 KB.
        assert len(whole) > 50_000 and len(filtered) < len(whole) / 7


def test_only_vllm_is_asked_to_filter() -> None:
    # SGLang's registry answers a filtered query with nothing (its multiprocess collector has no names to match);
    # llama.cpp's and TGI's servers ignore the query.
    assert metrics_path(Flavor.VLLM).startswith("/metrics?name%5B%5D=vllm%3A")
    assert {metrics_path(f) for f in (Flavor.SGLANG, Flavor.LLAMACPP, Flavor.TGI, None)} == {"/metrics"}
    assert len(metrics_path(Flavor.VLLM)) < 2048  # well within any server's request-line limit


def _engine(filtering: bool, refusal: bytes = ok(b"")) -> Server:
    """A vLLM engine: the real-size exposition, restricted per query when ``filtering``; else a filtered query gets
    ``refusal`` (by default an empty exposition, as a vLLM running several API servers over PROMETHEUS_MULTIPROC_DIR
    answers it)."""
    whole = vllm_v1_exposition(level=3)
    documents = {"/v1/models": json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode(),
                 "/version": b'{"version": "0.11.0"}'}

    def answer(line: str, served: int) -> bytes:
        path, _, query = line.split(" ")[1].partition("?")
        if path == "/metrics":
            names = parse_qs(query).get("name[]", [])
            if names and not filtering:
                return refusal
            return ok(restrict(whole, names) if names else whole)
        return ok(documents[path])

    return Server(answer)


async def _probe(url: str, times: int, flavor: str | None = None, **observe: object) -> tuple[EngineView, EnginePoller]:
    engine: dict[str, object] = {"name": "e", "url": url, "models": ["m"], "max_num_seqs": 8}
    if flavor:
        engine["flavor"] = flavor
    config = parse_config({"engines": [engine], "observe": observe})
    views: list[EngineView] = []
    poller = EnginePoller(config.engines[0], config.observe, on_probe=lambda view, rates: views.append(view))
    for _ in range(times):
        await poller.poll_once()
    poller.close()
    return views[-1], poller


def _metrics_requests(server: Server) -> list[str]:
    return [line.split(" ")[1] for line in server.requests if line.split(" ")[1].startswith("/metrics")]


async def test_a_detected_vllm_engine_is_probed_filtered_after_its_first_probe() -> None:
    server = _engine(filtering=True)
    async with server as url:
        view, _ = await _probe(url, 3)
    assert _metrics_requests(server) == ["/metrics", metrics_path(Flavor.VLLM), metrics_path(Flavor.VLLM)]
    assert view.flavor is Flavor.VLLM and view.degraded == ()
    whole_sample, _ = _read(vllm_v1_exposition(level=3), Flavor.VLLM)
    assert view.sample is not None and view.sample.running == whole_sample.running
    assert view.sample.kv_capacity_tokens == 20480 * 16  # cache_config_info is among the samples asked for


async def test_a_configured_vllm_engine_is_probed_filtered_from_the_start() -> None:
    server = _engine(filtering=True)
    async with server as url:
        await _probe(url, 2, flavor="vllm")
    assert _metrics_requests(server) == [metrics_path(Flavor.VLLM)] * 2


async def test_an_engine_answering_the_filter_with_nothing_is_probed_whole_from_then_on(
        caplog: pytest.LogCaptureFixture) -> None:
    server = _engine(filtering=False)
    with caplog.at_level(logging.WARNING, logger="controlplane.observe.poller"):
        async with server as url:
            view, _ = await _probe(url, 3, flavor="vllm")
    # The filtered probe came back empty: the same probe read the whole exposition, and every later one is whole.
    assert _metrics_requests(server) == [metrics_path(Flavor.VLLM), "/metrics", "/metrics", "/metrics"]
    assert view.degraded == () and view.sample is not None and view.sample.kv_usage is not None
    assert [r.getMessage() for r in caplog.records if "filtered" in r.getMessage()] == [
        "engine e: a filtered /metrics probe lacked vllm:num_requests_running, vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc; probing the whole exposition from now on"]


@pytest.mark.parametrize(("refusal", "warned"), [
    # a proxy that refuses query strings
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nbad request", "failed (GET /metrics?"),
    # a front end that answers every unknown URL with a page: it reads as an exposition without a single gauge
    (ok(b"<html><body>login</body></html>"), "lacked vllm:num_requests_running"),
], ids=["http-400", "html-page"])
async def test_an_engine_refusing_the_filter_is_probed_whole_in_the_same_probe(
        refusal: bytes, warned: str, caplog: pytest.LogCaptureFixture) -> None:
    server = _engine(filtering=False, refusal=refusal)
    with caplog.at_level(logging.WARNING, logger="controlplane.observe.poller"):
        async with server as url:
            view, poller = await _probe(url, 3, flavor="vllm")
    assert _metrics_requests(server) == [metrics_path(Flavor.VLLM), "/metrics", "/metrics", "/metrics"]
    assert poller.failures == 0 and view.last_error == "" and view.degraded == ()
    assert view.sample is not None and view.sample.kv_usage is not None
    warnings = [r.getMessage() for r in caplog.records if "filtered" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"engine e: a filtered /metrics probe {warned}")
    assert len(warnings[0]) < 240  # the 1.2 KB query is summarised, not quoted (poller.shown_path)


async def test_filtering_can_be_turned_off() -> None:
    server = _engine(filtering=True)
    async with server as url:
        await _probe(url, 2, flavor="vllm", filter_metrics=False)
    assert _metrics_requests(server) == ["/metrics", "/metrics"]
    with pytest.raises(ValueError, match="observe.filter_metrics"):
        parse_config({"engines": [{"name": "e", "url": "http://127.0.0.1:9"}], "observe": {"filter_metrics": "yes"}})
