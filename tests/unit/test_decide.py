"""The decision core, table-driven: every refusal, every fit rule, parking, shedding and Retry-After."""

from __future__ import annotations

import json

import pytest

from controlplane.core.decide import decide
from controlplane.core.waits import retry_after
from controlplane.core.model import Priority
from controlplane.core.engines import EngineRates, EngineSample, EngineView, ServedModel
from controlplane.core.fleet import EngineLedger, Fleet, RateTables
from controlplane.core.model import InferenceRequest, Reason, Verdict
from controlplane.core.policy import Box, ModelPolicy, Policy, meets_floor
from controlplane.core.prefix import prompt_blocks
from controlplane.core.request import RequestError, parse_request
from controlplane.edge import http_status, reply, response_body

P = Policy(default_max_tokens=100)


def engine(name: str, running: float | None = 0, waiting: float | None = 0, *, kv: float | None = 0.0,
           capacity: int | None = 100_000, stale: bool = False, models: tuple[str, ...] = ("cortex",),
           seqs: int | None = 2, version: str | None = "0.10.1", max_len: int | None = 32_768,
           chip: str = "", rates: EngineRates | None = None) -> EngineView:
    return EngineView(
        name=name, url=f"http://{name}", max_num_seqs=seqs, models=tuple(ServedModel(m, max_len) for m in models),
        version=version, sample=EngineSample(taken_at=0.0, running=running, waiting=waiting, kv_usage=kv,
                                             kv_capacity_tokens=capacity),
        last_ok_at=0.0, stale=stale, chip_class=chip or name, rates=rates,
    )


def fleet(*engines: EngineView, ledger: dict[str, EngineLedger] | None = None, admit_stale: bool = True,
          solo: dict[tuple[str, str], float] | None = None) -> Fleet:
    return Fleet(tuple(engines), ledger or {}, admit_stale, RateTables(solo_decode=solo or {}))


def chat(prompt_tokens: int = 10, max_tokens: int | None = 100, priority: str = "standard",
         model: str = "cortex") -> InferenceRequest:
    return InferenceRequest("POST", "/v1/chat/completions", model, prompt_tokens=prompt_tokens,
                            max_tokens=max_tokens, priority=Priority(priority))


