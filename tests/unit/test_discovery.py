"""Discovery documents per engine flavour parse into models, version, KV capacity and concurrency cap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controlplane.core.engines import Flavor, ServedModel
from controlplane.observe.discovery import (Discovery, parse_discovery, parse_lora_adapters, parse_models,
                                            slots_kv_usage)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-metrics"


def test_vllm_models_with_a_lora_adapter() -> None:
    """The captured vLLM /v1/models with LoRA adapters: the adapter names its base model and has no max_model_len."""
    path = FIXTURES / "vllm-0.7.x-aibrix-runtime-docs-v1-models-lora.json"
    if not path.exists():
        pytest.fail(f"fixture {path} missing (a copy of shared/fixtures/engine-metrics, see its SOURCES.md)")
    models = parse_models(json.loads(path.read_text()))
    bases = [m for m in models if m.parent is None]
    adapters = [m for m in models if m.parent is not None]
    assert bases and adapters
    assert all(a.max_model_len is None for a in adapters)
    assert all(b.max_model_len for b in bases)
    assert {a.parent for a in adapters} <= {b.model_id for b in bases}


M = (ServedModel("m", 8192),)


@pytest.mark.parametrize(
    ("flavor", "documents", "expected"),
    [
        (Flavor.VLLM, {"/version": {"version": "0.10.1"}}, Discovery(M, "0.10.1")),
        (Flavor.VLLM, {}, Discovery(M, None)),
        (Flavor.SGLANG, {"/server_info": {"version": "0.5.4", "max_running_requests": 48, "max_total_num_tokens": 90000}},
         Discovery(M, "0.5.4", 90000, 48)),
        (Flavor.SGLANG, {"/server_info": {"version": "0.5.4"},
                         "/v1/loads": {"loads": [{"max_total_num_tokens": 50000, "max_running_requests": 16},
                                                 {"max_total_num_tokens": 50000, "max_running_requests": 16}]}},
         Discovery(M, "0.5.4", 100000, 32)),
        (Flavor.LLAMACPP, {"/props": {"total_slots": 4, "default_generation_settings": {"n_ctx": 4096},
                                      "build_info": "b6500-abc"}},
         Discovery((ServedModel("m", 4096),), "b6500-abc", 16384, 4)),
        (Flavor.TGI, {"/info": {"version": "3.0.1", "max_concurrent_requests": 128, "model_id": "x"}},
         Discovery(M, "3.0.1", None, 128)),
    ],
    ids=["vllm", "vllm-no-version", "sglang-server-info", "sglang-dp-loads", "llamacpp-props", "tgi-info"],
)
def test_parse_discovery(flavor: Flavor, documents: dict[str, Any], expected: Discovery) -> None:
    assert parse_discovery(flavor, M, documents) == expected


LLAMACPP_LORA_ADAPTERS = """[
    {"id": 0, "path": "my_adapter_1.gguf", "scale": 0.0},
    {"id": 1, "path": "/models/lora/code-assist.gguf", "scale": 0.8}
]"""
"""llama.cpp's ``GET /lora-adapters`` as tools/server/README.md documents it (``[{id, path, scale}]``, adapters loaded
with ``--lora``), the second entry with a full path."""


def test_llamacpp_lora_adapters_are_read_at_discovery() -> None:
    """Each adapter by its file's name, in id order; ``sluice admin engines`` shows them as the engine's adapters."""
    listing = json.loads(LLAMACPP_LORA_ADAPTERS)
    assert parse_lora_adapters(listing) == ("my_adapter_1", "code-assist")
    found = parse_discovery(Flavor.LLAMACPP, M, {"/props": {"total_slots": 1}, "/lora-adapters": listing})
    assert found.lora_adapters == ("my_adapter_1", "code-assist")
    assert parse_lora_adapters(list(reversed(listing))) == ("my_adapter_1", "code-assist")
    assert parse_lora_adapters({"error": "not found"}) == () and parse_lora_adapters([{"id": 2}]) == ()


def test_tgi_without_v1_models_takes_the_model_from_info() -> None:
    found = parse_discovery(Flavor.TGI, (), {"/info": {"model_id": "bigscience/bloom", "max_total_tokens": 2048}})
    assert found.models == (ServedModel("bigscience/bloom", 2048),)


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        ([{"n_ctx": 1000, "is_processing": True, "n_prompt_tokens": 300, "next_token": {"n_decoded": 100}},
          {"n_ctx": 1000, "is_processing": False, "n_prompt_tokens": 900}], 0.2),
        ([], None),
        ([{"is_processing": True}], None),  # no n_ctx: unknown, not zero
    ],
    ids=["one-busy-slot", "no-slots", "no-context-size"],
)
def test_llamacpp_kv_usage_from_slots(slots: list[dict[str, Any]], expected: float | None) -> None:
    assert slots_kv_usage(slots) == expected


def test_probe_backoff_doubles_from_the_interval_up_to_the_cap() -> None:
    from controlplane.config import parse_config
    from controlplane.observe.poller import EnginePoller

    config = parse_config({"engines": [{"name": "a", "url": "http://127.0.0.1:1"}],
                           "observe": {"poll_interval_seconds": 0.5, "poll_timeout_seconds": 0.4,
                                       "max_backoff_seconds": 3.0}})
    poller = EnginePoller(config.engines[0], config.observe, on_probe=lambda view, rates: None)
    delays = []
    for failures in range(1, 6):
        poller.failures = failures
        delays.append(poller.backoff_s())
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_admin_engines_shows_a_llamacpp_engines_adapters() -> None:
    """``sluice admin engines``: the adapters column of a llama.cpp engine lists what ``/lora-adapters`` named."""
    from controlplane.core.engines import EngineView
    from controlplane.core.feedback import TtftSummary
    from controlplane.core.fleet import Fleet
    from controlplane.servicers.admin_views import engine_proto
    from sluice.admincli import _adapters

    view = EngineView(name="llama", url="http://llama", max_num_seqs=1, models=M, flavor=Flavor.LLAMACPP,
                      lora_adapters=parse_lora_adapters(json.loads(LLAMACPP_LORA_ADAPTERS)))
    shown = engine_proto(view, Fleet((view,)), 0.0, 0, (None, None), TtftSummary(0, None, None, None), None)
    assert list(shown.adapters_loaded) == ["my_adapter_1", "code-assist"]
    assert _adapters(shown) == "my_adapter_1,code-assist/?"
