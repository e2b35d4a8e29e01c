"""The limiter's arithmetic: GCRA meters for rates, leased slots for concurrency, charges that are settled later.

Pure: no I/O, no clock reads (every function takes ``now``, caller seconds, non-decreasing), no state of its own.
``memory.py`` runs these functions over dicts; ``valkey.py`` runs the same steps as Lua scripts and hands the raw numbers
back here to become a ``Verdict``. A rate of ``limit`` units per ``period_s`` has ``T = period_s / limit``; a meter
stores its TAT, ``debt = max(TAT, now) - now``, and a charge of ``cost`` units fits when (why GCRA: ratelimit/README.md)::

    debt + cost x T <= period_s                       (then TAT := max(TAT, now) + cost x T)
    remaining = floor((period_s - debt) / T)     reset_s = debt     wait_s = debt + cost x T - period_s (retry-after)

Invariants: a charge is all or nothing over every rate and concurrency slot of every scope it names, written only when
all fit; over any ``W`` seconds at most ``limit + W x limit / period_s`` units pass, plus the extra usage settles bill
beyond a pre-charge (``settle_meter``); a settle never credits more than exact accounting would; racing charges never
overshoot. Limits travel with every call, so a reload keeps each key's debt (in seconds of the period).
"""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

SLACK_S = 1e-6
"""Seconds of rounding every comparison tolerates: ``T`` is not an integer and a ``now`` computed from an epoch carries
~0.2 us of rounding. Worth ``1 us / T`` units (under 0.02 of a unit up to a million per minute)."""


class LimitKind(enum.StrEnum):
    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENT = "concurrent"


@dataclass(frozen=True, slots=True)
class Rate:
    """``limit`` units per ``period_s`` seconds, refilled continuously."""

    limit: int
    """Units per period, >= 1 (the most that can pass at once)."""
    period_s: float = 60.0
    """Seconds, > 0."""

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ValueError(f"Rate.limit must be an integer >= 1, not {self.limit!r}")
        if not isinstance(self.period_s, (int, float)) or not math.isfinite(self.period_s) or self.period_s <= 0:
            raise ValueError(f"Rate.period_s must be a number of seconds > 0, not {self.period_s!r}")

    @property
    def unit_s(self) -> float:
        """The emission interval ``T``: seconds of the period one unit occupies."""
        return self.period_s / self.limit


@dataclass(frozen=True, slots=True)
class Limits:
    """What one key may use. ``None``: no limit of that kind."""

    requests: Rate | None = None
    tokens: Rate | None = None
    """Prompt + output tokens."""
    concurrent: int | None = None
    """Charges open at once (settled or expired ones do not count), >= 1."""

    def __post_init__(self) -> None:
        if self.concurrent is not None and (isinstance(self.concurrent, bool) or not isinstance(self.concurrent, int)
                                            or self.concurrent < 1):
            raise ValueError(f"Limits.concurrent must be an integer >= 1 or None, not {self.concurrent!r}")

    @classmethod
    def per_minute(cls, requests: int | None = None, tokens: int | None = None,
                   concurrent: int | None = None) -> Limits:
        return cls(requests=Rate(requests) if requests is not None else None,
                   tokens=Rate(tokens) if tokens is not None else None, concurrent=concurrent)

    @property
    def unlimited(self) -> bool:
        return self.requests is None and self.tokens is None and self.concurrent is None


