"""Where a LoRA adapter lives: on as few engines as its share of the traffic needs (decision 0026). Pure. For a request
for adapter ``a`` among ``n`` candidate engines (adapters.py: ``resident``, ``busy``, ``swap_s``)::

    share(a)   = a's part of the last ``RECENT_ADMISSIONS`` adapter admissions of its base model (``AdapterShares``)
    need(a)    = share(a) x n x adapters.load_headroom                    (engines' worth of a's traffic)
    homes(a)   = min(n, max(1, ceil(need(a))))                            (how many engines a keeps to)
    victim(e)  = with every slot of e expected held: its least recently used adapter no open ticket uses, else none
    evicted(e) = 0 for no victim or one held on homes(v) other candidates, else need(v)

A load is charged ``swap(e) x min(1, evicted(e))`` in the choice (``Estimate.stall_s``, beside the batch's stall). The
candidates are narrowed to ``a``'s homes (``plan``), unless the soonest of them finishes later than ``(1 +
adapters.home_margin)`` x the soonest other candidate (``finish``, the swap included) or none of them can be estimated
(their adapter slots held by others): then every candidate stays and finish-soonest decides. With fewer than
``SHARE_MIN_ADMISSIONS`` admissions of the base model no shares are known: every victim weighs 1 and nothing is
narrowed (decision 0017's rule alone).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from controlplane.core import adapters
from controlplane.core.engines import EngineView
from controlplane.core.fleet import Fleet
from controlplane.core.route import Estimate

RECENT_ADMISSIONS = 512
"""Adapter admissions per base model whose adapters ``AdapterShares`` counts."""
SHARE_MIN_ADMISSIONS = 32
"""Below this many admissions of a base model's adapters, their shares are unknown."""


class AdapterShares:
    """Each adapter's share of its base model's recent adapter admissions (the module docstring's ``share``)."""

    def __init__(self, window: int = RECENT_ADMISSIONS, min_admissions: int = SHARE_MIN_ADMISSIONS) -> None:
        self.window = window
        self.min_admissions = min_admissions
        self._recent: dict[str, deque[str]] = {}
        self._counts: dict[str, Counter[str]] = {}
        self._view: Mapping[str, float] | None = MappingProxyType({})

    def note(self, adapter: str, base: str) -> None:
        """An admission of ``adapter`` (of ``base``), here or by another replica."""
        recent = self._recent.setdefault(base, deque())
        counts = self._counts.setdefault(base, Counter())
        if len(recent) >= self.window:
            old = recent.popleft()
            counts[old] -= 1
            if not counts[old]:
                del counts[old]
        recent.append(adapter)
        counts[adapter] += 1
        self._view = None

    def shares(self) -> Mapping[str, float]:
        """adapter -> its share, for base models with at least ``min_admissions`` admissions (``Fleet.adapter_shares``);
        an adapter of such a base missing here had none recently (share 0)."""
        if self._view is None:
            self._view = MappingProxyType({a: n / len(self._recent[base]) for base, counts in self._counts.items()
                                           if len(self._recent[base]) >= self.min_admissions
                                           for a, n in counts.items()})
        return self._view


def need(share: float, candidates: int, headroom: float) -> float:
    """Engines' worth of an adapter's traffic: ``share x candidates x headroom``."""
    return share * candidates * headroom


def homes(share: float, candidates: int, headroom: float) -> int:
    """How many engines may hold an adapter before its requests keep to them: ``max(1, ceil(need))``."""
    return max(1, math.ceil(need(share, candidates, headroom) - 1e-9))


def victim(engine: EngineView, fleet: Fleet, known: Mapping[str, str]) -> str | None:
    """The adapter a load on ``engine`` would evict (the module docstring), None when a slot is free or unknown."""
    slots = engine.adapter_slots
    if slots is None:
        return None
    held = adapters.resident(engine, fleet, known)
    if len(held) < slots:
        return None
    in_use = set(adapters.busy(engine, fleet, known))
    idle = [a for a in held if a not in in_use]
    return idle[-1] if idle else None


