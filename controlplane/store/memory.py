"""The in-process ``Store``: today's single control plane, and several ``AdmissionCore``s in one process in tests.

One ``MemoryState`` is the shared ledger; each ``MemoryStore`` is one replica's handle on it. Every operation is applied at
once (no suspension), so for a single replica the port costs a few dictionary writes per admission. Events reach the
handles' listeners on the next turn of the event loop, as they would from a server. Nothing survives the process.

A handle is alive from ``open`` to ``close`` (all of them live in this one process), unless a test's ``heartbeat``
gives it a lapse; ``start_liveness`` has nothing to renew.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from controlplane.core.fairshare import fair_pick
from controlplane.core.model import Ticket
from controlplane.store.base import (
    DEAD_FIRSTS_S, LINE_CLASSES, Claim, EventKind, FairCharge, FairCounters, Landed, LineChange, QueueRule, Refusal,
    Reserved, StoreEvent, StoreState, member,
)

SESSION_TTL_S = 3600.0
CHARGES_KEPT = 100_000
"""Fair-share charges kept for their settle (``Store.settle``), the oldest forgotten first (their estimates stand)."""
FAIR_RULES = (QueueRule.FAIR, QueueRule.FAIR_NEWEST)

Line = tuple[str, int]
"""(model, class index)."""


@dataclass
class _Listener:
    """One handle's subscription, and the admissions of its own it expects to hear (``expect_admission``)."""

    replica: str
    handler: Callable[[StoreEvent], None]
    expected: dict[str, Callable[[], None]]
    """Its handle's ``expected`` (the same dict)."""

    def deliver(self, event: StoreEvent) -> None:
        if event.kind in (EventKind.CLAIMED, EventKind.DEAD) or event.replica != self.replica:
            self.handler(event)
        elif event.kind is EventKind.ADMITTED and (then := self.expected.pop(event.ticket_id, None)) is not None:
            then()


