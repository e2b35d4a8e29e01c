"""Properties of the admission state machine over random interleavings of requests (every priority, with and without a TTFT
deadline and a session), releases, probes, cancellations, lease expiries and park deadlines: caps hold, KV is never
double-spent, floors hold, FIFO within a class (a wake serves newest first only while its oldest has waited longer than
``lifo_after_ms`` and no request of the class is committed), deadlines are kept by every request admitted inside its
decision window, a parked request is shed only inside its decision window (or at ``max_park_s``, the backstop), one
answer per request, nothing leaks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.core.model import Priority
from tests.unit.admissionworld import POLICY, World, op, run_and_drain


@settings(max_examples=400, deadline=None)
@given(st.lists(op, max_size=80))
# Leases expire after the probes that counted their tickets: the expiry must free the probe's slots as a release does.
@example([("submit", 100, Priority.CRITICAL, 5, None, None), ("probe", "a"), ("probe", "b"), ("tick", 20.0),
          ("tick", 40.0), ("tick", 40.0), ("submit", 100, Priority.CRITICAL, 1, None, None)])
# A request committed (parked past its decision window less the answer margin) and then served past its deadline: the
# deadline binds only before it is committed.
@example([("submit", 100, Priority.CRITICAL, 1, None, None), ("submit", 100, Priority.CRITICAL, 1, None, None),
          ("submit", 9000, Priority.CRITICAL, 5, 10000, None), ("submit", 100, Priority.CRITICAL, 1, None, None),
          ("submit", 100, Priority.CRITICAL, 1, None, None), ("submit", 100, Priority.CRITICAL, 1, None, None),
          ("tick", 0.9375)])
def test_admission_invariants(steps: list[tuple[Any, ...]]) -> None:
    """Strict FIFO (``lifo_after_ms: 0``): parked requests are admitted in the order they parked, however long they wait."""
    world = run_and_drain(World(replace(POLICY, lifo_after_ms=0)), steps)
    # FIFO within a class: parked requests were admitted in the order they parked.
    for klass, admitted in world.admitted_from_park.items():
        assert admitted == [r for r in world.parked_order[klass] if r in admitted], f"{klass} not FIFO"


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=80))
def test_admission_invariants_with_adaptive_lifo(steps: list[tuple[Any, ...]]) -> None:
    """Past ``lifo_after_ms`` (or half a request's deadline) a wake serves newest first while none of the class is
    committed (a 10 s decision window here, so that it can happen; ``World.wake`` checks each wake's order); every other
    invariant holds, and the drain still admits every parked request."""
    run_and_drain(World(replace(POLICY, lifo_deadline_fraction=0.5, shed_decision_s=10.0)), steps)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=80))
def test_admission_invariants_with_backfill(steps: list[tuple[Any, ...]]) -> None:
    """Backfill reorders admissions on purpose; every other invariant still holds."""
    run_and_drain(World(replace(POLICY, backfill=True)), steps)
