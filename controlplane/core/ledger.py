"""The ledger of admission tickets: every admit creates one, the access log releases it, a lease reaps a lost one.

Pure: no clock reads; every method takes ``now``. Not thread-safe: it lives on the control plane's event loop.

The load the decision core uses for an engine (``fit.effective_load``) is
``max(0, probe(running + waiting) + unseen_load, open tickets)`` where::

    unseen_load = #open tickets admitted at or after the probe was sent
                - #tickets released after the probe was sent that were admitted before it

The first term is what the probe cannot know yet (herding within a burst), the second what finished since the probe.
The open tickets bound it from below: until the access log releases a ticket, its request counts as running, whatever
a lagging probe says. KV gets the same two corrections in tokens (``unseen_reserved_tokens``,
``released_since_probe_tokens``; ``fit.held_tokens``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from operator import itemgetter

from controlplane.core.fleet import EngineLedger
from controlplane.core.model import Ticket

_expected_done = itemgetter(1)
"""The key of ``EngineLedger.running``'s order."""


@dataclass(frozen=True, slots=True)
class _Release:
    admitted_at: float
    released_at: float
    reserved_tokens: int


class Ledger:
    def __init__(self, lease_seconds: float) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        self.lease_seconds = lease_seconds
        self._open: dict[str, Ticket] = {}
        self._by_engine: dict[str, set[str]] = defaultdict(set)
        self._recent_releases: dict[str, list[_Release]] = defaultdict(list)
        self._last_probe: dict[str, float] = {}
        self._guessed: set[str] = set()
        """Open tickets whose expected times rest on the policy's default decode rate (their engine not yet measured):
        ``EngineLedger.guessed_tickets``."""
        self._views: dict[str, EngineLedger] = {}
        """``view`` results, dropped whenever that engine's tickets or probe change (a Check reads every engine's)."""
        self.changed: set[str] = set()
        """Engines whose view changed since a reader last cleared this (the fleet index refreshes only those rows)."""
        self.admitted_total = 0
        self.released_total = 0
        self.expired_total = 0

    def _dirty(self, engine: str) -> None:
        self._views.pop(engine, None)
        self.changed.add(engine)

    def admit(
        self, ticket_id: str, engine: str, model: str, now: float, reserved_tokens: int = 0, expected_done_at: float = 0.0,
        expected_ttft_s: float = 0.0, guessed: bool = False, decode_tokens_per_s: float = 0.0,
    ) -> Ticket:
        """``guessed``: the ticket's expected times rest on the policy's default decode rate (its engine not measured
        yet), so its expected finish may be off by any factor."""
        if ticket_id in self._open:
            raise ValueError(f"ticket {ticket_id} already open")
        ticket = Ticket(ticket_id, engine, model, admitted_at=now, lease_deadline=now + self.lease_seconds,
                        reserved_tokens=reserved_tokens, expected_done_at=expected_done_at or now,
                        expected_ttft_s=expected_ttft_s, decode_tokens_per_s=decode_tokens_per_s)
        self._open[ticket_id] = ticket
        if guessed:
            self._guessed.add(ticket_id)
        self._by_engine[engine].add(ticket_id)
        self._dirty(engine)
        self.admitted_total += 1
        return ticket

    def insert(self, ticket: Ticket) -> bool:
        """A ticket admitted elsewhere (another replica, or this process before a restart), as the shared store holds it:
        counted like one admitted here. False if it is already open."""
        if ticket.ticket_id in self._open:
            return False
        self._open[ticket.ticket_id] = ticket
        self._by_engine[ticket.engine].add(ticket.ticket_id)
        self._dirty(ticket.engine)
        return True

    def retract(self, ticket_id: str) -> Ticket | None:
        """Undo an admission the shared store refused: the ticket never existed (not a release: nothing finished)."""
        ticket = self._open.pop(ticket_id, None)
        if ticket is None:
            return None
        self._guessed.discard(ticket_id)
        self._by_engine[ticket.engine].discard(ticket_id)
        self._dirty(ticket.engine)
        self.admitted_total -= 1
        return ticket

    def tickets(self) -> list[Ticket]:
        return list(self._open.values())

    def release(self, ticket_id: str, now: float) -> Ticket | None:
        """Close a ticket; ``None`` if it is unknown or already closed (a duplicate log entry is harmless)."""
        ticket = self._open.pop(ticket_id, None)
        if ticket is None:
            return None
        self._guessed.discard(ticket_id)
        self._by_engine[ticket.engine].discard(ticket_id)
        self._dirty(ticket.engine)
        self.released_total += 1
        self._note_closed(ticket, now)
        return ticket

    def _note_closed(self, ticket: Ticket, now: float) -> None:
        """Remember a ticket the last probe counted as running that has closed since (its load and KV are gone)."""
        if ticket.admitted_at < self._last_probe.get(ticket.engine, float("-inf")):
            self._recent_releases[ticket.engine].append(_Release(ticket.admitted_at, now, ticket.reserved_tokens))

    def expire(self, now: float) -> list[Ticket]:
        """Reap tickets whose lease ran out (their completion signal was lost). A reaped ticket is presumed finished, so
        like a release it is subtracted from the last probe's gauges when that probe counted it: otherwise the probe's
        ``running`` keeps holding the slot until the next probe arrives (forever, if the engine stops answering)."""
        expired = [t for t in self._open.values() if t.lease_deadline <= now]
        for ticket in expired:
            del self._open[ticket.ticket_id]
            self._guessed.discard(ticket.ticket_id)
            self._by_engine[ticket.engine].discard(ticket.ticket_id)
            self._dirty(ticket.engine)
            self._note_closed(ticket, now)
        self.expired_total += len(expired)
        return expired

    def reap_idle(self, engine: str, probe_sent_at: float, grace: float) -> list[Ticket]:
        """The engine reported nothing running and nothing waiting at ``probe_sent_at``: every ticket admitted more than
        ``grace`` seconds before that has finished, whether or not its access-log entry arrives (Envoy restarted, the log
        stream broke). Reaped now instead of holding capacity until its lease runs out."""
        done = [self._open[t] for t in self._by_engine.get(engine, ()) if self._open[t].admitted_at < probe_sent_at - grace]
        for ticket in done:
            del self._open[ticket.ticket_id]
            self._guessed.discard(ticket.ticket_id)
            self._by_engine[engine].discard(ticket.ticket_id)
        if done:
            self._dirty(engine)
        self.expired_total += len(done)
        return done

    def note_probe(self, engine: str, probe_sent_at: float) -> None:
        """A probe sent at ``probe_sent_at`` now stands for the engine: forget releases it already reflects."""
        if self._last_probe.get(engine) == probe_sent_at:
            return
        self._last_probe[engine] = probe_sent_at
        releases = self._recent_releases[engine]
        if self._by_engine.get(engine) or releases:
            # The view reads the probe's time only through open tickets and recent releases: without either, it is the
            # empty view whatever the time, and neither it nor the engine's index rows need redoing.
            self._dirty(engine)
        if releases:
            self._recent_releases[engine] = [r for r in releases if r.released_at > probe_sent_at]

    def open_tickets(self, engine: str | None = None) -> int:
        if engine is None:
            return len(self._open)
        return len(self._by_engine.get(engine, ()))

    def get(self, ticket_id: str) -> Ticket | None:
        return self._open.get(ticket_id)

    def unseen_load(self, engine: str) -> int:
        probe_at = self._last_probe.get(engine)
        tickets = (self._open[t] for t in self._by_engine.get(engine, ()))
        if probe_at is None:
            return sum(1 for _ in tickets)
        admitted_after = sum(1 for t in tickets if t.admitted_at >= probe_at)
        released_after = sum(
            1 for r in self._recent_releases.get(engine, ()) if r.admitted_at < probe_at < r.released_at
        )
        return admitted_after - released_after

    def view(self, engine: str) -> EngineLedger:
        """The engine's tickets as the decision core reads them (cached until they change). One pass over the tickets: a
        Check at fleet scale redoes the views of the engines admitted to, released from and probed since the last one."""
        cached = self._views.get(engine)
        if cached is not None:
            return cached
        probe_at = self._last_probe.get(engine, float("-inf"))
        tickets = [self._open[t] for t in self._by_engine.get(engine, ())]
        by_model: dict[str, int] = {}
        committed = unseen_tokens = admitted_after = guessed = 0
        for t in tickets:
            by_model[t.model] = by_model.get(t.model, 0) + 1
            guessed += t.ticket_id in self._guessed
            committed += t.reserved_tokens
            if t.admitted_at >= probe_at:  # the probe cannot have seen it (always, before any probe)
                admitted_after += 1
                unseen_tokens += t.reserved_tokens
        released = [r for r in self._recent_releases.get(engine, ()) if r.admitted_at < probe_at < r.released_at]
        running = sorted(((t.admitted_at + t.expected_ttft_s, t.expected_done_at, t.model) for t in tickets),
                         key=_expected_done)
        view = self._views[engine] = EngineLedger(
            open_tickets=len(tickets),
            unseen_load=admitted_after - len(released),
            released_since_probe_tokens=sum(r.reserved_tokens for r in released),
            committed_tokens=committed,
            unseen_reserved_tokens=unseen_tokens,
            open_by_model=tuple(sorted(by_model.items())),
            expected_done=tuple(r[1] for r in running),
            running=tuple(running),
            finishing=tuple(sorted((t.expected_done_at, t.reserved_tokens) for t in tickets)),
            guessed_tickets=guessed,
        )
        return view
