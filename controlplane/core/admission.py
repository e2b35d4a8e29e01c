"""Admission as a sans-I/O state machine: the ledger, the parking lot and ``decide`` in one place, time passed in.

The gRPC shell calls ``check`` for every request and gets back an ``Outcome``: admitted (with its ticket), parked (the shell
holds the Check open until ``wake``/``expire_parked`` returns an outcome for that id, or the client leaves and the shell calls
``cancel``), or answered (refused, shed, the model list). ``release`` (access log), ``expire_leases`` (lease TTL) and new probes
free capacity; each returns the parked requests it could admit, in order. Every ticket event goes through this class
(``check``, ``release``, ``note_probe``'s idle reaping, ``expire_leases``), and so does a reload (``set_policy``): the shell
never writes to the ledger itself. ``wake`` takes the fleet as data and, after each admission, replaces it with
``refreshed(fleet, now)`` (an indexed fleet is re-snapshotted). ``record_output`` (access log: a finished
request's completion tokens) teaches the core how long each model's answers really are (output_length.py); every fleet the
core builds carries those means so time estimates use them.

Prefix cache (prefix.py): every admission notes the prompt's blocks against its engine in ``prefixes``, and every decision
gets, for its request, the prompt tokens each engine is expected to hold (``expected_cached``) and, for a prefix some
engine holds, the prompt tokens each would evict to cache it (``expected_displaced``, affinity.py). Another replica's
admission is noted too when its event carries the blocks (``learn``). ``note_cache_view`` keeps each engine's capacity and
forgets an engine that restarted (a counter went backwards) or was drained; a reload that changes the block size starts
an empty index (old hashes would never match again).

Parking lot: per model, one FIFO per priority class (critical, then standard). The heads are tried in that order each wake;
the first head that does not fit stops its model's wake (strict FIFO within a class, and critical before standard).
**Fair share** (``policy.fairness``, core/fairshare.py; on by default when tenants are configured): within a class the
head is instead the oldest request of the tenant with the lowest virtual token counter (``_order``), every admission
charges its tenant's counter with its estimate (``settle_usage`` corrects it from the access log, ``retract`` gives it
back), and a tenant parking with nothing parked is lifted to the backlogged minimum; a fair wake admits with
``QueueRule.CLASS`` (its order within the class is this lot's). "Ahead", "head" and "in its turn" below then mean the
fair order (``_order``: the projection that charges each pick its estimate in turn); off, everything is as written.
**Reserved shares** (``policy.fairness.reserved``, core/reserve.py): every admission (arrival, wake, backfill) of a
tenant's request must leave the free slots held for other tenants (``_may_take``; refused: it parks
``reserved_share``), and a wake first serves the tenants owed slots (``_wake_reserved``), before the classes. A head
that waits although a slot is free (``Decision.idle_slot``: it finishes sooner on a busy engine, such as the one holding its
prompt's prefix, or no free engine meets its deadline) does not hold the line for that slot: the wake passes it over (at
most ``backfill_scan`` a wake), and an arrival whose every request ahead was last decided that way, with no slot freed
since (``_frees``: a freed slot may be the one they wait for, and the wake that follows decides them first), is decided
as if first: it takes a slot they refused, or parks at the back.

**Shed early** (``shed_decision_s``, ``admission.shed_decision_seconds``, default 1 s). A parked request may be shed for
its bound only inside its decision window, its first ``shed_decision_s`` in the lot (less ``ANSWER_MARGIN_S``, so that
the answer reaches its client within the window); past it the request is committed.
When it parks (``_park``) and at every park sweep inside the window (``expire_parked``) the core estimates when it would
start (``waits.expected_start``: its place in line, every request of its class or a higher one parked before it,
taking the candidate engines' slots as they free, route.expected_frees for the running ones, then one service of its
shape each) and, if that is past its bound, sheds it at once with the estimate as its Retry-After (``_too_late``):

- with a TTFT deadline (``Parked.ttft_bound``), its park limit, the planned deadline less the prefill
  (``ttft_unmeetable``);
- without, ``_wait_bound_s`` counted from when it parked (``overloaded``; ``park_timeout`` when that is ``max_park_s``):
  the overload bound (``overload_bound_s``: ``overload_shed_after_ms``, or ``overload_shed_services`` of the model's
  recent service times if that is longer; a wait that long is an overload, not a burst's queue), tightened while the
  class's line stands (it holds a committed request: it has not drained within a window) to ``lifo_after_ms``, the
  TTFT clients count as good, or ``STANDING_SERVICES`` of the model's service times if that is longer. A committed line
  is served in order, so under a sustained overload every request it keeps waits about its bound: held to a good TTFT,
  the requests served meet it and the others are told at once.

A committed request is never shed for its bound again. It is served in its turn, before every request that parked after
it (adaptive LIFO, below, reorders only a class none of whose requests is committed; under fair share, before every
later request of its own tenant, while a tenant with a lower counter may go first: fairshare.py says why that wait is
bounded), except that a wake passes over a head that declines a free slot, as above. A committed request whose TTFT
deadline passes is not shed either: its wakes decide it without the deadline, and its client gets the answer late
rather than a 503 after its wait (a client for which a late answer is worthless closes the connection: the Check is
cancelled and the request leaves the lot). What still
answers a committed request without a slot: ``max_park_s`` (``park_timeout``, the backstop: a Check must be answered
before Envoy's times out; reaching it means the estimate that committed the request was wrong by that much, an engine
stalled or answers ran far past their expected length), and a wake that finds the fleet can no longer serve it at all
(every engine drained, below a raised floor, the model gone). ``shed_decision_s`` 0: decided at arrival only.
Failure modes: estimates err. One too late refuses a request that would have started in time (the price of telling
early); one too early commits a request that then waits past its bound (served late, not refused late). An estimate
that rests on the policy's default decode rate (an engine neither measured yet nor given an anchor:
``StartEstimate.known``) refuses nobody, since it may be off by any factor: the request waits, and is committed after
its window. So does one that counts a ticket admitted before its engine was measured (``guessed_tickets``: it keeps
the expected finish it was admitted with until it closes): a burst on a fresh fleet is not refused on the default
rate's figures once the first probe has measured the engines. With several replicas a request's place in line counts its own replica's lot (and, at arrival, ``ahead_elsewhere``), so its estimate
leaves out the others' parked requests.

Adaptive LIFO (``lifo_after_ms``, default 2000; 0 = strict FIFO always): when a class's oldest parked request has waited
longer than that (or longer than ``lifo_deadline_fraction`` of its own TTFT deadline, off by default) at a wake, and
none of the class is committed, the wake serves that class newest first (its "head" is the newest request; still
critical before standard, still head-of-line: a newest request that does not fit stops the wake). Newest-first lets
fresh requests start within their latency while the ones already late wait; shedding early does that by refusing the
late ones at once, and a committed request must not wait behind newer ones. With the default window (1 s) shorter than
the threshold (2 s) a class with a request past the threshold always holds a committed one, so the lot is FIFO; LIFO
reorders only with a window longer than the threshold, among requests still inside it.

Depth is bounded per model by ``max_queue_depth``: a request beyond it is shed (``queue_full``). Inside its window, a
parked request whose deadline passes is shed (``ttft_unmeetable``, or ``park_timeout`` at ``max_park_s``). Every shed
carries a Retry-After. A woken head's TTFT deadline counts from its arrival.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from controlplane.core.adapters import SwapBook, discovered_bases
from controlplane.core.fairshare import (
    ANONYMOUS, FairStanding, TenantAhead, TenantCounters, TenantShare, service_order,
)
from controlplane.core.decide import decide
from controlplane.core.waits import clamp_retry_after, deadline_text, expected_start, retry_after, shed
from controlplane.core.explain import earliest_fit
from controlplane.core.feedback import TtftCorrections
from controlplane.core.fleetindex import DecayedServes, FleetIndex, LastServed
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView
from controlplane.core.fleet import Fleet, RateTables
from controlplane.core.model import Decision, InferenceRequest, Priority, QueueRule, Reason, Ticket, Verdict
from controlplane.core.output_length import OutputLengthBook
from controlplane.core.policy import Policy
from controlplane.core.prefix import PrefixIndex, restarted
from controlplane.core.prompt_tokens import PromptShape, PromptTokenBook
from controlplane.core import reserve
from controlplane.core.route import ServeCounter, SessionMap
from controlplane.core.tenants import EMBEDDINGS_PATH


PARK_CLASSES = (Priority.CRITICAL, Priority.STANDARD)
"""The parking lot's classes, tried in this order; a sheddable request is never parked (it would park as standard)."""


