"""Preemption of sheddable work (``fairness.preempt_sheddable``, decision 0028). Pure: no I/O, no clock.

A critical request that shed early would refuse (its expected start is past its bound) may end running sheddable
streams instead, when all of these hold:

- the option is on and fewer than ``preempt_max_per_minute`` preemptions happened in the last 60 s (an
  ``EventWindow`` the core keeps);
- an engine serving its model misses it only for ``cap`` and/or ``kv_need`` (fit.py), and runs sheddable streams this
  replica can end (``Preemptible``: admitted sheddable, their ext_proc stream attached here, not marked already);
- ending the first k of them, least work lost first, lets it fit there::

      load - k < cap    and    held - sum(reserved_tokens of the k) + need <= kv_capacity x kv_high_watermark
      work lost (a stream) = max(0, now - admitted_at - expected_ttft_s) x decode_tokens_per_s
                             (its seconds since admission when the admission had no decode rate)

The engine needing the fewest victims wins (then the least work lost, then its name). The critical request parks
(``preempting``) and takes the slot the victims free. Critical and standard streams are never victims.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from controlplane.core.fit import effective_load, held_tokens, misfits, need_tokens
from controlplane.core.fleet import Fleet
from controlplane.core.model import InferenceRequest, Reason, Ticket
from controlplane.core.policy import Policy

RELIEVABLE = frozenset({Reason.CAP, Reason.KV_NEED})
"""The misfits that ending streams on an engine removes (the others, a probe's KV gauge or a box's pool, lag it)."""


@dataclass(frozen=True, slots=True)
class Preemption:
    """Streams to end so that parked request ``request_id`` can start on ``engine``; what the shell carries out."""

    request_id: str
    model: str
    engine: str
    victims: tuple[Ticket, ...]
    retry_after_s: int
    """What each victim's client is told to wait before it tries again."""


def work_lost(ticket: Ticket, now: float) -> float:
    """Tokens a stream has produced by ``now``, as its admission expected (module docstring)."""
    elapsed = max(0.0, now - ticket.admitted_at)
    if ticket.decode_tokens_per_s <= 0:
        return elapsed
    return max(0.0, elapsed - ticket.expected_ttft_s) * ticket.decode_tokens_per_s


def choose_victims(request: InferenceRequest, fleet: Fleet, policy: Policy, now: float,
                   preemptible: Iterable[Ticket]) -> tuple[str, tuple[Ticket, ...]] | None:
    """The engine and the streams to end there so that ``request`` fits (module docstring), or None."""
    model = request.model
    assert model is not None
    by_engine: dict[str, list[Ticket]] = {}
    for ticket in preemptible:
        by_engine.setdefault(ticket.engine, []).append(ticket)
    need = need_tokens(request, policy)
    best: tuple[int, float, str, tuple[Ticket, ...]] | None = None
    for engine in fleet.engines:
        running = by_engine.get(engine.name)
        if not running or not engine.serves(model) or engine.drained or (engine.stale and not fleet.admit_stale):
            continue
        missing = set(misfits(engine, request, fleet, policy))
        if not missing or not missing <= RELIEVABLE:
            continue
        load, held = effective_load(engine, fleet), held_tokens(engine, fleet)
        budget = engine.kv_capacity_tokens * policy.kv_high_watermark if engine.kv_capacity_tokens else None
        chosen: list[Ticket] = []
        freed = 0
        for ticket in sorted(running, key=lambda t: (work_lost(t, now), t.ticket_id)):
            chosen.append(ticket)
            freed += ticket.reserved_tokens
            if (engine.cap is None or load - len(chosen) < engine.cap) and \
                    (budget is None or held - freed + need <= budget):
                key = (len(chosen), sum(work_lost(t, now) for t in chosen), engine.name, tuple(chosen))
                if best is None or key[:3] < best[:3]:
                    best = key
                break
    return None if best is None else (best[2], best[3])


class Preemptible:
    """Which open tickets may be ended, and which are being ended for whom.

    A ticket is preemptible while it is a sheddable admission (``admitted``) whose stream the shell can end
    (``attach``, until ``detach``) and no parked request waits for it already (``mark``). A parked request that
    waits for its victims (``awaiting``) is not shed early until every one of them is closed."""

    def __init__(self) -> None:
        self._sheddable: set[str] = set()
        self._attached: set[str] = set()
        self._for: dict[str, tuple[str, ...]] = {}
        """Parked request -> the tickets ended for it."""
        self._marked: set[str] = set()

    def admitted(self, ticket_id: str) -> None:
        self._sheddable.add(ticket_id)

    def attach(self, ticket_id: str) -> bool:
        """The shell holds ``ticket_id``'s stream; False (ignored) unless it is a sheddable admission."""
        if ticket_id not in self._sheddable:
            return False
        self._attached.add(ticket_id)
        return True

    def detach(self, ticket_id: str) -> None:
        self._attached.discard(ticket_id)

    def closed(self, ticket_id: str) -> None:
        """The ticket is closed (released, reaped, retracted)."""
        self._sheddable.discard(ticket_id)
        self._attached.discard(ticket_id)
        self._marked.discard(ticket_id)

    def candidates(self, open_ticket: Iterable[Ticket | None]) -> list[Ticket]:
        """The open tickets among ``open_ticket`` (the ledger's lookups of ``attached``) not marked."""
        return [t for t in open_ticket if t is not None and t.ticket_id not in self._marked]

    @property
    def attached(self) -> frozenset[str]:
        return frozenset(self._attached & self._sheddable)

    def mark(self, request_id: str, victims: tuple[Ticket, ...]) -> None:
        for done in [r for r, ids in self._for.items() if not any(t in self._marked for t in ids)]:
            del self._for[done]  # every victim closed: nothing left to wait for (bounded by the rate bound anyway)
        ids = tuple(t.ticket_id for t in victims)
        self._for[request_id] = ids
        self._marked.update(ids)

    def awaiting(self, request_id: str) -> bool:
        """Whether ``request_id`` still waits for a victim ended for it (forgotten once every one is closed)."""
        ids = self._for.get(request_id)
        if ids is None:
            return False
        if any(t in self._marked for t in ids):
            return True
        del self._for[request_id]
        return False
