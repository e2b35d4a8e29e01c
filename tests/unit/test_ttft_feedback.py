"""TTFT feedback: an engine whose first tokens come slower (or sooner) than estimated is judged by what it delivers."""

from __future__ import annotations

from controlplane.core.admission import AdmissionCore
from controlplane.core.decide import decide
from controlplane.core.feedback import FirstToken, RecentTtfts, TtftCorrections, TtftSummary, end_to_end_error
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Reason, Verdict
from controlplane.core.policy import Policy


def served(corrections: TtftCorrections, engine: str, true_over_raw: float, n: int) -> None:
    """``n`` requests on ``engine`` whose real TTFT is ``true_over_raw`` times the uncorrected estimate; each ratio is
    taken against the estimate as corrected when it was made (as the access log compares with the ticket)."""
    for _ in range(n):
        corrections.observe(engine, true_over_raw / corrections.factor(engine), 0.0)


def test_the_correction_settles_at_the_measured_error() -> None:
    c = TtftCorrections(gain=0.1, maximum=4.0)
    served(c, "spark", 2.0, 80)
    assert abs(c.factor("spark") - 2.0) < 0.05 * 2.0
    assert c.factor("thor") == 1.0, "an engine never measured is not corrected"
    served(c, "spark", 1.0, 120)  # the engine is on time again: the correction goes away
    assert c.factor("spark") < 1.05


def test_the_correction_is_bounded_both_ways() -> None:
    c = TtftCorrections(gain=0.5, maximum=3.0, minimum=0.5)
    served(c, "lucky", 0.01, 50)  # first tokens far sooner than estimated: trusted only down to the minimum
    assert c.factor("lucky") == 0.5
    served(c, "stalled", 100.0, 50)
    assert c.factor("stalled") == 3.0
    assert c.forget("stalled") and c.factor("stalled") == 1.0


def test_a_faster_engine_settles_below_one_and_upward_only_stays_at_one() -> None:
    c = TtftCorrections(gain=0.1, maximum=4.0, minimum=0.5)
    served(c, "fast", 0.7, 80)
    assert abs(c.factor("fast") - 0.7) < 0.05 * 0.7
    upward_only = TtftCorrections(gain=0.1, maximum=4.0)
    served(upward_only, "fast", 0.7, 80)
    assert upward_only.factor("fast") == 1.0


def test_a_factor_below_one_decays_back_toward_one() -> None:
    c = TtftCorrections(gain=0.5, maximum=4.0, half_life_s=60.0, minimum=0.5)
    served(c, "fast", 0.6, 30)
    assert c.factor("fast") < 0.65
    assert c.decay(60.0) == []  # held for a half-life after its last request
    assert c.decay(600.0) == ["fast"] and c.factor("fast") == 1.0


def test_a_lower_maximum_on_reload_clamps_and_gain_zero_turns_it_off() -> None:
    c = TtftCorrections(gain=0.5, maximum=4.0)
    served(c, "a", 3.0, 40)
    assert c.configure(0.5, 2.0, 0.0) == ["a"] and c.factor("a") == 2.0
    assert c.configure(0.0, 2.0, 0.0) == ["a"] and c.factor("a") == 1.0
    assert not c.observe("a", 5.0, 0.0) and c.factor("a") == 1.0
    below = TtftCorrections(gain=0.5, maximum=4.0, minimum=0.25)
    served(below, "b", 0.3, 40)
    assert below.configure(0.5, 4.0, 0.0, minimum=0.5) == ["b"] and below.factor("b") == 0.5


def view(name: str) -> EngineView:
    return EngineView(name=name, url="", max_num_seqs=4, models=(ServedModel("m", 32_768),), version="0.10.1",
                      sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000),
                      last_ok_at=0.0, stale=False, chip_class=name, anchor_prefill_tokens_per_s=1000.0,
                      anchor_decode_tokens_per_s=50.0)


def test_an_engine_slower_than_estimated_loses_deadline_traffic_it_cannot_meet() -> None:
    """A 1500-token prompt prefills in 1.5 s on either engine by their rates; with a 3 s deadline both are in the band.
    Once the access log shows "slow" delivering TTFTs 2.5x its estimates, its corrected TTFT (3.8 s) misses the
    deadline and every such request goes to "ok"; the correction is what the metrics report."""
    core = AdmissionCore(Policy(), Ledger(3600))
    engines = [view("slow"), view("ok")]
    request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=1500, max_tokens=50,
                               max_ttft_ms=3000)
    before = {decide(request, core.fleet(engines, 0.0), core.policy, 0.0, pick=p / 10).engine for p in range(10)}
    assert before == {"slow", "ok"}
    for _ in range(60):
        core.observe_ttft("slow", 2.5 / core.ttft.factor("slow"), 0.0)
    assert 2.3 < core.ttft.factor("slow") <= 2.5
    after = [decide(request, core.fleet(engines, 0.0), core.policy, 0.0, pick=p / 10) for p in range(10)]
    assert {d.engine for d in after} == {"ok"}
    assert all(d.verdict is Verdict.ADMIT and d.reason is Reason.SATISFICING_BAND for d in after)