SERVICE_EWMA = 0.1
"""Weight of each release in a model's average service time: about the last 10-20 releases count."""


ANSWER_MARGIN_S = 0.1
"""A parked request is committed this much before its decision window ends: a shed decided at the last moment still
reaches its client within ``shed_decision_s`` of its Check (the shell's park sweep runs every 0.1 s, and the answer
passes through Envoy)."""


STANDING_SERVICES = 2.0
"""While a line stands, a request without a deadline may still be expected to wait this many of its model's service
times when that is longer than ``lifo_after_ms`` (a slow model's line turns over in service times, not seconds)."""


@dataclass(frozen=True, slots=True)
class Parked:
    request_id: str
    request: InferenceRequest
    parked_at: float
    deadline: float
    ttft_bound: bool = False
    """The deadline comes from the request's TTFT deadline, not ``max_park_s``."""
    seq: int = 0
    """Its place in the lot's order (parking order), which ``restore`` puts it back at: arrival times can tie."""


@dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    decision: Decision
    ticket: Ticket | None = None
    parked_for: float = 0.0
    """Seconds the request waited in the parking lot before this outcome."""
    rule: QueueRule = QueueRule.ARRIVAL
    """An admission's place against the line, which the shared store checks (a woken head: OLDEST or NEWEST; a
    backfill: NONE)."""
    parked: Parked | None = None
    """The request's entry in the lot when it was parked: what ``restore`` puts back if the store refuses a woken
    request's admission, and what leaves the shared line when the lot answers it without one (a wake's refusal or shed,
    ``expire_parked``). Every outcome for a parked request carries it."""
    noted: tuple[int, ...] = ()
    """Prompt blocks this admission added to the prefix index for its engine (``retract`` takes them back)."""


