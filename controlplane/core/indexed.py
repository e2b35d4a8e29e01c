"""``decide`` on the fleet index (fleetindex.py): the same decision as the full scan, at a few numpy operations a Check.

The fit rules and the no-wait estimate of every candidate run at once over the model's rows; real ``Estimate`` objects
are built only for the engines that can be chosen: the band (its weighted pick on a cumulative sum), or the soonest free
slot, its near ties, the busy engines whose no-wait lower bound could beat it, and the session's engine. Expected cache
hits and prefix affinity's eviction charges become vectors over the rows. ``decide_indexed`` returns None whenever the
full scan must decide (boxes, LoRA adapters, requests parked ahead, nothing fits now, an empty band, any refusal or
shed): the full scan stays the reference, and tests/unit/test_fleet_index.py holds the two equal on random fleets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from controlplane.core.affinity import charged_finish
from controlplane.core.choose import admit, finish_soonest, holders_suffice, soonest_key
from controlplane.core.fit import context_tokens, need_tokens
from controlplane.core.fleet import Fleet
from controlplane.core.model import Decision, InferenceRequest, Reason
from controlplane.core.policy import Policy
from controlplane.core.route import NONE_NAMED, TINY, Estimate, cached_tokens, estimate, expected_output_tokens
from controlplane.core.waits import park_or_shed


def decide_indexed(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float, queued_ahead: int,
                   affinity: str | None, pick: float, behind: int, arriving: bool = False,
                   cached: Mapping[str, int] = NONE_NAMED, waiting: Mapping[str, int] = NONE_NAMED,
                   displaced: Mapping[str, int] = NONE_NAMED, prefix_share: float = 0.0,
                   prefix_demand: Mapping[str, float] = NONE_NAMED) -> Decision | None:
    """What ``decide`` (the same arguments) decides, on the fleet's index; None: the full scan must decide."""
    index = fleet.index
    model = request.model
    if index is None or queued_ahead or policy.boxes or index.policy is not policy or index.admit_stale != fleet.admit_stale:
        return None
    if model in fleet.adapters or model in policy.adapters.base_models:  # adapter slots and swaps: the full scan
        return None
    rows = index.models.get(model)
    if rows is None:
        return None
    # A Check pays per numpy call: the rows hold what is compared here in the form it is compared in
    # (fleetindex.ModelArrays), and array methods stand in for numpy's module functions.
    need = need_tokens(request, policy)
    candidate = rows.ok & (rows.model_len >= context_tokens(request))
    if not candidate.any():
        return None
    # Expected prefix-cache hits as a vector over the rows; None (no hit anywhere, the common case) spares every Check the
    # vector's arithmetic.
    hit: Any = None
    if cached:
        hit = np.zeros(len(rows.names))
        for engine in cached:
            at_row = rows.position.get(engine)
            if at_row is not None:
                hit[at_row] = cached_tokens(engine, request, cached)
        free = candidate & (hit <= 0)
        evicting = sum(1 for name in displaced if (at := rows.position.get(name)) is not None and free[at])
        held = candidate & (hit > 0)
        held_demand = sum(prefix_demand.get(rows.names[i], 0.0) for i in np.flatnonzero(held))
        if holders_suffice(policy, prefix_share, int(held.sum()), float(rows.full.sum(where=held)),
                           float(rows.full.sum(where=candidate)), int(free.sum()) > evicting, held_demand):
            candidate = held
    if need > float(rows.kv_limit.max(where=candidate, initial=-math.inf)):
        return None  # context_length_exceeded (every candidate's KV known and too small): the full scan words the refusal
    deadline_s = request.planned_ttft_s()
    prefill_s = (request.prompt_tokens if hit is None else request.prompt_tokens - hit) / rows.prefill
    if deadline_s is not None and float(prefill_s.min(where=candidate, initial=math.inf)) > deadline_s:
        return None  # ttft_unmeetable
    other = rows.blocked | (rows.held + need > rows.kv_limit)
    not_ready = rows.cap_block | other
    fits = candidate & ~not_ready
    if not fits.any():
        return None
    pressure = bool((candidate & not_ready).any())
    rate, per_token = (rows.d_press, rows.per_token_press) if pressure else (rows.d_free, rows.per_token_free)
    out = expected_output_tokens(request, fleet, policy)
    ttft = (prefill_s + per_token) * rows.ttft_scale  # route.estimate with no wait (0.0 + x is x)

    def exact(i: int, can_start: bool) -> Estimate:
        return estimate(rows.views[i], request, can_start, fleet, policy, now, pressure, behind,
                        0 if hit is None else int(hit[i]), waiting.get(rows.names[i], 0),
                        displaced.get(rows.names[i], 0))

    # Prefix affinity's charge (affinity.py) as a vector over the rows, as route.estimate computes it; None: no charge.
    charge: Any = None
    if displaced and policy.prefix_eviction_charge:
        charge = np.zeros(len(rows.names))
        for engine, tokens in displaced.items():
            at_row = rows.position.get(engine)
            if at_row is not None:
                charge[at_row] = policy.prefix_eviction_charge * tokens / rows.prefill[at_row]

    at = rows.position.get(affinity) if affinity is not None else None
    if deadline_s is not None:
        floor = policy.model(model).decode_floor_tokens_per_s or 0.0
        band = fits & (ttft <= deadline_s - policy.band_margin_ms / 1000)
        if floor:
            band &= rate >= floor
        if at is not None and band[at]:
            return admit(request, exact(at, True), Reason.SESSION_AFFINITY, policy, now, fleet)
        members = band.nonzero()[0]
        if not len(members):
            # No band: finish-soonest among the engines that meet the deadline (busy ones filtered once estimated).
            busy = candidate & rows.cap_block & ~other
            return _soonest_indexed(request, rows, candidate, fits & (ttft <= deadline_s), busy, ttft + out / rate,
                                    prefill_s, out, exact, at, affinity, deadline_s, fleet, policy, now, hit, arriving,
                                    charge=charge)
        if hit is not None:
            longest = float(hit[members].max())
            if longest > 0:  # as the full scan: the band members expected to hold the longest prefix
                members = members[hit[members] == longest]
        serves = _recent_serves(rows, index, members)
        full = rows.full[members]
        largest = float(full.max())
        capacity = full / largest if largest > 0 else np.ones(len(members))
        quick, grain = ttft[members], policy.band_ttft_grain_fraction * deadline_s
        factor = (float(quick.min()) + grain) / (quick + grain)  # ttft_factor
        cumulative = (capacity / (1.0 + serves / capacity) * factor).cumsum()  # weighted_pick
        chosen = int(cumulative.searchsorted(pick * float(cumulative[-1]), side="right"))
        return admit(request, exact(int(members[min(chosen, len(members) - 1)]), True), Reason.SATISFICING_BAND,
                     policy, now, fleet)
    finish = ttft + out / rate
    busy = candidate & rows.cap_block & ~other
    set_aside = math.inf
    ratio = policy.max_share_over_capacity
    if ratio and int(candidate.sum()) >= 2:
        # The fair-share spread, as the full scan's (choose._spread).
        serves = _recent_serves(rows, index, slice(None))
        total_serves, total_throughput = float(serves[candidate].sum()), float(rows.full[candidate].sum())
        if total_throughput > 0:
            over = candidate & (serves >= 1.0 + ratio * total_serves * rows.full / total_throughput)
            if hit is not None:
                over &= hit == 0
            if over.any() and (fits & ~over).any():
                if (fits & over).any():
                    set_aside = float(finish[fits & over].min())
                fits, busy = fits & ~over, busy & ~over
    return _soonest_indexed(request, rows, candidate, fits, busy, finish, prefill_s, out, exact, at, affinity,
                            None, fleet, policy, now, hit, arriving, set_aside, charge)


