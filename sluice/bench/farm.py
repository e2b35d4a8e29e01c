"""A farm of simulated engine metric endpoints for ``sluice bench observe``: one aiohttp process answering ``/e/<i>/...``
for ``N`` engines with vLLM V1 exposition text, a few variants pre-rendered so the farm itself costs little CPU.

``--exposition vllm-v1`` (the default): real-size vLLM 0.11 text, every histogram bucket kept, about 54 KB
(``sluice/bench/vllm_exposition.py``; ``--data-parallel 2`` doubles the vLLM series, about 91 KB). ``--exposition sim``: the
simulator's collector, about 14 KB (it exposes only the families sluice and its tests use)."""

from __future__ import annotations

import argparse
import json

from aiohttp import web

from enginesim.batcher import Batcher, SimRequest
from enginesim.exposition import RequestStats, SimCollector, render
from enginesim.profiles import PROFILES


def _variants(count: int = 8, exposition: str = "vllm-v1", data_parallel: int = 1) -> list[bytes]:
    if exposition == "vllm-v1":
        from sluice.bench.vllm_exposition import variants

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


def build_app(engines: int, exposition: str = "vllm-v1", data_parallel: int = 1) -> web.Application:
    variants = _variants(8, exposition, data_parallel)
    models = json.dumps({"object": "list", "data": [{"id": "reasoning", "object": "model", "max_model_len": 131072}]})
    hits = [0]

    async def metrics(request: web.Request) -> web.Response:
        index = int(request.match_info["i"])
        if index >= engines:
            raise web.HTTPNotFound()
        hits[0] += 1
        return web.Response(body=variants[(index + hits[0]) % len(variants)], content_type="text/plain")

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
def build_engine_app(exposition: str = "vllm-v1", model: str = "reasoning") -> web.Application:
    """Every engine of the farm on its own port (Envoy's EDS needs a host:port per engine): real-size ``/metrics``,
    ``/v1/models``, ``/version`` and a ``/v1/chat/completions`` that answers at once (a one-token non-streaming completion,
    or a two-chunk SSE stream), naming the engine that answered in ``x-farm-engine`` so a bench can check Envoy went where
    the Check said. The engine is known from the local port the request arrived on."""
    variants = _variants(8, exposition)
    models = json.dumps({"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 131072}]})
    hits = [0]
    index_of: dict[int, int] = {}

    def engine(request: web.Request) -> int:
        assert request.transport is not None  # a request being handled has its connection
        return index_of[request.transport.get_extra_info("sockname")[1]]

    async def metrics(request: web.Request) -> web.Response:
        hits[0] += 1
        return web.Response(body=variants[(engine(request) + hits[0]) % len(variants)], content_type="text/plain")

    async def v1_models(request: web.Request) -> web.Response:
        return web.Response(text=models, content_type="application/json")

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.11.0"})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        name = f"e{engine(request)}"
        headers = {"x-farm-engine": name}
        created = {"id": "chatcmpl-farm", "created": 0, "model": body.get("model", model)}
        if body.get("stream"):
            response = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
            await response.prepare(request)
            chunk = {**created, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            done = {**created, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {},
                                                                            "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            await response.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
            await response.write_eof()
            return response
        return web.json_response({**created, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}, headers=headers)

    app = web.Application()
    app["index_of"] = index_of
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", v1_models)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def serve_engines(engines: int, exposition: str = "vllm-v1") -> None:
    """Listen on ``engines`` free ports of 127.0.0.1 (engine i on the i-th); print the ports as one JSON line, then serve
    until killed."""
    import asyncio
    import gc
    import sys

    app = build_engine_app(exposition)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ports = []
    for i in range(engines):
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=512)
        await site.start()
        port = int(runner.addresses[-1][1])  # this site's (the runner lists its sites' sockets in order)
        app["index_of"][port] = i
        ports.append(port)
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
    import asyncio

    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--exposition", choices=["vllm-v1", "sim"], default="vllm-v1")
    args = parser.parse_args()
    asyncio.run(serve_engines(args.engines, args.exposition))
