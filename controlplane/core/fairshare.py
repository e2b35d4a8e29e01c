"""Tenant fair share inside a parking class: a virtual token counter per model and tenant (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024; decision 0015). Pure: no I/O, no clock.

- **Charge**: each admission, ``counter += (prompt_weight x prompt + output_weight x output) / weight(tenant)``, with
  the prompt estimate and the expected output (the model's mean, never past ``max_tokens``); ``settle`` corrects it
  from the access log's usage, ``retract`` takes back an admission the store refused.
- **Lift**: a tenant that parks with nothing parked for the model rises to the lowest backlogged counter (none: the
  counter of the tenant charged last) less ``lift_credit_requests`` of its own requests' cost (decision 0031), never
  falling; idle time is banked up to that credit, no further.
- **Pick**: within a class, the oldest request of the lowest counter (ties: the tenant served less, its counter without
  lifts; then the request parked first). ``service_order`` projects a class's order, each pick charged in turn.

Requests without a tenant are one tenant, ``ANONYMOUS``. No starvation: every pick raises its tenant's counter and a
lifted tenant starts at most its credit below the backlogged minimum, so a backlogged tenant is picked after a bounded
amount of others' service (about ``(2 + lift_credit_requests) x (prompt_weight x prompt + output_weight x
max_output)`` per other tenant).
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeVar

ANONYMOUS = ""
"""The tenant of every request that names none (no tenant configured, or ``GET``-only paths): one tenant."""

SETTLE_AFTER_RELEASE = 10_000
"""Released tickets whose charge still waits for its settle (the access log releases a ticket before it settles it)."""


class FairMode(enum.StrEnum):
    """``fairness.enabled``."""

    AUTO = "auto"
    """On as soon as one tenant is configured (tenants are why fairness exists); off without tenants (every request is
    one tenant's, so the order would be FIFO anyway)."""
    ON = "on"
    OFF = "off"
    """The parking lot's order exactly as without this module: FIFO (adaptive LIFO aside)."""


@dataclass(frozen=True, slots=True)
class FairShare:
    """How the lot shares a class among tenants (the ``fairness`` config section and each tenant's ``weight``)."""

    enabled: bool = False
    """Resolved from ``mode`` (``auto``: whether tenants are configured)."""
    mode: FairMode = FairMode.AUTO
    prompt_weight: float = 1.0
    """What a prompt token costs a counter (the paper: 1), > 0."""
    output_weight: float = 2.0
    """What an output token costs a counter (the paper: 2: decoding a token costs more than prefilling one), >= 0."""
    weights: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Tenant -> weight (> 0; absent: ``default_weight``). A tenant of weight 2 is served twice the tokens of one of
    weight 1 while both are backlogged."""
    default_weight: float = 1.0
    """The weight of a tenant without its own, and of ``ANONYMOUS``."""
    lift_credit_requests: float = 16.0
    """A lifted tenant lands this many of its own requests (at the parking request's cost) below the backlogged
    minimum, never lower than its own counter (decision 0031): after an idle spell a burst goes ahead of a flood's
    instead of alternating with it, while other returning tenants go ahead of it too. 0: the paper's lift, exactly to
    the minimum."""
    reserved: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Tenant -> its reserved share of each model's slots (``tenants.NAME.reserved_share``, (0, 1], adding up to at
    most 1; core/reserve.py). Applied whether or not ``enabled``."""
    preempt_sheddable: bool = False
    """A critical request that would start past its bound may end running sheddable streams (core/preempt.py).
    Applied whether or not ``enabled``."""
    preempt_max_per_minute: int = 6
    """At most this many preemptions in any 60 s (>= 1)."""
    preempt_grace_ms: int = 500
    """The shell's: how long a started stream being ended waits for its next chunk to carry the error event."""
    across_replicas: bool = True
    """The fair line is the shared store's (``QueueRule.FAIR``, decision 0025): counters charged and lifted there, every
    replica's parked requests ordered together; False: each replica fair among its own (``QueueRule.CLASS``)."""

    def __post_init__(self) -> None:
        if type(self.weights) is not MappingProxyType:
            object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))
        if type(self.reserved) is not MappingProxyType:
            object.__setattr__(self, "reserved", MappingProxyType(dict(self.reserved)))

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def cost(self, tenant: str, prompt_tokens: float, output_tokens: float) -> float:
        """What serving these tokens adds to ``tenant``'s counter."""
        return (self.prompt_weight * prompt_tokens + self.output_weight * output_tokens) / self.weight(tenant)