def _soonest_indexed(request: InferenceRequest, rows: Any, candidate: Any, free: Any, busy: Any, finish: Any,
                     prefill_s: Any, out: float, exact: Any, at: int | None, affinity: str | None,
                     deadline_s: float | None, fleet: Fleet, policy: Policy, now: float, hit: Any,
                     arriving: bool = False, set_aside: float = math.inf, charge: Any = None) -> Decision | None:
    """Finish-soonest on the index: ``free`` rows can start now (with a deadline, those meeting it), ``busy`` rows are only
    short of a slot; None when no free row is left (the full scan parks or sheds). Waiting for a faster busy engine parks
    here, as the full scan would. ``charge``: prefix affinity's eviction charge per row (None: none), added to
    ``finish`` wherever rows are compared, as ``soonest_key`` adds it."""
    if not free.any():
        return None
    if charge is not None:
        finish = finish + charge
    free_rows = free.nonzero()[0]
    best_free = _soonest_row(rows, free_rows, finish)
    estimates = [exact(best_free, True)]
    near_tie = rows.names[best_free] if policy.near_tie_fraction > 0 else None
    if policy.near_tie_fraction > 0 and len(free_rows) > 1:
        # Near ties as choose._near_tie. Only the winner is estimated, and handed to finish_soonest as the near tie (its
        # own _near_tie would see only the few free slots estimated here).
        near = free_rows[finish[free_rows] <= charged_finish(estimates[0]) * (1 + policy.near_tie_fraction)]
        if len(near) > 1:
            if hit is not None:
                near = near[hit[near] == hit[near].max()]
            most = policy.near_tie_max_engines
            if most and len(near) > most:
                warm = near[rows.served_at[near] >= now - policy.near_tie_warm_seconds]
                near = warm if len(warm) else near[np.argpartition(rows.name_rank[near], most - 1)[:most]]
            assert fleet.index is not None
            ratio = _recent_serves(rows, fleet.index, near) / np.maximum(rows.full[near], TINY)
            tie = _soonest_row(rows, near[ratio == ratio.min()], finish)
            if tie != best_free:
                estimates.append(exact(tie, True))
                near_tie = rows.names[tie]
    if busy.any():
        # A busy engine runs the request at its full batch after its slot wait, which is at least until its soonest
        # ticket's expected finish (or one service when it has none): beyond the bound even so, it cannot win.
        bound = charged_finish(estimates[0]) + 1e-6
        decode_s = out / rows.d_press
        first_done = rows.first_done
        wait = np.where(np.isnan(first_done), prefill_s + decode_s, np.maximum(0.0, np.nan_to_num(first_done) - now))
        lower = wait + (prefill_s + rows.per_token_press) * rows.ttft_scale + decode_s
        if charge is not None:
            lower = lower + charge
        estimates += [x for x in (exact(int(i), False) for i in (busy & (lower <= bound)).nonzero()[0])
                      if deadline_s is None or x.ttft_s <= deadline_s]
    if at is not None and (free[at] or busy[at]) and all(x.engine.name != affinity for x in estimates):
        sticky = exact(at, bool(free[at]))
        if deadline_s is None or sticky.ttft_s <= deadline_s:
            estimates.append(sticky)
    soonest = finish_soonest(request, estimates, [x for x in estimates if x.can_start], fleet, policy, now, affinity,
                             Reason.FINISH_SOONEST, arriving, set_aside, near_tie)
    if soonest is not None:
        return soonest
    best = min(estimates, key=lambda x: soonest_key(x, fleet))
    park_limit = None
    if deadline_s is not None:
        park_limit = deadline_s - float(prefill_s[candidate].min())
    candidates = [rows.views[i] for i in candidate.nonzero()[0]]
    return park_or_shed(request, candidates, fleet, policy, now, 0, Reason.WAITING_FOR_FASTER,
                        f"{best.engine.name} finishes in {best.finish_s:.1f} s after a {best.slot_wait_s:.1f} s wait",
                        park_limit, idle_slot=True, waits_for=best.engine.name)


