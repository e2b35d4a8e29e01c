"""The limiter's pure parts, table by table: GCRA checks, refunds, verdicts, OpenAI's header formats, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ratelimit.core import (
    NEVER, ChargedMeter, ChargeRequest, LimiterSettings, LimitKind, Limits, LimitState, MeterState, Outcome, Rate,
    Scope, Verdict, check_meter, decide_charge, plan_charge, refund_s, settle_meter, verdict,
)
from ratelimit.headers import go_duration, openai_headers, retry_after_seconds, tightest


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0s"), (-3.0, "0s"), (0.0004, "1ms"), (0.012, "12ms"), (0.0064, "7ms"), (0.999, "999ms"), (1.0, "1s"),
    (8.64, "8.64s"), (17.5, "17.5s"), (59.9991, "1m0s"), (360.0, "6m0s"), (361.25, "6m1.25s"), (3600.0, "1h0m0s"),
    (3723.5, "1h2m3.5s"),
], ids=lambda v: str(v))
def test_durations_are_written_like_go_and_openai(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


@pytest.mark.parametrize(("wait", "header"), [(0.001, 1), (0.3, 1), (1.0, 1), (1.2, 2), (20.0, 20), (59.5, 60)])
def test_retry_after_is_whole_seconds_rounded_up(wait: float, header: int) -> None:
    assert retry_after_seconds(wait) == header


RPM6 = Rate(6)  # T = 10 s


@pytest.mark.parametrize(("state", "now", "cost", "wait"), [
    (None, 100.0, 1, 0.0),                              # empty meter
    (None, 100.0, 6, 0.0),                              # the whole budget at once
    (None, 100.0, 7, NEVER),                            # more than the whole budget: never
    (MeterState(100.0, 50.0), 100.0, 1, 0.0),           # 50 s of debt + 10 s = 60 s: fits exactly
    (MeterState(100.0, 50.0), 100.0, 2, 10.0),          # 70 s: 10 s too many
    (MeterState(100.0, 50.0), 105.0, 2, 5.0),           # 5 s drained since
    (MeterState(100.0, 50.0), 150.0, 6, 0.0),           # full again
    (MeterState(100.0, 50.0), 100.0, 0, 0.0),           # a zero cost always fits a meter within its period
], ids=["empty", "whole", "too-large", "exact", "over", "drained-some", "full-again", "zero"])
def test_check_meter(state: MeterState | None, now: float, cost: int, wait: float) -> None:
    assert check_meter(state, now, RPM6, cost).wait_s == pytest.approx(wait)


@pytest.mark.parametrize(("end", "removed", "elapsed", "credit"), [
    (30.0, 10.0, 0.0, 10.0),    # the unused top is all ahead
    (30.0, 10.0, 25.0, 5.0),    # half of it drained
    (30.0, 10.0, 30.0, 0.0),    # all of it drained
    (30.0, 30.0, 10.0, 20.0),   # nothing used, a third drained
], ids=["ahead", "half", "drained", "partly"])
def test_refund_gives_back_only_what_is_still_ahead(end: float, removed: float, elapsed: float, credit: float) -> None:
    assert refund_s(end, removed, elapsed) == credit


def test_a_settle_after_the_meter_started_afresh_gives_nothing_back() -> None:
    charged = ChargedMeter("k", LimitKind.TOKENS, cost=100, unit_s=0.1, born=0.0, end_s=10.0, credit_s=0.0)
    afresh = MeterState(born=20.0, tat_s=15.0)  # emptied at 10 s, charged again from 20 s
    assert settle_meter(charged, afresh, 21.0, actual_tokens=0, refund_request=False) == afresh


def test_an_extra_is_put_on_top_unchecked() -> None:
    charged = ChargedMeter("k", LimitKind.TOKENS, cost=100, unit_s=0.1, born=0.0, end_s=10.0, credit_s=0.0)
    after = settle_meter(charged, MeterState(0.0, 58.0), 1.0, actual_tokens=200, refund_request=False)
    assert after == MeterState(0.0, 68.0)  # 67 s of debt: beyond the period, so nothing fits for 7 s


def test_a_refused_verdict_says_what_refused_and_the_longest_wait() -> None:
    scopes = (Scope("t", Limits(requests=Rate(2), concurrent=1)), Scope("t/m", Limits(tokens=Rate(600))))
    request = ChargeRequest(scopes, tokens=300, charge_id="x")
    plan = plan_charge(request)
    states = [MeterState(0.0, 60.0), MeterState(0.0, 40.0)]  # requests: full; tokens: 400 of 600 used
    decision = decide_charge(plan, states, [1], now=0.0)
    v = verdict(request, plan, decision, 0.0, LimiterSettings(concurrency_retry_after_s=3.0))
    assert v.outcome is Outcome.OVER_LIMIT
    assert [(s.key, s.kind, s.remaining) for s in v.denied_by] == [
        ("t", LimitKind.REQUESTS, 0), ("t/m", LimitKind.TOKENS, 200), ("t", LimitKind.CONCURRENT, 0)]
    assert v.retry_after_s == pytest.approx(30.0)  # requests: 30 s; tokens: 10 s; concurrency: 3 s


def test_headers_report_the_tightest_limit_of_each_kind() -> None:
    states = (LimitState("t", LimitKind.TOKENS, 10_000, 9_000, 6.0),
              LimitState("t/m", LimitKind.TOKENS, 1000, 50, 57.0),
              LimitState("t", LimitKind.REQUESTS, 60, 59, 1.0), LimitState("t", LimitKind.CONCURRENT, 4, 0, 0.0))
    assert tightest(states, LimitKind.TOKENS) == states[1]
    headers = openai_headers(Verdict(Outcome.OVER_LIMIT, states, (states[1],), retry_after_s=2.5))
    assert headers == (
        ("x-ratelimit-limit-requests", "60"), ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-limit-tokens", "1000"), ("x-ratelimit-remaining-tokens", "50"),
        ("x-ratelimit-reset-tokens", "57s"),
        ("retry-after", "3"),
    )
    assert openai_headers(Verdict(Outcome.ALLOWED, ())) == ()


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Rate(0), "Rate.limit"),
    (lambda: Rate(True), "Rate.limit"),
    (lambda: Rate(10, 0), "Rate.period_s"),
    (lambda: Rate(10, math.inf), "Rate.period_s"),
    (lambda: Limits(concurrent=0), "Limits.concurrent"),
    (lambda: Scope("", Limits()), "Scope.key"),
    (lambda: Scope("k", Limits(), requests_cost=-1), "Scope.requests_cost"),
    (lambda: ChargeRequest((), tokens=-1), "ChargeRequest.tokens"),
    # A float where the type says int: refused at run time too.
    (lambda: ChargeRequest((), requests=1.5), "ChargeRequest.requests"),  # type: ignore[arg-type]
    (lambda: ChargeRequest((Scope("k", Limits()), Scope("k", Limits()))), "name a key twice"),
    (lambda: ChargeRequest((Scope("k", Limits(concurrent=1)),)), "needs a charge_id"),
    (lambda: ChargeRequest((), charge_id=""), "ChargeRequest.charge_id"),
    (lambda: LimiterSettings(lease_s=0), "lease_s"),
    (lambda: LimiterSettings(concurrency_retry_after_s=-1), "concurrency_retry_after_s"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_are_refused_with_the_field_named(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
