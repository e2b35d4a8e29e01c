"""An engine's own count of a long prompt before the Check decides (``admission.tokenize_above_chars``, off by
default): the learned estimate (core/prompt_tokens.py) is a per-character rule, and on a long prompt its error is the
KV it under- or over-reserves.

**Which engine.** One that serves the request's model, is ready and not drained, and speaks vLLM's or llama.cpp's
dialect (SGLang and TGI have no tokenize endpoint read here; an engine whose dialect is not known yet is asked as vLLM),
taken in turn so that no one engine's API server carries every count. **How.** vLLM: ``POST /tokenize`` with the
request's ``messages`` and ``add_generation_prompt: true`` (a chat completion's own rendering) or its ``prompt``; the
answer's ``count`` (vLLM's ``TokenizeResponse``). llama.cpp: a chat's messages through ``POST /apply-template`` (its
``prompt``), then ``POST /tokenize`` of that text (``{"content", "add_special": true}``: with the BOS its completion
endpoints add); the answer's ``len(tokens)``.

**Bounded.** Both calls together within ``admission.tokenize_timeout_ms``; a timeout, an error status, a refused
connection or an answer without a count leaves the Check's estimate, and each ask is counted by outcome
(``sluice_tokenize_requests_total{outcome}``). A count replaces the request's ``prompt_tokens`` (so the KV
reservation, the TTFT estimate and a tenant's pre-charge use it) and is one sample of its (model, engine)'s rule: it
is that engine's own tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp

from controlplane.core.admission import AdmissionCore
from controlplane.core.engines import EngineView, Flavor
from controlplane.core.model import InferenceRequest
from controlplane.core.prompt_tokens import PromptShape
from controlplane.metrics import SluiceMetrics
from controlplane.observe.observation import Observation

log = logging.getLogger("sluice.tokenize")

ASKED_FLAVORS = (Flavor.VLLM, Flavor.LLAMACPP, None)
CHAT_PATH = "/v1/chat/completions"


class PromptTokenizer:
    def __init__(self, core: AdmissionCore, observation: Observation, metrics: SluiceMetrics,
                 clock: Callable[[], float]) -> None:
        self.core = core
        self.observation = observation
        self.metrics = metrics
        self.clock = clock
        self._turn = 0
        self._http: aiohttp.ClientSession | None = None

    async def counted(self, request: InferenceRequest, body: bytes) -> InferenceRequest:
        """``request`` with its prompt tokens as an engine counts them when its prompt is long enough to ask
        (``tokenize_above_chars``), else (or on any failure) as it is."""
        policy = self.core.policy
        if not policy.tokenize_above_chars or request.model is None \
                or request.prompt_chars < policy.tokenize_above_chars:
            return request
        engine = self._engine(request.model)
        if engine is None:
            self.metrics.tokenize_requests.labels("no_engine").inc()
            return request
        try:
            payload = json.loads(body)
            async with asyncio.timeout(policy.tokenize_timeout_ms / 1000):
                count = await self._ask(engine, request, payload)
        except TimeoutError:
            self.metrics.tokenize_requests.labels("timeout").inc()
            return request
        except (aiohttp.ClientError, ValueError, TypeError, KeyError) as exc:
            self.metrics.tokenize_requests.labels("failed").inc()
            log.debug("tokenize on engine %s failed: %s", engine.name, exc)
            return request
        if count is None or count <= 0:
            self.metrics.tokenize_requests.labels("failed").inc()
            return request
        self.metrics.tokenize_requests.labels("ok").inc()
        shape = PromptShape(request.prompt_chars, request.prompt_messages)
        self.core.observe_prompt_tokens(request.model, engine.name, shape, count, request.prompt_tokens)
        return replace(request, prompt_tokens=count)

    def _engine(self, model: str) -> EngineView | None:
        """The next engine in turn that serves ``model`` and has a tokenize endpoint (the module docstring)."""
        candidates = sorted((e for e in self.observation.fleet(self.clock()).engines
                             if e.ready and not e.drained and e.serves(model) and e.flavor in ASKED_FLAVORS),
                            key=lambda e: e.name)
        if not candidates:
            return None
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    async def _ask(self, engine: EngineView, request: InferenceRequest, payload: Any) -> int | None:
        http = self._session()
        base = engine.url.rstrip("/")
        chat = request.path == CHAT_PATH
        if engine.flavor is Flavor.LLAMACPP:
            text = payload.get("prompt", payload.get("input", ""))
            if chat:
                async with http.post(f"{base}/apply-template", json={"messages": payload["messages"]}) as response:
                    response.raise_for_status()
                    text = (await response.json())["prompt"]
            async with http.post(f"{base}/tokenize", json={"content": text, "add_special": True}) as response:
                response.raise_for_status()
                return len((await response.json())["tokens"])
        asked: dict[str, Any] = {"model": request.model}
        if chat:
            asked.update(messages=payload["messages"], add_generation_prompt=True)
        else:
            asked["prompt"] = payload.get("prompt", payload.get("input", ""))
        async with http.post(f"{base}/tokenize", json=asked) as response:
            response.raise_for_status()
            count = (await response.json())["count"]
        return count if isinstance(count, int) else None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