def test_a_correction_holds_for_a_half_life_after_the_last_request_then_decays_to_none() -> None:
    c = TtftCorrections(gain=1.0, maximum=4.0, half_life_s=60.0)
    assert c.observe("spark", 4.0, now=100.0) and c.factor("spark") == 4.0
    assert c.decay(159.0) == [] and c.factor("spark") == 4.0  # held: its last request came in 59 s ago
    assert c.decay(220.0) == ["spark"] and abs(c.factor("spark") - 2.0) < 0.01  # one half-life past the hold: 4 ** 0.5
    assert c.decay(280.0) == ["spark"] and abs(c.factor("spark") - 2.0 ** 0.5) < 0.01
    c.decay(1000.0)
    assert c.factor("spark") == 1.0 and c.decay(2000.0) == []


def test_an_engine_in_steady_use_keeps_its_correction() -> None:
    c = TtftCorrections(gain=0.1, maximum=4.0, half_life_s=60.0)
    for second in range(600):
        c.observe("spark", 2.0 / c.factor("spark"), now=float(second))
        c.decay(float(second))
    assert abs(c.factor("spark") - 2.0) < 0.05 * 2.0


def test_an_engine_kept_out_by_its_correction_is_tried_again_once_it_decays() -> None:
    """After a stall, "slow" delivered TTFTs 2.5x its estimates and lost every deadline request to "ok". Nothing more is
    learned about an engine that gets no requests: once the correction has decayed, it is back in the band, where its
    next requests measure it again."""
    core = AdmissionCore(Policy(), Ledger(3600))
    engines = [view("slow"), view("ok")]
    request = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=1500, max_tokens=50,
                               max_ttft_ms=3000)
    for _ in range(60):
        core.observe_ttft("slow", 2.5 / core.ttft.factor("slow"), 10.0)

    def chosen(now: float) -> set[str | None]:
        return {decide(request, core.fleet(engines, now), core.policy, now, pick=p / 10).engine for p in range(10)}

    assert core.decay_corrections(60.0) == [] and chosen(60.0) == {"ok"}
    assert core.decay_corrections(400.0) == ["slow"] and core.ttft.factor("slow") < 1.1
    assert chosen(400.0) == {"slow", "ok"}


def test_recent_first_tokens_keep_the_last_requests_of_each_engine() -> None:
    recent = RecentTtfts(size=4)
    for ttft in (9.0, 0.1, 0.2, 0.3, 0.4):  # the oldest (9 s) has left the ring
        recent.record("a", ttft, None)
    recent.record("b", 2.0, 1.6)
    a, b = recent.summary("a"), recent.summary("b")
    assert (a.samples, a.p50_s, a.p90_s, a.error_median) == (4, 0.2, 0.4, None)
    assert (b.samples, b.p50_s, b.error_median) == (1, 2.0, 1.6)
    assert recent.summary("c") == TtftSummary(0, None, None, None)


def test_the_end_to_end_error_prices_the_real_length_at_the_estimated_rate() -> None:
    """A 101-token answer that took 6 s at its engine, admitted with an estimated TTFT of 1 s and 25 tokens/s: the
    estimate for that length is 1 + 100 / 25 = 5 s, the error 1.2. Without the length, the time or the rate (a ticket
    another replica admitted) there is none."""
    timing = FirstToken(engine_s=1.1, gateway_s=0.01, streamed=True, whole_s=6.0, output_tokens=101)
    assert end_to_end_error(timing, 1.0, 25.0) == 6.0 / 5.0
    assert end_to_end_error(timing, 1.0, 0.0) is None
    assert end_to_end_error(FirstToken(1.1, 0.01, True, whole_s=6.0), 1.0, 25.0) is None
    assert end_to_end_error(FirstToken(1.1, 0.01, True, output_tokens=101), 1.0, 25.0) is None
    recent = RecentTtfts()
    for ratio in (0.9, 1.2, 1.0):
        recent.record("a", 1.0, None, ratio)
    assert recent.summary("a").end_to_end_error_median == 1.0