def plan(adapter: str, candidates: list[EngineView], fleet: Fleet, headroom: float, capacity: Mapping[str, float],
         known: Mapping[str, str]) -> tuple[str, ...]:
    """The ``homes`` engines ``adapter``'s requests keep to, by name. The base model's adapters in order of share (then
    name) each take ``homes`` engines: first those with a pinned slot left (every slot, less one an engine when the
    adapters outnumber the slots), then one already holding the adapter while it has room, then the most room; room
    starts at each engine's part of ``capacity`` and loses ``share / homes`` per adapter placed there. Every adapter
    has a home; popular ones are pinned where capacity is, the rest share the slot each engine keeps."""
    base = known.get(adapter)
    shares = fleet.adapter_shares
    ranked = sorted({a for a in shares if known.get(a) == base} | {adapter}, key=lambda a: (-shares.get(a, 0.0), a))
    n = len(candidates)
    slots = {e.name: e.adapter_slots if e.adapter_slots is not None else len(ranked) for e in candidates}
    reserve = 1 if len(ranked) > sum(slots.values()) else 0
    total = sum(capacity.get(e.name, 0.0) for e in candidates) or 1.0
    room = {e.name: capacity.get(e.name, 0.0) / total for e in candidates}
    pinned = {e.name: max(0, slots[e.name] - reserve) for e in candidates}
    held = {e.name: set(adapters.resident(e, fleet, known)) for e in candidates}
    for a in ranked:
        share = shares.get(a, 0.0)
        k = min(n, homes(share, n, headroom))
        chosen = sorted(room, key=lambda name: (pinned[name] <= 0, not (a in held[name] and room[name] > 0),
                                                -room[name], name))[:k]
        if a == adapter:
            return tuple(chosen)
        for name in chosen:
            room[name] -= share / k
            pinned[name] -= 1
    raise AssertionError("unreachable: the adapter is among those ranked")


def placed(adapter: str, estimates: list[Estimate], candidates: list[EngineView], fleet: Fleet, headroom: float,
           margin: float, known: Mapping[str, str], capacity: Mapping[str, float]) -> list[Estimate]:
    """``estimates`` (for a request for ``adapter``, one per candidate that could take it now or after a slot frees)
    charged each load's eviction, and narrowed to the adapter's homes among all ``candidates`` (the module docstring);
    when no home is among the estimates (each one's adapter slots held by other adapters), every estimate stays. Never
    empty when ``estimates`` is not. ``headroom`` 0: every victim weighs 1 and nothing is narrowed."""
    if not estimates:
        return estimates
    base = known.get(adapter)
    shares = fleet.adapter_shares if headroom > 0 and base is not None else {}
    if shares and not any(known.get(a) == base for a in shares):
        shares = {}  # none known for this base model: decision 0017's rule alone
    n = len(candidates)
    holders_of = Counter(a for x in estimates for a in adapters.resident(x.engine, fleet, known))

    def victim_need(engine: EngineView) -> float:
        """What the load would evict, in engines' worth of traffic (0: a free slot, or a victim held elsewhere as
        often as its traffic needs); 1 for any victim while shares are unknown."""
        v = victim(engine, fleet, known)
        if v is None:
            return 0.0
        if not shares:
            return 1.0
        share = shares.get(v, 0.0)
        return 0.0 if holders_of[v] - 1 >= homes(share, n, headroom) else need(share, n, headroom)

    charged = [replace(x, stall_s=x.stall_s + x.swap_s * min(1.0, victim_need(x.engine))) if x.swap_s else x
               for x in estimates]
    if not shares:
        return charged
    kept = set(plan(adapter, candidates, fleet, headroom, capacity, known))
    home = [x for x in charged if x.engine.name in kept]
    if not home or len(home) == len(charged):
        return charged
    rest = min(x.finish_s for x in charged if x.engine.name not in kept)
    if min(x.finish_s for x in home) > rest * (1 + margin):
        return charged  # the homes are clearly worse: every candidate stays
    return home
