"""A Check always answers (issue 8). Envoy fails every failed Check open, so: parse_request is total (it returns an
``InferenceRequest`` or raises ``RequestError``, for any headers and body), a defect behind the handler is answered 500
``internal_error``, and a call that queued too long is answered 503 ``controlplane_overloaded`` before any work."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controlplane.app import ControlPlane
from controlplane.servicers.authz import AuthorizationServicer
from controlplane.core.model import InferenceRequest
from controlplane.core.request import MAX_JSON_DEPTH, MAX_TOKENS_LIMIT, RequestError, parse_request
from controlplane.names import PRIORITY_HEADER, SESSION_HEADER, TTFT_HEADER
from controlplane.edge import reply
from tests.unit.extauthz import CHAT, OneEnginePlane, chat_body, check_request, denial, one_engine_plane
from tests.unit.fakes import FakeContext


def parse_or_refuse(body: bytes, headers: dict[str, str] | None = None, path: str = CHAT) -> InferenceRequest | RequestError:
    """parse_request's answer; any exception other than RequestError escapes and fails the test."""
    try:
        return parse_request("POST", path, body, headers or {})
    except RequestError as error:
        assert reply(error.reason).status in (400, 404) and reply(error.reason).code, "a refusal maps to a 4xx error"
        return error


def refused_code(body: bytes, headers: dict[str, str] | None = None) -> str:
    answer = parse_or_refuse(body, headers)
    assert isinstance(answer, RequestError), f"expected a refusal, got {answer}"
    assert reply(answer.reason).status == 400
    return reply(answer.reason).code


def nested(depth: int, opener: str = "[", closer: str = "]") -> bytes:
    return json.dumps({"model": "cortex", "messages": "MARK"}).replace('"MARK"', opener * depth + closer * depth).encode()


# -- the inputs issue 8 names ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value", ["9" * 5000, "1" + "0" * 400, "①", "٣", "0", "-5", "1e3", " ", "1" * 10, "0x10"],
    ids=["5000-digits", "1e400", "circled-one", "arabic-three", "zero", "negative", "exponent", "blank", "10-digits",
         "hex"],
)
def test_ttft_header_must_be_a_small_ascii_integer(value: str) -> None:
    assert refused_code(chat_body(), {TTFT_HEADER: value}) == "invalid_max_ttft_ms"


def test_ttft_header_within_bounds_is_read() -> None:
    answer = parse_or_refuse(chat_body(), {TTFT_HEADER: " 999999999 "})
    assert isinstance(answer, InferenceRequest) and answer.max_ttft_ms == 999_999_999


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 990, 100_000])
@pytest.mark.parametrize(("opener", "closer"), [("[", "]"), ('{"a":' , "}")], ids=["arrays", "objects"])
def test_deep_nesting_is_refused_before_parsing(depth: int, opener: str, closer: str) -> None:
    assert refused_code(nested(depth, opener, closer)) == "json_too_deep"


def test_nesting_up_to_the_limit_is_parsed() -> None:
    # The body object itself is one level, so MAX_JSON_DEPTH - 1 levels inside it reach the limit exactly.
    assert isinstance(parse_or_refuse(nested(MAX_JSON_DEPTH - 1)), InferenceRequest)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    content = '"[{' * 5000 + "\\\\"  # quotes escaped, brackets, and a trailing escaped backslash before the close
    answer = parse_or_refuse(chat_body(messages=[{"role": "user", "content": content}] * 80))
    assert isinstance(answer, InferenceRequest) and answer.prompt_tokens > 0


def test_unterminated_string_hiding_deep_nesting_is_refused() -> None:
    assert refused_code(b'{"model": "cortex", "messages": "' + b"[" * 5000) == "invalid_json"
    assert refused_code(b'{"model": "cortex", "messages": ' + b"[" * 5000 + b'"') == "invalid_json"


@pytest.mark.parametrize(
    "fields",
    [{"max_tokens": 10**400}, {"max_tokens": MAX_TOKENS_LIMIT + 1}, {"max_completion_tokens": MAX_TOKENS_LIMIT + 1},
     {"max_tokens": 1.5}, {"max_completion_tokens": "9"}, {"max_completion_tokens": True}, {"max_tokens": -1}],
    ids=["1e400", "over-limit", "completion-over-limit", "float", "string", "bool", "negative"],
)
def test_token_limits_are_bounded(fields: dict[str, Any]) -> None:
    assert refused_code(chat_body(**fields)) == "invalid_max_tokens"


