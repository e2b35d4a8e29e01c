"""Long prompts counted by an engine's own tokenizer before the Check decides (observe/tokenizer.py,
``admission.tokenize_above_chars``): vLLM's and llama.cpp's endpoints as the simulator speaks them, and the estimate
standing whenever the count does not come in time."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controlplane.core.admission import AdmissionCore
from controlplane.core.engines import EngineView, Flavor, ServedModel
from controlplane.core.model import InferenceRequest
from controlplane.core.policy import Policy
from controlplane.core.prompt_tokens import PromptShape
from controlplane.core.request import parse_request
from controlplane.metrics import SluiceMetrics
from controlplane.observe.observation import Observation
from controlplane.observe.tokenizer import PromptTokenizer
from enginesim.profiles import PROFILES
from enginesim.server import EngineSimulator

PROFILE = replace(PROFILES["spark"], chars_per_token=1.3, template_tokens_per_message=5)


@dataclass
class FakeFleet:
    engines: tuple[EngineView, ...]


@dataclass
class FakeObservation:
    engines: tuple[EngineView, ...] = ()

    def fleet(self, now: float) -> FakeFleet:
        return FakeFleet(self.engines)


@dataclass
class FakeCore:
    policy: Policy = field(default_factory=lambda: Policy(tokenize_above_chars=1000, tokenize_timeout_ms=300))
    samples: list[tuple[str, str, PromptShape, int, int]] = field(default_factory=list)

    def observe_prompt_tokens(self, model: str, engine: str, shape: PromptShape, counted: int, estimated: int) -> None:
        self.samples.append((model, engine, shape, counted, estimated))


def view(name: str, url: str, flavor: Flavor | None, model: str = PROFILE.model) -> EngineView:
    return EngineView(name, url, None, models=(ServedModel(model),), stale=False, flavor=flavor)


async def serve(app: web.Application) -> TestServer:
    server = TestServer(app)
    await server.start_server()
    return server


@pytest.fixture
async def sims() -> AsyncIterator[dict[str, TestServer]]:
    servers = {"vllm": await serve(EngineSimulator(PROFILE, name="v").app()),
               "llamacpp": await serve(EngineSimulator(PROFILE, name="l", flavor="llamacpp").app())}
    yield servers
    for server in servers.values():
        await server.close()


def tokenizer(*engines: EngineView) -> tuple[PromptTokenizer, FakeCore, SluiceMetrics]:
    core, metrics = FakeCore(), SluiceMetrics()
    return PromptTokenizer(cast(AdmissionCore, core), cast(Observation, FakeObservation(engines)), metrics,
                           lambda: 0.0), core, metrics


def chat(chars: int, messages: int = 2) -> tuple[InferenceRequest, bytes]:
    body = {"model": PROFILE.model, "messages": [{"role": "user", "content": "x" * (chars // messages)}
                                                 for _ in range(messages)]}
    raw = json.dumps(body).encode()
    return parse_request("POST", "/v1/chat/completions", raw), raw


def outcomes(metrics: SluiceMetrics) -> dict[str, float]:
    return {outcome: metrics.registry.get_sample_value("sluice_tokenize_requests_total", {"outcome": outcome}) or 0.0
            for outcome in ("ok", "timeout", "failed", "no_engine")}


@pytest.mark.parametrize("flavor", [Flavor.VLLM, Flavor.LLAMACPP])
async def test_a_long_chat_prompt_is_counted_as_its_engine_counts_it(sims: dict[str, TestServer],
                                                                    flavor: Flavor) -> None:
    engine = view("e1", str(sims[flavor.value].make_url("")), flavor)
    tokens, core, metrics = tokenizer(engine)
    request, raw = chat(6000)
    assert request.prompt_tokens == 1500  # the prior: 4 characters a token, no template
    counted = await tokens.counted(request, raw)
    expected = math.ceil(6000 / 1.3) + 2 * 5
    assert counted.prompt_tokens == expected
    assert core.samples == [(PROFILE.model, "e1", PromptShape(6000, 2), expected, 1500)]
    assert outcomes(metrics)["ok"] == 1
    await tokens.stop()


async def test_a_long_completion_prompt_and_a_short_one(sims: dict[str, TestServer]) -> None:
    tokens, core, _ = tokenizer(view("e1", str(sims["vllm"].make_url("")), None))  # dialect unknown: asked as vLLM
    raw = json.dumps({"model": PROFILE.model, "prompt": "p" * 2600}).encode()
    counted = await tokens.counted(parse_request("POST", "/v1/completions", raw), raw)
    assert counted.prompt_tokens == 2000
    short, short_raw = chat(400)
    assert await tokens.counted(short, short_raw) == short, "below tokenize_above_chars: not asked"
    assert len(core.samples) == 1
    await tokens.stop()


async def test_the_estimate_stands_when_the_count_is_late_refused_or_nobody_can_count() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"count": 1})

    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=500)

    slow_app, broken_app = web.Application(), web.Application()
    slow_app.router.add_post("/tokenize", slow)
    broken_app.router.add_post("/tokenize", broken)
    slow_server, broken_server = await serve(slow_app), await serve(broken_app)
    try:
        request, raw = chat(6000)
        for engine, outcome in ((view("slow", str(slow_server.make_url("")), Flavor.VLLM), "timeout"),
                                (view("broken", str(broken_server.make_url("")), Flavor.VLLM), "failed"),
                                (view("sglang", "http://127.0.0.1:9", Flavor.SGLANG), "no_engine"),
                                (view("other", "http://127.0.0.1:9", Flavor.VLLM, model="other"), "no_engine")):
            tokens, core, metrics = tokenizer(engine)
            started = asyncio.get_running_loop().time()
            assert await tokens.counted(request, raw) == request, outcome
            assert asyncio.get_running_loop().time() - started < 1.0, "bounded by tokenize_timeout_ms"
            assert outcomes(metrics)[outcome] == 1 and core.samples == []
            await tokens.stop()
    finally:
        await slow_server.close()
        await broken_server.close()


