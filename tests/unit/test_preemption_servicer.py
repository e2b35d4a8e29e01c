"""The ext_proc servicer that ends preemptible streams (controlplane/servicers/preemption.py, decision 0028), over a real
grpc.aio server on port 0 with the control plane's admission service as its port: every message passes unchanged
until the stream is asked to end; then before the response a 503 with retry-after and the OpenAI error, after it the
next chunk becomes the SSE error event and a reset follows (no chunk within the grace: the reset alone). Streams
that are not open sheddable admissions are never attached; every attached stream detaches when it ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep, external_processor_pb2_grpc

from controlplane.app import ControlPlane
from controlplane.core.model import InferenceRequest, Priority
from controlplane.servicers.preemption import PreemptionServicer
from tests.unit.extauthz import one_engine_plane

RAW = {"engines": [{"name": "thor", "url": "http://127.0.0.1:9"}],
       "fairness": {"preempt_sheddable": True, "preempt_grace_ms": 200}}


@pytest.fixture
def plane(monkeypatch: pytest.MonkeyPatch) -> ControlPlane:
    return one_engine_plane(monkeypatch, RAW)


@pytest.fixture
async def stub(plane: ControlPlane) -> AsyncIterator[external_processor_pb2_grpc.ExternalProcessorStub]:
    server = grpc.aio.server()
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(PreemptionServicer(plane.service), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield external_processor_pb2_grpc.ExternalProcessorStub(channel)
    await server.stop(None)


async def admitted(plane: ControlPlane, priority: str = "sheddable") -> str:
    outcome = await plane.service.check("t1", InferenceRequest("POST", "/v1/chat/completions", "cortex", stream=True,
                                                              prompt_tokens=5, max_tokens=50,
                                                              priority=Priority(priority)))
    assert outcome.ticket is not None
    return outcome.ticket.ticket_id


def request_headers(ticket: str) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key="x-sluice-ticket", raw_value=ticket.encode())])))


RESPONSE_HEADERS = ep.ProcessingRequest(response_headers=ep.HttpHeaders())


def chunk(text: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=text))


class Envoy:
    """Envoy's side of one ext_proc stream: send a message, read an answer."""

    def __init__(self, stub: external_processor_pb2_grpc.ExternalProcessorStub) -> None:
        self.out: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._send())

    async def _send(self) -> AsyncIterator[ep.ProcessingRequest]:
        while (message := await self.out.get()) is not None:
            yield message

    async def ask(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse:
        await self.out.put(message)
        return await self.answer()

    async def answer(self) -> ep.ProcessingResponse:
        response = await asyncio.wait_for(self.call.read(), 5)
        assert isinstance(response, ep.ProcessingResponse)
        return response

    async def close(self) -> None:
        await self.out.put(None)
        await asyncio.sleep(0.05)


def unchanged(response: ep.ProcessingResponse, kind: str) -> None:
    assert response.WhichOneof("response") == kind
    assert not response.response_body.response.HasField("body_mutation")


async def started(plane: ControlPlane, stub: external_processor_pb2_grpc.ExternalProcessorStub) -> tuple[str, Envoy]:
    """A sheddable admission whose stream has passed its request headers and its response headers unchanged."""
    ticket = await admitted(plane)
    envoy = Envoy(stub)
    unchanged(await envoy.ask(request_headers(ticket)), "request_headers")
    unchanged(await envoy.ask(RESPONSE_HEADERS), "response_headers")
    return ticket, envoy


def error_of(response: ep.ProcessingResponse) -> tuple[int, dict[str, str], dict[str, str]]:
    immediate = response.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, headers, json.loads(immediate.body)["error"]


async def test_a_stream_asked_to_end_before_its_response_gets_a_503(
        plane: ControlPlane, stub: external_processor_pb2_grpc.ExternalProcessorStub) -> None:
    ticket = await admitted(plane)
    envoy = Envoy(stub)
    unchanged(await envoy.ask(request_headers(ticket)), "request_headers")
    plane.service._endings[ticket].end(7, "ended for a critical request")
    status, headers, error = error_of(await envoy.answer())  # unsolicited: no message of Envoy's pending
    assert status == 503 and headers["retry-after"] == "7" and headers["content-type"] == "application/json"
    assert error["code"] == "preempted" and error["type"] == "server_error" and "retry after 7 s" in error["message"]
    await envoy.close()
    assert ticket not in plane.service._endings and not plane.admission.preemptible.attached


async def test_a_started_stream_ends_with_an_error_event_then_a_reset(
        plane: ControlPlane, stub: external_processor_pb2_grpc.ExternalProcessorStub) -> None:
    ticket, envoy = await started(plane, stub)
    unchanged(await envoy.ask(chunk(b'data: {"choices": []}\n\n')), "response_body")
    plane.service._endings[ticket].end(3, "ended")
    replaced = await envoy.ask(chunk(b'data: {"choices": []}\n\n'))
    event = replaced.response_body.response.body_mutation.body
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: "):])["error"]["code"] == "preempted"
    assert error_of(await envoy.answer())[0] == 503
    await envoy.close()
    assert not plane.admission.preemptible.attached


async def test_a_started_stream_without_a_chunk_in_the_grace_is_reset(
        plane: ControlPlane, stub: external_processor_pb2_grpc.ExternalProcessorStub) -> None:
    ticket, envoy = await started(plane, stub)
    plane.service._endings[ticket].end(3, "ended")
    assert error_of(await envoy.answer())[0] == 503  # within 5 s: the grace is 0.2 s
    await envoy.close()


@pytest.mark.parametrize("priority", ["standard", "critical"])
async def test_other_classes_are_never_attached_and_pass_unchanged(
        plane: ControlPlane, stub: external_processor_pb2_grpc.ExternalProcessorStub, priority: str) -> None:
    ticket = await admitted(plane, priority)
    envoy = Envoy(stub)
    unchanged(await envoy.ask(request_headers(ticket)), "request_headers")
    assert ticket not in plane.service._endings
    unchanged(await envoy.ask(RESPONSE_HEADERS), "response_headers")
    unchanged(await envoy.ask(chunk(b"data: x\n\n")), "response_body")
    await envoy.close()


async def test_a_stream_that_ends_detaches(plane: ControlPlane,
                                           stub: external_processor_pb2_grpc.ExternalProcessorStub) -> None:
    ticket = await admitted(plane)
    envoy = Envoy(stub)
    unchanged(await envoy.ask(request_headers(ticket)), "request_headers")
    assert plane.admission.preemptible.attached == {ticket}
    unchanged(await envoy.ask(RESPONSE_HEADERS), "response_headers")
    await envoy.close()
    assert not plane.admission.preemptible.attached and ticket not in plane.service._endings


async def test_a_stream_closed_before_its_first_answer_was_taken_detaches(plane: ControlPlane) -> None:
    """The stream attaches as its request headers arrive; closed right after (Envoy's message timeout, a client gone)
    while its first answer is still being handed over, it is detached all the same: no ending left behind for good."""
    ticket = await admitted(plane)

    async def messages() -> AsyncIterator[ep.ProcessingRequest]:
        yield request_headers(ticket)
        await asyncio.Event().wait()  # nothing more comes

    answers = cast(AsyncGenerator[ep.ProcessingResponse, None],
                   PreemptionServicer(plane.service).Process(messages(), None))  # type: ignore[arg-type]
    await anext(answers)
    assert plane.admission.preemptible.attached == {ticket}
    await answers.aclose()
    assert not plane.admission.preemptible.attached and ticket not in plane.service._endings
