"""A farm of simulated engine metric endpoints for ``sluice bench observe``: one aiohttp process answering ``/e/<i>/...``
for ``N`` engines with real vLLM V1 exposition text (rendered by the simulator's collector, a few load levels, pre-rendered
so the farm itself costs little CPU)."""

from __future__ import annotations

import argparse
import json

from aiohttp import web

from enginesim.batcher import Batcher, SimRequest
from enginesim.exposition import RequestStats, SimCollector, render
from enginesim.profiles import PROFILES


def _variants(count: int = 8) -> list[bytes]:
    out = []
    for level in range(count):
        batcher = Batcher(PROFILES["v100pp2"])
        for i in range(level % 5):
            batcher.submit(SimRequest(str(i), prompt_tokens=1000 * (i + 1), max_tokens=64, arrived_at=0))
        batcher.schedule(0)
        batcher.apply_step(batcher.plan_step(), 0.05)
        out.append(render(SimCollector("vllm-v1", "reasoning", batcher, RequestStats())))
    return out


def build_app(engines: int) -> web.Application:
    variants = _variants()
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
    args = parser.parse_args()
    web.run_app(build_app(args.engines), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
