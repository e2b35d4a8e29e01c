"""Inputs to the pure admission core shared by its tests: an engine's view (``engine``: serving ``cortex``, idle unless
``running``, anchored rates), a chat request for ``cortex`` (``chat``), seed 000's measured decode rates (``SEED_000``)
and a fleet of one fast and one slow single-slot engine (``FAST_AND_SLOW``) with ``busy_fast`` to fill the fast one."""

from __future__ import annotations

from controlplane.core.admission import AdmissionCore
from controlplane.core.fleet import BatchRates
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Priority


def engine(name: str, running: int = 0, *, seqs: int = 2, prefill: float = 1000.0, decode: float = 20.0,
           version: str = "0.10.1", stale: bool = False, drained: bool = False) -> EngineView:
    return EngineView(name=name, url="", max_num_seqs=seqs, models=(ServedModel("cortex", 32_768),), version=version,
                      sample=EngineSample(0.0, running=running, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000),
                      last_ok_at=0.0, stale=stale, chip_class=name, anchor_prefill_tokens_per_s=prefill,
                      anchor_decode_tokens_per_s=decode, drained=drained)


def chat(prompt: int = 10, max_tokens: int | None = 111, ttft_ms: int | None = None, session: str | None = None,
         priority: str = "standard") -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", "cortex", prompt_tokens=prompt, max_tokens=max_tokens,
                            max_ttft_ms=ttft_ms, session=session, priority=Priority(priority))


# Seed 000: per-request decode at 1 and 2 streams (aggregate 18.18 / 50.71 and 49.24 / 87.82 tok/s).
SEED_000 = {"thor": BatchRates({1: 18.18, 2: 50.71 / 2}), "spark": BatchRates({1: 49.24, 2: 87.82 / 2})}

# One slot each; a 1000-token prompt takes 0.1 s to prefill on fast, 2 s on slow.
FAST_AND_SLOW = [engine("fast", seqs=1, prefill=10_000.0, decode=50.0),
                 engine("slow", seqs=1, prefill=500.0, decode=20.0)]


def busy_fast(core: AdmissionCore) -> None:
    holder = core.check("holder", chat(prompt=10, max_tokens=10), core.fleet(FAST_AND_SLOW[:1], 0.0), 0.0)
    assert holder.ticket is not None and holder.ticket.engine == "fast"  # frees in about 0.2 s
