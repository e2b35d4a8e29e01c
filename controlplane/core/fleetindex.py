"""The fleet as the control plane keeps it between Checks: engine views, ledger views and per-model candidate arrays,
refreshed only where something changed. Pure (time passed in); numpy only as a container of numbers.

``FleetIndex`` holds each engine's latest ``EngineView`` (pushed by the shell when a probe lands, an operator drains, a
request fails or staleness flips) and, per model, one row per engine serving it: what the fit rules and the no-wait
estimate need that does not depend on the request, in the form ``decide`` compares it (``ModelArrays``). A row is
recomputed when its engine's view, ledger view or serve count changed, with the very functions ``decide`` uses (fit.py,
route.py), so the numbers are the same numbers; values shared per (model, chip class) are applied per snapshot.
``snapshot`` hands out frozen arrays (``IndexSnapshot``): never changed under a holder (copied on the next write while
one holds them); the ledger views are a ``SharedMap`` snapshot. indexed.py decides on them; the full scan stays the
reference. Why and what it saves: bench/results/README.md (issue 9).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

import numpy as np

from controlplane.core.engines import EngineView
from controlplane.core.fleet import ClassChangeLog, EngineLedger, Fleet, RateTables
from controlplane.core.policy import Policy, meets_floor
from controlplane.core.fit import effective_load, held_tokens, model_len
from controlplane.core.route import capacity_throughput, decode_rate
from controlplane.core.sharedmap import SharedMap

_INF = math.inf
_NAN = math.nan


class _ServeCountView(Mapping[str, float]):
    """A read-only view of the serve counts (``ServeCounter.values``: engine -> (count, when last added)), without a
    copy: each subclass reads one figure from an engine's pair."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, tuple[float, float]]) -> None:
        self._values = values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class DecayedServes(_ServeCountView):
    """Recent serves per engine, decayed to ``now`` only when read (a Check reads one or a few, not every engine's)."""

    __slots__ = ("_now", "_half_life")

    def __init__(self, values: Mapping[str, tuple[float, float]], now: float, half_life_s: float) -> None:
        super().__init__(values)
        self._now = now
        self._half_life = half_life_s

    def __getitem__(self, engine: str) -> float:
        value, at = self._values[engine]
        return value * math.pow(0.5, max(0.0, self._now - at) / self._half_life)


class LastServed(_ServeCountView):
    """When each engine was last admitted to (warm near ties)."""

    __slots__ = ()

    def __getitem__(self, engine: str) -> float:
        value, at = self._values[engine]
        return at if value > 0 else -math.inf  # an admission taken back (ServeCounter.remove) left none


@dataclass(frozen=True, slots=True)
class ModelArrays:
    """One model's candidates, one row per engine serving it (in fleet order). Never changed after it is handed out.

    What ``decide`` compares per Check is kept in the form it compares it in (a KV limit rather than capacity and
    watermark, a decode time per token rather than a rate, serves in log space): a row is filled once per change, while
    every numpy operation on the arrays is paid by every Check."""

    names: tuple[str, ...]
    views: tuple[EngineView, ...]
    ok: np.ndarray
    """Serves the model, not drained, meets its version floor, fresh."""
    model_len: np.ndarray
    """max_model_len for the model (inf: unknown, never refuses)."""
    kv_limit: np.ndarray
    """KV capacity in tokens times ``kv_high_watermark`` (inf: capacity unknown, never refuses)."""
    cap: np.ndarray
    """Concurrency cap (inf: unknown)."""
    load: np.ndarray
    held: np.ndarray
    cap_block: np.ndarray
    """``load >= cap``: only short of a slot."""
    blocked: np.ndarray
    """Blocked whatever the request: the probe's KV usage at or over the watermark, or the quality cap reached."""
    prefill: np.ndarray
    """Prefill tokens/s as ``route.prefill_rate`` gives it."""
    quality_block: np.ndarray
    """The quality cap blocks the engine (request-independent for a model)."""
    d_press: np.ndarray
    """Per-request decode rate at the batch a free slot runs in under pressure (the cap; load + 1 without a cap)."""
    d_free: np.ndarray
    """... and without pressure (min(cap, load + 1))."""
    per_token_press: np.ndarray
    """``1 / d_press`` (inf for a zero rate): the first token's decode time, as ``route.estimate`` divides it."""
    per_token_free: np.ndarray
    full: np.ndarray
    """Tokens/s with the batch full (``route.capacity_throughput``): the engine's part of the capacity (fair share)."""
    ttft_scale: np.ndarray
    """The view's ``ttft_correction`` (route.estimate multiplies prefill and first token by it)."""
    serve_log2: np.ndarray
    """log2 of the engine's recent serves, brought to time 0: ``log2(count) + at / half_life`` (-inf: none), so that the
    serves at ``now`` are ``2 ** (serve_log2 - now / half_life)``, as ``DecayedServes`` reads them one at a time (the
    control plane's clock is monotonic, so a serve is never noted after a later snapshot's ``now``)."""
    served_at: np.ndarray
    """When the engine was last admitted to (-inf: never), as ``LastServed`` reads it."""
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


