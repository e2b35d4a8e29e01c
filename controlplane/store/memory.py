"""The in-process ``Store``: today's single control plane, and several ``AdmissionCore``s in one process in tests.

One ``MemoryState`` is the shared ledger; each ``MemoryStore`` is one replica's handle on it. Every operation is applied at
once (no suspension), so for a single replica the port costs a few dictionary writes per admission. Events reach the other
handles' listeners on the next turn of the event loop, as they would from a server. Nothing survives the process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.core.model import Ticket
from controlplane.store.base import (
    Claim, EventKind, QueueRule, Refusal, Reserved, StoreEvent, StoreState, member,
)

SESSION_TTL_S = 3600.0


@dataclass
class MemoryState:
    """The ledger every ``MemoryStore`` handle of one process shares."""

    wall: Callable[[], float] = time.time
    tickets: dict[str, tuple[Ticket, str]] = field(default_factory=dict)
    by_engine: dict[str, set[str]] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    lines: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    """(model, class) -> member -> sequence number, in line order (insertion order is sequence order)."""
    firsts: dict[tuple[str, int], dict[str, tuple[str, float]]] = field(default_factory=dict)
    """(model, class) -> request id -> (the replica whose member it is, when the request first parked): one entry per
    member of ``lines``."""
    seq: int = 0
    sessions: dict[str, tuple[str, float]] = field(default_factory=dict)
    replicas: dict[str, float] = field(default_factory=dict)
    """replica -> the wall-clock time its heartbeat lapses."""
    listeners: list[tuple[str, Callable[[StoreEvent], None]]] = field(default_factory=list)

    def alive(self, replica: str) -> bool:
        return self.replicas.get(replica, float("-inf")) > self.wall()

    def publish(self, event: StoreEvent) -> None:
        for replica, handler in list(self.listeners):
            if replica != event.replica:
                asyncio.get_running_loop().call_soon(handler, event)

    def first(self, model: str, klass: int, newest: bool = False) -> str | None:
        """The line's oldest (or newest) member held by a live replica; dead replicas' members are dropped on the way."""
        line = self.lines.get((model, klass))
        while line:
            candidate = next(reversed(line)) if newest else next(iter(line))
            replica, _, request_id = candidate.partition("|")
            if self.alive(replica):
                return candidate
            self.leave(model, klass, replica, request_id)
        return None

    def leave(self, model: str, klass: int, replica: str, request_id: str) -> bool:
        """Take ``replica``'s member of ``request_id`` out of the line; False if it was not there."""
        if self.lines.get((model, klass), {}).pop(member(replica, request_id), None) is None:
            return False
        firsts = self.firsts.get((model, klass), {})
        if firsts.get(request_id, ("", 0.0))[0] == replica:
            del firsts[request_id]
        return True