@dataclass
class MemoryState:
    """The ledger every ``MemoryStore`` handle of one process shares."""

    wall: Callable[[], float] = time.time
    tickets: dict[str, tuple[Ticket, str]] = field(default_factory=dict)
    by_engine: dict[str, set[str]] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    lines: dict[Line, dict[str, int]] = field(default_factory=dict)
    """(model, class) -> member -> sequence number, in line order (insertion order is sequence order)."""
    firsts: dict[Line, dict[str, tuple[str, float]]] = field(default_factory=dict)
    """(model, class) -> request id -> (the replica whose member it is, when the request first parked): one entry per
    member of ``lines``."""
    dead_firsts: dict[Line, dict[str, tuple[str, float, float]]] = field(default_factory=dict)
    """(model, class) -> request id -> (a dead replica, when the request first parked, until when this is kept)."""
    claims: dict[Line, dict[str, tuple[Claim, float]]] = field(default_factory=dict)
    """(model, class) -> member -> (its claim, until when it may be admitted on it)."""
    seq: int = 0
    sessions: dict[str, tuple[str, float]] = field(default_factory=dict)
    serves: dict[str, tuple[float, float]] = field(default_factory=dict)
    """engine -> (its recent-serve count as of its last admission, the time of that admission)."""
    replicas: dict[str, float] = field(default_factory=dict)
    """replica -> the wall-clock time its heartbeat lapses."""
    listeners: list[_Listener] = field(default_factory=list)
    fair: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    """model -> tenant -> (its virtual token counter, its charges without lifts) (decision 0025)."""
    fair_last: dict[str, str] = field(default_factory=dict)
    """model -> the tenant charged last."""
    tenants: dict[Line, dict[str, str]] = field(default_factory=dict)
    """(model, class) -> member -> its tenant, for members parked with one."""
    backlog: dict[str, dict[str, int]] = field(default_factory=dict)
    """model -> tenant -> its members in the model's lines (those in ``tenants``)."""
    charges: OrderedDict[str, tuple[str, FairCharge]] = field(default_factory=OrderedDict)
    """ticket id -> (model, its charge), until settled, its lease lapses, or ``CHARGES_KEPT`` newer ones."""

    def alive(self, replica: str) -> bool:
        return self.replicas.get(replica, float("-inf")) > self.wall()

    def publish(self, event: StoreEvent) -> None:
        """Hand ``event`` to every listener on the next turn of the loop (each skips another's own event, except
        ``CLAIMED`` and ``DEAD``, which everyone hears)."""
        if self.listeners:
            loop = asyncio.get_running_loop()
            for listener in self.listeners:
                loop.call_soon(listener.deliver, event)

    def first(self, model: str, klass: int, newest: bool = False) -> str | None:
        """The line's oldest (or newest) member held by a live replica; a dead replica met on the way is removed
        (``purge``)."""
        line = self.lines.get((model, klass))
        while line:
            candidate = next(reversed(line)) if newest else next(iter(line))
            replica = candidate.partition("|")[0]
            if self.alive(replica):
                return candidate
            self.purge(replica)
        return None

    def leave(self, model: str, klass: int, replica: str, request_id: str) -> bool:
        """Take ``replica``'s member of ``request_id`` out of the line, with its claim; False if it was not there."""
        held = member(replica, request_id)
        if self.lines.get((model, klass), {}).pop(held, None) is None:
            return False
        self.claims.get((model, klass), {}).pop(held, None)
        tenant = self.tenants.get((model, klass), {}).pop(held, None)
        if tenant is not None:
            backlog = self.backlog[model]
            backlog[tenant] -= 1
            if not backlog[tenant]:
                del backlog[tenant]
        firsts = self.firsts.get((model, klass), {})
        if firsts.get(request_id, ("", 0.0))[0] == replica:
            del firsts[request_id]
        return True

    def purge(self, replica: str) -> list[str]:
        """``replica`` is dead: its members leave every line (their first-park times kept ``DEAD_FIRSTS_S`` for Checks
        asked again elsewhere), a ``DEAD`` event says so. Returns the models whose lines it left (to be drained)."""
        self.replicas.pop(replica, None)
        models: list[str] = []
        until = self.wall() + DEAD_FIRSTS_S
        prefix = member(replica, "")
        for (model, klass), line in self.lines.items():
            mine = [m for m in line if m.startswith(prefix)]
            for held in mine:
                request_id = held[len(prefix):]
                first = self.firsts.get((model, klass), {}).get(request_id)
                if first is not None and first[0] == replica:
                    self.dead_firsts.setdefault((model, klass), {})[request_id] = (replica, first[1], until)
                self.leave(model, klass, replica, request_id)
            if mine and model not in models:
                models.append(model)
        self.publish(StoreEvent(EventKind.DEAD, replica, ""))
        return models

    def rank(self, model: str, tenant: str) -> tuple[float, float]:
        return self.fair.get(model, {}).get(tenant, (0.0, 0.0))

    def counters(self, model: str) -> FairCounters:
        return FairCounters(model, MappingProxyType(dict(self.fair.get(model, {}))), self.fair_last.get(model))

    def fair_first(self, model: str, klass: int, newest: bool) -> str | None:
        """The line's fair pick (``fair_pick``) among members of live replicas; a dead replica picked is removed."""
        while (line := self.lines.get((model, klass))):
            tenants = self.tenants.get((model, klass), {})
            pick = fair_pick(((m, seq, tenants.get(m, "")) for m, seq in line.items()),
                             lambda t: self.rank(model, t), newest)
            assert pick is not None
            replica = pick.partition("|")[0]
            if self.alive(replica):
                return pick
            self.purge(replica)
        return None

    def lift(self, model: str, tenant: str, credit: float) -> None:
        """``tenant`` parks with no member of it in the model's lines: raised to the lowest counter among the tenants
        with members (none: the counter of the tenant charged last) less ``credit``, never lowered."""
        others = [self.rank(model, t)[0] for t in self.backlog.get(model, {}) if t != tenant]
        last = self.fair_last.get(model)
        floor = (min(others) if others else self.rank(model, last)[0] if last is not None else 0.0) - credit
        counter, raw = self.rank(model, tenant)
        if floor > counter:
            self.fair.setdefault(model, {})[tenant] = (floor, raw)

    def charge(self, model: str, ticket_id: str, charge: FairCharge) -> None:
        counter, raw = self.rank(model, charge.tenant)
        self.fair.setdefault(model, {})[charge.tenant] = (counter + charge.cost, raw + charge.cost)
        self.fair_last[model] = charge.tenant
        self.charges[ticket_id] = (model, charge)
        while len(self.charges) > CHARGES_KEPT:
            self.charges.popitem(last=False)

    def write(self, ticket: Ticket, owner: str) -> None:
        self.tickets[ticket.ticket_id] = (ticket, owner)
        self.by_engine.setdefault(ticket.engine, set()).add(ticket.ticket_id)
        self.kv[ticket.engine] = self.kv.get(ticket.engine, 0) + ticket.reserved_tokens

    def fits(self, claim: Claim) -> Refusal | None:
        t = claim.ticket
        if claim.cap is not None and len(self.by_engine.get(t.engine, ())) >= claim.cap:
            return Refusal.CAP
        if claim.kv_limit is not None and self.kv.get(t.engine, 0) + t.reserved_tokens > claim.kv_limit:
            return Refusal.KV
        if claim.adapter_slots is not None and t.model not in claim.plain_models:
            held = {self.tickets[i][0].model for i in self.by_engine.get(t.engine, ())} - set(claim.plain_models)
            if t.model not in held and len(held) >= claim.adapter_slots:
                return Refusal.ADAPTER_SLOTS
        return None

    def serve(self, engine: str, at: float, half_life_s: float) -> None:
        """One admission to ``engine`` at ``at`` in its shared recent-serve count."""
        if half_life_s <= 0:
            return
        count, since = self.serves.get(engine, (0.0, at))
        if at >= since:
            self.serves[engine] = (count * math.pow(0.5, (at - since) / half_life_s) + 1.0, at)
        else:  # an admission older than the last one counted (clocks of several hosts): counted at the later time
            self.serves[engine] = (count + math.pow(0.5, (since - at) / half_life_s), since)

    def admitted(self, claim: Claim, owner: str) -> None:
        """Write ``claim``'s ticket for ``owner`` (cap and KV checked already), its serve and session."""
        ticket = claim.ticket
        self.write(ticket, owner)
        self.serve(ticket.engine, ticket.admitted_at, claim.serve_half_life_s)
        if claim.charge is not None:
            self.charge(ticket.model, ticket.ticket_id, claim.charge)
        if claim.session:
            self.sessions[claim.session] = (ticket.engine, self.wall() + SESSION_TTL_S)

    def drain(self, model: str) -> int:
        """Admit the lines' heads of ``model`` on their claims, in line order (see base.py, Claims); how many."""
        admitted = 0
        for klass in range(LINE_CLASSES):
            while (head := self.first(model, klass)) is not None:
                claims = self.claims.get((model, klass), {})
                held = claims.get(head)
                if held is None:
                    return admitted
                claim, until = held
                if until < self.wall() or claim.ticket.ticket_id in self.tickets:
                    del claims[head]
                    return admitted
                if self.fits(claim) is not None:
                    return admitted
                replica, _, request_id = head.partition("|")
                self.admitted(claim, replica)
                self.leave(model, klass, replica, request_id)
                t = claim.ticket
                self.publish(StoreEvent(EventKind.CLAIMED, replica, t.ticket_id, t, claim.session, model,
                                        claim.prefix_blocks))
                admitted += 1
        return admitted


