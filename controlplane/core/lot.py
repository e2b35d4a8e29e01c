"""The parking lot as data: per model, one line per priority class, each in parking order. Pure: no I/O, no clock.

A request parks under its id in one line (``PARK_CLASSES``: critical, then standard; a sheddable request never parks)
and leaves it once, by ``take`` (admitted or answered) or ``cancel`` (its client left); ``restore`` puts an entry back
at its place by its parking sequence number, which only grows. The lot also keeps which parked requests were last
decided to wait although a slot was free (``Decision.idle_slot``), with the count of freed slots they were decided at:
while no slot has freed since, requests behind them may pass them (``passing``). Which request goes first is not the
lot's business (admission.py, fairshare.py): it keeps parking order.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Mapping

from controlplane.core.fairshare import ANONYMOUS
from controlplane.core.model import InferenceRequest, Parked, Priority

PARK_CLASSES = (Priority.CRITICAL, Priority.STANDARD)
"""The parking lot's classes, tried in this order; a sheddable request is never parked (it would park as standard)."""

_NOT_PASSABLE = (-1, None)


def class_of(request: InferenceRequest) -> Priority:
    """The line a request parks in."""
    return request.priority if request.priority in PARK_CLASSES else Priority.STANDARD


def tenant_of(request: InferenceRequest) -> str:
    """The tenant fair share and reserved shares count a request for (``ANONYMOUS`` when it names none)."""
    return request.tenant or ANONYMOUS


class ParkingLot:
    """Every parked request, by model and class, and where each one is."""

    def __init__(self) -> None:
        self._lines: dict[str, dict[Priority, deque[Parked]]] = {}
        self._where: dict[str, tuple[str, Priority]] = {}
        self._passable: dict[str, tuple[int, str | None]] = {}
        """Requests last decided to wait although a slot was free: the freed-slot count then, the engine waited for."""
        self._seq = 0

    def queues(self, model: str) -> dict[Priority, deque[Parked]] | None:
        """``model``'s lines (every class), or None if the lot never held a request of it."""
        return self._lines.get(model)

    def line(self, model: str, klass: Priority) -> deque[Parked]:
        """One class's line of ``model`` (empty if it never held one; the empty line is not kept)."""
        return self._lines.get(model, {}).get(klass, deque())

    def models(self) -> list[str]:
        return list(self._lines)

    def next_seq(self) -> int:
        """The parking sequence number the next request to park gets."""
        return self._seq + 1

    def take_seq(self) -> int:
        """Use up ``next_seq`` (a request parked, or was shed at its park)."""
        self._seq += 1
        return self._seq

    def park(self, entry: Parked) -> None:
        """``entry`` joins the back of its line."""
        model, klass = entry.request.model, class_of(entry.request)
        assert model is not None
        self._lines.setdefault(model, {c: deque() for c in PARK_CLASSES})[klass].append(entry)
        self._where[entry.request_id] = (model, klass)

    def restore(self, entry: Parked) -> None:
        """Put ``entry`` back at its place in its line (by its sequence number)."""
        model, klass = entry.request.model, class_of(entry.request)
        assert model is not None
        queue = self._lines.setdefault(model, {c: deque() for c in PARK_CLASSES})[klass]
        queue.insert(sum(1 for p in queue if p.seq < entry.seq), entry)
        self._where[entry.request_id] = (model, klass)

    def take(self, entry: Parked) -> None:
        """``entry`` leaves the lot (admitted, or answered without a slot)."""
        model, klass = self._where.pop(entry.request_id)
        self._lines[model][klass].remove(entry)
        self._passable.pop(entry.request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Drop a parked request (its client left); False if it is not parked."""
        where = self._where.pop(request_id, None)
        self._passable.pop(request_id, None)
        if where is None:
            return False
        queue = self._lines[where[0]][where[1]]
        queue.remove(next(p for p in queue if p.request_id == request_id))
        return True

    def __iter__(self) -> Iterator[Parked]:
        return (p for queues in self._lines.values() for q in queues.values() for p in q)

    def depth(self, model: str | None = None) -> int:
        if model is None:
            return len(self._where)
        return sum(len(q) for q in self._lines.get(model, {}).values())

    def queued_ahead(self, model: str, priority: Priority) -> int:
        """Requests of ``model`` parked in ``priority``'s class or a higher one."""
        queues = self._lines.get(model, {})
        classes = PARK_CLASSES[: PARK_CLASSES.index(priority) + 1] if priority in PARK_CLASSES else PARK_CLASSES
        return sum(len(queues.get(c, ())) for c in classes)

    def higher(self, model: str, klass: Priority) -> int:
        """Requests of ``model`` parked in classes above ``klass``."""
        queues = self._lines.get(model, {})
        return sum(len(queues.get(c, ())) for c in PARK_CLASSES[:PARK_CLASSES.index(klass)])

    def where(self, request_id: str) -> tuple[str, int] | None:
        """A parked request's model and class index (the shared store's name for its line); None if not parked."""
        at = self._where.get(request_id)
        return None if at is None else (at[0], PARK_CLASSES.index(at[1]))

    def lines(self) -> list[tuple[str, int]]:
        """Every (model, class index) the lot has held requests of: the shared lines this replica may have members in."""
        return [(model, PARK_CLASSES.index(klass)) for model, queues in self._lines.items() for klass in queues]

    def backlogged(self, model: str) -> set[str]:
        """The tenants with a request of ``model`` parked."""
        return {tenant_of(p.request) for q in self._lines.get(model, {}).values() for p in q}

    def waiting(self) -> Counter[tuple[str, str]]:
        """Parked requests per (model, tenant)."""
        return Counter((model, tenant_of(p.request)) for model, queues in self._lines.items() for q in queues.values()
                       for p in q)

    def next_of(self, model: str, tenant: str) -> Parked | None:
        """``tenant``'s request of ``model`` served first among its own: its highest class's oldest."""
        for klass in PARK_CLASSES:
            for parked in self._lines.get(model, {}).get(klass, ()):
                if tenant_of(parked.request) == tenant:
                    return parked
        return None

    def note_passable(self, request_id: str, frees: int, waits_for: str | None) -> None:
        """``request_id`` was decided to wait although a slot was free, ``frees`` slots freed so far."""
        self._passable[request_id] = (frees, waits_for)

    def forget_passable(self, request_id: str) -> None:
        self._passable.pop(request_id, None)

    def passable(self, request_id: str, frees: int) -> bool:
        """Whether ``request_id`` declined a free slot and no slot has freed since (``frees`` now)."""
        return self._passable.get(request_id, _NOT_PASSABLE)[0] == frees

    def passing(self, model: str, request: InferenceRequest, frees: int) -> Counter[str] | None:
        """If every request parked ahead of ``request`` (its class and higher) is ``passable``: how many of them wait
        for each engine. Else None (it parks behind them)."""
        queues: Mapping[Priority, deque[Parked]] = self._lines.get(model, {})
        waiting: Counter[str] = Counter()
        for c in PARK_CLASSES[: PARK_CLASSES.index(class_of(request)) + 1]:
            for p in queues.get(c, ()):
                at, engine = self._passable.get(p.request_id, _NOT_PASSABLE)
                if at != frees:
                    return None
                if engine is not None:
                    waiting[engine] += 1
        return waiting