class MemoryStore:
    def __init__(self, state: MemoryState | None = None, replica_id: str = "r0") -> None:
        self.state = state or MemoryState()
        self.replica_id = replica_id

    async def open(self) -> None:
        self.state.replicas[self.replica_id] = float("inf")  # a handle is alive until close() (or a heartbeat says)

    async def close(self) -> None:
        self.state.replicas.pop(self.replica_id, None)

    async def reserve(self, claim: Claim) -> Reserved:
        s, ticket = self.state, claim.ticket
        if ticket.ticket_id in s.tickets:
            return Reserved(Refusal.EXISTS)
        mine = member(self.replica_id, ticket.ticket_id)
        if claim.queue is not QueueRule.NONE:
            higher = claim.klass if claim.queue is not QueueRule.ARRIVAL else claim.klass + 1
            if any(s.first(ticket.model, k) is not None for k in range(higher)):
                return Reserved(Refusal.QUEUED)
            if claim.queue is not QueueRule.ARRIVAL:
                head = s.first(ticket.model, claim.klass, newest=claim.queue is QueueRule.NEWEST)
                if head is not None and head != mine:
                    return Reserved(Refusal.QUEUED)
        open_ids = s.by_engine.get(ticket.engine, set())
        if claim.cap is not None and len(open_ids) >= claim.cap:
            return Reserved(Refusal.CAP, self._engine_tickets(ticket.engine))
        if claim.kv_limit is not None and s.kv.get(ticket.engine, 0) + ticket.reserved_tokens > claim.kv_limit:
            return Reserved(Refusal.KV, self._engine_tickets(ticket.engine))
        self._write(ticket, self.replica_id)
        if not s.leave(ticket.model, claim.klass, self.replica_id, ticket.ticket_id):
            held = s.firsts.get((ticket.model, claim.klass), {}).get(ticket.ticket_id)
            if held is not None:  # parked by a replica it left when its Check was asked again elsewhere
                s.leave(ticket.model, claim.klass, held[0], ticket.ticket_id)
        if claim.session:
            s.sessions[claim.session] = (ticket.engine, s.wall() + SESSION_TTL_S)
        s.publish(StoreEvent(EventKind.ADMITTED, self.replica_id, ticket.ticket_id, ticket, claim.session,
                             ticket.model, claim.prefix_blocks))
        return Reserved()

    def _engine_tickets(self, engine: str) -> tuple[Ticket, ...]:
        return tuple(self.state.tickets[t][0] for t in sorted(self.state.by_engine.get(engine, ())))

    def _write(self, ticket: Ticket, owner: str) -> None:
        s = self.state
        s.tickets[ticket.ticket_id] = (ticket, owner)
        s.by_engine.setdefault(ticket.engine, set()).add(ticket.ticket_id)
        s.kv[ticket.engine] = s.kv.get(ticket.engine, 0) + ticket.reserved_tokens

    def _close(self, ticket_id: str) -> Ticket | None:
        s = self.state
        held = s.tickets.pop(ticket_id, None)
        if held is None:
            return None
        ticket = held[0]
        s.by_engine[ticket.engine].discard(ticket_id)
        s.kv[ticket.engine] -= ticket.reserved_tokens
        s.publish(StoreEvent(EventKind.RELEASED, self.replica_id, ticket_id, ticket, model=ticket.model))
        return ticket

    async def release(self, ticket_id: str) -> Ticket | None:
        return self._close(ticket_id)

    async def expire(self, now: float, limit: int = 256) -> list[Ticket]:
        due = sorted((t.lease_deadline, t.ticket_id) for t, _ in self.state.tickets.values() if t.lease_deadline <= now)
        return [t for _, ticket_id in due[:limit] if (t := self._close(ticket_id)) is not None]

    async def restore(self, tickets: list[Ticket]) -> int:
        fresh = [t for t in tickets if t.ticket_id not in self.state.tickets]
        for ticket in fresh:
            self._write(ticket, self.replica_id)
        return len(fresh)

    async def park(self, model: str, klass: int, request_id: str, at: float) -> float:
        s = self.state
        first = at
        held = s.firsts.get((model, klass), {}).get(request_id)
        if held is not None and held[0] != self.replica_id and s.leave(model, klass, held[0], request_id):
            first = held[1]
            s.publish(StoreEvent(EventKind.UNPARKED, self.replica_id, request_id, model=model))
        s.seq += 1
        s.lines.setdefault((model, klass), {})[member(self.replica_id, request_id)] = s.seq
        s.firsts.setdefault((model, klass), {})[request_id] = (self.replica_id, first)
        return first

    async def unpark(self, model: str, klass: int, request_id: str) -> bool:
        if not self.state.leave(model, klass, self.replica_id, request_id):
            return False
        self.state.publish(StoreEvent(EventKind.UNPARKED, self.replica_id, request_id, model=model))
        return True

    async def members(self, model: str, klass: int) -> list[str]:
        mine = member(self.replica_id, "")
        return [m[len(mine):] for m in self.state.lines.get((model, klass), {}) if m.startswith(mine)]

    async def heartbeat(self, ttl_s: float) -> None:
        self.state.replicas[self.replica_id] = self.state.wall() + ttl_s

    async def load(self) -> StoreState:
        s, now = self.state, self.state.wall()
        return StoreState(tuple(s.tickets.values()),
                          {k: engine for k, (engine, until) in s.sessions.items() if until > now})

    async def listen(self, handler: Callable[[StoreEvent], None], on_connected: Callable[[], None]) -> None:
        entry = (self.replica_id, handler)
        self.state.listeners.append(entry)
        try:
            on_connected()
            await asyncio.Event().wait()
        finally:
            self.state.listeners.remove(entry)
