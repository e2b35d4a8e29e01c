"""Adaptive LIFO in the parking lot, which since "shed early" reorders only requests still inside their decision window
(``shed_decision_seconds``): FIFO while a class's oldest parked request has waited no longer than ``lifo_after_ms``;
past it, while no request of the class is committed, a wake serves the newest first (critical still before standard);
``lifo_after_ms: 0`` keeps strict FIFO however long the wait. A committed request (parked longer than the window) is
served before every request that parked after it, LIFO or not. With the defaults (2000 ms against a 1 s window) the lot
is FIFO."""

from __future__ import annotations

import pytest

from controlplane.config import DEFAULTS, ConfigError, parse_config
from controlplane.core.admission import AdmissionCore
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Priority, Reason, Verdict
from controlplane.core.policy import Policy

ENGINE = EngineView(
    name="one", url="", max_num_seqs=1, models=(ServedModel("m", 131_072),), version="1",
    sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000), last_ok_at=0.0,
    stale=False, chip_class="one", anchor_prefill_tokens_per_s=10_000, anchor_decode_tokens_per_s=100,
)


def chat(priority: Priority = Priority.STANDARD) -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=100, max_tokens=100, priority=priority)


WINDOW_S = 10.0
"""A decision window longer than every wait below: nobody is committed, so LIFO may reorder them all."""


def parked_three(lifo_after_ms: float, window_s: float = WINDOW_S) -> AdmissionCore:
    """One slot, taken; a, b, c park at 0.1, 0.2, 0.3 s."""
    core = AdmissionCore(Policy(lifo_after_ms=lifo_after_ms, shed_decision_s=window_s), Ledger(lease_seconds=3600))
    assert core.check("running", chat(), core.fleet([ENGINE], 0.0), 0.0).ticket is not None
    for i, rid in enumerate("abc", start=1):
        now = i / 10
        assert core.check(rid, chat(), core.fleet([ENGINE], now), now).decision.verdict is Verdict.PARK
    return core


def release_and_wake(core: AdmissionCore, ticket: str, now: float) -> list[str]:
    core.release(ticket, now)
    return [o.request_id for o in core.wake(core.fleet([ENGINE], now), now)]


def test_fifo_below_the_threshold() -> None:
    core = parked_three(1000)
    assert release_and_wake(core, "running", 0.9) == ["a"]  # the oldest has waited 0.8 s
    assert [p.request_id for p in core.parked()] == ["b", "c"]


def test_lifo_past_the_threshold() -> None:
    core = parked_three(1000)
    assert release_and_wake(core, "running", 1.5) == ["c"]  # the oldest has waited 1.4 s: newest first
    assert release_and_wake(core, "c", 1.6) == ["b"]
    assert release_and_wake(core, "b", 1.7) == ["a"]  # the old one runs once nothing newer waits
    assert not core.parked()


def test_committed_requests_are_served_in_arrival_order_past_the_threshold() -> None:
    """The same lot with a 1 s decision window: a, b and c have waited past it by 1.5 s (committed), so they are served
    oldest first, though the oldest has waited past ``lifo_after_ms``."""
    core = parked_three(1000, window_s=1.0)
    assert release_and_wake(core, "running", 1.5) == ["a"]
    assert release_and_wake(core, "a", 1.6) == ["b"]
    assert release_and_wake(core, "b", 1.7) == ["c"]


def test_lifo_never_puts_a_newer_request_before_a_committed_one() -> None:
    """A committed request (a, parked 1.4 s ago against a 1 s window) holds the class to FIFO: the newer d, still inside
    its window, waits behind it."""
    core = parked_three(500, window_s=1.0)
    core.cancel("b")
    core.cancel("c")
    assert core.check("d", chat(), core.fleet([ENGINE], 1.4), 1.4).decision.verdict is Verdict.PARK
    assert release_and_wake(core, "running", 1.5) == ["a"]
    assert release_and_wake(core, "a", 2.0) == ["d"]


