"""The fleet as the control plane keeps it between Checks: engine views, ledger views and per-model candidate arrays,
refreshed only where something changed. Pure (time passed in); numpy only as a container of numbers.

Issue 9: with 200 engines a Check rebuilt every engine's view and ledger view, decayed every engine's serve count, then
``decide`` ran ``misfits`` + ``estimate`` (a dozen Python calls) for every candidate: 2.5 ms a Check at 200 engines, 11 ms at
1000. Here a Check costs a few dictionary copies plus numpy over the model's rows:

- ``FleetIndex`` holds each engine's latest ``EngineView`` (the shell pushes one when a probe lands, an operator drains, a
  request fails, or staleness flips) and, per model, one row per engine serving it. A row holds what the fit rules and the
  estimate need that does not depend on the request: cap, load, KV held, KV capacity and usage, open tickets of the model,
  eligibility (not drained, meets the floor, fresh), the decode rate at the batch a free slot would run in (full batch under
  pressure, ``load + 1`` otherwise) and the prefill fallback. A row is recomputed when its engine's view, ledger view or
  serve count changed (``Ledger.changed``, ``note_serve``), with the very functions ``decide`` uses (fit.py's
  ``effective_load``, ``held_tokens``, ``model_len``; route.py's ``decode_rate``), so the numbers are the same numbers.
- Values shared across engines are applied per snapshot, vectorised: the trusted (model, chip class) prefill median and the
  quality cap from the (model, chip class) solo median.
- ``snapshot`` hands ``decide`` frozen copies (``IndexSnapshot``); the live arrays are copied on the next write, never
  changed under a holder.

``decide`` (decide.py, ``_indexed``) evaluates the fit rules and the no-wait estimate for every row at once, then builds
real ``Estimate`` objects only for the few engines that can matter (the soonest free slot, busy engines whose no-wait lower
bound beats it, the session's engine); the satisficing band's weighted pick runs on a cumulative sum. Anything unusual
(boxes, nothing fits, stale fail-open, a refusal) falls back to the full scan, which stays the reference: a unit test checks
the two agree on random fleets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

import numpy as np

from controlplane.core.model import ClassChangeLog, EngineLedger, EngineView, Fleet, RateTables
from controlplane.core.policy import Policy, meets_floor
from controlplane.core.fit import effective_load, held_tokens, model_len
from controlplane.core.route import capacity_throughput, decode_rate

_INF = math.inf
_NAN = math.nan


class DecayedServes(Mapping[str, float]):
    """Recent serves per engine, decayed to ``now`` only when read (a Check reads one or a few, not every engine's)."""

    __slots__ = ("_values", "_now", "_half_life")

    def __init__(self, values: dict[str, tuple[float, float]], now: float, half_life_s: float) -> None:
        self._values = values
        self._now = now
        self._half_life = half_life_s

    def __getitem__(self, engine: str) -> float:
        value, at = self._values[engine]
        return value * math.pow(0.5, max(0.0, self._now - at) / self._half_life)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass(frozen=True, slots=True)
class ModelArrays:
    """One model's candidates, one row per engine serving it (in fleet order). Never changed after it is handed out."""

    names: tuple[str, ...]
    views: tuple[EngineView, ...]
    ok: np.ndarray
    """Serves the model, not drained, meets its version floor, fresh."""
    model_len: np.ndarray
    """max_model_len for the model (inf: unknown, never refuses)."""
    capacity: np.ndarray
    """KV capacity in tokens (0: unknown)."""
    usage: np.ndarray
    """Probe KV usage (nan: not reported)."""
    cap: np.ndarray
    """Concurrency cap (inf: unknown)."""
    load: np.ndarray
    held: np.ndarray
    open_model: np.ndarray
    """Open tickets of this model (quality cap)."""
    prefill: np.ndarray
    """Prefill tokens/s as ``route.prefill_rate`` gives it."""
    quality_block: np.ndarray
    """The quality cap blocks the engine (request-independent for a model)."""
    d_press: np.ndarray
    """Per-request decode rate at the batch a free slot runs in under pressure (the cap; load + 1 without a cap)."""
    d_free: np.ndarray
    """... and without pressure (min(cap, load + 1))."""
    full: np.ndarray
    """Tokens/s with the batch full (``route.capacity_throughput``): the engine's part of the capacity (fair share)."""
    ttft_scale: np.ndarray
    """The view's ``ttft_correction`` (route.estimate multiplies prefill and first token by it)."""
    serve_value: np.ndarray
    serve_at: np.ndarray
    first_done: np.ndarray
    """The soonest expected finish of the engine's open tickets (nan: none): a busy engine's slot wait is at least that."""
    name_rank: np.ndarray
    """Rank of the engine's name among the rows (the last tie-break of finish-soonest)."""
    position: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class IndexSnapshot:
    models: Mapping[str, ModelArrays]
    policy: Policy
    admit_stale: bool
    now: float
    half_life_s: float
    eligibility: int = -1
    """``FleetIndex.eligibility`` when taken: equal numbers, the same engines serve, drained, at floor and stale."""


@dataclass(frozen=True, slots=True)
class _ChipTables:
    """One model's per-chip arrays (``FleetIndex._per_chip``) and what they were derived from."""

    prefill_median: Mapping[tuple[str, str], float]
    solo_decode: Mapping[tuple[str, str], float]
    class_serial: int
    class_changes: ClassChangeLog | None
    policy: Policy
    chips: int
    trusted: np.ndarray
    """Trusted prefill median by chip code (0 where none)."""
    quality_cap: np.ndarray
    """The quality cap by chip code (inf where none)."""


class _Rows:
    """The live arrays of one model (copy-on-write once a snapshot holds them)."""

    def __init__(self, model: str, names: list[str]) -> None:
        self.model = model
        self.names = tuple(names)  # never changes: every snapshot hands out this tuple
        self.position: Mapping[str, int] = MappingProxyType({n: i for i, n in enumerate(names)})
        n = len(names)
        self.views: list[EngineView | None] = [None] * n
        self.f = {k: np.zeros(n) for k in ("model_len", "capacity", "usage", "cap", "load", "held", "open_model",
                                           "p_fallback", "d_press", "d_free", "full", "ttft_scale", "serve_value", "serve_at",
                                           "first_done")}
        rank = {name: r for r, name in enumerate(sorted(names))}
        self.name_rank = np.array([rank[name] for name in names], dtype=np.int64)
        self.ok = np.zeros(n, dtype=bool)
        self.chip = np.zeros(n, dtype=np.int64)
        self.shared = False
        self.frozen: tuple[ModelArrays, np.ndarray, np.ndarray] | None = None
        """The last snapshot's arrays and the per-class arrays they were made with: handed out again while no row
        changed (a Check freezes every model, and most models' rows did not change since the last one)."""

    def writable(self) -> None:
        self.frozen = None
        if self.shared:
            self.f = {k: v.copy() for k, v in self.f.items()}
            self.ok = self.ok.copy()
            self.chip = self.chip.copy()
            self.views = list(self.views)
            self.shared = False


class FleetIndex:
    """Engine views, ledger views and per-model rows, kept current by the shell's change notices."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.views: dict[str, EngineView] = {}
        self._engines: tuple[EngineView, ...] | None = None
        self._list: list[EngineView] = []
        self._at: dict[str, int] = {}
        """Position of each engine with a view in ``_list`` (fleet order)."""
        self._ledger: dict[str, EngineLedger] = {}
        self._rows: dict[str, _Rows] = {}
        self._members_dirty = True
        self._models: frozenset[str] | None = None
        self._dirty: set[str] = set()
        self._serve_dirty: set[str] = set()
        self._chips: dict[str, int] = {}
        self._chip_tables: dict[str, _ChipTables] = {}
        self._policy: Policy | None = None
        self._admit_stale: bool | None = None
        self.eligibility = 0
        """Bumped whenever an engine comes or goes or its models, drain, version or staleness change: what decides
        which engines a model's route may use at all (``weights.eligible_engines``), so the publisher's staleness tick
        skips that pass over every engine while the number stands."""

    # -- change notices --------------------------------------------------------------------------------------------
    def set_order(self, names: Iterable[str]) -> None:
        """The fleet's engines in order (reload, start); views of engines no longer listed are dropped."""
        order = list(names)
        keep = set(order)
        for name in [n for n in self.views if n not in keep]:
            del self.views[name]
            self._ledger.pop(name, None)
        self.order = order
        self._relist()
        self._members_dirty = True
        self._models = None
        self.eligibility += 1

    def _relist(self) -> None:
        self._list = [self.views[n] for n in self.order if n in self.views]
        self._at = {v.name: i for i, v in enumerate(self._list)}
        self._engines = None

    def update(self, view: EngineView) -> None:
        """``view`` is now what the control plane knows of its engine."""
        old = self.views.get(view.name)
        if old is view:
            return
        if view.name not in self.views and view.name not in self.order:
            self.order.append(view.name)
        self.views[view.name] = view
        at = self._at.get(view.name)
        if at is None:
            self._relist()
        else:
            self._list[at] = view
        self._engines = None
        if old is None or old.models != view.models:
            self._members_dirty = True
            self._models = None
        if (old is None or old.models != view.models or old.drained != view.drained or old.version != view.version
                or old.stale != view.stale):
            self.eligibility += 1
        self._dirty.add(view.name)

    def note_serve(self, engine: str) -> None:
        self._serve_dirty.add(engine)

    # -- reading ---------------------------------------------------------------------------------------------------
    def serves(self, model: str) -> bool:
        """Whether any engine lists ``model`` (every Check's metrics label asks; a set lookup, not a pass over engines)."""
        if self._models is None:
            self._models = frozenset(m.model_id for v in self.views.values() for m in v.models)
        return model in self._models

    def engines(self) -> tuple[EngineView, ...]:
        if self._engines is None:
            self._engines = tuple(self._list)
        return self._engines

    def refresh(self, ledger_views: Callable[[str], EngineLedger], changed: set[str], serves: dict[str, tuple[float, float]],
                policy: Policy, admit_stale: bool, rates: RateTables, now: float) -> None:
        """Recompute the rows of engines whose view, tickets or serve count changed (every row after a change of members,
        policy or fail-open). ``snapshot`` starts with it; the shell also calls it between Checks, after a batch of
        probes, so that at 1000 engines (a probe a millisecond) a Check finds one or two rows to redo instead of the ten
        or so probes that landed since the last Check."""
        if self._members_dirty or policy is not self._policy or admit_stale != self._admit_stale:
            self._rebuild(ledger_views, serves, policy, admit_stale, rates, now)
            changed.clear()
        else:
            dirty = self._dirty | changed | self._serve_dirty
            changed.clear()
            for name in dirty:
                if name in self.views:
                    self._ledger[name] = ledger_views(name)
            ledgers = self._ledgers(rates)
            for rows in self._rows.values():
                hit = [n for n in dirty if n in rows.position]
                if hit:
                    rows.writable()
                    for name in hit:
                        self._fill(rows, rows.position[name], serves, policy, ledgers, now)
        self._dirty.clear()
        self._serve_dirty.clear()

    def snapshot(self, ledger_views: Callable[[str], EngineLedger], changed: set[str], serves: dict[str, tuple[float, float]],
                 policy: Policy, admit_stale: bool, rates: RateTables, now: float,
                 half_life_s: float) -> tuple[tuple[EngineView, ...], Mapping[str, EngineLedger], IndexSnapshot]:
        """The engines, their ledger views and the index, all as of now. ``ledger_views(name)`` gives an engine's ledger
        view; ``changed`` names engines whose ledger view changed since the last call (cleared here)."""
        engines = self.engines()
        self.refresh(ledger_views, changed, serves, policy, admit_stale, rates, now)
        models = {model: self._freeze(rows, policy, rates) for model, rows in self._rows.items()}
        return (engines, MappingProxyType(dict(self._ledger)),
                IndexSnapshot(MappingProxyType(models), policy, admit_stale, now, half_life_s, self.eligibility))

    # -- internals -------------------------------------------------------------------------------------------------
    def _rebuild(self, ledger_views: Callable[[str], EngineLedger], serves: dict[str, tuple[float, float]], policy: Policy,
                 admit_stale: bool, rates: RateTables, now: float) -> None:
        self._policy, self._admit_stale = policy, admit_stale
        self._ledger = {e.name: ledger_views(e.name) for e in self.engines()}
        members: dict[str, list[str]] = {}
        for engine in self.engines():
            for m in engine.models:
                names = members.setdefault(m.model_id, [])
                if not names or names[-1] != engine.name:
                    names.append(engine.name)
        self._rows = {}
        ledgers = self._ledgers(rates)
        for model, names in members.items():
            rows = _Rows(model, names)
            for i in range(len(names)):
                self._fill(rows, i, serves, policy, ledgers, now)
            self._rows[model] = rows
        self._members_dirty = False

    def _chip(self, chip: str) -> int:
        if chip not in self._chips:
            self._chips[chip] = len(self._chips)
        return self._chips[chip]

    def _ledgers(self, rates: RateTables) -> Fleet:
        """What ``_fill`` hands the fit and route functions: the index's ledger views (a live read-only proxy, not a
        copy: one Fleet per refresh instead of one per row) and the rates."""
        return Fleet((), MappingProxyType(self._ledger), bool(self._admit_stale), rates)

    def _fill(self, rows: _Rows, i: int, serves: dict[str, tuple[float, float]], policy: Policy, one: Fleet,
              now: float) -> None:
        name, model = rows.names[i], rows.model
        view = self.views[name]
        ledger = one.of(name)
        f = rows.f
        rows.views[i] = view
        rows.ok[i] = (view.serves(model) and not view.drained and not view.stale
                      and meets_floor(view.version, policy.floor_for(model)))
        f["model_len"][i] = model_len(view, model) or _INF
        f["capacity"][i] = view.kv_capacity_tokens or 0
        usage = view.sample.kv_usage if view.sample is not None else None
        f["usage"][i] = _NAN if usage is None else usage
        cap = view.cap
        f["cap"][i] = _INF if cap is None else cap
        load = effective_load(view, one)
        f["load"][i] = load
        f["held"][i] = held_tokens(view, one)
        f["open_model"][i] = ledger.open_for(model)
        rows.chip[i] = self._chip(view.chip_class)
        own = view.rates.prefill_tokens_per_s if view.rates is not None else None
        f["p_fallback"][i] = own or view.anchor_prefill_tokens_per_s or policy.default_prefill_tokens_per_s
        batch = int(load) + 1
        press = cap if cap is not None else batch
        free = min(cap, batch) if cap is not None else batch
        f["d_press"][i] = decode_rate(view, max(1, press), one, policy)
        f["d_free"][i] = decode_rate(view, max(1, free), one, policy)
        f["full"][i] = capacity_throughput(view, one, policy)
        f["ttft_scale"][i] = view.ttft_correction
        value, at = serves.get(name, (0.0, now))
        f["serve_value"][i] = value
        f["serve_at"][i] = at
        f["first_done"][i] = ledger.expected_done[0] if ledger.expected_done else _NAN

    def _per_chip(self, model: str, policy: Policy, rates: RateTables) -> tuple[np.ndarray, np.ndarray]:
        """Shared per (model, chip class): the trusted prefill median and the quality cap (fit.quality_cap), by chip code.
        Kept until the class medians, the policy or the chip classes change, and then redone only for the classes whose
        medians changed (the book's ``ClassChangeLog``) and new ones: an engine's chip class defaults to its name, so at
        1000 engines redoing every class was a loop over 1000 classes per Check."""
        cached = self._chip_tables.get(model)
        chips = len(self._chips)
        if (cached is not None and cached.prefill_median is rates.prefill_median
                and cached.solo_decode is rates.solo_decode and cached.policy is policy and cached.chips == chips):
            return cached.trusted, cached.quality_cap
        changed = None
        if cached is not None and cached.policy is policy and rates.class_changes is not None \
                and cached.class_changes is rates.class_changes:
            changed = rates.class_changes.since(cached.class_serial, rates.class_serial)
        if changed is None:
            trusted, qcap = np.zeros(chips), np.full(chips, _INF)
            redo: Iterable[tuple[str, int]] = self._chips.items()
        else:
            assert cached is not None  # a change log is only consulted against a cached table
            trusted = np.concatenate([cached.trusted, np.zeros(chips - cached.chips)])
            qcap = np.concatenate([cached.quality_cap, np.full(chips - cached.chips, _INF)])
            codes = [(chip, self._chips[chip]) for m, chip in changed if m == model and chip in self._chips]
            if chips > cached.chips:  # classes first seen since (codes only grow)
                codes += [(chip, code) for chip, code in self._chips.items() if code >= cached.chips]
            redo = codes
        floor = policy.model(model).decode_floor_tokens_per_s
        default_solo = policy.model(model).solo_decode_tokens_per_s
        for chip, code in redo:
            trusted[code] = rates.prefill_median.get((model, chip)) or 0.0
            if floor:
                solo = rates.solo_decode.get((model, chip)) or default_solo
                qcap[code] = max(1, math.floor(solo * policy.quality_overcommit / floor)) if solo else _INF
        self._chip_tables[model] = _ChipTables(rates.prefill_median, rates.solo_decode, rates.class_serial,
                                               rates.class_changes, policy, chips, trusted, qcap)
        return trusted, qcap

    def _freeze(self, rows: _Rows, policy: Policy, rates: RateTables) -> ModelArrays:
        model = rows.model
        f = rows.f
        trusted, qcap = self._per_chip(model, policy, rates)
        if rows.frozen is not None and rows.frozen[1] is trusted and rows.frozen[2] is qcap:
            return rows.frozen[0]
        chip_trusted = trusted[rows.chip]
        prefill = np.where(chip_trusted > 0, chip_trusted, f["p_fallback"])
        quality_block = f["open_model"] >= qcap[rows.chip]
        rows.shared = True
        views = cast("tuple[EngineView, ...]", tuple(rows.views))  # _fill has filled every slot
        arrays = ModelArrays(
            rows.names, views, rows.ok, f["model_len"], f["capacity"], f["usage"],
            f["cap"], f["load"], f["held"], f["open_model"], prefill, quality_block, f["d_press"], f["d_free"],
            f["full"], f["ttft_scale"], f["serve_value"], f["serve_at"], f["first_done"], rows.name_rank, rows.position,
        )
        rows.frozen = (arrays, trusted, qcap)
        return arrays