# -- parsing ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "code"),
    [
        ("POST", "/v1/chat/completions", b"{", {}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b"\xff\xfe", {}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', {}, 400, "missing_model"),
        ("POST", "/v1/chat/completions", b'{"model": 7}', {}, 400, "missing_model"),
        ("POST", "/v1/chat/completions", b'{"model": ""}', {}, 400, "missing_model"),
        ("POST", "/v1/chat/completions", b'{"model": "m", "max_tokens": 0}', {}, 400, "invalid_max_tokens"),
        ("POST", "/v1/chat/completions", b'{"model": "m", "max_tokens": "9"}', {}, 400, "invalid_max_tokens"),
        ("POST", "/v1/chat/completions", b'{"model": "m"}', {"x-sluice-priority": "urgent"}, 400, "invalid_priority"),
        ("GET", "/v1/chat/completions", b"", {}, 404, "unknown_url"),
        ("POST", "/admin", b"{}", {}, 404, "unknown_url"),
    ],
    ids=["truncated", "not-object", "not-utf8", "no-model", "model-not-string", "empty-model", "zero-max-tokens",
         "string-max-tokens", "bad-priority", "wrong-method", "path"],
)
def test_malformed_requests_are_refused(method: str, path: str, body: bytes, headers: dict[str, str], status: int,
                                        code: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(method, path, body, headers)
    answer = reply(caught.value.reason)
    assert (answer.status, answer.code, answer.type) == (status, code, "invalid_request_error")


def test_parse_estimates_prompt_tokens_and_reads_fields() -> None:
    body = json.dumps({"model": "cortex", "stream": True, "max_tokens": 50, "messages": [
        {"role": "system", "content": "x" * 400},
        {"role": "user", "content": [{"type": "text", "text": "y" * 399}]},
    ]}).encode()
    parsed = parse_request("POST", "/v1/chat/completions?x=1", body, {"x-sluice-priority": "Critical"})
    rendered = "\x1esystem\x1f" + "x" * 400 + "\x1euser\x1f" + "y" * 399  # 813 characters: 3 blocks of 256
    assert parsed == InferenceRequest("POST", "/v1/chat/completions", "cortex", stream=True, prompt_tokens=200,
                                      prompt_chars=799, prompt_messages=2, max_tokens=50, priority=Priority.CRITICAL,
                                      prefix_blocks=prompt_blocks(rendered, 256, 256))
    assert len(parsed.prefix_blocks) == 3
    assert parse_request("POST", "/v1/completions", b'{"model": "m", "prompt": "abcdefgh"}').prompt_tokens == 2


# -- decisions ----------------------------------------------------------------------------------------------------------
CASES = [
    # id, fleet, request, verdict, engine, reason
    ("least-probe", fleet(engine("thor", 1), engine("spark", 0)), chat(), Verdict.ADMIT, "spark", Reason.FINISH_SOONEST),
    ("unseen-tickets", fleet(engine("thor"), engine("spark"), ledger={"spark": EngineLedger(unseen_load=1)}),
     chat(), Verdict.ADMIT, "thor", Reason.FINISH_SOONEST),
    ("open-tickets-beat-stale-probe", fleet(engine("thor", 0), engine("spark", 0),
                                            ledger={"thor": EngineLedger(open_tickets=1)}),
     chat(), Verdict.ADMIT, "spark", Reason.FINISH_SOONEST),
    ("cap-N-not-N-minus-1", fleet(engine("thor", 1, seqs=2)), chat(), Verdict.ADMIT, "thor", Reason.FINISH_SOONEST),
    ("cap-full", fleet(engine("thor", 1, 1, seqs=2)), chat(), Verdict.PARK, None, Reason.CAP),
    ("cap-full-by-unseen", fleet(engine("thor", 1, seqs=2), ledger={"thor": EngineLedger(unseen_load=1)}),
     chat(), Verdict.PARK, None, Reason.CAP),
    ("kv-watermark", fleet(engine("thor", kv=0.90)), chat(), Verdict.PARK, None, Reason.KV_WATERMARK),
    ("kv-need-probe", fleet(engine("thor", kv=0.5, capacity=100_000, max_len=None)),
     chat(prompt_tokens=39_950, max_tokens=100),
     Verdict.PARK, None, Reason.KV_NEED),
    ("kv-need-committed", fleet(engine("thor", kv=0.0, capacity=100_000),
                                ledger={"thor": EngineLedger(open_tickets=1, committed_tokens=80_000)}),
     chat(prompt_tokens=9_950, max_tokens=100), Verdict.PARK, None, Reason.KV_NEED),
    ("kv-need-fits-exactly", fleet(engine("thor", kv=0.0, capacity=100_000),
                                   ledger={"thor": EngineLedger(open_tickets=1, committed_tokens=80_000)}),
     chat(prompt_tokens=9_900, max_tokens=100), Verdict.ADMIT, "thor", Reason.FINISH_SOONEST),
    ("kv-need-unseen-reserved", fleet(engine("thor", kv=0.5, capacity=100_000),
                                      ledger={"thor": EngineLedger(unseen_load=1, unseen_reserved_tokens=39_000)}),
     chat(prompt_tokens=1_000, max_tokens=100), Verdict.PARK, None, Reason.KV_NEED),
    ("unknown-gauges-skip-rules", fleet(engine("thor", None, None, kv=None, capacity=None)), chat(),
     Verdict.ADMIT, "thor", Reason.FINISH_SOONEST),
    ("second-engine-fits", fleet(engine("thor", 2, seqs=2), engine("spark", 0, kv=0.95)), chat(),
     Verdict.PARK, None, Reason.CAP),
    ("skip-stale", fleet(engine("thor", 0, stale=True), engine("spark", 1)), chat(), Verdict.ADMIT, "spark",
     Reason.FINISH_SOONEST),
    ("all-stale-fail-open", fleet(engine("thor", stale=True)), chat(), Verdict.ADMIT, "thor", Reason.STALE_FAIL_OPEN),
    ("all-stale-fail-closed", fleet(engine("thor", stale=True), admit_stale=False), chat(), Verdict.SHED, None,
     Reason.NO_READY_ENGINE),
    ("unknown-model", fleet(engine("thor", models=("other",))), chat(), Verdict.REJECT, None, Reason.UNKNOWN_MODEL),
    ("context-length", fleet(engine("thor", max_len=4096)), chat(prompt_tokens=4000, max_tokens=100),
     Verdict.REJECT, None, Reason.CONTEXT_LENGTH),
    ("context-beyond-every-kv", fleet(engine("thor", capacity=10_000, max_len=None)), chat(prompt_tokens=9_500),
     Verdict.REJECT, None, Reason.CONTEXT_LENGTH),
    ("context-fits-the-longer-engine", fleet(engine("thor", max_len=4096), engine("spark", 1, max_len=8192)),
     chat(prompt_tokens=4000), Verdict.ADMIT, "spark", Reason.FINISH_SOONEST),
    ("sheddable-shed-when-saturated", fleet(engine("thor", 2)), chat(priority="sheddable"), Verdict.SHED, None,
     Reason.SATURATED),
    ("sheddable-admitted-when-room", fleet(engine("thor", 0)), chat(priority="sheddable"), Verdict.ADMIT, "thor",
     Reason.FINISH_SOONEST),
    ("tie-goes-to-headroom", fleet(engine("a", 1, seqs=2), engine("b", 1, seqs=8)), chat(), Verdict.ADMIT, "b",
     Reason.FINISH_SOONEST),
]


@pytest.mark.parametrize(("fleet_", "request_", "verdict", "chosen", "reason"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(fleet_: Fleet, request_: InferenceRequest, verdict: Verdict, chosen: str | None,
                reason: Reason) -> None:
    decision = decide(request_, fleet_, P, now=10.0)
    assert (decision.verdict, decision.engine, decision.reason) == (verdict, chosen, reason)
    if verdict is Verdict.ADMIT:
        assert decision.reserved_tokens == request_.prompt_tokens + (request_.max_tokens or P.default_max_tokens)
        assert decision.expected_done_at > 10.0
    if verdict in (Verdict.SHED, Verdict.REJECT):
        body = json.loads(response_body(decision))["error"]
        assert body["code"] == {"unknown_model": "model_not_found"}.get(reason.value, reason.value)
        assert body["message"] == decision.detail and decision.detail
    if verdict is Verdict.SHED:
        assert http_status(decision) == 503 and 1 <= (decision.retry_after_s or 0) <= 60


def test_queued_ahead_parks_even_when_it_fits() -> None:
    decision = decide(chat(), fleet(engine("thor")), P, now=0, queued_ahead=1)
    assert (decision.verdict, decision.reason) == (Verdict.PARK, Reason.QUEUED_BEHIND)


@pytest.mark.parametrize(
    ("floors", "versions", "verdict", "chosen"),
    [
        ((("cortex", "0.10.0"),), ("0.9.2", "0.10.1"), Verdict.ADMIT, "spark"),
        ((("cortex", "0.10.0"),), ("0.9.2", None), Verdict.SHED, None),  # unknown version never meets a floor
        ((("CORT", "0.11"),), ("0.10.1", "0.11.0"), Verdict.ADMIT, "spark"),  # pattern is a case-insensitive substring
        ((("other", "9"),), ("0.1", "0.1"), Verdict.ADMIT, "thor"),  # floors for other models do not apply
    ],
    ids=["below-floor-skipped", "all-below-or-unknown", "pattern", "other-model"],
)
def test_version_floors(floors: tuple[tuple[str, str], ...], versions: tuple[str | None, str | None],
                        verdict: Verdict, chosen: str | None) -> None:
    policy = Policy(version_floors=floors)
    f = fleet(engine("thor", version=versions[0]), engine("spark", 1, version=versions[1]))
    decision = decide(chat(), f, policy, now=0)
    assert (decision.verdict, decision.engine) == (verdict, chosen)
    if verdict is Verdict.SHED:
        assert decision.reason is Reason.VERSION_FLOOR and "unknown" in decision.detail


def test_version_comparison() -> None:
    assert meets_floor("0.10.1", "0.10") and meets_floor("0.11.0rc1", "0.11.0") and meets_floor("b6500-sim", "b6000")
    assert not meets_floor("0.9.9", "0.10.0") and not meets_floor(None, "0.1") and not meets_floor("main", "0.1")


def test_box_pool_in_tokens_holds_across_engines() -> None:
    policy = Policy(boxes=(Box("box", ("a", "b"), kv_budget_tokens=50_000),))
    f = fleet(engine("a", kv=0.0), engine("b", kv=0.0), ledger={"a": EngineLedger(open_tickets=1, committed_tokens=45_000)})
    assert decide(chat(prompt_tokens=4_800, max_tokens=100), f, policy, now=0).verdict is Verdict.ADMIT
    blocked = decide(chat(prompt_tokens=5_000, max_tokens=100), f, policy, now=0)
    assert (blocked.verdict, blocked.reason) == (Verdict.PARK, Reason.BOX_POOL)


def test_box_pool_in_bytes_prices_unknown_rates_at_the_largest() -> None:
    """Seed 002: co-resident models spend one byte pool at different rates; tokens are not a common unit."""
    policy = Policy(
        models={"big": ModelPolicy(kv_bytes_per_token=100), "small": ModelPolicy(kv_bytes_per_token=10)},
        boxes=(Box("box", ("a", "b"), kv_budget_bytes=1_000_000),),
    )
    f = fleet(engine("a", models=("small",)), engine("b", models=("big",)),
              ledger={"a": EngineLedger(open_tickets=1, committed_tokens=90_000)})  # 0.9 MB of the 1 MB pool
    assert decide(chat(prompt_tokens=900, max_tokens=100, model="big"), f, policy, now=0).verdict is Verdict.ADMIT
    over = decide(chat(prompt_tokens=1_000, max_tokens=100, model="big"), f, policy, now=0)
    assert over.reason is Reason.BOX_POOL
    unknown = Policy(models=policy.models, boxes=policy.boxes)
    f2 = fleet(engine("a", models=("small",)), engine("b", models=("mystery",)),
               ledger={"a": EngineLedger(open_tickets=1, committed_tokens=90_000)})
    assert decide(chat(prompt_tokens=1_000, max_tokens=100, model="mystery"), f2, unknown, now=0).reason is Reason.BOX_POOL


@pytest.mark.parametrize(
    ("solo", "seed", "open_", "verdict"),
    [(14.0, None, 0, Verdict.ADMIT), (14.0, None, 1, Verdict.PARK), (None, 93.0, 11, Verdict.ADMIT),
     (None, None, 40, Verdict.ADMIT)],
    ids=["under-cap", "at-cap", "seeded-rate", "no-rate-no-cap"],
)
def test_quality_cap_from_the_models_own_solo_rate(solo: float | None, seed: float | None, open_: int,
                                                    verdict: Verdict) -> None:
    """cap = floor(solo x overcommit / floor), at least 1: seed 002's gemma (solo 14 tok/s, floor 15) gets 1 concurrent
    request where a provider-level benchmark of 93 tok/s would have granted 12."""
    policy = Policy(models={"cortex": ModelPolicy(decode_floor_tokens_per_s=15, solo_decode_tokens_per_s=seed)})
    f = fleet(engine("thor", 0, seqs=None, capacity=None),
              ledger={"thor": EngineLedger(open_tickets=open_, open_by_model=(("cortex", open_),))},
              solo={("cortex", "thor"): solo} if solo else None)
    decision = decide(chat(), f, policy, now=0)
    assert decision.verdict is verdict
    if verdict is Verdict.PARK:
        assert decision.reason is Reason.QUALITY_CAP


def test_retry_after_follows_the_ledger() -> None:
    engines = [engine("thor")]
    f = fleet(*engines, ledger={"thor": EngineLedger(open_tickets=3, expected_done=(12.2, 20.0, 30.0))})
    assert retry_after(engines, f, P, now=10.0) == 3  # first slot frees at 12.2 s
    assert retry_after(engines, f, P, now=10.0, queued_ahead=1) == 10
    # Deeper than every open ticket: the last one (20 s away) plus a typical request (20 s / 3) per extra round.
    assert retry_after(engines, f, P, now=10.0, queued_ahead=5) == 40
    assert retry_after(engines, f, P, now=10.0, queued_ahead=20) == 60  # clamped to the max
    assert retry_after(engines, fleet(*engines), P, now=10.0) == 1  # nothing open: the minimum


def test_model_list_merges_admissible_engines() -> None:
    f = fleet(engine("thor", models=("cortex", "muse")), engine("spark"), engine("old", stale=True, models=("gone",)),
              admit_stale=False)
    decision = decide(InferenceRequest("GET", "/v1/models", None), f, P, now=0)
    assert decision.verdict is Verdict.ANSWER and http_status(decision) == 200
    assert [m.model_id for m in decision.models] == ["cortex", "muse"]
    assert [m["id"] for m in json.loads(response_body(decision))["data"]] == ["cortex", "muse"]


def test_a_deadline_only_a_freed_slot_can_meet_parks_as_ttft_deadline_not_cap() -> None:
    """One reason per meaning: the engine is full (each engine's own misfit is ``cap``), but the request parks because no
    estimate meets its deadline yet (``ttft_deadline``); an idle engine could prefill it in time, so it is not shed."""
    full = fleet(engine("thor", 1, seqs=1), ledger={"thor": EngineLedger(open_tickets=1, expected_done=(40.0,))})
    request = InferenceRequest("POST", "/v1/chat/completions", "cortex", prompt_tokens=10, max_tokens=100,
                               max_ttft_ms=2_000)
    decision = decide(request, full, P, now=10.0)
    assert (decision.verdict, decision.reason) == (Verdict.PARK, Reason.TTFT_DEADLINE)
    assert decision.park_limit_s is not None and 0 < decision.park_limit_s < 2.0
    no_deadline = decide(InferenceRequest("POST", "/v1/chat/completions", "cortex", prompt_tokens=10, max_tokens=100),
                         full, P, now=10.0)
    assert (no_deadline.verdict, no_deadline.reason) == (Verdict.PARK, Reason.CAP)


def test_without_max_tokens_only_the_prompt_must_fit_the_context() -> None:
    """An engine caps an answer without max_tokens at its context itself, so a prompt that fits is not refused because
    the policy's default output would not (it used to be 400 context_length_exceeded); with max_tokens set, both must fit."""
    from controlplane.core.decide import decide as decide_
    from controlplane.core.engines import EngineSample, EngineView, ServedModel
    from controlplane.core.fleet import Fleet
    from controlplane.core.model import InferenceRequest, Verdict
    from controlplane.core.policy import Policy

    view = EngineView("a", "", 2, (ServedModel("m", 4096),), "1.0", EngineSample(0.0, running=0, waiting=0),
                      last_ok_at=0.0, stale=False, chip_class="a")
    policy = Policy(default_max_tokens=1024)
    open_ended = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=3500, max_tokens=None)
    assert decide_(open_ended, Fleet((view,)), policy, now=0.0).verdict is Verdict.ADMIT
    capped = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=3500, max_tokens=1000)
    refused = decide_(capped, Fleet((view,)), policy, now=0.0)
    assert refused.verdict is Verdict.REJECT and refused.reason.value == "context_length_exceeded"