def test_lifo_returns_to_fifo_once_the_old_ones_are_gone() -> None:
    core = parked_three(1000)
    assert release_and_wake(core, "running", 1.5) == ["c"]
    core.cancel("a")  # the oldest left (client gone); b has waited 1.3 s, still past the threshold
    assert core.check("d", chat(), core.fleet([ENGINE], 1.55), 1.55).decision.verdict is Verdict.PARK
    assert release_and_wake(core, "c", 1.6) == ["d"]
    core.cancel("b")
    for rid, now in (("e", 1.7), ("f", 1.8)):
        assert core.check(rid, chat(), core.fleet([ENGINE], now), now).decision.verdict is Verdict.PARK
    assert release_and_wake(core, "d", 2.0) == ["e"]  # e has waited 0.3 s: FIFO again


def test_zero_keeps_strict_fifo() -> None:
    core = parked_three(0)
    assert release_and_wake(core, "running", 100.0) == ["a"]
    assert release_and_wake(core, "a", 101.0) == ["b"]


def test_critical_still_before_standard_under_lifo() -> None:
    core = parked_three(1000)
    assert core.check("crit", chat(Priority.CRITICAL), core.fleet([ENGINE], 0.4), 0.4).decision.verdict is Verdict.PARK
    # Both classes past the threshold at 1.5 s: the critical one first, then the newest standard.
    assert release_and_wake(core, "running", 1.5) == ["crit"]
    assert release_and_wake(core, "crit", 1.6) == ["c"]


def test_park_deadline_still_sheds_the_old_ones() -> None:
    """``max_park_s`` is the backstop even for a committed request: the slot never frees, and the request that was
    expected to start within a second is shed ``park_timeout`` (with a Retry-After) once it has waited that long, and
    not before, however far past its expected start it is."""
    core = AdmissionCore(Policy(lifo_after_ms=1000, max_park_s=5), Ledger(lease_seconds=3600))
    assert core.check("running", chat(), core.fleet([ENGINE], 0.0), 0.0).ticket is not None
    assert core.check("old", chat(), core.fleet([ENGINE], 0.1), 0.1).decision.verdict is Verdict.PARK
    for tick in range(2, 51):
        assert not core.expire_parked(core.fleet([ENGINE], tick / 10), tick / 10), tick
    shed = core.expire_parked(core.fleet([ENGINE], 5.2), 5.2)
    assert [(o.request_id, o.decision.reason) for o in shed] == [("old", Reason.PARK_TIMEOUT)]
    assert shed[0].decision.retry_after_s is not None and shed[0].decision.retry_after_s >= 1


@pytest.mark.parametrize("value", [0, 250, 1000.0])
def test_the_config_key(value: float) -> None:
    assert DEFAULTS["admission"]["lifo_after_ms"] == Policy().lifo_after_ms
    raw = {"engines": [{"name": "a", "url": "http://127.0.0.1:1"}], "admission": {"lifo_after_ms": value}}
    assert parse_config(raw).policy.lifo_after_ms == value


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"engines": [{"name": "a", "url": "http://127.0.0.1:1"}], "admission": {"lifo_after_ms": -1}})
    assert [p.split(":")[0] for p in caught.value.problems] == ["admission.lifo_after_ms"]


def test_a_deadline_fraction_turns_lifo_before_lifo_after_ms() -> None:
    """Deadlines of 1 s keep a 2 s ``lifo_after_ms`` from ever passing; ``lifo_deadline_fraction`` 0.5 turns the lot LIFO
    once the oldest has waited half its deadline, and 0 (the default) keeps it FIFO, as a queue at 95% load needs."""
    def parked(fraction: float) -> AdmissionCore:
        core = AdmissionCore(Policy(lifo_after_ms=2000, lifo_deadline_fraction=fraction), Ledger(lease_seconds=3600))
        # Short answers (0.2 s each): every request is expected to start well within its deadline, so none is shed.
        holder = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=100, max_tokens=20)
        assert core.check("running", holder, core.fleet([ENGINE], 0.0), 0.0).ticket is not None
        for i, rid in enumerate("abc", start=1):
            request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=100, max_tokens=20,
                                       max_ttft_ms=1000)
            now = i / 10
            assert core.check(rid, request, core.fleet([ENGINE], now), now).decision.verdict is Verdict.PARK
        return core

    assert release_and_wake(parked(0.5), "running", 0.75) == ["c"]  # a has waited 0.65 s of its 1 s
    assert release_and_wake(parked(0.0), "running", 0.75) == ["a"]
    assert Policy().lifo_deadline_fraction == 0.0
