"""The HTTP edge (controlplane/edge.py): one table from every reason and failure to a status and an OpenAI error, used
alike by the Check's denials and by Envoy's local replies and direct responses (xds/resources.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.rpc import code_pb2

from controlplane.config import parse_config
from controlplane.core.model import Decision, Outcome, Reason, Ticket, Verdict
from controlplane.core.waits import refuse, shed
from controlplane.core.engines import ServedModel
from controlplane.core.request import INFERENCE_PATHS, MODELS_PATH, RequestError
from controlplane.edge import (
    REPLIES, Failure, TenantCharge, check_admit, check_deny, check_error, error_json, http_status, openai_error, reply,
)
from controlplane.xds.resources import INFERENCE_PATH_REGEX, build_listener, build_routes

REFUSED = {Reason.INVALID_JSON, Reason.JSON_TOO_DEEP, Reason.MISSING_MODEL, Reason.INVALID_MAX_TOKENS,
           Reason.INVALID_PRIORITY, Reason.INVALID_MAX_TTFT_MS, Reason.INVALID_SESSION, Reason.UNKNOWN_MODEL,
           Reason.UNKNOWN_PATH, Reason.CONTEXT_LENGTH, Reason.INVALID_API_KEY, Reason.MODEL_NOT_ALLOWED,
           Reason.RATE_LIMITED}
SHED = {Reason.NO_READY_ENGINE, Reason.VERSION_FLOOR, Reason.SATURATED, Reason.QUEUE_FULL, Reason.PARK_TIMEOUT,
        Reason.OVERLOADED,
        Reason.TTFT_UNMEETABLE, Reason.STORE_UNAVAILABLE, Reason.RATELIMIT_UNAVAILABLE}


def test_every_reason_and_failure_has_one_reply() -> None:
    assert set(REPLIES) == {*Reason, *Failure}
    assert {r for r in Reason if REPLIES[r].is_error} == REFUSED | SHED
    assert all(REPLIES[f].is_error for f in Failure)


def test_every_error_code_lives_once_and_its_type_follows_its_status() -> None:
    errors = [r for r in REPLIES.values() if r.is_error]
    codes = [r.code for r in errors]
    assert len(codes) == len(set(codes)), "two reasons share an error code"
    for r in errors:
        if r.status == 429:  # the request is fine, its tenant's budget is not
            assert (r.type, r.code) == ("rate_limit_error", "rate_limit_exceeded"), r
            continue
        assert r.type == ("invalid_request_error" if 400 <= r.status < 500 else "server_error"), r
    assert all(REPLIES[r].status == 503 for r in SHED)
    assert all(400 <= REPLIES[r].status < 500 for r in REFUSED)
    assert all(REPLIES[f].code == f.value for f in Failure), "a failure's value is its code"


def test_reasons_named_after_their_code_keep_it() -> None:
    """Where a reason's value and its code differ it is on purpose (metrics labels predate the codes); list them."""
    differ = {r: REPLIES[r].code for r in REFUSED | SHED if REPLIES[r].code != r.value}
    assert differ == {Reason.UNKNOWN_MODEL: "model_not_found", Reason.UNKNOWN_PATH: "unknown_url"}


def denial(response: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    assert response.status.code == code_pb2.PERMISSION_DENIED and response.HasField("denied_response")
    denied = response.denied_response
    headers = {h.header.key: h.header.value for h in denied.headers}
    assert headers["content-type"] == "application/json"
    body = json.loads(denied.body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] is None
    return denied.status.code, headers, body["error"]


@pytest.mark.parametrize(("decision", "status", "code", "err_type"), [
    (refuse(RequestError(Reason.JSON_TOO_DEEP, "too deep")), 400, "json_too_deep", "invalid_request_error"),
    (refuse(RequestError(Reason.UNKNOWN_MODEL, "no such model")), 404, "model_not_found", "invalid_request_error"),
    (refuse(RequestError(Reason.UNKNOWN_PATH, "no such path")), 404, "unknown_url", "invalid_request_error"),
    (shed(Reason.QUEUE_FULL, "lot full", 7), 503, "queue_full", "server_error"),
    (shed(Reason.TTFT_UNMEETABLE, "too slow", 2), 503, "ttft_unmeetable", "server_error"),
], ids=["json-too-deep", "unknown-model", "unknown-path", "queue-full", "ttft-unmeetable"])
def test_check_denial_carries_status_code_and_shape(decision: Decision, status: int, code: str, err_type: str) -> None:
    got_status, headers, error = denial(check_deny(Outcome("r1", decision, parked_for=0.25)))
    assert (got_status, error["code"], error["type"], error["message"]) == (status, code, err_type, decision.detail)
    assert headers["x-sluice-route-reason"] == decision.reason.value
    assert headers["x-sluice-parked-ms"] == "250"
    if decision.verdict is Verdict.SHED:
        assert headers["retry-after"] == str(decision.retry_after_s)
    else:
        assert "retry-after" not in headers


def test_check_error_without_a_decision() -> None:
    status, headers, error = denial(check_error(Failure.INTERNAL_ERROR, "boom", None))
    assert (status, error["code"], error["type"], error["message"]) == (500, "internal_error", "server_error", "boom")
    assert headers["x-sluice-route-reason"] == "internal_error" and "retry-after" not in headers
    status, headers, error = denial(check_error(Failure.UPSTREAM_UNAVAILABLE, "gone", 1))
    assert (status, error["code"], headers["retry-after"]) == (503, "upstream_unavailable", "1")


def test_model_list_is_a_200_answer_rendered_at_the_edge() -> None:
    decision = Decision(Verdict.ANSWER, Reason.MODEL_LIST, models=(ServedModel("cortex", 8192), ServedModel("muse")))
    response = check_deny(Outcome("r1", decision))
    assert response.denied_response.status.code == 200 and http_status(decision) == 200
    body = json.loads(response.denied_response.body)
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("cortex", "model", 8192),
                                                                                   ("muse", "model", None)]


