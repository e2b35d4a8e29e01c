"""The clairvoyant arm's I/O shell: arrivals into one central queue, ``clairvoyant.assign`` at every event, requests
streamed straight to the simulated engines (no Envoy, no control plane).

A request's TTFT and end-to-end time run from its arrival (its time in the central queue included) to its first content
chunk and to its stream's end, as for the other arms. The scheduler's view of a running request is what its client sees:
the tokens streamed so far (``clairvoyant.progress``); a slot counts as free once its stream has ended.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from bench.clairvoyant import Dispatch, EngineRates, Work, assign, progress
from bench.workload import Result

TAG = "clairvoyant"
PREDICTED = "x-clairvoyant-predicted-s"
"""Result header: wall seconds from dispatch to the last token that the scheduler expected when it dispatched."""
MEASURED = "x-clairvoyant-measured-s"
"""Result header: wall seconds from dispatch to the stream's end, measured."""


@dataclass(frozen=True, slots=True)
class ArmJob:
    """One request of the cell, as the other arms send it."""

    at: float
    """Wall seconds after the cell's start."""
    content: str
    """The user message."""
    natural: int
    """Its natural output length (sent as ``sim_output_tokens``)."""
    max_tokens: int | None


@dataclass(slots=True)
class _Flight:
    work: Work
    dispatched: float
    tokens: int = 0


async def drive(urls: Sequence[str], engines: Sequence[EngineRates], jobs: Sequence[ArmJob], model: str,
                speed: float, t0: float | None = None) -> list[Result]:
    """Run ``jobs`` through the clairvoyant scheduler on the engines at ``urls`` (simulator speed ``speed``); one result
    per job, in job order, each served one carrying its predicted and measured time from dispatch to the end
    (``PREDICTED``, ``MEASURED``). A request that fits no engine even alone is answered with status 0 at once."""
    results: list[Result | None] = [None] * len(jobs)
    arrived: dict[int, float] = {}
    queue: list[int] = []
    """Keys of the requests waiting in the central queue, in arrival order."""
    flights: list[dict[int, _Flight]] = [{} for _ in engines]
    wake = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()
    start = time.perf_counter() if t0 is None else t0

    def work_on(key: int, engine: EngineRates) -> Work:
        prompt = engine.prompt_tokens(len(jobs[key].content))
        return Work(key, prompt, engine.output_tokens(jobs[key].natural, jobs[key].max_tokens, prompt))

    async def serve(session: aiohttp.ClientSession, dispatch: Dispatch) -> None:
        job, i = jobs[dispatch.key], dispatch.engine
        flight = flights[i][dispatch.key]
        result = Result(TAG, 0, arrived[dispatch.key] - start, engine=engines[i].name)
        payload = {"model": model, "messages": [{"role": "user", "content": job.content}], "stream": True,
                   "stream_options": {"include_usage": True}, "sim_output_tokens": job.natural}
        if job.max_tokens is not None:
            payload["max_tokens"] = job.max_tokens
        try:
            async with session.post(urls[i] + "/v1/chat/completions", json=payload) as response:
                result.status = response.status
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        flight.tokens += 1
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - arrived[dispatch.key]
                            wake.set()
                    if chunk.get("usage"):
                        result.completion_tokens = chunk["usage"]["completion_tokens"]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            result.status, result.headers = 599, {"error": type(exc).__name__}
        end = time.perf_counter()
        result.total_s = end - arrived[dispatch.key]
        result.headers[PREDICTED] = f"{dispatch.finish_s / speed:.6f}"
        result.headers[MEASURED] = f"{end - flight.dispatched:.6f}"
        results[dispatch.key] = result
        del flights[i][dispatch.key]
        wake.set()

    async def arrive(key: int) -> None:
        await asyncio.sleep(max(0.0, start + jobs[key].at - time.perf_counter()))
        arrived[key] = time.perf_counter()
        queue.append(key)
        wake.set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        arrivals = [asyncio.create_task(arrive(k)) for k in range(len(jobs))]
        while any(r is None for r in results):
            await wake.wait()
            wake.clear()
            now = time.perf_counter()
            running = [[progress(f.work, f.tokens, (now - f.dispatched) * speed, engines[i]) for f in fl.values()]
                       for i, fl in enumerate(flights)]
            plan = assign(engines, running, [[work_on(k, e) for e in engines] for k in queue])
            if not plan and queue and not any(running):  # fits no engine even alone: refused at once
                key = queue.pop(0)
                results[key] = Result(TAG, 0, arrived[key] - start)
                wake.set()
            for dispatch in plan:
                queue.remove(dispatch.key)
                flights[dispatch.engine][dispatch.key] = _Flight(work_on(dispatch.key, engines[dispatch.engine]),
                                                                 time.perf_counter())
                task = asyncio.create_task(serve(session, dispatch))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        await asyncio.gather(*arrivals, *tasks)
    return [r for r in results if r is not None]