class Waiting(Protocol):
    """A parked request as the fair order reads it (``admission.Parked``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def seq(self) -> int: ...


@dataclass(slots=True)
class _Charge:
    model: str
    tenant: str
    prompt_tokens: float
    output_tokens: float
    cost: float


@dataclass(frozen=True, slots=True)
class TenantShare:
    """One tenant's standing for one model (``sluice admin tenants``, the metrics)."""

    model: str
    tenant: str
    counter: float
    """Its virtual token counter (weighted tokens / weight; only differences between tenants matter)."""
    served_tokens: float
    """Tokens served to it by this replica's admissions (prompt + output, unweighted; estimates until settled)."""
    waiting: int = 0
    """Its requests parked for the model on this replica."""


@dataclass(frozen=True, slots=True)
class TenantAhead:
    """A tenant with requests served before the one explained (``FairStanding``)."""

    tenant: str
    counter: float
    """Its virtual token counter now."""
    requests: int
    """How many of its requests go first."""


@dataclass(frozen=True, slots=True)
class FairStanding:
    """Why a request would wait under fair share if it parked now (``sluice admin explain``): its tenant's counter and
    the tenants whose requests the projected order (``service_order``) serves before it in its class."""

    tenant: str
    counter: float
    """Its tenant's counter as it would park: lifted to the backlogged minimum if none of its requests waits."""
    lifted: bool
    """The counter was raised by the lift (its tenant had nothing parked and stood below the backlogged minimum)."""
    ahead_in_class: int
    """Requests of its class served before it (its own tenant's older ones included)."""
    ahead_in_higher_classes: int
    """Requests of higher classes parked here: all served before it, whatever the counters."""
    tenants_ahead: tuple[TenantAhead, ...] = ()
    """Each tenant with requests before it in its class, lowest counter first."""
    held_slots: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Slots held back now for other tenants' reserved shares (core/reserve.py: ``owed``): tenant -> slots; a request
    of its tenant takes a free slot only if one is left beyond them all. Its own tenant's are not held from it."""


@dataclass(frozen=True, slots=True)
class FairCounters:
    """One model's counters as the shared store holds them (decision 0025): tenant -> (counter, its weighted service
    without lifts), and the tenant charged last (None: none yet). A tenant absent stands at 0."""

    model: str
    counters: Mapping[str, tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))
    last: str | None = None


