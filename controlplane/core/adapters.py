"""LoRA adapters as the decision core sees them: an adapter's base model, which engines have a slot for it, what loading
it costs (decision 0017). Pure. For engine ``e`` with ``slots(e)`` adapter slots (``engines[].max_loras``, else the
``max_lora`` it reports) and a request for adapter ``a``::

    busy(e)      = the adapters of e's open tickets (the ledger)
    blocked      : slots(e) known, a not in busy(e), |busy(e)| >= slots(e)                 (fit.py: ``adapter_slots``)
    resident(e)  = the first slots(e) of: busy(e), e's reported running and waiting adapters, its recent admissions
    swap_s(e, a) = 0 if a in resident(e), else e's learned swap (``SwapBook``), else ``adapters.swap_seconds``

Invariant: ``blocked`` reads the ledger alone, so no engine ever holds open tickets of more distinct adapters than it
has slots and no admitted request waits inside an engine for a slot (tests/unit/test_adapters.py); traffic that
bypasses sluice only moves ``resident``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet


@dataclass(frozen=True, slots=True)
class AdapterPolicy:
    """The ``adapters`` config section."""

    swap_s: float = 0.5
    """Seconds a load of an adapter into an engine's slot is expected to add to a request's time to first token (the
    prior: the batch stalls while the weights are copied in), >= 0."""
    base_models: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Adapter -> its base model, for engines whose ``/v1/models`` does not name a parent (discovery wins where it
    does)."""
    swap_min_samples: int = 5
    """Cold and warm adapter requests (each) an engine needs timed before its measured swap replaces the prior, >= 1."""
    load_headroom: float = 1.5
    """An adapter's requests keep to ``ceil(share x candidates x headroom)`` engines (at least one, its homes); its
    evictions are charged ``min(1, share x candidates x headroom)`` swaps (adapterhomes.py), >= 0. 0: no placement by
    share (every eviction a whole swap, no narrowing)."""
    home_margin: float = 1.0
    """An adapter's homes stay its only candidates unless the soonest of them finishes later than ``1 + margin`` times
    the soonest other candidate, its swap included (adapterhomes.py), >= 0."""
    dynamic_loading: bool = False
    """Load an adapter no engine lists on the engine where it costs least, unloading that engine's least recently used
    one sluice loaded (adapterloads.py), on engines that allow it."""
    loads_per_minute: int = 6
    """Dynamic loads per engine in any 60 s, >= 1."""
    load_timeout_s: float = 30.0
    """Seconds one load or unload request to an engine may take before it counts as failed."""
    paths: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Adapter -> the path an engine loads it from (vLLM's ``lora_path``); only adapters with one are loaded."""

    def __post_init__(self) -> None:
        for name in ("base_models", "paths"):
            if type(getattr(self, name)) is not MappingProxyType:
                object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


def base_of(model: str, fleet: Fleet, configured: Mapping[str, str]) -> str | None:
    """``model``'s base model if it is an adapter (discovered first, then configured); None for a base model."""
    return fleet.adapters.get(model) or configured.get(model)


def discovered_bases(engines: tuple[EngineView, ...] | list[EngineView]) -> dict[str, str]:
    """Adapter -> base model from the engines' model lists (the first engine naming a parent wins)."""
    out: dict[str, str] = {}
    for engine in engines:
        for served in engine.models:
            if served.parent and served.model_id not in out:
                out[served.model_id] = served.parent
    return out


def busy(engine: EngineView, fleet: Fleet, adapters: Mapping[str, str]) -> tuple[str, ...]:
    """Adapters with open tickets on ``engine`` (``adapters``: every known adapter -> its base)."""
    return tuple(model for model, count in fleet.of(engine.name).open_by_model if count > 0 and model in adapters)


def blocked(engine: EngineView, adapter: str, fleet: Fleet, adapters: Mapping[str, str]) -> bool:
    """Every slot of ``engine`` is held by open tickets of other adapters: ``adapter`` could not start there now."""
    slots = engine.adapter_slots
    if slots is None:
        return False
    held = busy(engine, fleet, adapters)
    return adapter not in held and len(held) >= slots


def resident(engine: EngineView, fleet: Fleet, adapters: Mapping[str, str]) -> tuple[str, ...]:
    """The adapters ``engine`` is expected to hold in its slots now (module docstring), most surely held first."""
    order: dict[str, None] = dict.fromkeys(busy(engine, fleet, adapters))
    sample = engine.sample
    if sample is not None:
        order.update(dict.fromkeys(sample.lora_running or ()))
        order.update(dict.fromkeys(sample.lora_waiting or ()))
    order.update(dict.fromkeys(fleet.adapter_recent.get(engine.name, ())))
    held = tuple(order)
    slots = engine.adapter_slots
    return held[:slots] if slots is not None else held


def swap_s(engine: EngineView, adapter: str, fleet: Fleet, policy: AdapterPolicy, adapters: Mapping[str, str]) -> float:
    """Seconds of swap ``engine`` adds before ``adapter``'s first token: 0 when it is expected resident, else its
    learned swap (``Fleet.adapter_swap_s``) or the prior."""
    if adapter in resident(engine, fleet, adapters):
        return 0.0
    return fleet.adapter_swap_s.get(engine.name, policy.swap_s)


SWAP_SAMPLES = 32
"""Residuals kept per engine and kind (cold, warm), the newest."""


class SwapBook:
    """Each engine's TTFT residuals of cold and warm adapter requests (module docstring), and the swaps fleets carry
    (``Fleet.adapter_swap_s``)."""

    def __init__(self, min_samples: int) -> None:
        self.min_samples = max(1, min_samples)
        self._cold: dict[str, deque[float]] = {}
        self._warm: dict[str, deque[float]] = {}
        self._learned: Mapping[str, float] = MappingProxyType({})

    def observe(self, engine: str, ttft_s: float, expected_ttft_s: float, priced_swap_s: float) -> float:
        """An adapter request's streamed TTFT at ``engine`` against its estimate, which priced ``priced_swap_s`` (0:
        warm): records its residual and returns it."""
        residual = ttft_s - (expected_ttft_s - priced_swap_s)
        book = self._cold if priced_swap_s > 0 else self._warm
        book.setdefault(engine, deque(maxlen=SWAP_SAMPLES)).append(residual)
        swap = self._swap(engine)
        if swap is not None:
            self._learned = MappingProxyType({**self._learned, engine: swap})
        return residual

    def _swap(self, engine: str) -> float | None:
        cold, warm = self._cold.get(engine, ()), self._warm.get(engine, ())
        if len(cold) < self.min_samples or len(warm) < self.min_samples:
            return None
        return max(0.0, statistics.median(cold) - statistics.median(warm))

    def configure(self, min_samples: int) -> None:
        """A reload: the swaps are recomputed under the new minimum."""
        self.min_samples = max(1, min_samples)
        learned = {e: self._swap(e) for e in self._cold}
        self._learned = MappingProxyType({e: v for e, v in learned.items() if v is not None})

    def forget(self, engine: str) -> None:
        """The engine restarted: its history says nothing of the new process."""
        self._cold.pop(engine, None)
        self._warm.pop(engine, None)
        if engine in self._learned:
            self._learned = MappingProxyType({e: v for e, v in self._learned.items() if e != engine})

    def learned(self) -> Mapping[str, float]:
        """engine -> its measured swap, for engines with enough samples of both kinds."""
        return self._learned

    def samples(self, engine: str) -> int:
        """Cold requests timed on ``engine`` (among its last ``SWAP_SAMPLES``)."""
        return len(self._cold.get(engine, ()))


def known_adapters(fleet: Fleet, policy: AdapterPolicy) -> Mapping[str, str]:
    """Every adapter the core knows of, with its base: configured, overridden by what engines report."""
    if not policy.base_models:
        return fleet.adapters
    if not fleet.adapters:
        return policy.base_models
    return {**policy.base_models, **fleet.adapters}
