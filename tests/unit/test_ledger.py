"""The ticket ledger: admits, releases, leases, and the load the probe cannot see yet."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.ledger import Ledger
from controlplane.core.model import Ticket
from controlplane.store.base import SharedClock


def test_release_is_idempotent_and_counts() -> None:
    ledger = Ledger(lease_seconds=60)
    ledger.admit("a", "thor", "cortex", now=0)
    assert ledger.open_tickets("thor") == 1
    assert ledger.release("a", now=1) is not None
    assert ledger.release("a", now=2) is None  # a duplicate access-log entry changes nothing
    assert ledger.open_tickets() == 0
    assert (ledger.admitted_total, ledger.released_total, ledger.expired_total) == (1, 1, 0)


def test_lease_reaps_tickets_whose_log_entry_was_lost() -> None:
    ledger = Ledger(lease_seconds=10)
    ledger.admit("lost", "thor", "cortex", now=0)
    ledger.admit("young", "thor", "cortex", now=5)
    assert ledger.expire(now=9.9) == []
    assert [t.ticket_id for t in ledger.expire(now=10)] == ["lost"]
    assert ledger.open_tickets("thor") == 1 and ledger.expired_total == 1
    assert ledger.release("lost", now=11) is None


def test_duplicate_ticket_id_is_refused() -> None:
    ledger = Ledger(lease_seconds=10)
    ledger.admit("x", "thor", "m", now=0)
    with pytest.raises(ValueError):
        ledger.admit("x", "spark", "m", now=1)


@pytest.mark.parametrize(
    ("events", "probe_at", "expected"),
    [
        ([("admit", "a", 1.0)], None, 1),  # never probed: every open ticket is unseen
        ([("admit", "a", 1.0)], 2.0, 0),  # admitted before the probe: the probe counts it
        ([("admit", "a", 3.0)], 2.0, 1),  # admitted after: the probe cannot know it (herding within a burst)
        ([("admit", "a", 1.0), ("release", "a", 3.0)], 2.0, -1),  # finished after the probe: the probe over-counts
        ([("admit", "a", 3.0), ("release", "a", 4.0)], 2.0, 0),  # came and went after the probe
        ([("admit", "a", 1.0), ("release", "a", 1.5)], 2.0, 0),  # came and went before the probe
    ],
    ids=["no-probe", "seen", "unseen", "stale-high", "after-probe-both", "before-probe-both"],
)
def test_unseen_load(events: list[tuple[str, str, float]], probe_at: float | None, expected: int) -> None:
    ledger = Ledger(lease_seconds=60)
    if probe_at is not None:
        ledger.note_probe("thor", probe_at)
    for kind, ticket, at in events:
        if kind == "admit":
            ledger.admit(ticket, "thor", "m", now=at)
        else:
            ledger.release(ticket, now=at)
    assert ledger.unseen_load("thor") == expected
    assert ledger.view("thor").unseen_load == expected  # the view counts it in its own pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "release", "probe", "expire"]), st.integers(0, 7)), max_size=60))
def test_no_ticket_leaks(ops: list[tuple[str, int]]) -> None:
    """Whatever the interleaving, every admitted ticket ends up open, released or expired, exactly once."""
    ledger = Ledger(lease_seconds=5)
    now = 0.0
    for i, (op, k) in enumerate(ops):
        now += 0.5
        if op == "admit":
            ledger.admit(f"t{i}", f"e{k % 2}", "m", now)
        elif op == "release":
            ledger.release(f"t{k * 3}", now)
        elif op == "probe":
            ledger.note_probe(f"e{k % 2}", now)
        else:
            ledger.expire(now)
    assert ledger.admitted_total == ledger.open_tickets() + ledger.released_total + ledger.expired_total
    assert ledger.open_tickets() == ledger.open_tickets("e0") + ledger.open_tickets("e1")


def test_an_idle_engine_reaps_tickets_whose_log_entry_was_lost() -> None:
    ledger = Ledger(lease_seconds=900)
    ledger.admit("lost", "thor", "m", now=0)
    ledger.admit("in-flight", "thor", "m", now=9)  # admitted just before the probe: may not have reached the engine
    ledger.admit("elsewhere", "spark", "m", now=0)
    reaped = ledger.reap_idle("thor", probe_sent_at=10, grace=5)
    assert [t.ticket_id for t in reaped] == ["lost"]
    assert ledger.open_tickets("thor") == 1 and ledger.open_tickets("spark") == 1
    assert ledger.expired_total == 1 and ledger.view("thor").open_tickets == 1


def test_a_ticket_crosses_to_the_shared_clock_and_back_with_every_field_kept() -> None:
    """``SharedClock`` builds the shifted ticket field by field (every admission does it): a field it forgot would
    silently fall back to its default in the store and on the other replicas."""
    values: dict[str, Any] = {"ticket_id": "t1", "engine": "e", "model": "m", "admitted_at": 1.0, "lease_deadline": 2.0,
              "reserved_tokens": 7, "expected_done_at": 3.0, "expected_ttft_s": 0.5, "decode_tokens_per_s": 25.0}
    assert sorted(f.name for f in dataclasses.fields(Ticket)) == sorted(values), "a new field: SharedClock must copy it"
    ticket = Ticket(**values)
    clock = SharedClock(100.0)
    shared = clock.to_shared(ticket)
    assert (shared.admitted_at, shared.lease_deadline, shared.expected_done_at) == (101.0, 102.0, 103.0)
    assert (shared.reserved_tokens, shared.expected_ttft_s, shared.engine) == (7, 0.5, "e")
    assert clock.to_local(shared) == ticket