def test_an_integer_too_long_for_python_is_invalid_json() -> None:
    assert refused_code(b'{"model": "cortex", "max_tokens": ' + b"7" * 5000 + b"}") == "invalid_json"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"max_completion_tokens": None, "max_tokens": 77}, 77), ({"max_completion_tokens": 5, "max_tokens": 77}, 5),
     ({"max_completion_tokens": 5}, 5), ({"max_tokens": None}, None), ({}, None)],
    ids=["null-completion-falls-back", "completion-wins", "completion-only", "null-legacy", "neither"],
)
def test_token_limit_is_read_as_engines_read_it(fields: dict[str, Any], expected: int | None) -> None:
    answer = parse_or_refuse(chat_body(**fields))
    assert isinstance(answer, InferenceRequest) and answer.max_tokens == expected


def test_text_length_does_not_recurse() -> None:
    # 30 nested content parts (60 levels: under the depth limit) and a wide list: counted without recursion either way.
    content: Any = "abcd"
    for _ in range(30):
        content = [{"type": "text", "content": content}]
    answer = parse_or_refuse(chat_body(messages=[{"role": "user", "content": content}] + [{"content": "abcd"}] * 5000))
    assert isinstance(answer, InferenceRequest) and answer.prompt_tokens == 5001


# -- properties ---------------------------------------------------------------------------------------------------------
header_values = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(categories=["Nd", "No", "Nl"])),  # digits str.isdigit() likes and int() may not
    st.integers(min_value=-(10**4000), max_value=10**4000).map(str),  # str() itself refuses past 4300 digits
    st.integers(min_value=0, max_value=6000).map(lambda n: "1" + "0" * n),  # past int()'s digit limit
)
client_headers = st.dictionaries(st.sampled_from([PRIORITY_HEADER, TTFT_HEADER, SESSION_HEADER]), header_values)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**400), max_value=10**400) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["text", "content", "x"]), inner,
                                                                max_size=3),
    max_leaves=20,
)


@st.composite
def deep_bodies(draw: st.DrawFn) -> bytes:
    """A body nesting from shallow to far past the recursion limit, through arrays, objects or both."""
    depth = draw(st.integers(min_value=1, max_value=120_000))
    kinds = draw(st.lists(st.sampled_from([("[", "]"), ('{"content":', "}")]), min_size=1, max_size=3))
    openers = "".join(kinds[i % len(kinds)][0] for i in range(depth))
    closers = "".join(kinds[i % len(kinds)][1] for i in reversed(range(depth)))
    if draw(st.booleans()):
        closers = closers[: draw(st.integers(0, len(closers)))]  # truncated: invalid JSON, still never a crash
    return b'{"model": "cortex", "messages": ' + (openers + '"x"' + closers).encode() + b"}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers=client_headers, body=st.binary(max_size=300) | deep_bodies())
@example(headers={TTFT_HEADER: "①"}, body=chat_body())
@example(headers={}, body=b"[" * 100_000)
@example(headers={}, body="\ufeff".encode() + chat_body())
@example(headers={}, body=chat_body().decode().encode("utf-16"))
def test_parse_is_total_over_headers_and_bytes(headers: dict[str, str], body: bytes) -> None:
    parse_or_refuse(body, headers)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.fixed_dictionaries({}, optional={
        "max_tokens": json_values, "max_completion_tokens": json_values, "messages": json_values,
        "prompt": json_values, "input": json_values, "stream": json_values, "model": json_values,
    }),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
)
def test_parse_is_total_over_json_fields(fields: dict[str, Any], path: str) -> None:
    answer = parse_or_refuse(json.dumps({"model": "cortex", **fields}).encode(), path=path)
    if isinstance(answer, InferenceRequest) and answer.max_tokens is not None:
        assert 1 <= answer.max_tokens <= MAX_TOKENS_LIMIT


# -- the Check handler ----------------------------------------------------------------------------------------------------
@pytest.fixture
def plane(monkeypatch: pytest.MonkeyPatch) -> OneEnginePlane:
    return one_engine_plane(monkeypatch, {"engines": [{"name": "thor", "url": "http://127.0.0.1:9"}],
                                          "controlplane": {"max_check_queue_ms": 1000,
                                                           "overload_retry_after_seconds": 3}})


def counter(plane: ControlPlane, name: str) -> float:
    return plane.metrics.registry.get_sample_value(name) or 0.0


async def test_check_admits_in_the_fixture(plane: ControlPlane) -> None:
    """The baseline the failure tests depart from: this request, unharmed, is admitted with a ticket."""
    response = await AuthorizationServicer(plane.service).Check(check_request(chat_body(max_tokens=5)), FakeContext(290.0))
    assert response.HasField("ok_response") and plane.ledger.open_tickets() == 1


