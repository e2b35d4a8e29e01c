"""The ``Store`` port: the state that must outlive a control-plane process or be shared by several (issue 11).

It holds tickets (engine, model, reserved KV, expected finish, lease, owner) and each engine's open tickets and KV; the
parking line per model and class across replicas (a member is ``<replica>|<request id>``: only its place is shared),
each member's first-park time and its claim (``Claim``); sessions, with a TTL; each engine's decayed recent-serve count;
which replicas are alive. Recent-serve counts, the prefix index and learned rates are otherwise derived by every
replica from the events it hears (``StoreEvent``) and its own probes.

Invariants: ``reserve`` is the one place a ticket comes into being, checking the engine's cap, its reserved KV and the
request's place in line (``QueueRule``) and writing in one atomic step, so caps and KV hold exactly with any number of
replicas whatever their mirrors' lag. The store admits a line's heads on their fresh claims in line order only (a claim
never overtakes). A dead replica's members leave every line at once; its tickets stay (``reap``). Times are shared
time, seconds since the epoch (``SharedClock`` converts at this port). ``memory.py`` and ``valkey.py`` run one contract
suite (``tests/unit/test_store_contract.py``); the design in full: docs/architecture.md, Replicas and the shared store.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# QueueRule is defined beside the core that chooses it; the store checks it (re-exported for the backends).
from controlplane.core.model import QueueRule as QueueRule, Ticket
from controlplane.core.fairshare import FairCounters as FairCounters


LINE_CLASSES = 2
"""Parking classes, each a line per model (index 0 critical, 1 standard: the core's ``PARK_CLASSES``); a line's heads
are admitted on claims class by class, a higher class's head holding the lower ones."""

DEAD_FIRSTS_S = 60.0
"""How long a dead replica's members' first-park times are kept for their Checks that Envoy asks again elsewhere."""


class StoreUnavailable(Exception):
    """The store could not be reached or did not answer in time; the caller applies ``store.on_failure``."""


@dataclass(frozen=True, slots=True)
class Claim:
    """A request a replica decided to admit, as ``reserve`` checks and writes it (times in shared time).

    Left with a member the store refused for the line alone (``Refusal.QUEUED``: it fitted, someone was ahead), it is
    that member's *claim*: whenever the line or capacity changes (every ``reserve``, ``release``, expiry, ``park``,
    ``unpark`` and a dead replica's removal) the store admits the line's heads on their claims, in line order (critical
    before standard), while the head's claim is fresh (``fresh_s``) and fits the engine's cap, KV and adapter slots
    exactly; it stops at the first head that has none, or whose claim does not fit (kept while fresh). Each such
    admission is a ``CLAIMED`` event every replica hears, the one holding the Check too. A ``reserve`` that takes a
    member out of line drops its claim."""

    ticket: Ticket
    cap: int | None
    """The engine's concurrency cap (None: not checked)."""
    kv_limit: int | None
    """KV tokens the engine's open tickets may reserve together: capacity x high watermark (None: not checked)."""
    session: str | None = None
    queue: QueueRule = QueueRule.NONE
    klass: int = 1
    """The request's parking class: an index into ``PARK_CLASSES`` (0 critical, 1 standard)."""
    prefix_blocks: tuple[int, ...] = ()
    """The prompt's block hashes (core/prefix.py), passed on in the admission's event (and kept with a claim)."""
    fresh_s: float = 0.0
    """A ``reserve`` refused only for the line (``QUEUED``) of a request already in it leaves this claim with its member
    for this long (0: none)."""
    serve_half_life_s: float = 0.0
    """The half-life of recent-serve counts (``admission.serve_half_life_seconds``): an admission adds one to its
    engine's shared count, decayed with it (0: not counted)."""
    charge: FairCharge | None = None
    """Fair share in the store (decision 0025): the written admission adds ``charge.cost`` to its tenant's counter for
    the model in the same step, and the store keeps the charge for ``Store.settle`` (None: nothing charged)."""
    adapter_slots: int | None = None
    """The engine's LoRA adapter slots, for a ticket whose model is an adapter (None: not checked): refused
    ``ADAPTER_SLOTS`` when the engine's open tickets already use that many distinct adapters, none of them this one."""
    plain_models: tuple[str, ...] = ()
    """The engine's models that are not adapters (base models): their tickets hold no adapter slot."""


@dataclass(frozen=True, slots=True)
class FairCharge:
    """What an admission adds to its tenant's virtual token counter (core/fairshare.py), with the weights that priced
    it, so that ``Store.settle`` can price the real usage on any replica: ``(prompt_weight x prompt + output_weight x
    output) / weight``, the formula of ``FairShare.cost``, computed in the same order."""

    tenant: str
    cost: float
    prompt_weight: float
    output_weight: float
    weight: float

    def priced(self, prompt_tokens: float, output_tokens: float) -> float:
        return (self.prompt_weight * prompt_tokens + self.output_weight * output_tokens) / self.weight


class Refusal(enum.StrEnum):
    CAP = "cap"
    KV = "kv"
    QUEUED = "queued"
    EXISTS = "exists"
    ADAPTER_SLOTS = "adapter_slots"
    """Every adapter slot of the engine is held by open tickets of other adapters (``Claim.adapter_slots``)."""
    UNAVAILABLE = "unavailable"
    """Never from a store: the admission service's own answer when the store cannot be reached (``on_failure: closed``)."""


@dataclass(frozen=True, slots=True)
class Reserved:
    refusal: Refusal | None = None
    engine_tickets: tuple[Ticket, ...] = ()
    """On a CAP, KV or ADAPTER_SLOTS refusal: every open ticket of the engine, as the store holds them (the caller's
    mirror catches up)."""
    counters: FairCounters | None = None
    """On a QUEUED refusal of a ``FAIR`` or ``FAIR_NEWEST`` admission: the model's counters as the store holds them (the
    caller's lot learns them and decides again)."""

    @property
    def ok(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True, slots=True)
class LineChange:
    """One change to a shared line, as ``Store.change_lines`` applies it: this replica's park of ``request_id`` in the
    line ``(model, klass)`` (as ``Store.park``: ``at`` now in shared time, ``claim`` left with its member), or, with
    ``unpark``, its removal (as ``Store.unpark``). ``offer``: the park is first offered as an arrival (``reserve`` with
    it, its ``queue`` ``ARRIVAL``): admitted, the request does not park; refused for the line alone (``QUEUED``), it
    parks with ``claim``; refused otherwise (CAP, KV, EXISTS), it parks without one."""

    model: str
    klass: int
    request_id: str
    at: float = 0.0
    claim: Claim | None = None
    offer: Claim | None = None
    unpark: bool = False
    tenant: str | None = None
    """The parked request's tenant when fair share is the store's (decision 0025): lifted as ``Store.park`` says."""
    lift_credit: float = 0.0
    """How far below the backlogged minimum that lift may leave the tenant (``Store.park``)."""


@dataclass(frozen=True, slots=True)
class Landed:
    """What a ``LineChange`` did: a park's first-park time (``Store.park``'s answer; None when its offer was admitted
    instead), its offer's answer (None without an offer), or whether an unpark took a member out (``left``)."""

    first_parked_at: float | None = None
    offered: Reserved | None = None
    left: bool = False


class EventKind(enum.StrEnum):
    ADMITTED = "admitted"
    RELEASED = "released"
    UNPARKED = "unparked"
    """A parked request left the line (admitted, shed, cancelled): a replica whose head waited behind it may go."""
    CLAIMED = "claimed"
    """A parked request the store admitted on its claim: ``replica`` holds its Check; every replica hears it, that one
    too (it answers the Check with ``ticket``; the others learn the ticket as an admission)."""
    DEAD = "dead"
    """``replica``'s heartbeat lapsed: its members left every line. Every replica hears it (each wakes its lot)."""


@dataclass(frozen=True, slots=True)
class StoreEvent:
    kind: EventKind
    replica: str
    """The replica whose action this was (a replica ignores its own events), or, for ``CLAIMED`` and ``DEAD``, the
    replica it is about (every replica hears those)."""
    ticket_id: str
    ticket: Ticket | None = None
    """ADMITTED, CLAIMED: the new ticket (shared time); RELEASED: the closed one."""
    session: str | None = None
    model: str = ""
    prefix_blocks: tuple[int, ...] = ()
    """ADMITTED: the prompt's block hashes, for every replica's prefix index."""


@dataclass(frozen=True, slots=True)
class StoreState:
    """What a (re)starting replica reads: every open ticket and its owner, the live sessions, and each engine's
    recent-serve count with when it was last admitted to (shared time)."""

    tickets: tuple[tuple[Ticket, str], ...]
    sessions: Mapping[str, str]
    serves: Mapping[str, tuple[float, float]] = field(default_factory=dict)


class Store(Protocol):
    """The shared ledger. Every method may raise ``StoreUnavailable``. A ``reserve`` that admits a request takes it out
    of its line, whichever replica's member it is (one that parked it before its Check was asked again elsewhere)."""

    replica_id: str

    async def open(self) -> None:
        """Join the store, alive for a few seconds (``start_liveness`` keeps it so); members a former process of this
        replica id left in any line are removed (their Checks died with it)."""
    async def close(self) -> None: ...
    async def reserve(self, claim: Claim) -> Reserved: ...
    async def release(self, ticket_id: str) -> Ticket | None:
        """Close a ticket, whoever admitted it; ``None`` if it is unknown (already released, expired, never stored)."""
    async def expire(self, now: float, limit: int = 256) -> list[Ticket]:
        """Close tickets whose lease ended by ``now`` (shared time), at most ``limit`` per call; each goes to one caller."""
    async def restore(self, tickets: list[Ticket]) -> int:
        """Write back tickets this replica owns that the store lacks (after a store outage), without checks; how many."""
    async def park(self, model: str, klass: int, request_id: str, at: float, claim: Claim | None = None,
                   tenant: str | None = None, lift_credit: float = 0.0) -> float:
        """Put ``request_id`` at the back of the line ``(model, klass)`` as this replica's member; ``at``: now, in
        shared time. Returns when the request first parked: ``at``, or, when another replica's member of the same
        request id is in that line (Envoy asked the request's Check again of this replica after that one went away:
        resources/listener.py ``_check_retry``) or was until that replica was found dead, the time that member parked; that
        member leaves the line (an UNPARKED event), so the request is in line once, at the back. ``claim``: the
        admission the store refused it for the line alone, left with its member for ``claim.fresh_s``. ``tenant`` (fair
        share in the store): the member counts for its tenant, which, with no member of that tenant parked for the
        model in any class, is first lifted to the lowest counter among the model's backlogged tenants (none: the
        counter of the tenant charged last) less ``lift_credit``, never lowered (decision 0015's lift, over every
        replica's members; the credit: decision 0031)."""
    async def settle(self, ticket_id: str, prompt_tokens: int, output_tokens: int) -> float | None:
        """What an admission charged with ``Claim.charge`` really used (the access log, on whichever replica): its
        tenant's counter moves by ``charge.priced(usage) - charge.cost``, returned; None when the store holds no charge
        for it (charged nothing, settled already, or its lease lapsed: the estimate stands)."""
    async def counters(self, model: str) -> FairCounters:
        """The model's tenant counters as the store holds them."""
    async def claim(self, model: str, klass: int, claims: Sequence[tuple[str, Claim]]) -> None:
        """Leave each claim with this replica's member of its request id in the line ``(model, klass)`` for its
        ``fresh_s`` (a request not in that line is skipped); then the line's heads go on their claims (``Claim``)."""
    async def unpark(self, model: str, klass: int, request_id: str) -> bool:
        """Take a request out of the line (its claim too); False if it was not there (admitted, or unparked before)."""
    async def change_lines(self, changes: Sequence[LineChange]) -> list[Landed]:
        """Apply ``changes`` in their order, each atomic against every replica's calls as ``park``, ``unpark`` and
        ``reserve`` are, in one round trip; one ``Landed`` per change, in order. A batch the store fails midway raises
        ``StoreUnavailable`` (the changes before the failure may have landed, as separate calls' would)."""
    async def members(self, model: str, klass: int) -> list[str]:
        """Request ids this replica holds in the line ``(model, klass)``, oldest first (the line audit's view)."""
    async def heartbeat(self, ttl_s: float) -> None:
        """This replica is alive for ``ttl_s`` more seconds (``start_liveness`` renews it from then on)."""
    async def reap(self) -> list[str]:
        """Remove every replica whose heartbeat lapsed; returns their ids. Its members leave every line at once, with
        their claims (a ``DEAD`` event each; their first-park times are kept ``DEAD_FIRSTS_S`` for Checks Envoy asks again
        elsewhere), then those lines move on claims. Its tickets stay: their streams may still run, and the access log
        releases them. A ``reserve`` that meets a dead member at a line's head removes its replica the same way."""
    def start_liveness(self, every_s: float, lapse_s: float, on_lapsed: Callable[[], None]) -> None:
        """Until ``close``: renew this replica's heartbeat every ``every_s`` with a lapse of ``lapse_s``, and ``reap``
        after each renewal, from a thread of its own (a busy event loop does not make a live replica look dead).
        ``on_lapsed`` is called (from any thread) when a renewal finds this replica's own heartbeat had lapsed
        meanwhile (beats held up past the lapse, or the store lost its data): the caller puts its parked requests back
        in line, at the back, in its lot's order."""
    async def load(self) -> StoreState: ...
    async def listen(self, handler: Callable[[StoreEvent], None], on_connected: Callable[[], None]) -> None:
        """Deliver every other replica's events to ``handler`` until cancelled (reconnecting when the store comes back;
        ``on_connected`` each time the subscription is (re)established, so the caller can resynchronise)."""
    def expect_admission(self, ticket_id: str, then: Callable[[], None]) -> None:
        """Call ``then`` when ``listen`` hands on this replica's own admission of ``ticket_id`` (own events go to no
        handler): right after that event, before the next one. Asked before the ``reserve`` that may write it, so the
        request is answered in the store's order among the admissions answered from the stream (claimed ones), whether
        the event or the ``reserve``'s reply comes first. ``admission_settled`` says what the ``reserve`` did."""
    def admission_settled(self, ticket_id: str, written: bool) -> None:
        """The ``reserve`` behind ``expect_admission(ticket_id, ...)`` returned: not ``written``, the expectation is
        dropped; written but not heard yet, ``then`` is called once it is, or at once when not listening, or after the
        store's call timeout (a stream that lost events is resynchronised anyway)."""


def member(replica: str, request_id: str) -> str:
    """A parked request's member in a shared line: which replica holds its Check, and its id."""
    return f"{replica}|{request_id}"


@dataclass(frozen=True, slots=True)
class SharedClock:
    """Converts the admission service's monotonic seconds to shared (epoch) seconds and back; the offset is read once."""

    offset: float

    @staticmethod
    def here(monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> SharedClock:
        return SharedClock(wall() - monotonic())

    def to_shared(self, ticket: Ticket) -> Ticket:
        return _shifted(ticket, self.offset)

    def to_local(self, ticket: Ticket) -> Ticket:
        return _shifted(ticket, -self.offset)


def _shifted(ticket: Ticket, offset: float) -> Ticket:
    """``ticket`` with its times moved by ``offset``. Built directly, not with ``dataclasses.replace`` (which looks up
    every field by name): every admission converts its ticket."""
    return Ticket(ticket.ticket_id, ticket.engine, ticket.model, ticket.admitted_at + offset,
                  ticket.lease_deadline + offset, ticket.reserved_tokens, ticket.expected_done_at + offset,
                  ticket.expected_ttft_s, ticket.decode_tokens_per_s)
