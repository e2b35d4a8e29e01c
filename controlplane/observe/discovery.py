"""What an engine says about itself, per flavour: served models, version, KV capacity, concurrency cap. Pure parsers of the
JSON each endpoint returns; the poller fetches.

| flavour | endpoints | version | KV capacity (tokens) | concurrency cap |
|---|---|---|---|---|
| vLLM | ``/v1/models``, ``/version`` | ``version`` | from metrics (``cache_config_info``) | configured only |
| SGLang | ``/v1/models``, ``/server_info``, ``/v1/loads`` | ``version`` | ``max_total_num_tokens`` (summed over DP ranks) | ``max_running_requests`` |
| llama.cpp | ``/v1/models``, ``/props``, ``/lora-adapters`` | ``build_info`` | per-slot ``n_ctx`` x ``total_slots`` | ``total_slots`` |
| TGI | ``/info`` | ``version`` | - | ``max_concurrent_requests`` |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.core.engines import ServedModel
from controlplane.core.engines import Flavor

#: Endpoints fetched at discovery, per flavour, after ``/v1/models``. Each is optional: a 404 leaves its fields unknown.
DISCOVERY_PATHS: dict[Flavor, tuple[str, ...]] = {
    Flavor.VLLM: ("/version",),
    Flavor.SGLANG: ("/server_info", "/v1/loads"),
    Flavor.LLAMACPP: ("/props", "/lora-adapters"),
    Flavor.TGI: ("/info",),
}


@dataclass(frozen=True, slots=True)
class Discovery:
    models: tuple[ServedModel, ...] = ()
    version: str | None = None
    kv_capacity_tokens: int | None = None
    max_concurrency: int | None = None
    lora_adapters: tuple[str, ...] = ()
    """llama.cpp: the adapters ``/lora-adapters`` lists (``parse_lora_adapters``)."""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_models(listing: Any) -> tuple[ServedModel, ...]:
    """``/v1/models``: ids, ``max_model_len`` (vLLM, SGLang) or ``meta.n_ctx_train`` (llama.cpp), LoRA ``parent``."""
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return ()
    out = []
    for m in listing["data"]:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        max_len = _int(m.get("max_model_len"))
        meta = m.get("meta")
        if max_len is None and isinstance(meta, dict):
            max_len = _int(meta.get("n_ctx_train"))
        parent = m.get("parent") if isinstance(m.get("parent"), str) else None
        out.append(ServedModel(m["id"], max_len, parent))
    return tuple(out)


def parse_discovery(flavor: Flavor, models: tuple[ServedModel, ...], documents: dict[str, Any]) -> Discovery:
    """Combine ``/v1/models`` with the flavour's other discovery documents (path -> parsed JSON, absent when unavailable)."""
    if flavor is Flavor.VLLM:
        doc = documents.get("/version") or {}
        return Discovery(models, _str(doc.get("version")))
    if flavor is Flavor.SGLANG:
        info = documents.get("/server_info") or {}
        capacity = _int(info.get("max_total_num_tokens"))
        cap = _int(info.get("max_running_requests"))
        loads = documents.get("/v1/loads")
        ranks = loads.get("loads") if isinstance(loads, dict) else loads
        if isinstance(ranks, list) and ranks:
            capacity = _sum(r.get("max_total_num_tokens") for r in ranks if isinstance(r, dict)) or capacity
            cap = _sum(r.get("max_running_requests") for r in ranks if isinstance(r, dict)) or cap
        return Discovery(models, _str(info.get("version")), capacity, cap)
    if flavor is Flavor.LLAMACPP:
        props = documents.get("/props") or {}
        slots = _int(props.get("total_slots"))
        settings = props.get("default_generation_settings")
        per_slot = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
        capacity = per_slot * slots if per_slot and slots else None
        if per_slot:
            # One request can use one slot's context, whatever the model was trained for.
            models = tuple(ServedModel(m.model_id, per_slot, m.parent) for m in models)
        return Discovery(models, _str(props.get("build_info")), capacity, slots,
                         parse_lora_adapters(documents.get("/lora-adapters")))
    info = documents.get("/info") or {}
    if not models and isinstance(info.get("model_id"), str):
        models = (ServedModel(info["model_id"], _int(info.get("max_total_tokens"))),)
    return Discovery(models, _str(info.get("version")), None, _int(info.get("max_concurrent_requests")))


def parse_lora_adapters(listing: Any) -> tuple[str, ...]:
    """llama.cpp's ``GET /lora-adapters`` (``[{"id": 0, "path": "my_adapter_1.gguf", "scale": 0.0}, ...]``, every
    adapter loaded at start with ``--lora``; ``scale`` 0 means not applied unless a request asks): each adapter's file
    name without its directory and ``.gguf``, in id order; entries without a path are left out."""
    if not isinstance(listing, list):
        return ()
    named: list[tuple[int, str]] = []
    for entry in listing:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry["path"]:
            ident = entry.get("id")
            name = entry["path"].replace("\\", "/").rsplit("/", 1)[-1]
            named.append((ident if isinstance(ident, int) else len(named), name.removesuffix(".gguf") or name))
    return tuple(name for _, name in sorted(named))


def slots_kv_usage(slots: Any) -> float | None:
    """Mainline llama.cpp has no KV gauge: tokens held by busy slots over the total context of all slots (``/slots``)."""
    if not isinstance(slots, list) or not slots:
        return None
    total = used = 0
    for slot in slots:
        if not isinstance(slot, dict) or not _int(slot.get("n_ctx")):
            return None
        total += slot["n_ctx"]
        if slot.get("is_processing"):
            decoded = (slot.get("next_token") or {}).get("n_decoded", 0) if isinstance(slot.get("next_token"), dict) else 0
            used += (slot.get("n_prompt_tokens") or 0) + (decoded or 0)
    return min(1.0, used / total) if total else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _sum(values: Any) -> int | None:
    ints = [v for v in (_int(x) for x in values) if v is not None]
    return sum(ints) if ints else None