@dataclass(frozen=True, slots=True)
class Scope:
    """One budget a charge draws on: ``key`` names it (``acme``, ``acme/cortex``: the caller's choice), ``limits`` says
    how big it is now (limits travel with every call, so a reload changes them without touching the stored state)."""

    key: str
    limits: Limits
    requests_cost: int | None = None
    """Requests this charge counts against this scope, instead of ``ChargeRequest.requests`` (Envoy's per-descriptor
    ``hits_addend``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or len(self.key) > 512:
            raise ValueError(f"Scope.key must be a non-empty string of at most 512 characters, not {self.key!r}")
        if self.requests_cost is not None and (not isinstance(self.requests_cost, int) or self.requests_cost < 0):
            raise ValueError(f"Scope.requests_cost must be an integer >= 0, not {self.requests_cost!r}")


@dataclass(frozen=True, slots=True)
class ChargeRequest:
    scopes: tuple[Scope, ...]
    tokens: int = 0
    """The pre-charge: the prompt estimate + ``max_tokens`` (or the default), >= 0."""
    requests: int = 1
    charge_id: str | None = None
    """Names the charge for ``settle``; unique among open charges (a ticket id). ``None``: the charge is final (nothing
    to settle, no concurrency slot; Envoy's rate-limit service charges that way)."""

    def __post_init__(self) -> None:
        for name in ("tokens", "requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ChargeRequest.{name} must be an integer >= 0, not {value!r}")
        keys = [s.key for s in self.scopes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"ChargeRequest.scopes name a key twice: {keys}")
        if self.charge_id is not None and (not isinstance(self.charge_id, str) or not self.charge_id
                                           or len(self.charge_id) > 256):
            raise ValueError("ChargeRequest.charge_id must be a non-empty string of at most 256 characters, not "
                             f"{self.charge_id!r}")
        if self.charge_id is None and any(s.limits.concurrent is not None for s in self.scopes):
            raise ValueError("a concurrency limit needs a charge_id (the slot is held until that charge is settled)")


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    lease_s: float = 900.0
    """Seconds a charge stays open without a settle, > 0. After it the charge's concurrency slot is free and a settle of
    it does nothing (its tokens stay charged). Longer than the longest stream (the control plane's ticket lease)."""
    concurrency_retry_after_s: float = 1.0
    """Seconds, > 0: the retry-after when a concurrency limit refused (a slot frees when some stream ends, which
    nothing predicts)."""

    def __post_init__(self) -> None:
        if not self.lease_s > 0 or not math.isfinite(self.lease_s):
            raise ValueError(f"LimiterSettings.lease_s must be > 0, not {self.lease_s!r}")
        if not self.concurrency_retry_after_s > 0:
            raise ValueError("LimiterSettings.concurrency_retry_after_s must be > 0, not "
                             f"{self.concurrency_retry_after_s!r}")


# ---- the plan of a charge: which meters and slot sets it touches ---------------------------------------------------

@dataclass(frozen=True, slots=True)
class Meter:
    """One rate of one scope, charged ``cost`` units."""

    key: str
    kind: LimitKind
    rate: Rate
    cost: int


@dataclass(frozen=True, slots=True)
class SlotSet:
    """One concurrency limit of one scope: a charge holds a slot until it is settled or its lease
    (``LimiterSettings.lease_s``) runs out, so a lost completion cannot leak a slot."""

    key: str
    limit: int


@dataclass(frozen=True, slots=True)
class ChargePlan:
    meters: tuple[Meter, ...]
    slot_sets: tuple[SlotSet, ...]


def plan_charge(request: ChargeRequest) -> ChargePlan:
    """Every meter and slot set a charge touches, in a fixed order (scopes in order; requests before tokens)."""
    return plan_scopes(request.scopes, request.requests, request.tokens)


def plan_scopes(scopes: Sequence[Scope], requests: int = 0, tokens: int = 0) -> ChargePlan:
    meters: list[Meter] = []
    slot_sets: list[SlotSet] = []
    for scope in scopes:
        limits = scope.limits
        if limits.requests is not None:
            cost = requests if scope.requests_cost is None else scope.requests_cost
            meters.append(Meter(scope.key, LimitKind.REQUESTS, limits.requests, cost))
        if limits.tokens is not None:
            meters.append(Meter(scope.key, LimitKind.TOKENS, limits.tokens, tokens))
        if limits.concurrent is not None:
            slot_sets.append(SlotSet(scope.key, limits.concurrent))
    return ChargePlan(tuple(meters), tuple(slot_sets))


# ---- GCRA, one meter ------------------------------------------------------------------------------------------------

NEVER = math.inf
"""``wait_s`` of a cost larger than the whole budget: no wait makes it fit."""


@dataclass(frozen=True, slots=True)
class MeterState:
    """What a store keeps per meter. Times are kept relative to ``born``: an epoch timestamp carries 0.2 us of rounding,
    and adding a charge's seconds to one thousands of times would sum that rounding into whole units; a difference of
    two epoch timestamps is exact."""

    born: float
    """Caller time when the meter last started from a full budget. A charge made before that has drained entirely: its
    settle has nothing to give back."""
    tat_s: float
    """The theoretical arrival time, seconds after ``born``: ``debt = tat_s - (now - born)``. A meter with no debt
    left is full again and is forgotten."""
    credit_s: float = 0.0
    """Seconds settles have taken off this meter's timeline since ``born``. A refund moves every segment above it down,
    so an open charge's recorded end is now at most ``end_s - (credit_s - its credit_s)``."""

    def debt_s(self, now: float) -> float:
        return self.tat_s - (now - self.born)

    @property
    def full_at(self) -> float:
        """Caller time when the debt reaches 0 (a TTL, not arithmetic: it carries the epoch's rounding)."""
        return self.born + self.tat_s


@dataclass(frozen=True, slots=True)
class MeterCheck:
    wait_s: float
    """0 when the cost fits now; else seconds until it does; ``NEVER`` when it never will."""

    @property
    def fits(self) -> bool:
        return self.wait_s == 0.0


def live(state: MeterState | None, now: float) -> MeterState | None:
    """``state`` unless it is full again by ``now`` (then it is as if never charged)."""
    return state if state is not None and state.debt_s(now) > 0.0 else None


def debt_s(state: MeterState | None, now: float) -> float:
    current = live(state, now)
    return current.debt_s(now) if current is not None else 0.0


def check_meter(state: MeterState | None, now: float, rate: Rate, cost: int) -> MeterCheck:
    """Does ``cost`` fit a meter in ``state`` (``None``: never charged, or full again)?

    A settle's unchecked extra can leave a meter *overdrawn*, in debt by more than its whole period: then nothing fits,
    not even a cost of 0, until the overdraft has drained (``wait_s``), and ``remaining_units`` reads 0 (it is clamped:
    a header cannot show the negative balance)."""
    unit_s = rate.unit_s
    if cost * unit_s > rate.period_s + SLACK_S:
        return MeterCheck(NEVER)
    over = debt_s(state, now) + cost * unit_s - rate.period_s
    return MeterCheck(over if over > SLACK_S else 0.0)


def charged_state(state: MeterState | None, now: float, added_s: float) -> MeterState:
    """The meter after ``added_s`` more seconds of the period were put on top of it."""
    current = live(state, now)
    if current is None:
        return MeterState(now, added_s, 0.0)
    return MeterState(current.born, current.tat_s + added_s, current.credit_s)


def remaining_units(debt_s: float, rate: Rate) -> int:
    """Units that would fit a meter ``debt_s`` seconds in debt, 0..limit."""
    units = math.floor((rate.period_s + SLACK_S - debt_s) / rate.unit_s)
    return max(0, min(rate.limit, units))


def refund_s(end_s: float, removed_s: float, elapsed_s: float) -> float:
    """Seconds to take off a meter's TAT when the top ``removed_s`` of a charge's segment ``[.., end_s]`` went unused:
    only the part of ``[end_s - removed_s, end_s]`` still ahead of ``elapsed_s`` (the rest has drained already). All
    three are seconds after the meter's ``born``."""
    return max(0.0, end_s - max(elapsed_s, end_s - removed_s))


# ---- a whole charge -------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChargedMeter:
    """What settle needs of one meter a charge drew on."""

    key: str
    kind: LimitKind
    cost: int
    unit_s: float
    """``T`` when charged: a refund or an extra is priced at the rate the charge was made at."""
    born: float
    """The meter's ``born`` when charged."""
    end_s: float
    """The meter's ``tat_s`` right after this charge: the top of the charge's segment, seconds after ``born``."""
    credit_s: float
    """The meter's ``credit_s`` when charged."""
    below_s: float = 0.0
    """The meter's debt just before this charge: the segments below this one. Only their refunds can move this
    segment down, so the settle's correction is at most this much (refunds of later charges, above it, never move
    it)."""


@dataclass(frozen=True, slots=True)
class OpenCharge:
    """A charge waiting for its settle (the backends store this; Valkey as JSON)."""

    charge_id: str
    tokens: int
    lease_deadline: float
    meters: tuple[ChargedMeter, ...]
    slot_keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ChargeDecision:
    """The raw result of a charge, as both backends compute it: per meter (in plan order) its state after the charge
    (admitted) or as found (refused), and why it does or does not fit; per slot set the live slots after / as found."""

    allowed: bool
    meter_checks: tuple[MeterCheck, ...]
    states: tuple[MeterState | None, ...]
    held: tuple[int, ...]


def decide_charge(plan: ChargePlan, states: Sequence[MeterState | None], held: Sequence[int],
                  now: float) -> ChargeDecision:
    """All or nothing: admitted only if every meter fits and every slot set has a free slot. ``states``: each meter's
    stored state; ``held``: each slot set's live slots (leases not yet run out)."""
    checks = tuple(check_meter(state, now, m.rate, m.cost) for m, state in zip(plan.meters, states, strict=True))
    slots_free = all(h < s.limit for s, h in zip(plan.slot_sets, held, strict=True))
    allowed = slots_free and all(c.fits for c in checks)
    if not allowed:
        return ChargeDecision(False, checks, tuple(live(s, now) for s in states), tuple(held))
    after = tuple(charged_state(state, now, m.cost * m.rate.unit_s)
                  for m, state in zip(plan.meters, states, strict=True))
    return ChargeDecision(True, checks, after, tuple(h + 1 for h in held))


def open_charge(request: ChargeRequest, plan: ChargePlan, decision: ChargeDecision, now: float,
                settings: LimiterSettings) -> OpenCharge | None:
    """The record an admitted charge leaves for its settle (``None`` without a charge id)."""
    if request.charge_id is None or not decision.allowed:
        return None
    meters = tuple(ChargedMeter(m.key, m.kind, m.cost, m.rate.unit_s, state.born, state.tat_s, state.credit_s,
                                max(0.0, state.tat_s - m.cost * m.rate.unit_s - (now - state.born)))
                   for m, state in zip(plan.meters, decision.states, strict=True) if state is not None)
    return OpenCharge(request.charge_id, request.tokens, now + settings.lease_s, meters,
                      tuple(s.key for s in plan.slot_sets))


# ---- settle ---------------------------------------------------------------------------------------------------------

def check_actual_tokens(actual_tokens: int) -> None:
    if isinstance(actual_tokens, bool) or not isinstance(actual_tokens, int) or actual_tokens < 0:
        raise ValueError(f"actual_tokens must be an integer >= 0, not {actual_tokens!r}")


def settle_meter(meter: ChargedMeter, state: MeterState | None, now: float, actual_tokens: int,
                 refund_request: bool) -> MeterState | None:
    """The meter's state after a settle (``None``: full again, forget it).

    Unused units give back ``refund_s`` of the charge's segment where it is now, at worst: its recorded end moved down
    by every credit since, but never by more than the debt that lay below it when it was charged (only refunds of those
    segments move it); an extra is put on top, unchecked: it may overdraw the meter (a debt beyond the period), and then
    every charge waits, even one of 0 units, until the overdraft drains."""
    current = live(state, now)
    if meter.kind is LimitKind.TOKENS:
        unused = meter.cost - actual_tokens
    else:
        unused = meter.cost if refund_request else 0
    if unused < 0:
        return charged_state(current, now, -unused * meter.unit_s)
    if unused == 0 or current is None or current.born != meter.born:
        return current  # nothing unused, or the segment drained before the meter last started afresh
    # Refunds since the charge moved its segment down by at most their sum, and by at most what lay below it.
    end_now = meter.end_s - min(current.credit_s - meter.credit_s, meter.below_s)
    credit = refund_s(end_now, unused * meter.unit_s, now - current.born)
    if credit <= 0.0:
        return current
    return live(MeterState(current.born, current.tat_s - credit, current.credit_s + credit), now)


class SettleOutcome(enum.StrEnum):
    SETTLED = "settled"
    NOT_OPEN = "not_open"
    """No open charge by that id: already settled, its lease ran out, or never charged. Nothing changed."""


@dataclass(frozen=True, slots=True)
class Settlement:
    outcome: SettleOutcome
    charged_tokens: int = 0
    actual_tokens: int = 0


# ---- verdicts -------------------------------------------------------------------------------------------------------

class Outcome(enum.StrEnum):
    ALLOWED = "allowed"
    OVER_LIMIT = "over_limit"
    """A rate has no room now; ``retry_after_s`` says when it will."""
    CONCURRENCY = "concurrency"
    """Only a concurrency limit refused: every slot is held by an open charge."""
    TOO_LARGE = "too_large"
    """The cost exceeds a rate's whole budget: no wait makes it fit."""


@dataclass(frozen=True, slots=True)
class LimitState:
    """One limit as a charge left it (admitted) or found it (refused)."""

    key: str
    kind: LimitKind
    limit: int
    remaining: int
    reset_s: float
    """Seconds until this limit is back to its full budget (OpenAI's ``x-ratelimit-reset-*``); 0 for a concurrency
    limit."""


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    states: tuple[LimitState, ...]
    """Every limit the charge touched, in plan order."""
    denied_by: tuple[LimitState, ...] = ()
    """Every limit without room for this charge, in plan order (empty when admitted). A rate's ``remaining`` here is
    below the charge's cost, or 0 when the meter is overdrawn (see ``check_meter``)."""
    retry_after_s: float | None = None
    """Refused: seconds until every limit has room for this same charge (rates: exact, so charging again at
    ``now + retry_after_s`` fits if nothing else was charged; concurrency: ``concurrency_retry_after_s``). ``None``
    when admitted, or when the charge can never fit (``TOO_LARGE``)."""
    charge_id: str | None = None
    """The id to settle, when admitted with one."""

    @property
    def allowed(self) -> bool:
        return self.outcome is Outcome.ALLOWED


def verdict(request: ChargeRequest, plan: ChargePlan, decision: ChargeDecision, now: float,
            settings: LimiterSettings) -> Verdict:
    """The backends' raw decision as a ``Verdict``: remaining and reset per limit, the retry-after of a refusal."""
    states: list[LimitState] = []
    refusing_rates: list[tuple[LimitState, float]] = []
    refusing_slots: list[LimitState] = []
    for meter, check, meter_state in zip(plan.meters, decision.meter_checks, decision.states, strict=True):
        debt = debt_s(meter_state, now)
        state = LimitState(meter.key, meter.kind, meter.rate.limit, remaining_units(debt, meter.rate), debt)
        states.append(state)
        if not check.fits:
            refusing_rates.append((state, check.wait_s))
    for slot_set, held in zip(plan.slot_sets, decision.held, strict=True):
        slots = LimitState(slot_set.key, LimitKind.CONCURRENT, slot_set.limit, max(0, slot_set.limit - held), 0.0)
        states.append(slots)
        if held >= slot_set.limit:
            refusing_slots.append(slots)
    if decision.allowed:
        return Verdict(Outcome.ALLOWED, tuple(states), charge_id=request.charge_id)
    # Every limit without room is named, whichever decides the outcome: a too-large charge may also find every slot
    # held, and the rate-limit service marks each descriptor by it.
    denied = tuple(state for state, _ in refusing_rates) + tuple(refusing_slots)
    if any(wait == NEVER for _, wait in refusing_rates):
        return Verdict(Outcome.TOO_LARGE, tuple(states), denied)
    waits = [wait for _, wait in refusing_rates]
    if refusing_slots:
        waits.append(settings.concurrency_retry_after_s)
    outcome = Outcome.OVER_LIMIT if refusing_rates else Outcome.CONCURRENCY
    return Verdict(outcome, tuple(states), denied, max(waits))


def peek_states(scopes: Sequence[Scope], meters: Sequence[MeterState | None], held: Sequence[int],
                now: float) -> tuple[LimitState, ...]:
    """The limits of ``scopes`` as they stand (``meters`` and ``held`` in ``plan_scopes`` order), charging nothing."""
    plan = plan_scopes(scopes)
    states = [LimitState(m.key, m.kind, m.rate.limit, remaining_units(debt_s(state, now), m.rate), debt_s(state, now))
              for m, state in zip(plan.meters, meters, strict=True)]
    states += [LimitState(s.key, LimitKind.CONCURRENT, s.limit, max(0, s.limit - h), 0.0)
               for s, h in zip(plan.slot_sets, held, strict=True)]
    return tuple(states)