def _recent_serves(rows: Any, index: Any, among: Any) -> Any:
    """The rows' recent serves decayed to the snapshot's time, as ``DecayedServes`` reads them one at a time
    (``ModelArrays.serve_log2``)."""
    return np.exp2(rows.serve_log2[among] - index.now / index.half_life_s)


def _soonest_row(rows: Any, among: Any, finish: Any) -> int:
    """The row of ``among`` (row numbers) first by soonest_key: finish rounded to 1 us (Python's round, on the few
    distinct values near the minimum), then the lighter load, the more headroom, the name."""
    values = finish[among]
    near = (values <= float(values.min()) + 1e-6).nonzero()[0]
    if len(near) == 1:
        return int(among[near[0]])  # the common case: one row finishes soonest, no tie to break
    near_values = values[near]
    lowest = round(float(near_values.min()), 6)  # round is monotonic: the lowest rounded value is the minimum's
    if round(float(near_values.max()), 6) != lowest:
        rounded = {float(v): round(float(v), 6) for v in np.unique(near_values)}
        near = near[np.isin(near_values, [v for v, r in rounded.items() if r == lowest])]
    tied = among[near]
    load = rows.load[tied]
    cap = rows.cap[tied]
    headroom = np.where(np.isfinite(cap) & (cap > 0), load / np.where(np.isfinite(cap) & (cap > 0), cap, 1.0), load)
    return int(tied[np.lexsort((rows.name_rank[tied], headroom, load))[0]])