class MemoryStore:
    def __init__(self, state: MemoryState | None = None, replica_id: str = "r0") -> None:
        self.state = state or MemoryState()
        self.replica_id = replica_id
        self.expected: dict[str, Callable[[], None]] = {}
        """This handle's own admissions it expects to hear (``expect_admission``), by ticket id."""

    async def open(self) -> None:
        s = self.state
        mine = member(self.replica_id, "")
        if any(m.startswith(mine) for line in s.lines.values() for m in line):  # a former handle of this id
            for model in s.purge(self.replica_id):
                s.drain(model)
        s.replicas[self.replica_id] = float("inf")  # a handle is alive until close() (or a heartbeat says)

    async def close(self) -> None:
        self.state.replicas.pop(self.replica_id, None)

    async def reserve(self, claim: Claim) -> Reserved:
        s, ticket = self.state, claim.ticket
        model = ticket.model
        s.drain(model)
        if ticket.ticket_id in s.tickets:
            return Reserved(Refusal.EXISTS)
        mine = member(self.replica_id, ticket.ticket_id)
        if claim.queue is not QueueRule.NONE:
            higher = claim.klass if claim.queue is not QueueRule.ARRIVAL else claim.klass + 1
            queued = any(s.first(model, k) is not None for k in range(higher))
            if not queued and claim.queue in (QueueRule.OLDEST, QueueRule.NEWEST):
                head = s.first(model, claim.klass, newest=claim.queue is QueueRule.NEWEST)
                queued = head is not None and head != mine
            elif not queued and claim.queue in FAIR_RULES:
                pick = s.fair_first(model, claim.klass, newest=claim.queue is QueueRule.FAIR_NEWEST)
                queued = pick is not None and pick != mine
            if queued:
                if (claim.queue is QueueRule.OLDEST and claim.fresh_s > 0
                        and mine in s.lines.get((model, claim.klass), {})):
                    s.claims.setdefault((model, claim.klass), {})[mine] = (claim, s.wall() + claim.fresh_s)
                return Reserved(Refusal.QUEUED, counters=s.counters(model) if claim.queue in FAIR_RULES else None)
        refusal = s.fits(claim)
        if refusal is not None:
            return Reserved(refusal, self._engine_tickets(ticket.engine))
        s.admitted(claim, self.replica_id)
        if not s.leave(model, claim.klass, self.replica_id, ticket.ticket_id):
            held = s.firsts.get((model, claim.klass), {}).get(ticket.ticket_id)
            if held is not None:  # parked by a replica it left when its Check was asked again elsewhere
                s.leave(model, claim.klass, held[0], ticket.ticket_id)
        s.publish(StoreEvent(EventKind.ADMITTED, self.replica_id, ticket.ticket_id, ticket, claim.session, model,
                             claim.prefix_blocks))
        s.drain(model)
        return Reserved()

    def _engine_tickets(self, engine: str) -> tuple[Ticket, ...]:
        return tuple(self.state.tickets[t][0] for t in sorted(self.state.by_engine.get(engine, ())))

    def _close(self, ticket_id: str, lapsed: bool = False) -> Ticket | None:
        """Close a ticket; ``lapsed`` (its lease ran out): its charge is dropped, no settle will come."""
        s = self.state
        if lapsed:
            s.charges.pop(ticket_id, None)
        held = s.tickets.pop(ticket_id, None)
        if held is None:
            return None
        ticket = held[0]
        s.by_engine[ticket.engine].discard(ticket_id)
        s.kv[ticket.engine] -= ticket.reserved_tokens
        s.publish(StoreEvent(EventKind.RELEASED, self.replica_id, ticket_id, ticket, model=ticket.model))
        s.drain(ticket.model)
        return ticket

    async def release(self, ticket_id: str) -> Ticket | None:
        return self._close(ticket_id)

    async def expire(self, now: float, limit: int = 256) -> list[Ticket]:
        due = sorted((t.lease_deadline, t.ticket_id) for t, _ in self.state.tickets.values() if t.lease_deadline <= now)
        return [t for _, ticket_id in due[:limit] if (t := self._close(ticket_id, lapsed=True)) is not None]

    async def restore(self, tickets: list[Ticket]) -> int:
        fresh = [t for t in tickets if t.ticket_id not in self.state.tickets]
        for ticket in fresh:
            self.state.write(ticket, self.replica_id)
        return len(fresh)

    async def park(self, model: str, klass: int, request_id: str, at: float, claim: Claim | None = None,
                   tenant: str | None = None, lift_credit: float = 0.0) -> float:
        s = self.state
        first = at
        held = s.firsts.get((model, klass), {}).get(request_id)
        dead = s.dead_firsts.get((model, klass), {}).pop(request_id, None)
        if held is not None and held[0] != self.replica_id and s.leave(model, klass, held[0], request_id):
            first = held[1]
            s.publish(StoreEvent(EventKind.UNPARKED, self.replica_id, request_id, model=model))
        elif dead is not None and dead[0] != self.replica_id and dead[2] > s.wall():
            first = dead[1]
        s.seq += 1
        mine = member(self.replica_id, request_id)
        tenants = s.tenants.setdefault((model, klass), {})
        if tenant is not None and mine not in tenants:
            backlog = s.backlog.setdefault(model, {})
            if not backlog.get(tenant):
                s.lift(model, tenant, lift_credit)
            backlog[tenant] = backlog.get(tenant, 0) + 1
            tenants[mine] = tenant
        s.lines.setdefault((model, klass), {})[mine] = s.seq
        s.firsts.setdefault((model, klass), {})[request_id] = (self.replica_id, first)
        if claim is not None and claim.fresh_s > 0:
            s.claims.setdefault((model, klass), {})[mine] = (claim, s.wall() + claim.fresh_s)
        s.drain(model)
        return first

    async def settle(self, ticket_id: str, prompt_tokens: int, output_tokens: int) -> float | None:
        s = self.state
        held = s.charges.pop(ticket_id, None)
        if held is None:
            return None
        model, charge = held
        delta = charge.priced(prompt_tokens, output_tokens) - charge.cost
        counter, raw = s.rank(model, charge.tenant)
        s.fair.setdefault(model, {})[charge.tenant] = (counter + delta, raw + delta)
        return delta

    async def counters(self, model: str) -> FairCounters:
        return self.state.counters(model)

    async def claim(self, model: str, klass: int, claims: Sequence[tuple[str, Claim]]) -> None:
        s = self.state
        line, held = s.lines.get((model, klass), {}), s.claims.setdefault((model, klass), {})
        until = s.wall()
        for request_id, claim in claims:
            mine = member(self.replica_id, request_id)
            if mine in line:
                held[mine] = (claim, until + claim.fresh_s)
        s.drain(model)

    async def unpark(self, model: str, klass: int, request_id: str) -> bool:
        if not self.state.leave(model, klass, self.replica_id, request_id):
            return False
        self.state.publish(StoreEvent(EventKind.UNPARKED, self.replica_id, request_id, model=model))
        self.state.drain(model)
        return True

    async def change_lines(self, changes: Sequence[LineChange]) -> list[Landed]:
        out: list[Landed] = []
        for change in changes:  # no call here suspends: the batch is atomic as a whole
            if change.unpark:
                out.append(Landed(left=await self.unpark(change.model, change.klass, change.request_id)))
                continue
            claim = change.claim
            offered = None
            if change.offer is not None:
                offered = await self.reserve(change.offer)
                if offered.ok:
                    out.append(Landed(offered=offered))
                    continue
                if offered.refusal is not Refusal.QUEUED:
                    claim = None
            first = await self.park(change.model, change.klass, change.request_id, change.at, claim, change.tenant,
                                     change.lift_credit)
            out.append(Landed(first, offered))
        return out

    async def members(self, model: str, klass: int) -> list[str]:
        mine = member(self.replica_id, "")
        return [m[len(mine):] for m in self.state.lines.get((model, klass), {}) if m.startswith(mine)]

    async def heartbeat(self, ttl_s: float) -> None:
        self.state.replicas[self.replica_id] = self.state.wall() + ttl_s

    async def reap(self) -> list[str]:
        s = self.state
        dead = [r for r, until in s.replicas.items() if until <= s.wall()]
        for replica in dead:
            for model in s.purge(replica):
                s.drain(model)
        return dead

    def start_liveness(self, every_s: float, lapse_s: float, on_lapsed: Callable[[], None]) -> None:
        """Nothing to renew: a handle is alive until ``close`` (module docstring)."""

    async def load(self) -> StoreState:
        s, now = self.state, self.state.wall()
        return StoreState(tuple(s.tickets.values()),
                          {k: engine for k, (engine, until) in s.sessions.items() if until > now}, dict(s.serves))

    async def listen(self, handler: Callable[[StoreEvent], None], on_connected: Callable[[], None]) -> None:
        entry = _Listener(self.replica_id, handler, self.expected)
        self.state.listeners.append(entry)
        try:
            on_connected()
            await asyncio.Event().wait()
        finally:
            self.state.listeners.remove(entry)

    def expect_admission(self, ticket_id: str, then: Callable[[], None]) -> None:
        self.expected[ticket_id] = then

    def admission_settled(self, ticket_id: str, written: bool) -> None:
        if not written:
            self.expected.pop(ticket_id, None)
        elif not any(x.replica == self.replica_id for x in self.state.listeners):
            then = self.expected.pop(ticket_id, None)
            if then is not None:
                then()
        # else: its event is on its way to this handle's listener (``publish``), which calls ``then``
