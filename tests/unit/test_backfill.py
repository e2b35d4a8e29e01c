"""Opt-in EASY backfilling: behind a head blocked on KV, a request that will finish before the head could start runs now;
one that would still be running when the head could start keeps its place. Off (the default), FIFO is strict."""

from __future__ import annotations

import pytest

from controlplane.core.admission import AdmissionCore
from controlplane.core.explain import earliest_fit
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Verdict
from controlplane.core.policy import Policy

ENGINE = EngineView(
    name="v100", url="", max_num_seqs=4, models=(ServedModel("m", 131_072),), version="1",
    sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000), last_ok_at=0.0,
    stale=False, chip_class="v100", anchor_prefill_tokens_per_s=10_000, anchor_decode_tokens_per_s=100,
)


def chat(prompt: int, max_tokens: int) -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=prompt, max_tokens=max_tokens)


def scenario(backfill: bool) -> AdmissionCore:
    """A 60k-token request runs (done in ~160 s); a 40k one parks: 60k + 40k exceeds 90% of 100k tokens of KV."""
    core = AdmissionCore(Policy(backfill=backfill), Ledger(lease_seconds=3600))
    fleet = core.fleet([ENGINE], 0.0)
    assert core.check("running", chat(59_000, 1_000), fleet, 0.0).ticket is not None
    assert core.check("head", chat(39_000, 1_000), core.fleet([ENGINE], 0.1), 0.1).decision.verdict is Verdict.PARK
    return core


def test_earliest_fit_is_when_enough_kv_frees() -> None:
    core = scenario(backfill=False)
    running = core.ledger.get("running")
    assert running is not None
    start = earliest_fit(chat(39_000, 1_000), core.fleet([ENGINE], 1.0), core.policy, 1.0)
    assert start == pytest.approx(running.expected_done_at)


@pytest.mark.parametrize(("backfill", "short_admitted"), [(False, False), (True, True)], ids=["strict-fifo", "backfill"])
def test_a_short_request_behind_a_blocked_head(backfill: bool, short_admitted: bool) -> None:
    core = scenario(backfill)
    # 4k prompt + 1k tokens: ~10 s, long before the running request frees the KV the head needs.
    short = core.check("short", chat(4_000, 1_000), core.fleet([ENGINE], 1.0), 1.0)
    assert (short.ticket is not None) is short_admitted
    # 4k prompt + 25k tokens: it fits too, but would still run when the head could start: it waits its turn.
    long = core.check("long", chat(4_000, 25_000), core.fleet([ENGINE], 1.1), 1.1)
    assert long.decision.verdict is Verdict.PARK


def test_backfill_on_wake_keeps_the_head_first_in_line() -> None:
    core = scenario(backfill=False)
    core.check("short", chat(4_000, 1_000), core.fleet([ENGINE], 1.0), 1.0)  # parks behind the head (strict)
    core.set_policy(Policy(backfill=True), admit_stale=True)
    woken = core.wake(core.fleet([ENGINE], 2.0), 2.0)
    assert [o.request_id for o in woken] == ["short"]
    assert [p.request_id for p in core.parked()] == ["head"]
    core.release("running", 200.0)
    assert [o.request_id for o in core.wake(core.fleet([ENGINE], 200.0), 200.0)] == ["head"]