def test_admission_pins_the_engine_and_hides_the_ticket_from_the_client() -> None:
    decision = Decision(Verdict.ADMIT, Reason.FINISH_SOONEST, engine="thor")
    ticket = Ticket("t1", "thor", "cortex", admitted_at=0.0, lease_deadline=1.0)
    response = check_admit(Outcome("r1", decision, ticket))
    assert response.status.code == code_pb2.OK
    upstream = {h.header.key: h.header.value for h in response.ok_response.headers}
    client = {h.header.key: h.header.value for h in response.ok_response.response_headers_to_add}
    assert upstream == {"x-sluice-engine": "thor", "x-sluice-ticket": "t1"}
    assert client == {"x-sluice-engine": "thor", "x-sluice-route-reason": "finish_soonest"}
    assert dict(response.dynamic_metadata) == {"ticket": "t1", "engine": "thor"}
    assert list(response.ok_response.headers_to_remove) == []  # no tenants: an engine's own API key passes through
    tenant = check_admit(Outcome("r1", decision, ticket), TenantCharge("acme", 10, charged=False))
    assert list(tenant.ok_response.headers_to_remove) == ["authorization"]  # a tenant's key is sluice's, not the engine's


def test_error_json_refuses_a_non_error() -> None:
    with pytest.raises(ValueError):
        error_json(Reason.FINISH_SOONEST, "not an error")


CONFIG = parse_config({"engines": [{"name": "thor", "url": "http://127.0.0.1:9000"}]})


def _mappers() -> list[hcm_pb2.ResponseMapper]:
    hcm = hcm_pb2.HttpConnectionManager()
    chain = build_listener(CONFIG).filter_chains[0]
    chain.filters[0].typed_config.Unpack(hcm)
    return list(hcm.local_reply_config.mappers)


def test_envoy_local_replies_are_the_edge_rendering() -> None:
    """Every local-reply body Envoy sends is exactly what the edge renders for its code, with the table's status where
    the mapper sets one."""
    by_code = {r.code: key for key, r in REPLIES.items() if r.is_error}
    seen = set()
    for mapper in _mappers():
        text = mapper.body_format_override.text_format_source.inline_string
        error = json.loads(text)["error"]
        key = by_code[error["code"]]
        assert text == error_json(key, error["message"]) == openai_error(error["message"], REPLIES[key].type,
                                                                         REPLIES[key].code)
        assert mapper.body_format_override.content_type == "application/json"
        if mapper.HasField("status_code"):
            assert mapper.status_code.value == REPLIES[key].status
        seen.add(key)
    assert seen == {Failure.REQUEST_TOO_LARGE, Failure.CONTROLPLANE_UNAVAILABLE, Failure.ENGINE_OVERLOADED,
                    Failure.REQUEST_HEADER_FIELDS_TOO_LARGE, Failure.REQUEST_TIMEOUT, Failure.INVALID_HTTP_REQUEST,
                    Failure.UPSTREAM_UNAVAILABLE}


def test_envoy_direct_responses_are_the_edge_rendering() -> None:
    routes = {r.name: r for r in build_routes(CONFIG).virtual_hosts[0].routes}
    expected: dict[str, Reason | Failure] = {"models": Failure.CONTROLPLANE_UNAVAILABLE,
                                             "unpinned": Failure.NOT_ADMITTED, "unknown": Reason.UNKNOWN_PATH}
    for name, key in expected.items():
        direct = routes[name].direct_response
        error = json.loads(direct.body.inline_string)["error"]
        assert direct.body.inline_string == error_json(key, error["message"])
        assert direct.status == reply(key).status
    assert routes["unknown"].direct_response.status == 404  # the same 404 unknown_url a Check gives an unknown path


def test_envoy_routes_the_paths_the_parser_accepts() -> None:
    assert all(re.fullmatch(INFERENCE_PATH_REGEX, p) for p in INFERENCE_PATHS)
    assert not re.fullmatch(INFERENCE_PATH_REGEX, MODELS_PATH)