_COLUMNS = ("model_len", "kv_limit", "cap", "load", "held", "open_model", "p_fallback", "prefill", "d_press", "d_free",
            "per_token_press", "per_token_free", "full", "ttft_scale", "serve_log2", "served_at", "first_done")
"""The float columns of a model's rows, in the order ``_fill`` writes them (one row of the matrix each)."""
_P_FALLBACK, _PREFILL = _COLUMNS.index("p_fallback"), _COLUMNS.index("prefill")
_FLAGS = ("ok", "hot", "cap_block")
"""The boolean columns: ``ok`` as ``ModelArrays.ok``; ``hot``: the probe's KV usage at or over the watermark."""


class _Rows:
    """The live arrays of one model (copy-on-write once a snapshot holds them): one float matrix and one boolean matrix,
    a row per column and a column per engine, so that a copy is two numpy calls and a row's refresh two assignments."""

    def __init__(self, model: str, names: list[str]) -> None:
        self.model = model
        self.names = tuple(names)  # never changes: every snapshot hands out this tuple
        self.position: Mapping[str, int] = MappingProxyType({n: i for i, n in enumerate(names)})
        n = len(names)
        self.views: list[EngineView | None] = [None] * n
        self.values = np.zeros((len(_COLUMNS), n))
        self.flags = np.zeros((len(_FLAGS), n), dtype=bool)
        rank = {name: r for r, name in enumerate(sorted(names))}
        self.name_rank = np.array([rank[name] for name in names], dtype=np.int64)
        self.chip = np.zeros(n, dtype=np.int64)
        self.never = np.zeros(n, dtype=bool)
        self.never.flags.writeable = False
        """All False: the quality cap of a model without a decode floor (shared by every snapshot, never written)."""
        self.views_tuple: tuple[EngineView, ...] | None = None
        """``views`` as the last snapshot handed them out, kept until a row's view changes."""
        self.shared = False
        self.prefill_from: np.ndarray | None = None
        """The per-class trusted prefill table (``_ChipTables.trusted``) the prefill column was computed with: a row
        filled since takes its class's value from the same table, so the column is redone only when the table is new."""
        self.frozen: tuple[ModelArrays, np.ndarray, np.ndarray] | None = None
        """The last snapshot's arrays and the per-class arrays they were made with: handed out again while no row
        changed."""

    def writable(self) -> None:
        """Before a row is written: copy the matrices a handed-out snapshot still reads (its arrays are views of them).
        A snapshot nobody holds any more (the Check that took it has answered) leaves no view alive, and its matrices
        are written in place: ``sys.getrefcount`` counts the matrix's own reference, the call's argument and one per
        live view. (``chip`` and ``views`` are never handed out: a snapshot gets derived arrays and a tuple.)"""
        self.frozen = None  # drops the last snapshot's arrays unless someone else still holds them
        if self.shared:
            if sys.getrefcount(self.values) > 2:
                self.values = self.values.copy()
            if sys.getrefcount(self.flags) > 2:
                self.flags = self.flags.copy()
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
        self._ledger: SharedMap[str, EngineLedger] = SharedMap()
        """Each engine's ledger view; a snapshot hands out ``snapshot()`` (no copy of the unchanged views)."""
        self._rows: dict[str, _Rows] = {}
        self._fill_fleet: Fleet | None = None
        self._fill_ledger: SharedMap[str, EngineLedger] | None = None
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

    def refresh(self, ledger_views: Callable[[str], EngineLedger], changed: set[str], serves: Mapping[str, tuple[float, float]],
                policy: Policy, admit_stale: bool, rates: RateTables, now: float) -> None:
        """Recompute the rows of engines whose view, tickets or serve count changed (every row after a change of members,
        policy or fail-open). ``snapshot`` starts with it; the shell also calls it between Checks, after a batch of
        probes, so that a Check finds few rows to redo."""
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

    def snapshot(self, ledger_views: Callable[[str], EngineLedger], changed: set[str], serves: Mapping[str, tuple[float, float]],
                 policy: Policy, admit_stale: bool, rates: RateTables, now: float,
                 half_life_s: float) -> tuple[tuple[EngineView, ...], Mapping[str, EngineLedger], IndexSnapshot]:
        """The engines, their ledger views and the index, all as of now. ``ledger_views(name)`` gives an engine's ledger
        view; ``changed`` names engines whose ledger view changed since the last call (cleared here)."""
        engines = self.engines()
        self.refresh(ledger_views, changed, serves, policy, admit_stale, rates, now)
        models = {model: self._freeze(rows, policy, rates) for model, rows in self._rows.items()}
        return (engines, self._ledger.snapshot(),
                IndexSnapshot(MappingProxyType(models), policy, admit_stale, now, half_life_s, self.eligibility))

    # -- internals -------------------------------------------------------------------------------------------------
    def _rebuild(self, ledger_views: Callable[[str], EngineLedger], serves: Mapping[str, tuple[float, float]], policy: Policy,
                 admit_stale: bool, rates: RateTables, now: float) -> None:
        self._policy, self._admit_stale = policy, admit_stale
        self._ledger = SharedMap((e.name, ledger_views(e.name)) for e in self.engines())
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
        copy) and the rates, one Fleet kept while the rates, the ledger dictionary and fail-open stay the same."""
        cached = self._fill_fleet
        if (cached is not None and cached.rates is rates and self._fill_ledger is self._ledger
                and cached.admit_stale == bool(self._admit_stale)):
            return cached
        self._fill_ledger = self._ledger
        self._fill_fleet = Fleet((), self._ledger.live(), bool(self._admit_stale), rates)
        return self._fill_fleet

    def _fill(self, rows: _Rows, i: int, serves: Mapping[str, tuple[float, float]], policy: Policy, one: Fleet,
              now: float) -> None:
        name, model = rows.names[i], rows.model
        view = self.views[name]
        ledger = one.of(name)
        if rows.views[i] is not view:
            rows.views[i] = view
            rows.views_tuple = None
        rows.chip[i] = self._chip(view.chip_class)
        usage = view.sample.kv_usage if view.sample is not None else None
        capacity = view.kv_capacity_tokens or 0
        watermark = policy.kv_high_watermark
        cap = view.cap
        load = effective_load(view, one)
        batch = int(load) + 1
        press = cap if cap is not None else batch
        free = min(cap, batch) if cap is not None else batch
        d_press = decode_rate(view, max(1, press), one, policy)
        d_free = decode_rate(view, max(1, free), one, policy)
        own = view.rates.prefill_tokens_per_s if view.rates is not None else None
        fallback = own or view.anchor_prefill_tokens_per_s or policy.default_prefill_tokens_per_s
        trusted = 0.0
        if rows.prefill_from is not None and rows.chip[i] < len(rows.prefill_from):
            trusted = float(rows.prefill_from[rows.chip[i]])
        served, served_at = serves.get(name, (0.0, now))
        rows.values[:, i] = (  # in _COLUMNS' order
            model_len(view, model) or _INF,
            capacity * watermark if capacity > 0 else _INF,
            _INF if cap is None else cap,
            load,
            held_tokens(view, one),
            ledger.open_for(model),
            fallback,
            trusted if trusted > 0 else fallback,  # as _freeze computes the column (route.prefill_rate)
            d_press,
            d_free,
            1.0 / d_press if d_press else _INF,
            1.0 / d_free if d_free else _INF,
            cap * d_press if cap else capacity_throughput(view, one, policy),  # (the same: cap x the rate at cap)
            view.ttft_correction,
            math.log2(served) + served_at / policy.serve_half_life_s if served > 0 else -_INF,
            served_at if served > 0 else -_INF,
            ledger.expected_done[0] if ledger.expected_done else _NAN,
        )
        rows.flags[:, i] = (  # in _FLAGS' order
            (view.serves(model) and not view.drained and not view.stale
             and meets_floor(view.version, policy.floor_for(model))),
            usage is not None and usage >= watermark,
            cap is not None and load >= cap,
        )

    def _per_chip(self, model: str, policy: Policy, rates: RateTables) -> tuple[np.ndarray, np.ndarray]:
        """Shared per (model, chip class): the trusted prefill median and the quality cap (fit.quality_cap), by chip code.
        Kept until the class medians, the policy or the chip classes change, and then redone only for the classes whose
        medians changed (the book's ``ClassChangeLog``) and new ones (a chip class defaults to the engine's name)."""
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
            if chips == cached.chips:
                trusted, qcap = cached.trusted.copy(), cached.quality_cap.copy()
            else:
                trusted = np.concatenate([cached.trusted, np.zeros(chips - cached.chips)])
                qcap = np.concatenate([cached.quality_cap, np.full(chips - cached.chips, _INF)])
            codes = [(chip, self._chips[chip]) for m, chip in changed if m == model and chip in self._chips]
            if chips > cached.chips:  # classes first seen since (codes only grow)
                codes += [(chip, code) for chip, code in self._chips.items() if code >= cached.chips]
            redo = codes
        model_policy = policy.model(model)
        floor, default_solo = model_policy.decode_floor_tokens_per_s, model_policy.solo_decode_tokens_per_s
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
        trusted, qcap = self._per_chip(model, policy, rates)
        if rows.frozen is not None and rows.frozen[1] is trusted and rows.frozen[2] is qcap:
            return rows.frozen[0]
        if rows.prefill_from is not trusted:
            rows.writable()
            chip_trusted = trusted[rows.chip]
            rows.values[_PREFILL] = np.where(chip_trusted > 0, chip_trusted, rows.values[_P_FALLBACK])
            rows.prefill_from = trusted
        (model_len, kv_limit, cap, load, held, open_model, _, prefill, d_press, d_free, per_token_press, per_token_free,
         full, ttft_scale, serve_log2, served_at, first_done) = rows.values  # the matrix's rows, in _COLUMNS' order
        ok, hot, cap_block = rows.flags
        if policy.model(model).decode_floor_tokens_per_s:
            quality_block = open_model >= qcap[rows.chip]
            blocked = hot | quality_block
        else:  # no floor, no quality cap (the common case): nothing to compare
            quality_block, blocked = rows.never, hot
        rows.shared = True
        if rows.views_tuple is None:
            rows.views_tuple = cast("tuple[EngineView, ...]", tuple(rows.views))  # _fill has filled every slot
        arrays = ModelArrays(
            rows.names, rows.views_tuple, ok, model_len, kv_limit, cap, load, held, cap_block, blocked, prefill,
            quality_block, d_press, d_free, per_token_press, per_token_free, full, ttft_scale, serve_log2, served_at,
            first_done,
            rows.name_rank, rows.position,
        )
        rows.frozen = (arrays, trusted, qcap)
        return arrays