class AdmissionCore:
    def __init__(self, policy: Policy, ledger: Ledger, admit_stale: bool = True,
                 draw: Callable[[], float] = lambda: 0.5) -> None:
        self.policy = policy
        self.ledger = ledger
        self.admit_stale = admit_stale
        self.draw = draw
        """Uniform draws in [0, 1) for the satisficing band (the shell passes a real RNG; tests a seeded one)."""
        self.serves = ServeCounter(policy.serve_half_life_s)
        self.sessions = SessionMap()
        self.output_lengths = OutputLengthBook()
        self.index = FleetIndex()
        self.prefixes = PrefixIndex(policy.prefix_index_blocks)
        """Which engine probably holds which prompt prefix (prefix.py)."""
        self.ttft = TtftCorrections(policy.ttft_correction_gain, policy.ttft_correction_max,
                                    policy.ttft_correction_half_life_s, policy.ttft_correction_min)
        """Each engine's TTFT correction from the access log (feedback.py): set on the views the core decides on."""
        self.prompt_tokens = PromptTokenBook(policy.chars_per_token, policy.prompt_tokens_min_samples)
        """Prompt tokens per character and chat message, learned from the engines' counts (prompt_tokens.py); the Check
        estimates with ``prompt_tokens.rules``."""
        self._last_sample: dict[str, EngineSample] = {}
        self._lot: dict[str, dict[Priority, deque[Parked]]] = {}
        self._where: dict[str, tuple[str, Priority]] = {}
        self._park_seq = itertools.count(1)
        self._service_s: dict[str, float] = {}
        """model -> recent seconds from admission to release, averaged (``SERVICE_EWMA``): ``overload_bound_s``."""
        self._passable: dict[str, tuple[int, str | None]] = {}
        """Parked requests last decided to wait although a slot was free (``Decision.idle_slot``: waiting for a busy
        engine, or no free one meets the deadline): the ``_frees`` count they were decided at and the engine they wait
        for. An arrival may pass them while nothing has freed since (see ``check``), counting them ahead on theirs."""
        self.fair = TenantCounters()
        """Each tenant's virtual token counter per model (core/fairshare.py): charged at every admission here,
        corrected by ``settle_usage``; the order of a class's wake while ``policy.fairness.enabled``."""
        self._adapter_bases: dict[str, str] = {}
        """Adapter -> base model, as the engines' ``/v1/models`` name them (``note_view``)."""
        self._adapters_view: Mapping[str, str] = MappingProxyType({})
        self._adapter_recent: dict[str, dict[str, float]] = {}
        """engine -> adapter -> when it was last admitted there (``ADAPTER_MEMORY`` per engine, oldest dropped)."""
        self._recent_view: Mapping[str, tuple[str, ...]] = MappingProxyType({})
        """``_adapter_recent`` as fleets carry it (``Fleet.adapter_recent``), rebuilt when it changes."""
        self.swaps = SwapBook(policy.adapters.swap_min_samples)
        """Each engine's measured adapter swaps (core/adapters.py): fleets carry their medians."""
        self._timed: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        """Ticket -> (engine, expected TTFT, swap priced) of adapter requests, until their first token is timed (at
        most ``TIMED_TICKETS``, oldest dropped: a ticket whose first token is never timed is forgotten)."""
        self._frees = 0
        """Slots freed so far (releases, reaped and lapsed tickets, reloads): a freed slot may be what a passable request
        waits for, so it must be decided again (the wake that follows does) before anyone passes it."""

    # -- views -------------------------------------------------------------------------------------------------------
    def fleet(self, engines: Iterable[EngineView], now: float, rates: RateTables | None = None) -> Fleet:
        """A fleet of exactly ``engines`` (no index: ``decide`` scans every candidate). For tests and tools."""
        engines = tuple(self._corrected(e) for e in engines)
        recent, last = self._serves_at(now)
        return Fleet(engines, MappingProxyType({e.name: self.ledger.view(e.name) for e in engines}), self.admit_stale,
                     rates or RateTables(), recent, self.output_lengths.snapshot(), self.output_lengths.tails(now),
                     last_served=last, adapters=self._note_adapters(engines), adapter_recent=self._recent_view,
                     adapter_swap_s=self.swaps.learned())

    def expected_cached(self, request: InferenceRequest) -> dict[str, int]:
        """Prompt tokens of ``request`` each engine is expected to hold in its prefix cache (engines holding none left
        out): matched blocks x block characters / the model's characters per token (learned, prompt_tokens.py)."""
        if not request.prefix_blocks or not self.policy.prefix_routing:
            return {}
        per_block = self.policy.prefix_block_chars / self.prompt_tokens.rules.rule(request.model).chars_per_token
        return {engine: int(blocks * per_block) for engine, blocks in self.prefixes.match(request.prefix_blocks).items()}

    def expected_displaced(self, request: InferenceRequest) -> dict[str, int]:
        """Prompt tokens of other prefixes each engine would evict to cache ``request``'s prompt (engines evicting none
        left out; affinity.py): only when some engine is expected to hold its prefix and the affinity is on."""
        if not request.prefix_blocks or not self.policy.prefix_routing or not self.policy.prefix_eviction_charge:
            return {}
        held = self.prefixes.match(request.prefix_blocks)
        if not held:
            return {}
        per_block = self.policy.prefix_block_chars / self.prompt_tokens.rules.rule(request.model).chars_per_token
        return {engine: int(blocks * per_block)
                for engine, blocks in self.prefixes.displaced(request.prefix_blocks, held).items()}

    def prefix_share(self, request: InferenceRequest) -> float:
        """``request``'s prefix's share of the requests that recently arrived here (prefix.py; 0: unknown, or prefix
        routing off): how many engines it may occupy (choose.holders_limit)."""
        if not request.prefix_blocks or not self.policy.prefix_routing:
            return 0.0
        return self.prefixes.share(request.prefix_blocks)

    def note_cache_view(self, view: EngineView) -> str | None:
        """A probe or an operator changed what is known of an engine: its KV capacity bounds its share of the prefix
        index; if it restarted (a cumulative counter went backwards) or is drained, it holds nothing any more. Returns
        why its blocks were forgotten (``restart``, ``drained``), or None."""
        capacity = view.kv_capacity_tokens
        model = view.models[0].model_id if view.models else None
        chars_per_token = self.prompt_tokens.engine_rule(model, view.name).chars_per_token if model else \
            self.policy.chars_per_token
        self.prefixes.set_capacity(view.name, None if capacity is None else int(
            capacity * chars_per_token // self.policy.prefix_block_chars))
        why = None
        sample, before = view.sample, self._last_sample.get(view.name)
        if sample is not None:
            if before is not None and sample.taken_at > before.taken_at and restarted(before, sample):
                why = "restart"
            self._last_sample[view.name] = sample
        if why == "restart" and self.ttft.forget(view.name):  # its history says nothing of the new process
            self._refresh_corrected([view.name])
        if why == "restart":
            self.prompt_tokens.forget(view.name)
            self.swaps.forget(view.name)
        if view.drained:
            why = "drained"
        if why is not None and self.prefixes.forget(view.name):
            return why
        return None

    def note_view(self, view: EngineView) -> None:
        """The shell's latest view of an engine (probe, drain, failure, staleness flip): the index refreshes its rows,
        and the adapters it lists with their base model join the fleet's (``Fleet.adapters``)."""
        self.index.update(self._corrected(view))
        self._note_adapters((view,))

    def _note_adapters(self, views: Iterable[EngineView]) -> Mapping[str, str]:
        """Adapters the views list with a base model join those known (``Fleet.adapters``); returns them all."""
        new = {a: base for a, base in discovered_bases(tuple(views)).items() if self._adapter_bases.get(a) != base}
        if new:
            self._adapter_bases.update(new)
            self._adapters_view = MappingProxyType(dict(self._adapter_bases))
        return self._adapters_view

    def is_adapter(self, model: str) -> bool:
        """Whether ``model`` is a LoRA adapter (listed with a parent by an engine, or configured)."""
        return model in self._adapter_bases or model in self.policy.adapters.base_models

    def _corrected(self, view: EngineView) -> EngineView:
        factor = self.ttft.factor(view.name)
        return view if view.ttft_correction == factor else replace(view, ttft_correction=factor)

    def observe_prompt_tokens(self, model: str, engine: str, shape: PromptShape, counted: int, estimated: int) -> None:
        """A served request's prompt as its engine counted it (``usage.prompt_tokens``) and as the Check estimated it:
        the model's token rule learns (prompt_tokens.py); later Checks estimate with it."""
        self.prompt_tokens.observe(model, engine, shape, counted, estimated)

    def observe_first_token(self, ticket_id: str, ttft_s: float) -> float | None:
        """A streamed request's TTFT at its engine (the access log): for an adapter request, its residual against the
        estimate is recorded for that engine's swap (``SwapBook``: cold if a swap was priced, else warm) and returned;
        None for any other request."""
        timed = self._timed.pop(ticket_id, None)
        if timed is None:
            return None
        engine, expected, priced = timed
        return self.swaps.observe(engine, ttft_s, expected, priced)

    def observe_ttft(self, engine: str, ratio: float, now: float) -> None:
        """A served stream's measured TTFT (its first token, from the access log) over the decision's estimate: the engine's
        correction moves (feedback.py), and once it changed, the index's rows of that engine and every parked request's
        last decision are stale."""
        if self.ttft.observe(engine, ratio, now):
            self._refresh_corrected([engine])

    def decay_corrections(self, now: float) -> list[str]:
        """TTFT corrections held past their half-life without a request decay toward 1 (feedback.py); returns the
        engines whose correction moved (their rows and parked requests' decisions are refreshed)."""
        changed = self.ttft.decay(now)
        if changed:
            self._refresh_corrected(changed)
        return changed

    def _refresh_corrected(self, engines: Iterable[str]) -> None:
        for engine in engines:
            current = self.index.views.get(engine)
            if current is not None:
                self.index.update(self._corrected(current))
        self._frees += 1

    def set_engines(self, names: Iterable[str]) -> None:
        """The fleet's engines, in order (start, reload)."""
        self.index.set_order(names)

    def refresh_index(self, now: float, rates: RateTables) -> None:
        """Bring the index's rows up to date now, between Checks (``FleetIndex.refresh``)."""
        self.index.refresh(self.ledger.view, self.ledger.changed, self.serves.values(), self.policy, self.admit_stale,
                           rates, now)

    def indexed_fleet(self, now: float, rates: RateTables | None = None) -> Fleet:
        """The fleet as noted through ``note_view``, with its index: only rows whose engine's view, tickets or serve count
        changed since the last call are recomputed, so a Check costs a few copies, not a pass over every engine."""
        engines, ledger, index = self.index.snapshot(
            self.ledger.view, self.ledger.changed, self.serves.values(), self.policy, self.admit_stale,
            rates or RateTables(), now, self.serves.half_life_s)
        recent, last = self._serves_at(now)
        return Fleet(engines, ledger, self.admit_stale, rates or RateTables(), recent, self.output_lengths.snapshot(),
                     self.output_lengths.tails(now), index, last, self._adapters_view, self._recent_view,
                     self.swaps.learned())

    def _serves_at(self, now: float) -> tuple[DecayedServes, LastServed]:
        """The serve counts as a fleet reads them, from one snapshot: decayed to ``now``, and when each engine was last
        admitted to."""
        values = self.serves.values().snapshot()
        return DecayedServes(values, now, self.serves.half_life_s), LastServed(values)

    def depth(self, model: str | None = None) -> int:
        if model is None:
            return len(self._where)
        return sum(len(q) for q in self._lot.get(model, {}).values())

    def queued_ahead(self, model: str, priority: Priority) -> int:
        queues = self._lot.get(model, {})
        classes = PARK_CLASSES[: PARK_CLASSES.index(priority) + 1] if priority in PARK_CLASSES else PARK_CLASSES
        return sum(len(queues.get(c, ())) for c in classes)

    def parked(self) -> list[Parked]:
        return [p for queues in self._lot.values() for q in queues.values() for p in q]

    # -- events ------------------------------------------------------------------------------------------------------
    def check(self, request_id: str, request: InferenceRequest, fleet: Fleet, now: float,
              ahead_elsewhere: int = 0) -> Outcome:
        """A new request. ``Outcome.decision.verdict`` PARK means it is now in the lot under ``request_id``.
        ``ahead_elsewhere``: requests the shared store says are parked ahead of it on other replicas."""
        model = request.model
        if request.prefix_blocks and self.policy.prefix_routing:
            self.prefixes.arrived(request.prefix_blocks)
        ahead = (self.queued_ahead(model, request.priority) if model else 0) + ahead_elsewhere
        # Everyone parked ahead waits for a busy engine although a slot is free (they would not take it): the arrival is
        # decided as if first. It may take a free slot they refused, or park too (at the back, as ever).
        waiting = self._passing(model, request) if ahead and not ahead_elsewhere and model is not None else None
        passing = waiting is not None
        decision = decide(request, fleet, self.policy, now, 0 if passing else ahead,
                          self.sessions.get(request.session), self.draw(), arriving=True,
                          cached=self.expected_cached(request), waiting=waiting,
                          displaced=self.expected_displaced(request), prefix_share=self.prefix_share(request))
        rule = QueueRule.NONE if passing else QueueRule.ARRIVAL
        if decision.verdict is Verdict.PARK and ahead and not passing and self.policy.backfill and model is not None:
            decision = self._backfill_arrival(request, model, fleet, now, decision)
            rule = QueueRule.NONE
        if decision.verdict is Verdict.ADMIT and model is not None and not self._may_take(request, fleet, now):
            decision = self._held(request, model)
        if decision.verdict is Verdict.ADMIT:
            return self._admit(request_id, request, decision, now, parked_for=0.0, rule=rule)
        if decision.verdict is not Verdict.PARK:
            return Outcome(request_id, decision)
        return self._park(request_id, request, decision, fleet, now, ahead_elsewhere)

    def _passing(self, model: str, request: InferenceRequest) -> Counter[str] | None:
        """If every request parked ahead of ``request`` (its class and higher) was decided to wait although a slot was
        free, with no slot freed since: how many of them wait for each engine. Else None (it parks behind them)."""
        queues = self._lot.get(model, {})
        klass = _class_of(request)
        waiting: Counter[str] = Counter()
        for c in PARK_CLASSES[: PARK_CLASSES.index(klass) + 1]:
            for p in queues.get(c, ()):
                frees, engine = self._passable.get(p.request_id, (-1, None))
                if frees != self._frees:
                    return None
                if engine is not None:
                    waiting[engine] += 1
        return waiting

    def _park(self, request_id: str, request: InferenceRequest, decision: Decision, fleet: Fleet,
              now: float, ahead_elsewhere: int = 0) -> Outcome:
        model = request.model
        assert model is not None
        if self.depth(model) >= self.policy.max_queue_depth:
            candidates = [e for e in fleet.engines if e.serves(model)]
            wait = retry_after(candidates, fleet, self.policy, now, self.depth(model))
            return Outcome(request_id, shed(Reason.QUEUE_FULL,
                                            f"{self.depth(model)} requests already parked for {model}", wait))
        klass = _class_of(request)
        limit = decision.park_limit_s
        ttft_bound = limit is not None and limit < self.policy.max_park_s
        longest = limit if ttft_bound and limit is not None else self.policy.max_park_s
        entry = Parked(request_id, request, now, now + longest, ttft_bound, next(self._park_seq))
        tenant = _tenant_of(request)
        backlogged = self._backlogged(model)
        if tenant not in backlogged:  # back in line after none of its requests waited: no idle time banked
            self.fair.lift(model, tenant, backlogged)
        early = self._too_late(entry, self._ahead_at_park(model, klass, entry) + ahead_elsewhere, fleet, now)
        if early is not None:  # it would start past its bound: told now, with when it would have started
            return Outcome(request_id, early)
        self._lot.setdefault(model, {c: deque() for c in PARK_CLASSES})[klass].append(entry)
        self._where[request_id] = (model, klass)
        if decision.idle_slot:
            self._passable[request_id] = (self._frees, decision.waits_for)
        return Outcome(request_id, decision)

    def force_park(self, request_id: str, request: InferenceRequest, fleet: Fleet, now: float) -> Outcome:
        """Park a request whose admissions the shared store kept refusing (other replicas took each slot first): it
        waits in line like any other, until ``max_park_s`` or its TTFT deadline."""
        limit = request.planned_ttft_s()
        decision = Decision(Verdict.PARK, Reason.QUEUED_BEHIND, detail="slots taken by other control-plane replicas",
                            park_limit_s=limit)
        return self._park(request_id, request, decision, fleet, now)

    def where(self, request_id: str) -> tuple[str, int] | None:
        """A parked request's model and class index (the shared store's name for its line); None if not parked."""
        at = self._where.get(request_id)
        return None if at is None else (at[0], PARK_CLASSES.index(at[1]))

    def lines(self) -> list[tuple[str, int]]:
        """Every (model, class index) the lot has held requests of: the shared lines this replica may have members in."""
        return [(model, PARK_CLASSES.index(klass)) for model, queues in self._lot.items() for klass in queues]

    def class_index(self, request: InferenceRequest) -> int:
        """The request's parking class as an index into ``PARK_CLASSES`` (how the shared store names its line)."""
        return PARK_CLASSES.index(_class_of(request))

    def retract(self, outcome: Outcome, now: float) -> None:
        """Undo an admission the shared store refused: no ticket, no serve counted, none of the prompt blocks it noted
        (``restore`` puts a woken one back)."""
        if outcome.ticket is not None and self.ledger.retract(outcome.ticket.ticket_id) is not None:
            self.fair.retract(outcome.ticket.ticket_id)
            self.serves.remove(outcome.ticket.engine, now)
            self.index.note_serve(outcome.ticket.engine)
            self.prefixes.remove(outcome.ticket.engine, outcome.noted)

    def restore(self, parked: Parked) -> None:
        """Put a woken request back in its place in the lot (its parking sequence number: the lot's order)."""
        model, klass = parked.request.model, _class_of(parked.request)
        assert model is not None
        queue = self._lot.setdefault(model, {c: deque() for c in PARK_CLASSES})[klass]
        at = sum(1 for p in queue if p.seq < parked.seq)
        queue.insert(at, parked)
        self._where[parked.request_id] = (model, klass)

    def learn(self, ticket: Ticket, session: str | None, now: float, prefix_blocks: tuple[int, ...] = ()) -> bool:
        """A ticket the shared store holds that this core has not seen: another replica's admission, or this process's
        before a restart. Counted like one admitted here (load, KV, serve count, session, and the prompt's blocks when
        the event carried them). False if already known; its session and blocks are noted anyway: a ticket learned first
        from a refusal's list of an engine's tickets (which carries neither) is completed by its admission event."""
        known = not self.ledger.insert(ticket)
        if not known:
            self.serves.add(ticket.engine, min(now, ticket.admitted_at))
            self.index.note_serve(ticket.engine)
        self.sessions.set(session, ticket.engine)
        if self.policy.prefix_routing:
            self.prefixes.note(ticket.engine, prefix_blocks)
        return not known

    def tickets(self) -> list[Ticket]:
        return self.ledger.tickets()

    def cancel(self, request_id: str) -> bool:
        """The client went away while parked: drop it; it holds nothing. False if it was not parked."""
        where = self._where.pop(request_id, None)
        self._passable.pop(request_id, None)
        if where is None:
            return False
        model, klass = where
        queue = self._lot[model][klass]
        queue.remove(next(p for p in queue if p.request_id == request_id))
        return True

    def release(self, ticket_id: str, now: float, completed: bool = True) -> Ticket | None:
        """Close a ticket. ``completed``: its request ended now (an access-log entry, another replica's release event);
        False for a ticket found closed late (a lapsed lease, a resync), whose time held says nothing of service."""
        ticket = self.ledger.release(ticket_id, now)
        if ticket is not None:
            self._frees += 1
            if completed:  # its settle (the access log's usage) comes next
                self.fair.close(ticket_id)
            else:  # no usage will come: its estimate stands
                self.fair.forget(ticket_id)
        if ticket is not None and completed:
            # How long a slot of this model is held per request, as achieved (the overload bound scales with it).
            held = max(0.0, now - ticket.admitted_at)
            before = self._service_s.get(ticket.model)
            self._service_s[ticket.model] = held if before is None else before + SERVICE_EWMA * (held - before)
        return ticket

    def overload_bound_s(self, model: str, estimated_s: float = 0.0) -> float:
        """The overload bound of ``model``: the fixed ``overload_shed_after_ms``, or ``overload_shed_services`` of the
        model's recent service times when that is longer (``estimated_s``, the engines' expected service, until a
        request of the model has been released)."""
        return max(self.policy.overload_shed_after_ms / 1000,
                   self.policy.overload_shed_services * self._service_s.get(model, estimated_s))

    def note_probe(self, engine: str, taken_at: float, idle: bool, idle_grace_s: float) -> list[Ticket]:
        """A probe of ``engine`` sent at ``taken_at`` landed. When it saw nothing running and nothing waiting, tickets
        older than ``idle_grace_s`` lost their access-log entry: they are reaped (returned). Later admissions are
        counted against this probe (the ledger's unseen-load correction)."""
        reaped = self.ledger.reap_idle(engine, taken_at, idle_grace_s) if idle else []
        self.ledger.note_probe(engine, taken_at)
        self._frees += bool(reaped)
        for ticket in reaped:  # no longer running (reserved shares); a late settle still finds its charge
            self.fair.close(ticket.ticket_id)
        return reaped

    def expire_leases(self, now: float) -> list[Ticket]:
        """Tickets whose lease ran out (their access-log entry never came): closed and returned."""
        expired = self.ledger.expire(now)
        self._frees += bool(expired)
        for ticket in expired:  # no longer running (reserved shares); a late settle still finds its charge
            self.fair.close(ticket.ticket_id)
        return expired

    def set_policy(self, policy: Policy, admit_stale: bool) -> None:
        """A reload: the new policy (and ``observe.on_stale``) applies to every later decision; parked requests keep
        their place and deadlines."""
        if (policy.prefix_block_chars != self.policy.prefix_block_chars
                or policy.prefix_max_blocks != self.policy.prefix_max_blocks or not policy.prefix_routing):
            self.prefixes = PrefixIndex(policy.prefix_index_blocks)  # old hashes would never match new prompts
            self._last_sample.clear()
        elif policy.prefix_index_blocks != self.prefixes.limit_blocks:
            self.prefixes.set_limit(policy.prefix_index_blocks)
        self.policy = policy
        self.admit_stale = admit_stale
        self.serves.half_life_s = policy.serve_half_life_s
        self._refresh_corrected(self.ttft.configure(policy.ttft_correction_gain, policy.ttft_correction_max,
                                                    policy.ttft_correction_half_life_s, policy.ttft_correction_min))
        self.prompt_tokens.configure(policy.chars_per_token, policy.prompt_tokens_min_samples)
        self.swaps.configure(policy.adapters.swap_min_samples)
        self._frees += 1  # what a parked request would take may have changed: decide it again before passing it

    def record_output(self, model: str, completion_tokens: int) -> None:
        """A request of ``model`` finished after generating ``completion_tokens`` (the access log's count, or the engine's
        generation counter split over the requests it finished): later estimates expect that many, on average."""
        self.output_lengths.record(model, completion_tokens)

    def record_outputs(self, model: str, lengths: Iterable[int]) -> None:
        """``record_output`` for several requests at once (a probe's interval)."""
        self.output_lengths.record_many(model, lengths)

    def refreshed(self, fleet: Fleet, now: float) -> Fleet:
        """``fleet`` with what the core itself changed since it was built (tickets, serve counts): after an admission the
        next decision must see it. An indexed fleet is re-snapshotted; a plain one gets fresh ledger views."""
        if fleet.index is not None:
            return self.indexed_fleet(now, fleet.rates)
        recent, last = self._serves_at(now)
        return replace(fleet, ledger=MappingProxyType({e.name: self.ledger.view(e.name) for e in fleet.engines}),
                       recent_serves=recent, last_served=last, expected_output=self.output_lengths.snapshot(),
                       output_tails=self.output_lengths.tails(now), adapter_recent=self._recent_view,
                       adapter_swap_s=self.swaps.learned())

    def wake(self, fleet: Fleet, now: float, models: Iterable[str] | None = None) -> list[Outcome]:
        """Admit parked heads that fit ``fleet`` now, in order (the core refreshes the fleet after each admission)."""
        current = [fleet]

        def fleet_of() -> Fleet:
            return current[0]

        out: list[Outcome] = []
        for model in list(models) if models is not None else list(self._lot):
            queues = self._lot.get(model)
            if not queues:
                continue
            skipped: set[str] = set()  # owed tenants whose next request decide did not admit: they hold nothing now
            if self.policy.fairness.reserved:
                def refreshed() -> None:
                    current[0] = self.refreshed(current[0], now)
                out.extend(self._wake_reserved(model, queues, fleet_of, refreshed, now, skipped))
            for klass in PARK_CLASSES:
                queue = queues[klass]
                blocked = False
                # Adaptive LIFO: the mode is fixed for the whole wake (popping the oldest leaves a younger one; popping
                # the newest leaves the oldest), so one class's admissions in one wake are all oldest-first or all
                # newest-first.
                lifo = self._lifo(queue, now) and not any(self._committed(p, now) for p in queue)
                passed = 0  # heads that will not take a free slot: left parked, passed over
                passed_ids: set[str] = set()
                waiting: Counter[str] = Counter()  # the engines the passed heads wait for (each takes a slot there first)
                fair = self.policy.fairness.enabled
                while passed < len(queue):
                    order: list[Parked] | None = None
                    if fair:  # the lowest counter's next request; the order moves with every admission's charge
                        order = [p for p in self._order(model, queue, lifo) if p.request_id not in passed_ids]
                        head = order[0]
                        at = next(i for i, p in enumerate(queue) if p is head)
                    else:
                        at = len(queue) - 1 - passed if lifo else passed
                        head = queue[at]
                    committed = self._committed(head, now)
                    request = _as_woken(head, now, committed)
                    # Behind it: every other parked request but the heads passed over before it (they are ahead).
                    behind = self.depth(model) - 1 - passed
                    decision = decide(request, fleet_of(), self.policy, now, 0,
                                      self.sessions.get(request.session), self.draw(), behind,
                                      cached=self.expected_cached(request), waiting=waiting,
                          displaced=self.expected_displaced(request), prefix_share=self.prefix_share(request))
                    if committed and decision.reason is Reason.TTFT_UNMEETABLE:
                        # Committed: its deadline no longer sheds it; it is served in its turn, late.
                        request = _without_deadline(request)
                        decision = decide(request, fleet_of(), self.policy, now, 0,
                                          self.sessions.get(request.session), self.draw(), behind,
                                          cached=self.expected_cached(request), waiting=waiting,
                          displaced=self.expected_displaced(request), prefix_share=self.prefix_share(request))
                    if decision.verdict is Verdict.PARK and decision.idle_slot and passed < self.policy.backfill_scan:
                        # A slot is free that it will not take (it waits for a busy engine that finishes it sooner, or
                        # no free engine meets its deadline): holding the line for it would idle that slot.
                        self._passable[head.request_id] = (self._frees, decision.waits_for)
                        if decision.waits_for is not None:
                            waiting[decision.waits_for] += 1
                        passed += 1
                        passed_ids.add(head.request_id)
                        continue
                    self._passable.pop(head.request_id, None)
                    if decision.verdict is Verdict.ADMIT and not self._may_take(head.request, fleet_of(), now,
                                                                                skipped):
                        decision = self._held(head.request, model)  # what is free is held for owed tenants
                    if decision.verdict is Verdict.PARK:
                        blocked = True
                        if self.policy.backfill:
                            def refresh() -> None:
                                current[0] = self.refreshed(current[0], now)
                            out.extend(self._backfill(model, klass, head, fleet_of, refresh, now, lifo,
                                                      None if order is None else order[1:]))
                        break
                    del queue[at]
                    del self._where[head.request_id]
                    if decision.verdict is Verdict.ADMIT:
                        # Past a passed-over head the line is not the store's to check (as backfill): that head stays.
                        rule = QueueRule.NONE if passed else QueueRule.CLASS if fair else \
                            QueueRule.NEWEST if lifo else QueueRule.OLDEST
                        out.append(self._admit(head.request_id, head.request, decision, now, now - head.parked_at,
                                               rule, head))
                        current[0] = self.refreshed(current[0], now)
                    else:
                        # Answered without a place (its TTFT deadline can no longer be met, the model is gone, a floor
                        # was raised): now rather than at its timeout. ``parked`` tells the shell to take it out of the
                        # shared line too; left there, it would head the line for good and every later admission of the
                        # model would be refused ``queued`` (bench steady, deadline mix at 110%: 155 of 237 shed).
                        out.append(Outcome(head.request_id, decision, parked_for=now - head.parked_at, parked=head))
                if blocked:
                    break  # critical before standard: a blocked critical head holds the standard class too
        return out

    def due(self, now: float) -> list[Parked]:
        """The parked requests ``expire_parked`` sheds at ``now`` whatever the estimates say: inside its decision
        window, one whose deadline has passed (its TTFT deadline, or ``max_park_s``); past it (committed), one that has
        waited ``max_park_s`` (the backstop: its Check must be answered before Envoy's times out)."""
        return [p for p in self.parked()
                if (p.deadline <= now and not self._committed(p, now)) or now - p.parked_at >= self.policy.max_park_s]

    def expire_parked(self, fleet: Fleet, now: float) -> list[Outcome]:
        """The park sweep: shed every parked request ``due`` now (``ttft_unmeetable`` or ``park_timeout``), and every
        request still inside its decision window whose estimated start (its place in line now, ``expected_start``) is
        past its bound (``_too_late``: ``ttft_unmeetable``, ``overloaded`` or ``park_timeout``, with that estimate as
        its Retry-After). Each outcome carries its ``parked`` entry, for the shell to take it out of the shared
        line."""
        out = []
        due = {p.request_id for p in self.due(now)}
        for model, queues in list(self._lot.items()):
            ahead = 0
            for klass in PARK_CLASSES:
                for parked in self._order(model, queues[klass]):
                    decision = None
                    if parked.request_id in due:
                        candidates = [e for e in fleet.engines if e.serves(model)]
                        wait = retry_after(candidates, fleet, self.policy, now, ahead)
                        if parked.ttft_bound and not self._committed(parked, now):
                            decision = shed(Reason.TTFT_UNMEETABLE, f"no slot for {model} in time to meet "
                                            f"{parked.request.max_ttft_ms} ms", wait)
                        else:
                            decision = shed(Reason.PARK_TIMEOUT,
                                            f"no capacity for {model} within {self.policy.max_park_s:g} s", wait)
                    elif not self._committed(parked, now):
                        decision = self._too_late(parked, ahead, fleet, now)
                    if decision is None:
                        ahead += 1
                        continue
                    self.cancel(parked.request_id)
                    out.append(Outcome(parked.request_id, decision, parked_for=now - parked.parked_at, parked=parked))
        return out

    def _committed(self, parked: Parked, now: float) -> bool:
        """Past its decision window (``shed_decision_s`` less ``ANSWER_MARGIN_S``): never shed for its bound again,
        served in its turn."""
        return now - parked.parked_at >= self.policy.shed_decision_s - ANSWER_MARGIN_S

    def _too_late(self, parked: Parked, ahead: int, fleet: Fleet, now: float) -> Decision | None:
        """The shed for ``parked`` (not committed, ``ahead`` requests in line before it) if it is expected to start past
        its bound (``expected_start``): with a TTFT deadline, its park limit (``ttft_unmeetable``); without, its wait
        bound from when it parked (``_wait_bound_s``: ``overloaded``, or ``park_timeout`` when that is ``max_park_s``).
        The Retry-After is the expected wait. None: it may wait, also when the estimate rests on the policy's default
        decode rate (an engine not measured yet and without an anchor: ``StartEstimate.known``)."""
        model = parked.request.model
        assert model is not None
        start = expected_start(parked.request, fleet, self.policy, now, ahead, typical=model not in self._service_s,
                               cached=self.expected_cached(parked.request))
        if not start.known:
            return None  # a guess from the policy's default rates: no grounds to refuse anyone
        wait = start.wait_s
        retry = clamp_retry_after(wait, self.policy)
        if parked.ttft_bound:
            if now + wait <= parked.deadline:
                return None
            return shed(Reason.TTFT_UNMEETABLE,
                        f"{model}: expected to start in {wait:.1f} s ({ahead} ahead in line), too late for "
                        f"{deadline_text(parked.request)}", retry)
        bound = self._wait_bound_s(model, _class_of(parked.request), now, start.service_s)
        if now + wait <= parked.parked_at + bound:
            return None
        if bound >= self.policy.max_park_s:
            return shed(Reason.PARK_TIMEOUT, f"{model}: expected to start in {wait:.1f} s ({ahead} ahead in line), "
                        f"past the {self.policy.max_park_s:g} s a request may wait", retry)
        return shed(Reason.OVERLOADED, f"{model} is overloaded: expected to start in {wait:.1f} s ({ahead} ahead in "
                    f"line), past the {bound:.1f} s a request without a deadline may wait now", retry)

    def _wait_bound_s(self, model: str, klass: Priority, now: float, service_s: float = 0.0) -> float:
        """How long after parking a request of ``model`` without a TTFT deadline may be expected to start (module
        docstring, "Shed early"): the overload bound (``overload_bound_s``), or, while its class's line stands (holds a
        committed request), ``lifo_after_ms``, or ``STANDING_SERVICES`` of the model's service times if that is longer
        (not with ``overload_shed_services`` 0); never past ``max_park_s``. ``overload_shed_after_ms`` 0: ``max_park_s``
        alone; ``lifo_after_ms`` 0: no standing-line bound. ``service_s``: the engines' expected service for the
        request, standing in for the model's measured one until it has one."""
        bound = self.policy.max_park_s
        if self.policy.overload_shed_after_ms <= 0:
            return bound
        bound = min(bound, self.overload_bound_s(model, service_s))
        target = self.policy.lifo_after_ms / 1000
        if target > 0 and any(self._committed(p, now) for p in self._lot.get(model, {}).get(klass, ())):
            if self.policy.overload_shed_services > 0:
                target = max(target, STANDING_SERVICES * self._service_s.get(model, service_s))
            bound = min(bound, target)
        return bound

    def _backfill_arrival(self, request: InferenceRequest, model: str, fleet: Fleet, now: float,
                          parked: Decision) -> Decision:
        """A new arrival behind parked requests may start at once if it finishes before every head ahead of it could."""
        heads = [self._order(model, q)[0] for k, q in self._lot.get(model, {}).items()
                 if q and PARK_CLASSES.index(k) <= PARK_CLASSES.index(_class_of(request))]
        starts = [earliest_fit(h.request, fleet, self.policy, now) for h in heads]
        if not starts or any(s is None for s in starts):
            return parked
        decision = decide(request, fleet, self.policy, now, 0, self.sessions.get(request.session), self.draw(),
                          cached=self.expected_cached(request), displaced=self.expected_displaced(request),
                          prefix_share=self.prefix_share(request))
        if decision.verdict is Verdict.ADMIT and decision.expected_done_at <= min(s for s in starts if s is not None):
            return decision
        return parked

    def _lifo(self, queue: deque[Parked], now: float) -> bool:
        """Whether a wake serves ``queue`` newest first: its oldest request has waited longer than ``lifo_after_ms``, or
        longer than ``lifo_deadline_fraction`` of its own TTFT deadline (off by default: see Policy). Deadlines at or
        below ``lifo_after_ms`` keep the lot FIFO then (each request is shed before it has waited that long), which is
        what serves the most of them in time: a FIFO head with little of its deadline left that only the fastest engine
        could start is passed over by the wake, not waited for."""
        limit = self.policy.lifo_after_ms
        if limit <= 0 or not queue:
            return False
        oldest = queue[0]
        waited_ms = (now - oldest.parked_at) * 1000
        deadline_ms = oldest.request.max_ttft_ms
        fraction = self.policy.lifo_deadline_fraction
        return waited_ms > limit or bool(deadline_ms and fraction and waited_ms > deadline_ms * fraction)

    # -- fair share (core/fairshare.py) -------------------------------------------------------------------------------
    def _order(self, model: str, queue: Iterable[Parked], newest_first: bool = False) -> list[Parked]:
        """The order ``queue`` (one class of ``model``, in parking order) is served in: parking order (``newest_first``:
        adaptive LIFO's), or with fair share on, the tenants' counters' (``fairshare.service_order``; within a tenant,
        parking order or newest first)."""
        entries = list(queue)
        if not self.policy.fairness.enabled:
            return entries[::-1] if newest_first else entries
        return service_order(entries, lambda p: _tenant_of(p.request), lambda t: self.fair.rank(model, t),
                             self._cost, newest_first)

    def _cost(self, parked: Parked) -> float:
        """What serving ``parked`` is expected to add to its tenant's counter."""
        return self.policy.fairness.cost(_tenant_of(parked.request), *self._expected_tokens(parked.request))

    def _expected_tokens(self, request: InferenceRequest) -> tuple[float, float]:
        """A request's charge before it runs: its prompt estimate and its expected output (the model's learned mean,
        else ``default_expected_output_tokens``, never past its ``max_tokens``; none for embeddings)."""
        if request.path == EMBEDDINGS_PATH or request.model is None:
            return float(request.prompt_tokens), 0.0
        typical = self.output_lengths.expected(request.model) or float(self.policy.default_expected_output_tokens)
        return float(request.prompt_tokens), min(typical, float(request.max_tokens)) if request.max_tokens else typical

    def _backlogged(self, model: str) -> set[str]:
        """The tenants with a request of ``model`` parked here."""
        return {_tenant_of(p.request) for q in self._lot.get(model, {}).values() for p in q}

    def _ahead_at_park(self, model: str, klass: Priority, entry: Parked) -> int:
        """Requests served before ``entry`` if it parked now: every one of a higher class, and those of its class
        before it in the class's order (all of them in parking order; under fair share, its place by the counters)."""
        queues = self._lot.get(model, {})
        higher = sum(len(queues.get(c, ())) for c in PARK_CLASSES[:PARK_CLASSES.index(klass)])
        queue = list(queues.get(klass, ()))
        if not self.policy.fairness.enabled:
            return higher + len(queue)
        return higher + next(i for i, p in enumerate(self._order(model, [*queue, entry])) if p is entry)

    def fair_standing(self, request: InferenceRequest, fleet: Fleet, now: float) -> FairStanding:
        """Where ``request`` would stand if it parked now, nothing changed (``sluice admin explain``): its tenant's
        counter (lifted as ``_park`` would lift it), the requests of higher classes, those of its class the fair
        order (``_order``) serves before it, by tenant, and the slots held for other tenants' reserved shares
        (``owed``). Fair share off: parking order, every request parked before it ahead (the counters are still
        shown)."""
        model = request.model
        assert model is not None
        klass, tenant = _class_of(request), _tenant_of(request)
        queues = self._lot.get(model, {})
        higher = sum(len(queues.get(c, ())) for c in PARK_CLASSES[:PARK_CLASSES.index(klass)])
        backlogged = self._backlogged(model)
        counter = self.fair.counter(model, tenant)
        lifted = counter if tenant in backlogged else self.fair.lifted(model, tenant, backlogged)
        queue = list(queues.get(klass, ()))
        entry = Parked("", request, 0.0, 0.0, seq=max((p.seq for p in queue), default=0) + 1)

        def rank(t: str) -> tuple[float, float]:
            c, raw = self.fair.rank(model, t)
            return (lifted, raw) if t == tenant else (c, raw)

        order = service_order([*queue, entry], lambda p: _tenant_of(p.request), rank, self._cost) \
            if self.policy.fairness.enabled else [*queue, entry]
        at = next(i for i, p in enumerate(order) if p is entry)
        before = Counter(_tenant_of(p.request) for p in order[:at])
        ahead = tuple(sorted((TenantAhead(t, lifted if t == tenant else self.fair.counter(model, t), n)
                              for t, n in before.items()), key=lambda a: (a.counter, a.tenant)))
        held = {t: n for t, n in self.owed(model, fleet, now).items() if t != tenant}
        return FairStanding(tenant, lifted, lifted > counter, sum(before.values()), higher, ahead, held)

    # -- reserved shares (core/reserve.py) -----------------------------------------------------------------------------
    def owed(self, model: str, fleet: Fleet, now: float, skipped: Iterable[str] = ()) -> dict[str, int]:
        """Slots held back now for each tenant with a reserved share (``reserve.owed``): those with a request of
        ``model`` parked whose next one (class order, then the class's order) fits some engine now, running fewer
        than their reserved slots (no more than they have parked). Holding nothing: ``skipped`` tenants (a wake found
        ``decide`` would not admit them), and one whose next request was last decided to wait although a slot was
        free (``_passable``, no slot freed since: it waits for a busy engine, so the free slot is not its)."""
        shares = self.policy.fairness.reserved
        queues = self._lot.get(model)
        if not shares or not queues:
            return {}
        running = self.fair.running(model)
        total, _ = reserve.slots(fleet, model)
        parked = Counter(_tenant_of(p.request) for q in queues.values() for p in q)
        holding = {}
        for tenant in set(parked) - set(skipped):
            if reserve.reserved_slots(shares.get(tenant, 0.0), total) <= running.get(tenant, 0):
                continue
            head = self._next_of(model, tenant)
            if head is None or self._passable.get(head.request_id, (-1, None))[0] == self._frees:
                continue  # it declined a free slot (waits for a busy engine) and none has freed since
            if earliest_fit(head.request, fleet, self.policy, now) == now:
                holding[tenant] = parked[tenant]
        return reserve.owed(shares, total, running, holding)

    def _next_of(self, model: str, tenant: str) -> Parked | None:
        """``tenant``'s request of ``model`` served first among its own: its highest class's oldest."""
        for klass in PARK_CLASSES:
            for parked in self._lot.get(model, {}).get(klass, ()):
                if _tenant_of(parked.request) == tenant:
                    return parked
        return None

    def _may_take(self, request: InferenceRequest, fleet: Fleet, now: float, skipped: Iterable[str] = ()) -> bool:
        """Whether ``request`` may take a free slot under the reserved shares (``reserve.may_take``)."""
        if not self.policy.fairness.reserved or request.model is None:
            return True
        held = self.owed(request.model, fleet, now, skipped)
        if not held:
            return True
        return reserve.may_take(_tenant_of(request), reserve.slots(fleet, request.model)[1], held)

    def _held(self, request: InferenceRequest, model: str) -> Decision:
        """The park for a request the reserved shares keep from the free slots."""
        return Decision(Verdict.PARK, Reason.RESERVED_SHARE,
                        detail=f"the free slots of {model} are held for other tenants' reserved shares",
                        park_limit_s=request.planned_ttft_s())

    def _wake_reserved(self, model: str, queues: dict[Priority, deque[Parked]], fleet_of: Callable[[], Fleet],
                       refresh: Callable[[], None], now: float, skipped: set[str]) -> list[Outcome]:
        """A wake's first pass (core/reserve.py): while a slot is free and a tenant is owed slots, its next request
        (the owed tenants' highest class first, then the class's order) is decided and admitted if ``decide`` admits
        it, passing the line (``QueueRule.NONE``); a tenant whose request is not admitted joins ``skipped``."""
        out: list[Outcome] = []
        while True:
            fleet = fleet_of()
            owed = self.owed(model, fleet, now, skipped)
            if not owed or reserve.slots(fleet, model)[1] <= 0:
                return out
            head, klass = next((p, k) for k in PARK_CLASSES for p in self._order(model, queues[k])
                               if _tenant_of(p.request) in owed)
            request = _as_woken(head, now, self._committed(head, now))
            decision = decide(request, fleet, self.policy, now, 0, self.sessions.get(request.session), self.draw(),
                              cached=self.expected_cached(request), displaced=self.expected_displaced(request),
                              prefix_share=self.prefix_share(request))
            if decision.verdict is not Verdict.ADMIT:
                skipped.add(_tenant_of(head.request))
                if decision.verdict is Verdict.PARK and decision.idle_slot:  # as the wake notes a head it passes
                    self._passable[head.request_id] = (self._frees, decision.waits_for)
                continue
            queues[klass].remove(head)
            del self._where[head.request_id]
            self._passable.pop(head.request_id, None)
            out.append(self._admit(head.request_id, head.request, decision, now, now - head.parked_at,
                                   QueueRule.NONE, head))
            refresh()

    def settle_usage(self, ticket_id: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        """What a finished request really used (the access log): its tenant's counter is corrected from the estimate
        it was charged at admission. None: no charge of that ticket here (another replica admitted it)."""
        return self.fair.settle(ticket_id, prompt_tokens, completion_tokens, self.policy.fairness)

    def tenant_shares(self) -> list[TenantShare]:
        """Every tenant's counter, served tokens and parked requests, per model (admin, metrics)."""
        waiting: Counter[tuple[str, str]] = Counter(
            (model, _tenant_of(p.request)) for model, queues in self._lot.items() for q in queues.values() for p in q)
        return self.fair.shares(waiting)

    def _backfill(self, model: str, klass: Priority, head: Parked, fleet_of: Callable[[], Fleet],
                  refresh: Callable[[], None], now: float, lifo: bool = False,
                  behind: list[Parked] | None = None) -> list[Outcome]:
        """EASY backfilling behind a blocked head: admit a later request of the class that fits now and is expected to
        finish before the head could start, so the head's start is not pushed back (under adaptive LIFO the head is
        the newest and "later" means older; under fair share, ``behind``: the requests after the head in the fair
        order)."""
        head_start = earliest_fit(head.request, fleet_of(), self.policy, now)
        if head_start is None:
            return []
        out = []
        queue = self._lot[model][klass]
        order = (list(reversed(queue)) if lifo else list(queue))[1:] if behind is None else behind
        for parked in order[:self.policy.backfill_scan]:
            decision = decide(parked.request, fleet_of(), self.policy, now, 0,
                              self.sessions.get(parked.request.session), self.draw(),
                              cached=self.expected_cached(parked.request),
                              displaced=self.expected_displaced(parked.request),
                              prefix_share=self.prefix_share(parked.request))
            if decision.verdict is Verdict.ADMIT and decision.expected_done_at <= head_start \
                    and self._may_take(parked.request, fleet_of(), now):
                queue.remove(parked)
                del self._where[parked.request_id]
                self._passable.pop(parked.request_id, None)
                out.append(self._admit(parked.request_id, parked.request, decision, now, now - parked.parked_at,
                                       QueueRule.NONE, parked))
                refresh()
        return out

    def _note_adapter(self, engine: str, adapter: str, now: float) -> None:
        """``adapter`` was admitted to ``engine``: it is that engine's most recently used adapter."""
        recent = self._adapter_recent.setdefault(engine, {})
        recent.pop(adapter, None)
        recent[adapter] = now
        while len(recent) > ADAPTER_MEMORY:
            del recent[next(iter(recent))]
        self._recent_view = MappingProxyType({**self._recent_view, engine: tuple(reversed(recent))})

    def _admit(self, request_id: str, request: InferenceRequest, decision: Decision, now: float,
               parked_for: float, rule: QueueRule = QueueRule.ARRIVAL, parked: Parked | None = None) -> Outcome:
        assert decision.engine is not None and request.model is not None
        ticket = self.ledger.admit(request_id, decision.engine, request.model, now,
                                   reserved_tokens=decision.reserved_tokens, expected_done_at=decision.expected_done_at,
                                   expected_ttft_s=decision.expected_ttft_s, guessed=not decision.rates_measured,
                                   decode_tokens_per_s=decision.decode_tokens_per_s)
        self.serves.add(decision.engine, now)
        self.index.note_serve(decision.engine)
        self.sessions.set(request.session, decision.engine)
        self.fair.charge(ticket.ticket_id, request.model, _tenant_of(request), *self._expected_tokens(request),
                         self.policy.fairness)
        noted = self.prefixes.note(decision.engine, request.prefix_blocks) if self.policy.prefix_routing else ()
        if self.is_adapter(request.model):
            self._note_adapter(decision.engine, request.model, now)
            self._timed[ticket.ticket_id] = (decision.engine, decision.expected_ttft_s, decision.swap_s)
            while len(self._timed) > TIMED_TICKETS:
                self._timed.popitem(last=False)
        return Outcome(request_id, decision, ticket, parked_for, rule, parked, noted)


TIMED_TICKETS = 4096
"""Adapter admissions remembered until their first token is timed."""
ADAPTER_MEMORY = 64
"""Adapters remembered per engine as recently admitted there (far more than any engine's slots)."""


def _as_woken(head: Parked, now: float, committed: bool) -> InferenceRequest:
    """A parked request as a wake decides it: the deadline counts from arrival, so what is left of it is what the wake
    can still promise (at least 1 ms); a committed request whose deadline has passed has none."""
    request = head.request
    if request.max_ttft_ms:
        left = request.max_ttft_ms - int((now - head.parked_at) * 1000)
        request = replace(request, max_ttft_ms=max(1, left))
        if committed and left <= 0:
            request = _without_deadline(request)
    return request


def _without_deadline(request: InferenceRequest) -> InferenceRequest:
    """``request`` as if it had no TTFT deadline (a committed request whose deadline passed)."""
    return replace(request, max_ttft_ms=None, ttft_headroom_ms=0)


def _tenant_of(request: InferenceRequest) -> str:
    return request.tenant or ANONYMOUS


def _class_of(request: InferenceRequest) -> Priority:
    return request.priority if request.priority in PARK_CLASSES else Priority.STANDARD
