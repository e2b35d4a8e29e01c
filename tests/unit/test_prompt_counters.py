"""The engines' prompt-token counters as a second source of the token rule (core/prompt_counters.py): requests served
without usage still teach it, through the windows between an engine's quiet probes."""

from __future__ import annotations

import math
import random

from controlplane.core.engines import EngineSample, EngineView
from controlplane.core.fleetstate import FleetState
from controlplane.core.ledger import Ledger
from controlplane.core.model import Ticket
from controlplane.core.policy import Policy
from controlplane.core.prompt_counters import CounterWindows
from controlplane.core.prompt_tokens import PromptShape


class Engine:
    """A simulated engine behind a ``FleetState``: 1.3 characters a token, 7 template tokens a chat message, a
    cumulative prompt-token counter, probes that see what it runs."""

    def __init__(self, state: FleetState, name: str = "e1", model: str = "m") -> None:
        self.state, self.name, self.model = state, name, model
        self.total = 0
        self.running: dict[str, PromptShape] = {}
        self.now = 0.0
        self.seq = 0

    def count(self, shape: PromptShape) -> int:
        return math.ceil(shape.chars / 1.3) + 7 * shape.messages

    def start(self, shape: PromptShape) -> Ticket:
        """A request admitted here and taken by the engine (its prompt counted)."""
        self.seq += 1
        ticket = self.state.ledger.admit(f"{self.name}-{self.seq}", self.name, self.model, self.now)
        self.running[ticket.ticket_id] = shape
        self.total += self.count(shape)
        return ticket

    def finish(self, ticket: Ticket, ok: bool = True) -> None:
        """Its access-log entry: the release, then what the Check counted (no usage)."""
        shape = self.running.pop(ticket.ticket_id)
        released = self.state.release(ticket.ticket_id, self.now)
        assert released is not None
        self.state.observe_served_prompt(released, shape, math.ceil(shape.chars / 4), ok)

    def probe(self) -> None:
        self.now += 1.0
        busy = float(len(self.running))
        sample = EngineSample(self.now, running=busy, waiting=0.0, prompt_tokens_total=float(self.total))
        self.state.note_cache_view(EngineView(self.name, "http://e1", None, sample=sample))


def state() -> FleetState:
    return FleetState(Policy(prompt_tokens_min_samples=8), Ledger(60.0))


def shapes(rng: random.Random, n: int) -> list[PromptShape]:
    return [PromptShape(rng.randint(200, 3000), rng.randint(1, 4)) for _ in range(n)]


def test_requests_served_without_usage_teach_the_rule_through_the_counter() -> None:
    s = state()
    engine = Engine(s)
    rng = random.Random(7)
    engine.probe()  # quiet: the first window opens
    for _ in range(12):  # twelve busy spells, each a few overlapping requests, a quiet probe after each
        tickets = [engine.start(shape) for shape in shapes(rng, rng.randint(1, 4))]
        engine.probe()  # busy: the window stays open
        for ticket in tickets:
            engine.finish(ticket)
        engine.probe()
    rule = s.prompt_tokens.rules.rule("m")
    assert rule.samples >= 8
    probe = PromptShape(1300, 2)
    assert abs(rule.tokens(probe) - engine.count(probe)) <= 0.03 * engine.count(probe)
    summary = s.prompt_tokens.summary("m", "e1")
    assert summary.error_median is not None and 2.5 < summary.error_median < 3.5  # the prior's error, reported


def test_a_window_that_cannot_account_for_every_prompt_teaches_nothing() -> None:
    """A failed request, a ticket reaped or released elsewhere, two models in one window, a busy probe: none of these
    windows becomes a sample."""
    s = state()
    engine = Engine(s)
    rng = random.Random(3)
    engine.probe()
    # a failed request (its prompt may or may not have been counted)
    a, b = engine.start(shapes(rng, 1)[0]), engine.start(shapes(rng, 1)[0])
    engine.finish(a)
    engine.finish(b, ok=False)
    engine.probe()
    # a release whose Check's counts never come (another replica's release event)
    c = engine.start(shapes(rng, 1)[0])
    engine.running.pop(c.ticket_id)
    s.release(c.ticket_id, engine.now)
    engine.probe()
    # a ticket whose lease lapsed
    d = engine.start(shapes(rng, 1)[0])
    engine.running.pop(d.ticket_id)
    s.release(d.ticket_id, engine.now, completed=False)
    engine.probe()
    # two models in one window
    e = engine.start(shapes(rng, 1)[0])
    other = s.ledger.admit("other-1", "e1", "m2", engine.now)
    engine.finish(e)
    released = s.release(other.ticket_id, engine.now)
    assert released is not None
    s.observe_served_prompt(released, PromptShape(100, 1), 25, True)
    engine.probe()
    assert s.prompt_tokens.summary("m", "e1").samples == 0
    assert s.prompt_tokens.summary("m2", "e1").samples == 0
    # and the next clean window counts
    f = engine.start(shapes(rng, 1)[0])
    engine.finish(f)
    engine.probe()
    assert s.prompt_tokens.summary("m", "e1").samples == 1


def test_a_window_closes_only_when_the_ledger_is_empty_too() -> None:
    """The engine idle but a ticket still open here (its request not arrived yet, or its entry not): no close."""
    windows = CounterWindows()
    assert windows.probe("e1", 0.0, quiet=True) is None  # opens
    windows.released("e1")
    windows.served("e1", "m", PromptShape(400, 1), 100, True)
    assert windows.probe("e1", 330.0, quiet=False) is None
    closed = windows.probe("e1", 330.0, quiet=True)
    assert closed is not None and closed.counted == 330.0 and closed.chars == 400 and closed.requests == 1
    assert windows.probe("e1", 330.0, quiet=True) is None, "an empty window says nothing"
    windows.released("e1")
    windows.served("e1", "m", PromptShape(400, 1), 100, True)
    assert windows.probe("e1", 100.0, quiet=True) is None, "a counter that went backwards says nothing"
    windows.released("e1")
    windows.served("e1", "m", PromptShape(400, 1), 100, True)
    assert windows.probe("e1", None, quiet=True) is None, "no counter: the window is dropped"
    assert windows.probe("e1", 500.0, quiet=True) is None