class TenantCounters:
    """The counters, by model then tenant, and the open charges that ``settle`` corrects. With fair share in the shared
    store (decision 0025) the store's counters decide the line and these are this replica's copy, charged by its own
    admissions and settles and replaced by the store's when it refuses a fair pick (``adopt``)."""

    def __init__(self) -> None:
        self._counters: dict[str, dict[str, float]] = {}
        self._raw: dict[str, dict[str, float]] = {}
        """The counters without lifts (weighted service alone): who has been served less, for ties."""
        self._served: dict[str, dict[str, float]] = {}
        self._last: dict[str, str] = {}
        """model -> the tenant charged last: a tenant that parks while none is backlogged is lifted to its counter."""
        self._open: dict[str, _Charge] = {}
        """Charges of open tickets, by ticket id."""
        self._running: dict[str, dict[str, int]] = {}
        """model -> tenant -> its open tickets here (``_open`` counted): reserved shares' ``running``."""
        self._closed: OrderedDict[str, _Charge] = OrderedDict()
        """Charges of released tickets whose settle has not come (bounded by ``SETTLE_AFTER_RELEASE``)."""

    def counter(self, model: str, tenant: str) -> float:
        return self._counters.get(model, {}).get(tenant, 0.0)

    def rank(self, model: str, tenant: str) -> tuple[float, float]:
        """A tenant's place in the pick: its counter, then (ties) its weighted service without lifts."""
        return self.counter(model, tenant), self._raw.get(model, {}).get(tenant, 0.0)

    def lifted(self, model: str, tenant: str, backlogged: Iterable[str], credit: float = 0.0) -> float:
        """The counter ``tenant`` would have for ``model`` if it became backlogged now (``lift``), nothing changed:
        ``max(its counter, floor - credit)``, ``floor`` the lowest counter among the other backlogged tenants, or with
        none backlogged the counter of the tenant charged last (0 for none)."""
        others = [self.counter(model, t) for t in backlogged if t != tenant]
        if others:
            floor = min(others)
        elif model in self._last:
            floor = self.counter(model, self._last[model])
        else:
            floor = 0.0
        return max(self.counter(model, tenant), floor - credit)

    def lift(self, model: str, tenant: str, backlogged: Iterable[str], credit: float = 0.0) -> float:
        """``tenant`` becomes backlogged for ``model`` (it had nothing parked): its counter is raised to ``lifted``'s.
        Returns its counter."""
        value = self.lifted(model, tenant, backlogged, credit)
        self._counters.setdefault(model, {})[tenant] = value
        return value

    def charge(self, ticket_id: str, model: str, tenant: str, prompt_tokens: float, output_tokens: float,
               share: FairShare) -> float:
        """An admission: ``tenant``'s counter advances by the request's estimated cost (returned)."""
        cost = share.cost(tenant, prompt_tokens, output_tokens)
        counters = self._counters.setdefault(model, {})
        counters[tenant] = counters.get(tenant, 0.0) + cost
        raw = self._raw.setdefault(model, {})
        raw[tenant] = raw.get(tenant, 0.0) + cost
        served = self._served.setdefault(model, {})
        served[tenant] = served.get(tenant, 0.0) + prompt_tokens + output_tokens
        self._last[model] = tenant
        self._open[ticket_id] = _Charge(model, tenant, prompt_tokens, output_tokens, cost)
        running = self._running.setdefault(model, {})
        running[tenant] = running.get(tenant, 0) + 1
        return cost

    def charged(self, ticket_id: str) -> tuple[str, float] | None:
        """The tenant and cost of ``ticket_id``'s open charge here (None: not admitted here, or closed)."""
        charge = self._open.get(ticket_id)
        return None if charge is None else (charge.tenant, charge.cost)

    def adopt(self, held: FairCounters) -> bool:
        """The store's counters of ``held.model`` replace this replica's (the store's are the ones its line is decided
        by); returns whether any counter or the tenant charged last differed."""
        model = held.model
        counters = {t: c for t, (c, _) in held.counters.items()}
        raw = {t: r for t, (_, r) in held.counters.items()}
        before = (self._counters.get(model, {}), self._raw.get(model, {}), self._last.get(model))
        changed = _nonzero(before[0]) != _nonzero(counters) or _nonzero(before[1]) != _nonzero(raw) \
            or (held.last is not None and held.last != before[2])
        self._counters[model], self._raw[model] = counters, raw
        if held.last is not None:
            self._last[model] = held.last
        return changed

    def running(self, model: str) -> Mapping[str, int]:
        """Each tenant's open tickets of ``model`` admitted here (released, retracted, lapsed or settled: no longer)."""
        return self._running.get(model, {})

    def _opened(self, ticket_id: str) -> _Charge | None:
        """Take ``ticket_id``'s charge out of the open ones (and its tenant's running count)."""
        charge = self._open.pop(ticket_id, None)
        if charge is not None:
            running = self._running[charge.model]
            running[charge.tenant] -= 1
            if not running[charge.tenant]:
                del running[charge.tenant]
        return charge

    def retract(self, ticket_id: str) -> bool:
        """An admission undone (the shared store refused it): its charge is taken back whole."""
        charge = self._opened(ticket_id)
        if charge is None:
            return False
        self._counters[charge.model][charge.tenant] -= charge.cost
        self._raw[charge.model][charge.tenant] -= charge.cost
        self._served[charge.model][charge.tenant] -= charge.prompt_tokens + charge.output_tokens
        return True

    def close(self, ticket_id: str) -> None:
        """The ticket was released: its charge waits a while for its settle (the access log settles right after)."""
        charge = self._opened(ticket_id)
        if charge is None:
            return
        self._closed[ticket_id] = charge
        while len(self._closed) > SETTLE_AFTER_RELEASE:
            self._closed.popitem(last=False)

    def forget(self, ticket_id: str) -> None:
        """No usage will come (a lapsed lease): the estimate stands."""
        self._opened(ticket_id)
        self._closed.pop(ticket_id, None)

    def settle(self, ticket_id: str, prompt_tokens: int, output_tokens: int, share: FairShare) -> float | None:
        """What the request really used: its tenant's counter (and served tokens) are corrected from the estimate it
        was charged. Returns the correction, or None if the ticket's charge is unknown here (another replica's)."""
        charge = self._opened(ticket_id) or self._closed.pop(ticket_id, None)
        if charge is None:
            return None
        cost = share.cost(charge.tenant, prompt_tokens, output_tokens)
        delta = cost - charge.cost
        self._counters[charge.model][charge.tenant] += delta
        self._raw[charge.model][charge.tenant] += delta
        self._served[charge.model][charge.tenant] += prompt_tokens + output_tokens - charge.prompt_tokens \
            - charge.output_tokens
        return delta

    def shares(self, waiting: Mapping[tuple[str, str], int] | None = None) -> list[TenantShare]:
        """Every (model, tenant) known here, by model then tenant, with how many wait (``waiting``)."""
        waiting = waiting or {}
        keys = {(m, t) for m, counters in self._counters.items() for t in counters} | set(waiting)
        return [TenantShare(m, t, self.counter(m, t), self._served.get(m, {}).get(t, 0.0), waiting.get((m, t), 0))
                for m, t in sorted(keys)]


