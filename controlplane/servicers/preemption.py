"""Envoy's ext_proc stream of each preemptible stream: how the control plane ends one (decision 0028).

Only a sheddable admission with ``fairness.preempt_sheddable`` reaches here (route ``pinned_preemptible``). Its stream
opens with the request's headers, whose ``x-sluice-ticket`` attaches it to its admission (``PreemptPort.attach``; a
ticket this replica did not admit cannot be ended here, and its messages still make the round trip, passed on
unchanged); every message passes on unchanged at once until
``Ending.end`` asks for its end:

- before the response started: an unsolicited ``immediate_response`` (503, ``retry-after``, the OpenAI error
  ``preempted``), Envoy's local reply;
- after: the next body chunk becomes an SSE error event and an ``immediate_response`` follows, which resets the stream
  (downstream after the event; upstream, so the engine aborts it as for a client that leaves). No chunk within
  ``fairness.preempt_grace_ms``: the reset alone.

Either way the access-log entry releases the ticket as for every stream; the stream detaches however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep, external_processor_pb2_grpc
from envoy.type.v3 import http_status_pb2

from controlplane.edge import JSON_CONTENT_TYPE, Failure, error_json, sse_error_event
from controlplane.names import CONTENT_TYPE_HEADER, RETRY_AFTER_HEADER, TICKET_HEADER
from controlplane.ports import Ending, PreemptPort

log = logging.getLogger("sluice.preemption")

_STATUS = 503


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))


def _error(ending: Ending) -> str:
    return error_json(Failure.PREEMPTED, f"{ending.message}; retry after {ending.retry_after_s} s")


def local_reply(ending: Ending) -> ep.ProcessingResponse:
    """The end of a stream whose response has not started: a 503 with ``retry-after`` and the OpenAI error."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=_STATUS),
        headers=ep.HeaderMutation(set_headers=[_header(RETRY_AFTER_HEADER, str(ending.retry_after_s)),
                                               _header(CONTENT_TYPE_HEADER, JSON_CONTENT_TYPE)]),
        body=_error(ending).encode(), details="sluice_preempted"))


def error_chunk(ending: Ending) -> ep.ProcessingResponse:
    """A started stream's next chunk replaced by the error event (its end follows: ``local_reply``, a reset now)."""
    return ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=ep.BodyMutation(body=sse_error_event(_error(ending))))))


def passed(message: ep.ProcessingRequest) -> ep.ProcessingResponse:
    """``message`` passed on unchanged."""
    kind = message.WhichOneof("request")
    return ep.ProcessingResponse(**{kind: ep.TrailersResponse() if kind.endswith("trailers") else
                                    ep.BodyResponse() if kind.endswith("body") else ep.HeadersResponse()})


class PreemptionServicer(external_processor_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, port: PreemptPort) -> None:
        self.port = port

    async def Process(  # noqa: N802 (gRPC method name)
        self, requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[ep.ProcessingResponse]:
        """One preemptible stream, from its request headers to its end (module docstring)."""
        first = await anext(requests, None)
        if first is None:
            return
        headers = {h.key: h.raw_value.decode(errors="replace") or h.value
                   for h in first.request_headers.headers.headers}
        ticket = headers.get(TICKET_HEADER, "")
        ending = Ending()
        attached = bool(ticket) and self.port.attach(ticket, ending)
        try:  # from the attach on: a stream closed or cancelled anywhere below is detached
            yield passed(first)
            if not attached:  # nothing here can end it: every message passes unchanged
                async for message in requests:
                    yield passed(message)
                return
            async for answer in self._follow(requests, ending):
                yield answer
        finally:
            if attached:
                self.port.detach(ticket)

    async def _follow(self, requests: AsyncIterator[ep.ProcessingRequest],
                      ending: Ending) -> AsyncIterator[ep.ProcessingResponse]:
        started = False
        asked: asyncio.Future[Any] = asyncio.ensure_future(ending.asked.wait())
        nxt: asyncio.Future[Any] = asyncio.ensure_future(anext(requests, None))
        try:
            while True:
                timeout = self.port.grace_s if asked.done() else None
                waits = {nxt} if asked.done() else {nxt, asked}
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # asked to end, no chunk within the grace: reset without the event
                    yield local_reply(ending)
                    return
                if nxt in done:
                    message = nxt.result()
                    if message is None:
                        return
                    kind = message.WhichOneof("request")
                    if asked.done() and kind == "response_body":
                        yield error_chunk(ending)
                        yield local_reply(ending)
                        return
                    if asked.done() and kind == "response_headers":
                        yield local_reply(ending)
                        return
                    started = started or kind == "response_headers"
                    yield passed(message)
                    nxt = asyncio.ensure_future(anext(requests, None))
                elif not started:
                    yield local_reply(ending)
                    return
        finally:
            for task in (asked, nxt):
                task.cancel()