async def test_a_request_id_that_names_an_open_ticket_is_admitted_under_another(plane: ControlPlane) -> None:
    """A client's own x-request-id reused while its first request streams, or a Check Envoy asks again after the
    replica that admitted it died unanswered: a ticket of that id is open, and the Check is answered, not failed."""
    servicer = AuthorizationServicer(plane.service)
    first = await servicer.Check(check_request(chat_body(max_tokens=5), {"x-request-id": "r1"}), FakeContext(290.0))
    again = await servicer.Check(check_request(chat_body(max_tokens=5), {"x-request-id": "r1"}), FakeContext(290.0))
    assert first.HasField("ok_response") and again.HasField("ok_response")
    tickets = sorted(t.ticket_id for t in plane.ledger.tickets())
    assert len(tickets) == 2 and tickets[0] == "r1" and tickets[1].startswith("r1.")


async def test_defect_in_decide_is_a_500_never_an_rpc_error(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("injected defect")

    monkeypatch.setattr("controlplane.core.fleetstate.decide", broken)
    response = await AuthorizationServicer(plane.service).Check(check_request(chat_body()), FakeContext(290.0))
    status, headers, error = denial(response)
    assert status == 500
    assert error == {"message": error["message"], "type": "server_error", "param": None, "code": "internal_error"}
    assert headers["x-sluice-route-reason"] == "internal_error" and "retry-after" not in headers
    assert counter(plane, "sluice_authz_internal_errors_total") == 1


async def test_failure_after_admission_gives_the_ticket_back(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(outcome: Any) -> Any:
        raise RuntimeError("injected defect while answering")

    monkeypatch.setattr("controlplane.servicers.authz._admit", broken)
    status, _, error = denial(await AuthorizationServicer(plane.service).Check(check_request(chat_body()), FakeContext(290.0)))
    assert (status, error["code"]) == (500, "internal_error")
    assert plane.ledger.admitted_total == 1 and plane.ledger.open_tickets() == 0, "the refused request kept its ticket"


async def test_queued_check_is_shed_as_overloaded_before_any_work(plane: ControlPlane,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    monkeypatch.setattr("controlplane.servicers.authz.parse_request", lambda *a, **k: parsed.append(a[2]))
    waited_two_seconds = FakeContext(plane.config.authz_timeout_s - 2.0)
    status, headers, error = denial(await AuthorizationServicer(plane.service).Check(check_request(chat_body()),
                                                                             waited_two_seconds))
    assert status == 503 and headers["retry-after"] == "3"
    assert error["code"] == "controlplane_overloaded" and error["type"] == "server_error" and error["param"] is None
    assert parsed == [], "an overloaded Check must answer before parsing"
    assert counter(plane, "sluice_authz_overloaded_total") == 1


@pytest.mark.parametrize("waited", [None, 0.9], ids=["no-deadline", "under-the-limit"])
async def test_short_or_unknown_queueing_is_not_shed(plane: ControlPlane, waited: float | None) -> None:
    remaining = None if waited is None else plane.config.authz_timeout_s - waited
    response = await AuthorizationServicer(plane.service).Check(check_request(chat_body(max_tokens=5)), FakeContext(remaining))
    assert response.HasField("ok_response")
    assert counter(plane, "sluice_authz_overloaded_total") == 0


async def test_cancelled_parked_check_propagates_and_leaves_nothing(plane: OneEnginePlane) -> None:
    plane.cap_running = (1, 1)  # the only seat is taken: the request parks
    task = asyncio.create_task(AuthorizationServicer(plane.service).Check(check_request(chat_body()), FakeContext(290.0)))
    for _ in range(100):
        await asyncio.sleep(0)
        if plane.admission.depth():
            break
    assert plane.admission.depth() == 1, "the request should be parked"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert plane.admission.depth() == 0 and plane.ledger.open_tickets() == 0
    assert counter(plane, "sluice_authz_internal_errors_total") == 0, "a client leaving is not a control-plane defect"


async def test_checks_sharing_a_client_request_id_keep_their_own_places(plane: OneEnginePlane) -> None:
    """A client may send its own x-request-id, twice: both requests park under distinct keys and both are answered when
    capacity frees (the second must not take the first's place in the lot, or one Check would never be answered)."""
    plane.cap_running = (2, 2)
    servicer = AuthorizationServicer(plane.service)
    same = {"x-request-id": "client-chosen"}
    tasks = [asyncio.create_task(servicer.Check(check_request(chat_body(max_tokens=5), same), FakeContext(290.0)))
             for _ in range(2)]
    for _ in range(100):
        await asyncio.sleep(0)
        if plane.admission.depth() == 2:
            break
    assert plane.admission.depth() == 2, "both requests should be parked, each under its own key"
    plane.cap_running = (2, 0)
    plane.service.wake()
    responses = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert all(r.HasField("ok_response") for r in responses)
    assert plane.ledger.open_tickets() == 2