def _nonzero(values: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if v}


def fair_pick(members: Iterable[tuple[str, int, str]], rank_of: Callable[[str], tuple[float, float]],
              newest_first: bool = False) -> str | None:
    """The member a fair wake serves next among a class's parked ``members`` (member, parking sequence, tenant): the
    oldest (``newest_first``: newest) of the tenant with the lowest rank (``rank_of``: its counter, then its service
    without lifts; last ties: the tenant whose candidate parked first), as ``service_order``'s first pick. None if
    empty. The shared store's ``FAIR`` check (store/memory.py; valkeyscripts.py ``fair_pick`` is the same rule)."""
    heads: dict[str, tuple[int, str]] = {}
    for held, seq, tenant in members:
        at = heads.get(tenant)
        if at is None or (seq > at[0] if newest_first else seq < at[0]):
            heads[tenant] = (seq, held)
    if not heads:
        return None
    tenant = min(heads, key=lambda t: (*rank_of(t), -heads[t][0] if newest_first else heads[t][0]))
    return heads[tenant][1]


_Entry = tuple[float, float, int, str]
_W = TypeVar("_W", bound=Waiting)


def service_order(entries: Sequence[_W], tenant_of: Callable[[_W], str],
                  rank_of: Callable[[str], tuple[float, float]], cost_of: Callable[[_W], float],
                  newest_first: bool = False) -> list[_W]:
    """The order a class's parked ``entries`` (in parking order) are served in by fair share: repeatedly the next
    request of the tenant with the lowest rank (``rank_of``: its counter, then its service without lifts; last ties:
    the tenant whose next request parked first), that tenant's counter and service then advanced by the request's
    estimated cost (``cost_of``, already over its weight). Within a tenant, parking order (``newest_first``: newest
    first, for adaptive LIFO)."""
    by_tenant: dict[str, list[_W]] = {}
    for entry in entries:
        by_tenant.setdefault(tenant_of(entry), []).append(entry)
    if len(by_tenant) <= 1:
        return list(reversed(entries)) if newest_first else list(entries)
    for queue in by_tenant.values():
        if newest_first:
            queue.reverse()
    heap: list[_Entry] = []
    at = {tenant: 0 for tenant in by_tenant}
    for tenant, queue in by_tenant.items():
        counter, raw = rank_of(tenant)
        heapq.heappush(heap, (counter, raw, _tie(queue[0], newest_first), tenant))
    out: list[_W] = []
    while heap:
        counter, raw, _, tenant = heapq.heappop(heap)
        queue = by_tenant[tenant]
        entry = queue[at[tenant]]
        out.append(entry)
        at[tenant] += 1
        if at[tenant] < len(queue):
            cost = cost_of(entry)
            heapq.heappush(heap, (counter + cost, raw + cost, _tie(queue[at[tenant]], newest_first), tenant))
    return out


def _tie(entry: Waiting, newest_first: bool) -> int:
    return -entry.seq if newest_first else entry.seq
