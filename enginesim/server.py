"""The engine simulator's HTTP shell: an OpenAI-compatible server in front of ``Batcher``.

Speaks what vLLM speaks (V1 metric names, ``/v1/models`` with ``max_model_len``, ``/health``, ``/version``) so the control
plane cannot tell it from a real engine; ``flavor`` picks another dialect (``exposition.py``). Extras for tests, all under
``/sim/``: the log of what it served (each entry with the ``x-sluice-*``, ``x-request-id``, ``traceparent`` and
``tracestate`` headers it arrived with: every value, in order), the most requests it ever ran at once, the prefix cache
oracle (``sim_cache``) and ``/metrics`` faults. Request extensions, ignored by real engines: ``sim_prompt_tokens`` forces
the prompt's token count (``_prompt``), ``sim_output_tokens`` its natural output length (``plan_output``).

Like vLLM: streams send their headers first (``headers_at_first_token`` holds them); automatic prefix caching
(prefixcache.py) reports ``cached_tokens`` and ``vllm:prefix_cache_*``; LoRA adapters (``max_loras`` > 0, batcher.py)
are listed by ``/v1/models``, loaded at runtime with ``runtime_lora_updating``, published as ``vllm:lora_requests_info``.
``speed`` is emulated seconds per wall second: ``/metrics`` publishes wall-clock durations (what a real engine that
fast would report), ``/sim/log`` and ``/sim/stats`` emulated time (docs/architecture.md, Engine simulator).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import random
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from aiohttp import web
from enginesim.batcher import Batcher, SimRequest
from enginesim.exposition import Dialect, RequestStats, SimCollector, render
from enginesim.prefixcache import block_hashes
from enginesim.profiles import OUTPUT_MODELS, Profile

log = logging.getLogger("sluice.sim")

DEFAULT_MAX_TOKENS = 64
"""Output tokens without ``max_tokens`` under the old ``max_tokens`` output model only."""
WORDS = ("the", "quick", "river", "runs", "through", "a", "narrow", "sluice", "and", "turns", "the", "mill")


def _error(status: int, message: str, err_type: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return web.json_response(body, status=status)


class MetricsFault(enum.StrEnum):
    """What ``/metrics`` does (``POST /sim/fault``): answer, hang until the client gives up, or answer 500."""

    OK = "ok"
    HANG = "hang"
    ERROR = "error"


class EngineSimulator:
    def __init__(
        self, profile: Profile, *, name: str, speed: float = 1.0, model: str | None = None, flavor: str = "vllm-v1",
        output_model: str | None = None, seed: int | None = None, headers_at_first_token: bool = False,
        chars_per_token: float | None = None, template_tokens_per_message: int | None = None,
        max_loras: int = 0, lora_swap_s: float = 0.0, lora_modules: dict[str, str] | None = None,
        runtime_lora_updating: bool = False,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        if (lora_modules or runtime_lora_updating) and not max_loras:
            raise ValueError("LoRA adapters need max_loras >= 1 (vLLM's --enable-lora --max-loras)")
        dialect = Dialect.of(flavor)
        if max_loras and not dialect.vllm:
            raise ValueError("LoRA adapters are simulated for the vllm flavours only")
        if output_model is not None and output_model not in OUTPUT_MODELS:
            raise ValueError(f"unknown output model {output_model!r}; known: {', '.join(OUTPUT_MODELS)}")
        if model:
            profile = replace(profile, model=model)
        if output_model:
            profile = replace(profile, output_model=output_model)
        if chars_per_token is not None:
            profile = replace(profile, chars_per_token=chars_per_token)
        if template_tokens_per_message is not None:
            profile = replace(profile, template_tokens_per_message=template_tokens_per_message)
        self.rng = random.Random(zlib.crc32(name.encode()) if seed is None else seed)
        """Natural output lengths; seeded by the engine's name unless told, so two engines of one profile differ but a
        rerun replays."""
        self.profile = profile
        self.name = name
        self.speed = speed
        self.headers_at_first_token = headers_at_first_token
        """False (the default, as vLLM's ``StreamingResponse``): a stream's headers go out as soon as the request is
        accepted, before its prefill; True: they wait for the first token (time to first byte is then the TTFT)."""
        self.flavor = dialect
        self.batcher = Batcher(profile, metrics_time_scale=1.0 / speed, max_loras=max_loras, lora_swap_s=lora_swap_s)
        self.adapters: dict[str, str] = dict(lora_modules or {})
        """Registered LoRA adapters (name -> path), in registration order: what ``/v1/models`` lists after the base."""
        self.runtime_lora_updating = runtime_lora_updating
        self.stats = RequestStats()
        self.collector = SimCollector(dialect, profile.model, self.batcher, self.stats)
        self.metrics_fault = MetricsFault.OK
        """``hang``: /metrics never answers; ``error``: /metrics answers 500 (set through POST /sim/fault)."""
        self.served: list[dict[str, Any]] = []
        self._streams: dict[SimRequest, asyncio.Queue[int | None]] = {}
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self._loop_task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Emulated seconds since the simulator started."""
        return (time.monotonic() - self._t0) * self.speed

    # -- engine loop ---------------------------------------------------------------------------------------------------
    async def run_engine(self) -> None:
        """Step the batcher in emulated time. A sleep overshoots (more so at high ``speed``), so every step that fits in the
        emulated time that really passed is applied: rates stay the profile's, tokens just arrive in small bursts."""
        b = self.batcher
        last = self.now()
        while True:
            b.schedule(last)
            planned = b.plan_step()
            if planned == 0:
                self._wake.clear()
                await self._wake.wait()
                last = self.now()
                continue
            await asyncio.sleep(planned / self.speed)
            elapsed = self.now() - last
            while planned > 0 and elapsed >= planned:
                last += planned
                elapsed -= planned
                b.apply_step(planned, last)
                self._deliver()
                b.schedule(last)
                self.collector.record_lora(time.time())
                planned = b.plan_step()

    def _deliver(self) -> None:
        b = self.batcher
        for request in b.running:
            for index in request.emitted:
                self._streams[request].put_nowait(index)
        for request in b.finished:
            for index in request.emitted:
                self._streams[request].put_nowait(index)
            self._streams[request].put_nowait(None)
        b.finished.clear()

    # -- HTTP ------------------------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        if self.flavor.vllm:
            app.router.add_get("/version", self.version)
        elif self.flavor is Dialect.SGLANG:
            app.router.add_get("/server_info", self.server_info)
        else:
            app.router.add_get("/props", self.props)
            app.router.add_get("/slots", self.slots)
        if self.flavor.vllm or self.flavor is Dialect.LLAMACPP:
            app.router.add_post("/tokenize", self.tokenize)
        if self.flavor is Dialect.LLAMACPP:
            app.router.add_post("/apply-template", self.apply_template)
        if self.flavor.vllm and self.runtime_lora_updating:
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/sim/log", self.sim_log)
        app.router.add_get("/sim/stats", self.sim_stats)
        app.router.add_post("/sim/fault", self.sim_fault)
        app.router.add_post("/sim/cache", self.sim_cache)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._loop_task = asyncio.create_task(self.run_engine())

    async def _stop(self, app: web.Application) -> None:
        if self._loop_task:
            self._loop_task.cancel()

    async def health(self, request: web.Request) -> web.Response:
        if self.flavor is Dialect.LLAMACPP:
            return web.json_response({"status": "ok"})
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.profile.version})

    @property
    def slot_ctx(self) -> int:
        """llama.cpp splits its context evenly over its slots (``--parallel``)."""
        return self.profile.kv_capacity_tokens // self.profile.max_num_seqs

    async def server_info(self, request: web.Request) -> web.Response:
        p = self.profile
        return web.json_response({
            "model_path": p.model, "served_model_name": p.model, "version": "0.5.4",
            "max_running_requests": p.max_num_seqs, "max_total_num_tokens": p.kv_capacity_tokens,
            "context_length": p.max_model_len, "tp_size": 2, "dp_size": 1,
        })

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({
            "default_generation_settings": {"n_ctx": self.slot_ctx, "temperature": 0.8},
            "total_slots": self.profile.max_num_seqs,
            "model_path": f"/models/{self.profile.model}.gguf",
            "build_info": "b6500-sim",
        })

    async def slots(self, request: web.Request) -> web.Response:
        running = self.batcher.running
        out = []
        for i in range(self.profile.max_num_seqs):
            r = running[i] if i < len(running) else None
            out.append({
                "id": i, "n_ctx": self.slot_ctx, "is_processing": r is not None,
                "n_prompt_tokens": r.prompt_tokens if r else 0,
                "next_token": {"has_next_token": r is not None, "n_decoded": r.generated if r else 0},
            })
        return web.json_response(out)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize`` (``{"model", "prompt"}`` or ``{"model", "messages", "add_generation_prompt"}`` ->
        ``{"count", "max_model_len", "tokens"}``, its ``TokenizeResponse``), counting as a request's prompt is counted;
        llama.cpp's (``{"content"}`` -> ``{"tokens"}``), where each ``TEMPLATE_MARK`` that ``/apply-template`` put
        before a message counts as the profile's template tokens of a message. Token ids are placeholders."""
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        p = self.profile
        if self.flavor is Dialect.LLAMACPP:
            content = body.get("content")
            if not isinstance(content, str):
                return _error(400, "\"content\" must be provided", "invalid_request_error")
            marks = content.count(TEMPLATE_MARK)
            text = content.replace(TEMPLATE_MARK, "")
            count = math.ceil(len(text) / p.chars_per_token) + marks * p.template_tokens_per_message
            return web.json_response({"tokens": list(range(count))})
        if not isinstance(body.get("messages"), list) and not isinstance(body.get("prompt"), str):
            return _error(400, "either prompt or messages must be given", "BadRequestError")
        _, count = _prompt(body, chat=isinstance(body.get("messages"), list), profile=p)
        return web.json_response({"count": count, "max_model_len": p.max_model_len, "tokens": list(range(count))})

    async def apply_template(self, request: web.Request) -> web.Response:
        """llama.cpp's ``POST /apply-template`` (``{"messages"}`` -> ``{"prompt"}``): each message's content after a
        ``TEMPLATE_MARK``, which the simulator's ``/tokenize`` counts as the template's tokens of one message."""
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        return web.json_response({"prompt": "".join(TEMPLATE_MARK + str(m.get("content", "")) for m in messages)})

    async def models(self, request: web.Request) -> web.Response:
        """The base model, then each registered adapter as vLLM's ``OpenAIServingModels.show_available_models`` lists
        it (``id`` its name, ``root`` its path, ``parent`` the base model, no ``max_model_len``)."""
        p = self.profile
        if self.flavor is Dialect.LLAMACPP:
            entry = {"id": p.model, "object": "model", "created": int(self._t0), "owned_by": "llamacpp",
                     "meta": {"n_ctx_train": p.max_model_len, "n_vocab": 151936}}
        else:
            entry = {"id": p.model, "object": "model", "created": int(self._t0),
                     "owned_by": "vllm" if self.flavor.vllm else "sglang", "root": p.model,
                     "parent": None, "max_model_len": p.max_model_len, "permission": []}
        cards = [entry] + [
            {"id": name, "object": "model", "created": int(self._t0), "owned_by": "vllm", "root": path,
             "parent": p.model, "max_model_len": None, "permission": []}
            for name, path in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): ``{"lora_name", "lora_path"}`` registers
        the adapter and activates it in a slot (a swap): 200 and a plain-text line; 400 when a field is missing or the
        name is already loaded. Without ``runtime_lora_updating`` the path does not exist (404)."""
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.adapters:
            return _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        self.adapters[name] = path
        self.batcher.load_adapter(name, self.now())
        self._wake.set()
        log.info("loaded LoRA adapter %s from %s on %s", name, path, self.name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA unloading (``{"lora_name"}``): the adapter is no longer served and leaves its slot (404
        when unknown)."""
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _error(400, "either 'lora_name' and 'lora_int_id' needs to be provided.", "InvalidUserInput")
        if name not in self.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        self.batcher.unload_adapter(name)
        log.info("unloaded LoRA adapter %s on %s", name, self.name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.metrics_fault is MetricsFault.HANG:
            await asyncio.Event().wait()  # until the client gives up and the handler is cancelled
        if self.metrics_fault is MetricsFault.ERROR:
            return web.Response(status=500, text="internal error (simulated)")
        names = request.query.getall("name[]", []) if self.collector.flavor.filters else []
        return web.Response(body=render(self.collector, names), content_type="text/plain", charset="utf-8")

    async def sim_fault(self, request: web.Request) -> web.Response:
        body = await request.json()
        fault = body.get("metrics", "ok") if isinstance(body, dict) else None
        if not isinstance(fault, str) or fault not in {f.value for f in MetricsFault}:
            return _error(400, f"metrics fault must be one of {', '.join(MetricsFault)}", "BadRequestError")
        self.metrics_fault = MetricsFault(fault)
        return web.json_response({"metrics": fault})

    async def sim_log(self, request: web.Request) -> web.Response:
        return web.json_response(self.served)

    async def sim_stats(self, request: web.Request) -> web.Response:
        b = self.batcher
        return web.json_response(
            {
                "name": self.name,
                "profile": self.profile.name,
                "flavor": self.flavor,
                "max_running_seen": b.max_running_seen,
                "running": len(b.running),
                "waiting": len(b.waiting),
                "preemptions": b.preemptions,
                "kv_usage": b.kv_usage,
                "served": len(self.served),
                "prefix_cache_queries": b.prefix.queries,
                "prefix_cache_hits": b.prefix.hits,
                "cached_blocks": b.prefix.cached_blocks,
                "prefix_cache_evictions": b.prefix.evictions,
                "max_loras": b.max_loras,
                "lora_swaps": b.swaps,
                "resident_adapters": list(b.resident),
                "adapters": list(self.adapters),
            }
        )

    async def sim_cache(self, request: web.Request) -> web.Response:
        """How many prompt tokens of this request body are cached right now (what it would skip if scheduled now), and
        the queue it would join. Nothing runs."""
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        chat = "messages" in body
        text, prompt_tokens = _prompt(body, chat=chat, profile=self.profile)
        b = self.batcher
        cached = b.cached_tokens_for(self._blocks(text, prompt_tokens), prompt_tokens)
        return web.json_response({"cached_tokens": cached, "prompt_tokens": prompt_tokens, "running": len(b.running),
                                  "waiting": len(b.waiting), "max_num_seqs": self.profile.max_num_seqs})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        model = body.get("model")
        if model != self.profile.model and (not isinstance(model, str) or model not in self.adapters):
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model_not_found")
        adapter = model if model != self.profile.model else None
        text, prompt_tokens = _prompt(body, chat=chat, profile=self.profile)
        planned = self.plan_output(body, prompt_tokens)
        if isinstance(planned, web.Response):
            return planned
        max_tokens, output_tokens = planned
        sim_request = SimRequest(uuid.uuid4().hex, prompt_tokens, max_tokens, arrived_at=self.now(),
                                 output_tokens=output_tokens, adapter=adapter,
                                 block_hashes=self._blocks(text, prompt_tokens))
        entry: dict[str, Any] = {
            "id": sim_request.request_id,
            "engine": self.name,
            "path": request.path,
            "model": body["model"],
            "adapter": adapter,
            "stream": bool(body.get("stream")),
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "output_tokens": sim_request.target_tokens,
            "finish_reason": sim_request.finish_reason,
            "completion_tokens": 0,
            "x_sluice_engine": request.headers.getall("x-sluice-engine", []),
            "x_sluice_headers": sorted(k.lower() for k in request.headers if k.lower().startswith("x-sluice-")),
            "x_request_id": request.headers.get("x-request-id", ""),
            "authorization": "authorization" in request.headers,  # whether one arrived (never its value)
            "traceparent": request.headers.getall("traceparent", []),
            "tracestate": request.headers.getall("tracestate", []),
            "arrived_at": sim_request.arrived_at,
            "status": "running",
        }
        self.served.append(entry)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._streams[sim_request] = queue
        self.batcher.submit(sim_request)
        self._wake.set()
        created = int(time.time())
        completion_id = ("chatcmpl-" if chat else "cmpl-") + sim_request.request_id
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
                if self.headers_at_first_token:
                    first = await queue.get()
                    await response.prepare(request)
                else:
                    await response.prepare(request)
                    first = await queue.get()
                async for chunk in self._sse_chunks(sim_request, queue, chat, completion_id, created, include_usage,
                                                    first):
                    await response.write(chunk)
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                result: web.StreamResponse = response
            else:
                text = "".join([_word(i) async for i in _tokens(queue)])
                result = web.json_response(self._full_body(sim_request, chat, completion_id, created, text))
            entry["status"] = "finished"
            return result
        except (asyncio.CancelledError, ConnectionResetError):
            entry["status"] = "aborted"
            self.batcher.abort(sim_request)
            if sim_request.finished_at is None:  # it was still queued or generating: the engine stopped it
                self.stats.finished["abort"] += 1
            raise
        finally:
            entry["completion_tokens"] = sim_request.generated
            entry["cached_tokens"] = sim_request.cached_tokens or 0
            entry["adapter_swapped"] = sim_request.swapped
            entry["finished_at"] = self.now()
            entry["ttft_s"] = (
                sim_request.first_token_at - sim_request.arrived_at if sim_request.first_token_at is not None else None
            )
            self._record_finish(sim_request)
            self._streams.pop(sim_request, None)

    def _blocks(self, text: str, prompt_tokens: int) -> tuple[int, ...]:
        return block_hashes(text, prompt_tokens, self.profile.block_size, self.profile.chars_per_token)

    def plan_output(self, body: dict[str, Any], prompt_tokens: int) -> tuple[int, int | None] | web.Response:
        """``(max_tokens, natural output length or None to run to max_tokens)`` for a request body, or its 400.

        Each request stops at a natural length drawn from the profile's lognormal (seeded per simulator, so a run
        replays) unless ``sim_output_tokens`` forces one (``finish_reason: stop``), never beyond ``max_tokens``
        (``finish_reason: length``) or, when the request names none, ``max_model_len - prompt``. ``ignore_eos: true``
        generates exactly the limit; ``output_model="max_tokens"`` does so for every request (64 when absent)."""
        legacy = self.profile.output_model == "max_tokens"
        # Draw for every request, used or not, so the n-th request's length does not depend on earlier requests' flags.
        natural = self.profile.draw_output_tokens(self.rng)
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
            return _error(400, "max_tokens must be a positive integer", "BadRequestError")
        if requested is None:
            # vLLM's default is whatever context is left; the old output model kept a short fixed default.
            max_tokens = DEFAULT_MAX_TOKENS if legacy else self.profile.max_model_len - prompt_tokens
        else:
            max_tokens = requested
        if max_tokens < 1 or prompt_tokens + max_tokens > self.profile.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.profile.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max(max_tokens, 1)} tokens ({prompt_tokens} in the messages, {max(max_tokens, 1)} in "
                f"the completion).",
                "BadRequestError",
                "context_length_exceeded",
            )
        forced = body.get("sim_output_tokens")
        if isinstance(forced, int) and not isinstance(forced, bool) and forced > 0:
            return max_tokens, forced
        if legacy or body.get("ignore_eos") is True:
            return max_tokens, None
        return max_tokens, natural

    def _record_finish(self, r: SimRequest) -> None:
        if r.finished_at is None:
            return
        st = self.stats
        wall = 1.0 / self.speed
        st.success += 1
        st.finished[r.finish_reason] = st.finished.get(r.finish_reason, 0) + 1
        st.prompt_tokens.observe(r.prompt_tokens)
        st.prefill_computed.observe(r.prompt_tokens - (r.cached_tokens or 0))
        st.generation_tokens.observe(r.generated)
        if r.first_token_at is not None:
            st.ttft.observe((r.first_token_at - r.arrived_at) * wall)
        st.e2e.observe((r.finished_at - r.arrived_at) * wall)
        if r.prefill_started_at is not None and r.first_token_at is not None:
            st.prefill_time.observe((r.first_token_at - r.prefill_started_at) * wall)

    def _usage(self, r: SimRequest) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.generated,
            "total_tokens": r.prompt_tokens + r.generated,
        }
        if r.cached_tokens:  # vLLM adds the details only when some prompt tokens came from the cache
            usage["prompt_tokens_details"] = {"cached_tokens": r.cached_tokens}
        return usage

    def _full_body(self, r: SimRequest, chat: bool, cid: str, created: int, text: str) -> dict[str, Any]:
        choice: dict[str, Any]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": r.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finish_reason}
        return {
            "id": cid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": r.adapter or self.profile.model,
            "choices": [choice],
            "usage": self._usage(r),
        }

    async def _sse_chunks(
        self, r: SimRequest, queue: asyncio.Queue[int | None], chat: bool, cid: str, created: int, include_usage: bool,
        first: int | None,
    ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            payload: dict[str, Any] = {"id": cid, "object": obj, "created": created,
                                       "model": r.adapter or self.profile.model, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        async for index in _tokens(queue, first):
            last = index + 1 == r.target_tokens
            reason = r.finish_reason if last else None
            if chat:
                yield chunk([{"index": 0, "delta": {"content": _word(index)}, "logprobs": None, "finish_reason": reason}])
            else:
                yield chunk([{"index": 0, "text": _word(index), "logprobs": None, "finish_reason": reason}])
        if include_usage:
            yield chunk([], self._usage(r))


async def _tokens(queue: asyncio.Queue[int | None], first: int | None = -1) -> AsyncIterator[int]:
    """Token indexes until the end marker; ``first`` is one already taken off the queue (-1: none)."""
    if first is None:
        return
    if first >= 0:
        yield first
    while (index := await queue.get()) is not None:
        yield index


def _word(index: int) -> str:
    return (" " if index else "") + WORDS[index % len(WORDS)]


async def _json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request body as a JSON object, or the engine's 400 for one that is not."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "request body is not valid JSON", "BadRequestError")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object", "BadRequestError")
    return body


def _prompt(body: dict[str, Any], *, chat: bool, profile: Profile) -> tuple[str, int]:
    """The prompt text (the messages' contents one after another, or the completion prompt) and its token count:
    ``ceil(characters / chars_per_token)`` plus, for a chat, ``template_tokens_per_message`` for each message (the
    profile's), or ``sim_prompt_tokens`` when the body forces one."""
    template = 0
    if chat:
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        text = "".join(str(m.get("content", "")) for m in messages)
        template = profile.template_tokens_per_message * len(messages)
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    forced = body.get("sim_prompt_tokens")
    if isinstance(forced, int) and forced > 0:
        return text, forced
    return text, max(1, math.ceil(len(text) / profile.chars_per_token) + template)


TEMPLATE_MARK = "<|sim_message|>"
"""What the llama.cpp dialect's ``/apply-template`` puts before each message (its template's tokens)."""

LISTENING = "listening on http://{host}:{port}"
"""The line ``serve`` prints (stdout, flushed) once it accepts connections: the port it bound, ``--port 0`` included."""


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """``name=path`` items (vLLM's ``--lora-modules`` short form) as a mapping; ValueError for an item without both."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes name=path, not {spec!r}")
        modules[name] = path
    return modules


def serve(
    profile: Profile, *, name: str, host: str, port: int, speed: float, model: str | None = None, flavor: str = "vllm-v1",
    output_model: str | None = None, seed: int | None = None, headers_at_first_token: bool = False,
    chars_per_token: float | None = None, template_tokens_per_message: int | None = None,
    max_loras: int = 0, lora_swap_s: float = 0.0, lora_modules: dict[str, str] | None = None,
    runtime_lora_updating: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM. ``port`` 0 binds any free port; either way the bound one is printed (``LISTENING``)."""
    sim = EngineSimulator(profile, name=name, speed=speed, model=model, flavor=flavor, output_model=output_model,
                          seed=seed, headers_at_first_token=headers_at_first_token, chars_per_token=chars_per_token,
                          template_tokens_per_message=template_tokens_per_message, max_loras=max_loras,
                          lora_swap_s=lora_swap_s, lora_modules=lora_modules,
                          runtime_lora_updating=runtime_lora_updating)
    asyncio.run(_serve(sim, host, port))


async def _serve(sim: EngineSimulator, host: str, port: int) -> None:
    import signal

    runner = web.AppRunner(sim.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = int(runner.addresses[0][1])
        log.info("simulated engine %s (%s, %s, output model %s) on http://%s:%d speed x%g", sim.name, sim.profile.name,
                 sim.flavor, sim.profile.output_model, host, bound, sim.speed)
        print(LISTENING.format(host=host, port=bound), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
