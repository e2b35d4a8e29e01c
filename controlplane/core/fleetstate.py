"""What the admission core knows besides its parking lot: the ledger, what it learned of the engines, and the fleets it
decides on. Sans-I/O, time passed in.

Every ticket event goes through here (``_admit``, ``retract``, ``release``, ``note_probe``'s idle reaping,
``expire_leases``, ``learn``), and so does a reload (``set_policy``): the shell never writes to the ledger itself. Each
admission is recorded everywhere it counts: the ledger, the serve counts, the session map, its tenant's fair-share
counter (fairshare.py), the prefix index (prefix.py) and, for a LoRA adapter, the engine's recent adapters and the
adapter's share (adapterhomes.py). What the access log reports teaches the core: output lengths (output_length.py),
prompt tokens (prompt_tokens.py), TTFT corrections (feedback.py), adapter swaps (adapters.py); every fleet the core
builds (``fleet``, ``indexed_fleet``, ``refreshed``) carries what it learned. ``_frees`` counts the slots freed
(releases, reaped and lapsed tickets, changed corrections, reloads): a parked request that declined a free slot is
decided again after any of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from controlplane.core.adapterhomes import AdapterShares
from controlplane.core.adapters import SwapBook, discovered_bases
from controlplane.core.decide import decide
from controlplane.core.engines import EngineSample, EngineView
from controlplane.core.fairshare import TenantCounters
from controlplane.core.feedback import TtftCorrections
from controlplane.core.fleet import Fleet, RateTables
from controlplane.core.fleetindex import DecayedServes, FleetIndex, LastServed
from controlplane.core.ledger import Ledger
from controlplane.core.lot import tenant_of
from controlplane.core.model import Decision, InferenceRequest, Outcome, Parked, Priority, QueueRule, Ticket
from controlplane.core.output_length import OutputLengthBook
from controlplane.core.policy import Policy
from controlplane.core.preempt import Preemptible
from controlplane.core.prefix import PrefixIndex, restarted
from controlplane.core.prompt_counters import CounterWindows
from controlplane.core.prompt_tokens import PromptShape, PromptTokenBook
from controlplane.core.route import ServeCounter, SessionMap
from controlplane.core.shedearly import ServiceTimes
from controlplane.core.tenants import EMBEDDINGS_PATH

TIMED_TICKETS = 4096
"""Adapter admissions remembered until their first token is timed."""
ADAPTER_MEMORY = 64
"""Adapters remembered per engine as recently admitted there (far more than any engine's slots)."""
PREVIEW_PICK = 0.5
"""The satisficing band's draw in a preview (a preview takes none from ``draw``)."""


@dataclass(slots=True)
class DecisionCounts:
    """What this core has decided since it started (previews not counted): every ``decide`` call, and those the fleet
    index answered (the rest scanned every candidate). Read by tools; nothing in the core depends on them."""

    decided: int = 0
    on_index: int = 0

    @property
    def full_scan(self) -> int:
        return self.decided - self.on_index


class FleetState:
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
        self.ttft = TtftCorrections(policy.ttft_correction_gain, policy.ttft_correction_max,
                                    policy.ttft_correction_half_life_s, policy.ttft_correction_min)
        """Each engine's TTFT correction (feedback.py), set on the views the core decides on."""
        self.prompt_tokens = PromptTokenBook(policy.chars_per_token, policy.prompt_tokens_min_samples)
        """The Check estimates prompt tokens with ``prompt_tokens.rules``."""
        self.prompt_counters = CounterWindows()
        """Windows of each engine's prompt-token counter between quiet probes: samples for ``prompt_tokens`` when
        requests are served without usage (prompt_counters.py)."""
        self.fair = TenantCounters()
        """Each tenant's virtual token counter per model (fairshare.py), charged at every admission here."""
        self.swaps = SwapBook(policy.adapters.swap_min_samples)
        self.adapter_shares = AdapterShares()
        """Each adapter's share of its base model's recent admissions (adapterhomes.py)."""
        self.service_times = ServiceTimes()
        self.preemptible = Preemptible()
        """Sheddable admissions whose streams the shell can end (preempt.py; only with ``preempt_sheddable``)."""
        self._last_sample: dict[str, EngineSample] = {}
        self._adapter_bases: dict[str, str] = {}
        """Adapter -> base model, as the engines' ``/v1/models`` name them (``note_view``)."""
        self._adapters_view: Mapping[str, str] = MappingProxyType({})
        self._adapter_recent: dict[str, dict[str, float]] = {}
        """engine -> adapter -> when it was last admitted there (``ADAPTER_MEMORY`` per engine, oldest dropped)."""
        self._recent_view: Mapping[str, tuple[str, ...]] = MappingProxyType({})
        """``_adapter_recent`` as fleets carry it (``Fleet.adapter_recent``), rebuilt when it changes."""
        self._timed: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        """Ticket -> (engine, expected TTFT, swap priced) of adapter requests until their first token is timed (at
        most ``TIMED_TICKETS``, oldest dropped)."""
        self._frees = 0
        self.decisions = DecisionCounts()

    # -- fleets --------------------------------------------------------------------------------------------------------
    def fleet(self, engines: Iterable[EngineView], now: float, rates: RateTables | None = None) -> Fleet:
        """A fleet of exactly ``engines`` (no index: ``decide`` scans every candidate)."""
        engines = tuple(self._corrected(e) for e in engines)
        recent, last = self._serves_at(now)
        return Fleet(engines, MappingProxyType({e.name: self.ledger.view(e.name) for e in engines}), self.admit_stale,
                     rates or RateTables(), recent, self.output_lengths.snapshot(), self.output_lengths.tails(now),
                     last_served=last, adapters=self._note_adapters(engines), adapter_recent=self._recent_view,
                     adapter_swap_s=self.swaps.learned(), adapter_shares=self.adapter_shares.shares())

    def indexed_fleet(self, now: float, rates: RateTables | None = None) -> Fleet:
        """The fleet as noted through ``note_view``, with its index: only the rows whose engine's view, tickets or serve
        count changed since the last call are recomputed."""
        engines, ledger, index = self.index.snapshot(
            self.ledger.view, self.ledger.changed, self.serves.values(), self.policy, self.admit_stale,
            rates or RateTables(), now, self.serves.half_life_s)
        recent, last = self._serves_at(now)
        return Fleet(engines, ledger, self.admit_stale, rates or RateTables(), recent, self.output_lengths.snapshot(),
                     self.output_lengths.tails(now), index, last, self._adapters_view, self._recent_view,
                     self.swaps.learned(), self.adapter_shares.shares())

    def refreshed(self, fleet: Fleet, now: float) -> Fleet:
        """``fleet`` with what the core itself changed since it was built (tickets, serve counts): after an admission the
        next decision must see it. An indexed fleet is re-snapshotted; a plain one gets fresh ledger views."""
        if fleet.index is not None:
            return self.indexed_fleet(now, fleet.rates)
        recent, last = self._serves_at(now)
        return replace(fleet, ledger=MappingProxyType({e.name: self.ledger.view(e.name) for e in fleet.engines}),
                       recent_serves=recent, last_served=last, expected_output=self.output_lengths.snapshot(),
                       output_tails=self.output_lengths.tails(now), adapter_recent=self._recent_view,
                       adapter_swap_s=self.swaps.learned(), adapter_shares=self.adapter_shares.shares())

    def _serves_at(self, now: float) -> tuple[DecayedServes, LastServed]:
        """The serve counts as a fleet reads them, from one snapshot: decayed to ``now``, and when each engine was last
        admitted to."""
        values = self.serves.values().snapshot()
        return DecayedServes(values, now, self.serves.half_life_s), LastServed(values)

    def set_engines(self, names: Iterable[str]) -> None:
        """The fleet's engines, in order (start, reload)."""
        self.index.set_order(names)

    def refresh_index(self, now: float, rates: RateTables) -> None:
        """Bring the index's rows up to date now, between Checks (``FleetIndex.refresh``)."""
        self.index.refresh(self.ledger.view, self.ledger.changed, self.serves.values(), self.policy, self.admit_stale,
                           rates, now)

    # -- what a request is expected to find -------------------------------------------------------------------------
    def expected_cached(self, request: InferenceRequest) -> dict[str, int]:
        """Prompt tokens of ``request`` each engine is expected to hold in its prefix cache (engines holding none left
        out): matched blocks x block characters / the model's characters per token (prompt_tokens.py)."""
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

    def prefix_share(self, request: InferenceRequest, arriving: bool = False) -> float:
        """``request``'s prefix's share of the requests that recently arrived here (prefix.py; 0: unknown, or prefix
        routing off), which bounds how many engines it may occupy (choose.holders_suffice). ``arriving``: counting
        ``request`` as arrived once more."""
        if not request.prefix_blocks or not self.policy.prefix_routing:
            return 0.0
        return self.prefixes.share(request.prefix_blocks, arriving)

    def prefix_demand(self) -> Mapping[str, float]:
        """Per engine, what the prefixes it holds ask of it (``PrefixIndex.demand``); empty, and not computed, with
        prefix routing or ``prefix_demand_slack`` off (the default), since only that rule reads it."""
        if not self.policy.prefix_routing or self.policy.prefix_demand_slack <= 0:
            return {}
        return self.prefixes.demand()

    def _decide(self, request: InferenceRequest, fleet: Fleet, now: float, queued_ahead: int = 0, behind: int = 0,
                arriving: bool = False, waiting: Mapping[str, int] | None = None, preview: bool = False) -> Decision:
        """``decide`` with what the core knows of ``request``: its session's engine, a draw for the band, its expected
        cache hits and evictions, its prefix's share. ``preview``: nothing changes (not the session map's order, not
        the draws: the band draws ``PREVIEW_PICK``), and the prefix share counts ``request`` as arrived, as a Check
        does."""
        session = self.sessions.peek(request.session) if preview else self.sessions.get(request.session)
        pick = PREVIEW_PICK if preview else self.draw()
        decision = decide(request, fleet, self.policy, now, queued_ahead, session, pick, behind, arriving,
                          cached=self.expected_cached(request), waiting=waiting,
                          displaced=self.expected_displaced(request), prefix_share=self.prefix_share(request, preview),
                          prefix_demand=self.prefix_demand())
        if not preview:
            self.decisions.decided += 1
            self.decisions.on_index += decision.on_index
        return decision

    # -- what the engines and the access log report -------------------------------------------------------------------
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
            elif before is None or sample.taken_at > before.taken_at:
                self._count_prompts(view.name, sample)
            self._last_sample[view.name] = sample
        if why == "restart" and self.ttft.forget(view.name):
            self._refresh_corrected([view.name])
        if why == "restart":
            self.prompt_tokens.forget(view.name)
            self.prompt_counters.forget(view.name)
            self.swaps.forget(view.name)
        if view.drained:
            why = "drained"
        if why is not None and self.prefixes.forget(view.name):
            return why
        return None

    def _count_prompts(self, engine: str, sample: EngineSample) -> None:
        """A new probe of ``engine``: at a quiet one (nothing running or waiting there, no ticket on it here) its
        prompt-token counter's window closes, and what it counted teaches the token rule (prompt_counters.py)."""
        quiet = sample.running == 0 and sample.waiting == 0 and self.ledger.view(engine).open_tickets == 0
        window = self.prompt_counters.probe(engine, sample.prompt_tokens_total, quiet)
        if window is not None:
            self.prompt_tokens.observe_window(window)

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
        the model's token rule learns (prompt_tokens.py)."""
        self.prompt_tokens.observe(model, engine, shape, counted, estimated)

    def observe_served_prompt(self, ticket: Ticket, shape: PromptShape, estimated: int, ok: bool) -> None:
        """What the Check counted of a request whose ticket was just released (its access-log entry), usage or not;
        ``ok``: its engine answered it 200. Its engine's prompt-token counter window accounts for it."""
        self.prompt_counters.served(ticket.engine, ticket.model, shape, estimated, ok)

    def observe_first_token(self, ticket_id: str, ttft_s: float) -> float | None:
        """A streamed request's TTFT at its engine (the access log): for an adapter request, its residual against the
        estimate is recorded for that engine's swap (``SwapBook``) and returned; None for any other request."""
        timed = self._timed.pop(ticket_id, None)
        if timed is None:
            return None
        engine, expected, priced = timed
        return self.swaps.observe(engine, ttft_s, expected, priced)

    def observe_ttft(self, engine: str, ratio: float, now: float) -> None:
        """A served stream's measured TTFT over the decision's estimate: the engine's correction moves (feedback.py);
        once it changed, the engine's index rows and every parked request's last decision are stale."""
        if self.ttft.observe(engine, ratio, now):
            self._refresh_corrected([engine])

    def decay_corrections(self, now: float) -> list[str]:
        """TTFT corrections held past their half-life without a request decay toward 1 (feedback.py); returns the
        engines whose correction moved."""
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

    def record_output(self, model: str, completion_tokens: int) -> None:
        """A request of ``model`` finished after generating ``completion_tokens``: later estimates expect that many, on
        average (output_length.py)."""
        self.output_lengths.record(model, completion_tokens)

    def record_outputs(self, model: str, lengths: Iterable[int]) -> None:
        """``record_output`` for several requests at once (a probe's interval)."""
        self.output_lengths.record_many(model, lengths)

    def set_policy(self, policy: Policy, admit_stale: bool) -> None:
        """A reload: the new policy (and ``observe.on_stale``) applies to every later decision; parked requests keep
        their place and deadlines. A new block size empties the prefix index (old hashes would never match again)."""
        if (policy.prefix_block_chars != self.policy.prefix_block_chars
                or policy.prefix_max_blocks != self.policy.prefix_max_blocks or not policy.prefix_routing):
            self.prefixes = PrefixIndex(policy.prefix_index_blocks)
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
        self._frees += 1

    # -- tickets --------------------------------------------------------------------------------------------------------
    def _admit(self, request_id: str, request: InferenceRequest, decision: Decision, now: float,
               parked_for: float, rule: QueueRule = QueueRule.ARRIVAL, parked: Parked | None = None) -> Outcome:
        """Record an admission everywhere it counts (the module docstring) and return its outcome."""
        assert decision.engine is not None and request.model is not None
        ticket = self.ledger.admit(request_id, decision.engine, request.model, now,
                                   reserved_tokens=decision.reserved_tokens, expected_done_at=decision.expected_done_at,
                                   expected_ttft_s=decision.expected_ttft_s, guessed=not decision.rates_measured,
                                   decode_tokens_per_s=decision.decode_tokens_per_s)
        self.serves.add(decision.engine, now)
        self.index.note_serve(decision.engine)
        self.sessions.set(request.session, decision.engine)
        self.fair.charge(ticket.ticket_id, request.model, tenant_of(request), *self._expected_tokens(request),
                         self.policy.fairness)
        noted = self.prefixes.note(decision.engine, request.prefix_blocks) if self.policy.prefix_routing else ()
        if request.priority is Priority.SHEDDABLE and self.policy.fairness.preempt_sheddable:
            self.preemptible.admitted(ticket.ticket_id)
        if self.is_adapter(request.model):
            self._note_adapter(decision.engine, request.model, now)
            self._note_share(request.model)
            self._timed[ticket.ticket_id] = (decision.engine, decision.expected_ttft_s, decision.swap_s)
            while len(self._timed) > TIMED_TICKETS:
                self._timed.popitem(last=False)
        return Outcome(request_id, decision, ticket, parked_for, rule, parked, noted)

    def _note_adapter(self, engine: str, adapter: str, now: float) -> None:
        """``adapter`` was admitted to ``engine``: it is that engine's most recently used adapter."""
        recent = self._adapter_recent.setdefault(engine, {})
        recent.pop(adapter, None)
        recent[adapter] = now
        while len(recent) > ADAPTER_MEMORY:
            del recent[next(iter(recent))]
        self._recent_view = MappingProxyType({**self._recent_view, engine: tuple(reversed(recent))})

    def _note_share(self, adapter: str) -> None:
        base = self._adapter_bases.get(adapter) or self.policy.adapters.base_models.get(adapter)
        if base is not None:
            self.adapter_shares.note(adapter, base)

    def _expected_tokens(self, request: InferenceRequest) -> tuple[float, float]:
        """A request's charge before it runs: its prompt estimate and its expected output (the model's learned mean,
        else ``default_expected_output_tokens``, never past its ``max_tokens``; none for embeddings)."""
        if request.path == EMBEDDINGS_PATH or request.model is None:
            return float(request.prompt_tokens), 0.0
        typical = self.output_lengths.expected(request.model) or float(self.policy.default_expected_output_tokens)
        return float(request.prompt_tokens), min(typical, float(request.max_tokens)) if request.max_tokens else typical

    def retract(self, outcome: Outcome, now: float) -> None:
        """Undo an admission the shared store refused: no ticket, no serve counted, none of the prompt blocks it noted
        (``restore`` puts a woken one back)."""
        if outcome.ticket is not None and self.ledger.retract(outcome.ticket.ticket_id) is not None:
            self.fair.retract(outcome.ticket.ticket_id)
            self.preemptible.closed(outcome.ticket.ticket_id)
            self.serves.remove(outcome.ticket.engine, now)
            self.index.note_serve(outcome.ticket.engine)
            self.prefixes.remove(outcome.ticket.engine, outcome.noted)

    def learn(self, ticket: Ticket, session: str | None, now: float, prefix_blocks: tuple[int, ...] = ()) -> bool:
        """A ticket the shared store holds that this core has not seen: another replica's admission, or this process's
        before a restart. Counted like one admitted here (load, KV, serve count, session, and the prompt's blocks when
        the event carried them). False if already known; its session and blocks are noted anyway (a ticket first
        learned from a refusal's list, which carries neither, is completed by its admission event)."""
        known = not self.ledger.insert(ticket)
        if not known:
            self.serves.add(ticket.engine, min(now, ticket.admitted_at))
            self.index.note_serve(ticket.engine)
            if self.is_adapter(ticket.model):
                self._note_share(ticket.model)
        self.sessions.set(session, ticket.engine)
        if self.policy.prefix_routing:
            self.prefixes.note(ticket.engine, prefix_blocks)
        return not known

    def tickets(self) -> list[Ticket]:
        return self.ledger.tickets()

    def release(self, ticket_id: str, now: float, completed: bool = True) -> Ticket | None:
        """Close a ticket. ``completed``: its request ended now (an access-log entry, another replica's release event),
        so its time held counts in its model's service time; False for a ticket found closed late (a lapsed lease, a
        resync), whose usage will never be settled."""
        ticket = self.ledger.release(ticket_id, now)
        if ticket is not None:
            self._frees += 1
            self.preemptible.closed(ticket_id)
            if completed:
                self.fair.close(ticket_id)
                self.prompt_counters.released(ticket.engine)
            else:
                self.fair.forget(ticket_id)
                self.prompt_counters.spoil(ticket.engine)
        if ticket is not None and completed:
            self.service_times.record(ticket.model, max(0.0, now - ticket.admitted_at))
        return ticket

    def note_probe(self, engine: str, taken_at: float, idle: bool, idle_grace_s: float) -> list[Ticket]:
        """A probe of ``engine`` sent at ``taken_at`` landed. When it saw nothing running and nothing waiting, tickets
        older than ``idle_grace_s`` lost their access-log entry: they are reaped (returned). Later admissions are
        counted against this probe (the ledger's unseen-load correction)."""
        reaped = self.ledger.reap_idle(engine, taken_at, idle_grace_s) if idle else []
        self.ledger.note_probe(engine, taken_at)
        self._frees += bool(reaped)
        for ticket in reaped:  # no longer running; a late settle still finds its charge
            self.fair.close(ticket.ticket_id)
            self.preemptible.closed(ticket.ticket_id)
            self.prompt_counters.spoil(engine)
        return reaped

    def expire_leases(self, now: float) -> list[Ticket]:
        """Tickets whose lease ran out (their access-log entry never came): closed and returned."""
        expired = self.ledger.expire(now)
        self._frees += bool(expired)
        for ticket in expired:  # no longer running; a late settle still finds its charge
            self.fair.close(ticket.ticket_id)
            self.preemptible.closed(ticket.ticket_id)
            self.prompt_counters.spoil(ticket.engine)
        return expired

    def settle_usage(self, ticket_id: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        """What a finished request really used (the access log): its tenant's counter is corrected from the estimate
        it was charged at admission. None: no charge of that ticket here (another replica admitted it)."""
        return self.fair.settle(ticket_id, prompt_tokens, completion_tokens, self.policy.fairness)
