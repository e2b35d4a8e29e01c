"""A farm of simulated engine metric endpoints for ``sluice bench observe``: one aiohttp process answering ``/e/<i>/...``
for ``N`` engines with vLLM V1 exposition text, a few variants pre-rendered so the farm itself costs little CPU.

``--exposition vllm-v1`` (the default): real-size vLLM 0.11 text, every histogram bucket kept, about 54 KB
(``bench/vllm_exposition.py``; ``--data-parallel 2`` doubles the vLLM series, about 91 KB). ``--exposition sim``: the
simulator's collector, about 14 KB (it exposes only the families sluice and its tests use)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from functools import partial
from urllib.parse import parse_qs

from aiohttp import web

from enginesim.batcher import Batcher, SimRequest
from enginesim.exposition import RequestStats, SimCollector, render, restrict
from enginesim.profiles import PROFILES


def _variants(count: int = 8, exposition: str = "vllm-v1", data_parallel: int = 1) -> list[bytes]:
    if exposition == "vllm-v1":
        from bench.vllm_exposition import variants

        return variants(count, data_parallel=data_parallel)
    return _sim_variants(count)


def _sim_variants(count: int = 8) -> list[bytes]:
    out = []
    for level in range(count):
        batcher = Batcher(PROFILES["v100pp2"])
        for i in range(level % 5):
            batcher.submit(SimRequest(str(i), prompt_tokens=1000 * (i + 1), max_tokens=64, arrived_at=0))
        batcher.schedule(0)
        batcher.apply_step(batcher.plan_step(), 0.05)
        out.append(render(SimCollector("vllm-v1", "reasoning", batcher, RequestStats())))
    return out


class _Expositions:
    """The pre-rendered expositions, and each restricted to the samples a probe's ``name[]`` query names, as a real vLLM
    restricts its own (``enginesim.exposition.restrict``): rendered (and ``wrap``ped) once per distinct query."""

    def __init__(self, variants: list[bytes], wrap: Callable[[bytes], bytes] = bytes) -> None:
        self.variants = variants
        self.wrap = wrap
        self._answers: dict[str, list[bytes]] = {}

    def get(self, turn: int, query: str) -> bytes:
        answers = self._answers.get(query)
        if answers is None:
            names = parse_qs(query).get("name[]", [])
            answers = [self.wrap(restrict(v, names) if names else v) for v in self.variants]
            self._answers[query] = answers
        return answers[turn % len(answers)]


def build_app(engines: int, exposition: str = "vllm-v1", data_parallel: int = 1) -> web.Application:
    variants = _Expositions(_variants(8, exposition, data_parallel))
    models = json.dumps({"object": "list", "data": [{"id": "reasoning", "object": "model", "max_model_len": 131072}]})
    hits = [0]

    async def metrics(request: web.Request) -> web.Response:
        index = int(request.match_info["i"])
        if index >= engines:
            raise web.HTTPNotFound()
        hits[0] += 1
        return web.Response(body=variants.get(index + hits[0], request.query_string), content_type="text/plain")

    async def v1_models(request: web.Request) -> web.Response:
        return web.Response(text=models, content_type="application/json")

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.11.0"})

    app = web.Application()
    app.router.add_get("/e/{i}/metrics", metrics)
    app.router.add_get("/e/{i}/v1/models", v1_models)
    app.router.add_get("/e/{i}/version", version)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exposition", choices=["vllm-v1", "sim"], default="vllm-v1")
    parser.add_argument("--data-parallel", type=int, default=1)
    args = parser.parse_args()
    web.run_app(build_app(args.engines, args.exposition, args.data_parallel), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()


# -- one engine per port, with a chat endpoint (``sluice bench scale``) --------------------------------------------------
def _response(status: str, content_type: str, body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode("latin-1") + body)


class _Farm:
    """Every engine of the farm on its own port (Envoy's EDS needs a host:port per engine): real-size ``/metrics``,
    ``/v1/models``, ``/version`` and a ``/v1/chat/completions`` that answers at once (a one-token non-streaming completion,
    or a two-chunk SSE stream), naming the engine that answered in ``x-farm-engine`` so a bench can check Envoy went where
    the Check said.

    Answers are pre-rendered bytes written by a bare asyncio protocol (HTTP/1.1, keep-alive, Content-Length bodies),
    not an aiohttp application: the farm stands in for N engines on N other hosts, so its CPU on the bench's 2 cores is
    measurement overhead, not the gateway's cost. With aiohttp it took about a fifth of a core at 1000 engines (1000
    probes of 54 KB a second), on the cores the gateway under test was measured on."""

    def __init__(self, exposition: str = "vllm-v1", model: str = "reasoning") -> None:
        self.model = model
        self.metrics = _Expositions(_variants(8, exposition),
                                    partial(_response, "200 OK", "text/plain; version=0.0.4; charset=utf-8"))
        models = json.dumps({"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 131072}]})
        self.documents = {
            "/v1/models": _response("200 OK", "application/json", models.encode()),
            "/version": _response("200 OK", "application/json", b'{"version": "0.11.0"}'),
        }
        self.hits = 0

    def answer(self, engine: int, method: str, target: str, body: bytes) -> bytes:
        path, _, query = target.partition("?")
        if method == "GET" and path == "/metrics":
            self.hits += 1
            return self.metrics.get(engine + self.hits, query)
        if method == "GET" and path in self.documents:
            return self.documents[path]
        if method == "POST" and path == "/v1/chat/completions":
            return self._chat(engine, body)
        return _response("404 Not Found", "text/plain", b"not found")

    def _chat(self, engine: int, body: bytes) -> bytes:
        try:
            request = json.loads(body)
        except ValueError:
            return _response("400 Bad Request", "application/json", b'{"error": {"message": "not JSON"}}')
        header = f"x-farm-engine: e{engine}\r\n"
        created = {"id": "chatcmpl-farm", "created": 0, "model": request.get("model", self.model)}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        if request.get("stream"):
            chunk = {**created, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None}]}
            done = {**created, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
            stream = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode()
            return _response("200 OK", "text/event-stream", stream, header)
        completion = {**created, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        return _response("200 OK", "application/json", json.dumps(completion).encode(), header)


class _EngineConnection(asyncio.Protocol):
    """One connection to one farm engine: requests in order, each answered whole as soon as it has arrived."""

    def __init__(self, farm: _Farm, engine: int) -> None:
        self.farm = farm
        self.engine = engine
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            method, target = (lines[0].split(" ") + ["", ""])[:2]
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if "chunked" in headers.get("transfer-encoding", ""):  # never sent to it: Envoy keeps Content-Length
                self.transport.write(_response("411 Length Required", "text/plain", b"Content-Length required",
                                               "Connection: close\r\n"))
                self.transport.close()
                return
            length = int(headers.get("content-length", "0") or 0)
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            self.transport.write(self.farm.answer(self.engine, method, target, body))
            if headers.get("connection", "").lower() == "close":
                self.transport.close()
                return


async def serve_engines(engines: int, exposition: str = "vllm-v1") -> None:
    """Listen on ``engines`` free ports of 127.0.0.1 (engine i on the i-th); print the ports as one JSON line, then serve
    until killed."""
    import gc
    import sys

    loop = asyncio.get_running_loop()
    farm = _Farm(exposition)
    ports = []
    for i in range(engines):
        server = await loop.create_server(partial(_EngineConnection, farm, i), "127.0.0.1", 0, backlog=512)
        ports.append(int(server.sockets[0].getsockname()[1]))
    # One process stands in for N engines on N hosts, so its collector's pauses stall every engine at once, which no
    # real fleet does: at 1000 engines its passes (20-76 ms, young ones included: each keep-alive connection holds its
    # last request's objects) were most of the gateway's end-to-end p99 in ``bench scale``. The start-up objects leave
    # the collector's reach and the collector is off: what requests leave behind is freed by reference counting, and
    # the farm's memory stayed at about 52 MB over a 1000-engine run.
    gc.collect()
    gc.freeze()
    gc.disable()
    sys.stdout.write(json.dumps({"ports": ports}) + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


def main_engines() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--exposition", choices=["vllm-v1", "sim"], default="vllm-v1")
    args = parser.parse_args()
    asyncio.run(serve_engines(args.engines, args.exposition))
