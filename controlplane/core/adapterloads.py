"""Dynamic LoRA loading's choices (``adapters.dynamic_loading``), pure: the HTTP is observe/adapterloader.py's.

A request for adapter ``a`` that no fresh, undrained engine lists, with ``a``'s base model configured
(``adapters.models``) and its path (``adapters.paths``), is loaded on one engine (``plan_load``):

    candidates = fresh, undrained engines serving a's base that allow runtime loading
                 (``engines[].runtime_lora_updating``) and took fewer than ``adapters.loads_per_minute`` loads in 60 s
    engine     = the candidate where a request for ``a`` finishes soonest, charged (route.estimate with the swap,
                 adapterhomes.placed's eviction charge, affinity.charged_finish); ties by name
    unload     = with as many adapters listed there as it has slots: the least recently admitted one sluice loaded there
                 that no open ticket uses (none: nothing is unloaded)

Invariant: at most ``loads_per_minute`` loads per engine in any 60 s (``LoadBook``); an adapter that some engine lists
is never loaded again.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.core import adapters
from controlplane.core.adapterhomes import placed
from controlplane.core.affinity import charged_finish
from controlplane.core.eventwindow import EventWindow
from controlplane.core.fit import misfits
from controlplane.core.fleet import Fleet
from controlplane.core.model import InferenceRequest
from controlplane.core.policy import Policy
from controlplane.core.route import capacity_throughput, estimate

@dataclass(frozen=True, slots=True)
class LoadPlan:
    adapter: str
    base: str
    path: str
    engine: str
    unload: str | None
    """An adapter to unload from ``engine`` first (its least recently used one sluice loaded), or None."""


class LoadBook:
    """What sluice loaded where: each engine's load times (the rate limit) and the adapters it loaded there."""

    def __init__(self) -> None:
        self._times: dict[str, EventWindow] = {}
        self._loaded: dict[str, set[str]] = {}

    def allowed(self, engine: str, now: float, per_minute: int) -> bool:
        """Whether ``engine`` may take another load at ``now`` (fewer than ``per_minute`` in the last 60 s)."""
        times = self._times.get(engine)
        return times is None or times.allows(now, per_minute)

    def note_load(self, engine: str, adapter: str, now: float) -> None:
        """A load was sent to ``engine`` at ``now`` (counted whether or not it succeeds: the engine did the work)."""
        self._times.setdefault(engine, EventWindow()).note(now)
        self._loaded.setdefault(engine, set()).add(adapter)

    def note_unload(self, engine: str, adapter: str) -> None:
        self._loaded.get(engine, set()).discard(adapter)

    def loaded(self, engine: str) -> frozenset[str]:
        """Adapters sluice loaded on ``engine`` and has not unloaded."""
        return frozenset(self._loaded.get(engine, ()))


def plan_load(adapter: str, fleet: Fleet, policy: Policy, loadable: frozenset[str], book: LoadBook,
              now: float) -> LoadPlan | None:
    """Where to load ``adapter`` (the module docstring), or None: loading off, nothing to load, or no engine may."""
    ap = policy.adapters
    base, path = ap.base_models.get(adapter), ap.paths.get(adapter)
    if not ap.dynamic_loading or base is None or path is None:
        return None
    live = [e for e in fleet.engines if not e.drained and not e.stale]
    if any(e.serves(adapter) for e in live):
        return None
    engines = [e for e in live if e.name in loadable and e.serves(base)
               and book.allowed(e.name, now, ap.loads_per_minute)]
    if not engines:
        return None
    request = InferenceRequest("POST", "/v1/chat/completions", adapter, prompt_tokens=1)
    known = adapters.known_adapters(fleet, ap)
    estimates = [estimate(e, request, not misfits(e, request, fleet, policy), fleet, policy, now) for e in engines]
    capacity = {e.name: capacity_throughput(e, fleet, policy) for e in engines}
    best = min(placed(adapter, estimates, engines, fleet, ap.load_headroom, ap.home_margin, known, capacity),
               key=lambda x: (charged_finish(x), x.engine.name))
    engine = best.engine
    listed = [m.model_id for m in engine.models if m.model_id in known]
    unload = None
    slots = engine.adapter_slots
    if slots is not None and len(listed) >= slots:
        ours = book.loaded(engine.name) - set(adapters.busy(engine, fleet, known))
        recent = fleet.adapter_recent.get(engine.name, ())
        order = {a: i for i, a in enumerate(recent)}
        # Least recently admitted last in ``recent``; never admitted at all: older still.
        unload = max(sorted(a for a in ours if a in listed), key=lambda a: order.get(a, len(recent)), default=None)
    return LoadPlan(adapter, base, path, engine.name, unload)
