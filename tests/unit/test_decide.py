"""The first cut of the decision core: refusals, the model list, least effective load."""

from __future__ import annotations

import json

import pytest

from controlplane.core.decide import RequestError, decide, parse_request
from controlplane.core.model import EngineSample, EngineView, Fleet, InferenceRequest, Reason, ServedModel, Verdict


def engine(name: str, running: float | None = 0, waiting: float | None = 0, *, stale: bool = False,
           models: tuple[str, ...] = ("cortex",), seqs: int | None = 2) -> EngineView:
    return EngineView(
        name=name, url=f"http://{name}", max_num_seqs=seqs, models=tuple(ServedModel(m, 4096) for m in models),
        sample=EngineSample(taken_at=0.0, running=running, waiting=waiting), last_ok_at=0.0, stale=stale,
    )


CHAT = InferenceRequest("POST", "/v1/chat/completions", model="cortex")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "reason"),
    [
        ("POST", "/v1/chat/completions", b"{", 400, Reason.MALFORMED_JSON),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, Reason.MALFORMED_JSON),
        ("POST", "/v1/chat/completions", b"\xff\xfe", 400, Reason.MALFORMED_JSON),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, Reason.MISSING_MODEL),
        ("POST", "/v1/chat/completions", b'{"model": 7}', 400, Reason.MISSING_MODEL),
        ("POST", "/v1/chat/completions", b'{"model": ""}', 400, Reason.MISSING_MODEL),
        ("GET", "/v1/chat/completions", b"", 404, Reason.UNKNOWN_PATH),
        ("POST", "/admin", b"{}", 404, Reason.UNKNOWN_PATH),
    ],
    ids=["truncated", "not-object", "not-utf8", "no-model", "model-not-string", "empty-model", "wrong-method", "path"],
)
def test_malformed_requests_are_refused(method: str, path: str, body: bytes, status: int, reason: Reason) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(method, path, body)
    assert (caught.value.status, caught.value.reason) == (status, reason)


def test_parse_reads_model_and_stream_and_ignores_query() -> None:
    parsed = parse_request("POST", "/v1/completions?x=1", b'{"model": "cortex", "stream": true, "prompt": "hi"}')
    assert parsed == InferenceRequest("POST", "/v1/completions", "cortex", stream=True)


@pytest.mark.parametrize(
    ("engines", "unseen", "verdict", "chosen", "reason"),
    [
        ([engine("thor", 1), engine("spark", 0)], {}, Verdict.ADMIT, "spark", Reason.LEAST_LOADED),
        ([engine("thor", 0), engine("spark", 0)], {"spark": 2}, Verdict.ADMIT, "thor", Reason.LEAST_LOADED),
        ([engine("thor", 2), engine("spark", 1, 1)], {"thor": -2}, Verdict.ADMIT, "thor", Reason.LEAST_LOADED),
        ([engine("thor", 0, stale=True), engine("spark", 5)], {}, Verdict.ADMIT, "spark", Reason.LEAST_LOADED),
        ([engine("thor", None, None), engine("spark", 1)], {}, Verdict.ADMIT, "thor", Reason.LEAST_LOADED),
        ([engine("thor", 0, models=("other",))], {}, Verdict.REJECT, None, Reason.UNKNOWN_MODEL),
        ([engine("thor", 0, stale=True), engine("spark", 1, stale=True)], {}, Verdict.ADMIT, "thor",
         Reason.STALE_FAIL_OPEN),
        ([engine("a", 1, seqs=2), engine("b", 1, seqs=8)], {}, Verdict.ADMIT, "b", Reason.LEAST_LOADED),
    ],
    ids=["least-probe", "unseen-tickets", "released-since-probe", "skip-stale", "unknown-gauges-count-as-idle",
         "unknown-model", "all-stale-fail-open", "tie-goes-to-headroom"],
)
def test_decide(engines: list[EngineView], unseen: dict[str, int], verdict: Verdict, chosen: str | None,
                reason: Reason) -> None:
    decision = decide(CHAT, Fleet(tuple(engines), unseen), now=1.0)
    assert (decision.verdict, decision.engine, decision.reason) == (verdict, chosen, reason)
    if verdict is Verdict.REJECT:
        assert decision.status == 404 and json.loads(decision.body)["error"]["code"] == "model_not_found"


def test_all_stale_fail_closed_sheds_with_retry_after() -> None:
    decision = decide(CHAT, Fleet((engine("thor", 0, stale=True),), admit_stale=False), now=1.0)
    assert (decision.verdict, decision.reason, decision.status) == (Verdict.SHED, Reason.NO_READY_ENGINE, 503)
    assert decision.retry_after_s and decision.retry_after_s >= 1
    assert json.loads(decision.body)["error"]["code"] == "no_ready_engine"


@pytest.mark.parametrize(("admit_stale", "models"), [(False, ["cortex", "muse"]), (True, ["cortex", "gone", "muse"])],
                         ids=["fail-closed", "fail-open"])
def test_model_list_merges_admissible_engines(admit_stale: bool, models: list[str]) -> None:
    fleet = Fleet((engine("thor", models=("cortex", "muse")), engine("spark"), engine("old", stale=True, models=("gone",))),
                  admit_stale=admit_stale)
    decision = decide(InferenceRequest("GET", "/v1/models", None), fleet, now=0)
    assert decision.verdict is Verdict.ANSWER and decision.status == 200
    assert [m["id"] for m in json.loads(decision.body)["data"]] == models
