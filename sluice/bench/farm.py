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
