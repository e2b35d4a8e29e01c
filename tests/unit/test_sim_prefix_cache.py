"""The simulator's automatic prefix caching against hand-computed cases: block hashes and their chains, hits that skip
prefill (never the last token), shared blocks counted once, freed blocks kept until evicted tail first, vLLM V1's counters
and ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

from dataclasses import replace
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from controlplane.observe.parse import read_series
from enginesim.batcher import Batcher, SimRequest
from enginesim.prefixcache import block_hashes
from enginesim.profiles import ESTIMATOR_WORLD, PROFILES, Profile
from enginesim.server import EngineSimulator

#: ``ESTIMATOR_WORLD`` (a ``dict[str, float]``) as ``Profile`` fields by name, for ``replace``.
IN_ESTIMATOR_WORLD: dict[str, Any] = ESTIMATOR_WORLD

TINY = Profile("tiny", "m", 2, 10, 16, 100.0, (10.0,), 1000, "0")
"""10 KV blocks of 16 tokens, 2 slots, 100 prompt tokens/s."""


def text(tag: str, tokens: int) -> str:
    """``tokens`` tokens of text (4 characters each) starting with ``tag``."""
    return (tag + "." * (tokens * 4))[:tokens * 4]


def request(name: str, body: str, max_tokens: int = 1) -> SimRequest:
    tokens = len(body) // 4
    return SimRequest(name, tokens, max_tokens, arrived_at=0, block_hashes=block_hashes(body, tokens, 16))


def run(b: Batcher, *requests: SimRequest) -> None:
    for r in requests:
        b.submit(r)
    now = 0.0
    while not b.idle:
        b.schedule(now)
        step = b.plan_step()
        now += step
        b.apply_step(step, now)
        b.finished.clear()


def test_block_hashes_are_chained_64_character_spans() -> None:
    a = block_hashes("a" * 64 + "b" * 64 + "c" * 64 + "d" * 10, 100, 16)
    assert len(a) == 3  # the 10 trailing characters are not a full block
    same_start = block_hashes("a" * 64 + "b" * 64 + "x" * 64, 48, 16)
    assert same_start[:2] == a[:2] and same_start[2] != a[2]
    # A block's hash depends on what came before it: the same second block after a different first one differs.
    assert block_hashes("z" * 64 + "b" * 64, 32, 16)[1] != a[1]
    assert block_hashes("a" * 640, 20, 16) == block_hashes("a" * 64, 16, 16)  # a forced token count caps the blocks
    assert block_hashes("a" * 640, 40, 16) == block_hashes("a" * 640, 40, 16)  # deterministic


def test_a_repeated_prompt_prefills_only_its_last_block() -> None:
    """100 tokens = 6 full blocks + 4 tokens. The second copy finds all 6 blocks: 96 tokens cached, 4 prefilled; the
    counters add both lookups' tokens (200) and the hits (96)."""
    b = Batcher(PROFILES["thor"])
    first, second = request("a", text("A", 100)), request("b", text("A", 100))
    run(b, first)
    assert first.cached_tokens == 0 and b.prefix.cached_blocks == 6
    assert b.free_blocks == PROFILES["thor"].num_gpu_blocks and b.kv_usage == 0  # cached and free: not usage
    run(b, second)
    assert second.cached_tokens == 96
    assert (b.prefix.queries, b.prefix.hits) == (200, 96)
    assert b.prompt_tokens_total == 200  # vLLM counts every prompt token, cached or not


def test_a_prompt_of_whole_blocks_recomputes_its_last_block() -> None:
    """64 tokens = exactly 4 blocks: at most (64 - 1) // 16 = 3 hit, so the last token is computed (vLLM)."""
    b = Batcher(PROFILES["thor"])
    run(b, request("a", text("A", 64)))
    again = request("b", text("A", 64))
    run(b, again)
    assert again.cached_tokens == 48


def test_the_chain_breaks_where_the_prompts_diverge() -> None:
    b = Batcher(PROFILES["thor"])
    shared = text("S", 48)  # 3 blocks
    run(b, request("a", shared + text("one", 52)))
    other = request("b", shared + text("two", 52))
    run(b, other)
    assert other.cached_tokens == 48
    assert b.prefix.cached_blocks == 6 + 3  # a's 6 blocks, and b's 3 blocks after the shared ones


def test_running_requests_share_cached_blocks_once() -> None:
    """The second copy is scheduled after the first registered its blocks: both hold the 4 shared blocks, which KV counts
    once."""
    b = Batcher(TINY)
    first = request("a", text("A", 64), max_tokens=50)
    b.submit(first)
    now = 0.0
    while first.prefill_left:
        b.schedule(now)
        step = b.plan_step()
        now += step
        b.apply_step(step, now)
    second = request("b", text("A", 64), max_tokens=50)
    b.submit(second)
    b.schedule(now)
    assert second.cached_tokens == 48 and second.shared == first.shared[:3]
    assert b.prefix.refs[first.shared[0]] == 2
    held = first.blocks + second.blocks - 3  # three blocks are the same blocks
    assert b.free_blocks == TINY.num_gpu_blocks - held


def test_freed_blocks_stay_cached_until_needed_and_the_tail_goes_first() -> None:
    """10 blocks. A (64 tokens + 1 generated) leaves its 4 prompt blocks cached and free. C (112 tokens + 1 = 8 blocks)
    needs 2 more than the 6 never used: A's last two blocks are evicted (freed tail first), its first two stay. A again hits
    those two: 32 tokens."""
    b = Batcher(TINY)
    run(b, request("a", text("A", 64)))
    assert b.prefix.cached_blocks == 4 and b.free_blocks == 10
    run(b, request("c", text("C", 112)))
    assert b.prefix.evictions == 2
    again = request("a2", text("A", 64))
    run(b, again)
    assert again.cached_tokens == 32
    assert b.free_blocks == 10  # everything given back


def test_preemption_frees_shared_blocks_and_the_resumption_hits_them() -> None:
    """Two long requests on 10 blocks: the younger is preempted; when it resumes it finds its own prompt blocks cached
    (counted as a second lookup, as vLLM does)."""
    b = Batcher(TINY)
    old, young = request("old", text("O", 48), max_tokens=60), request("young", text("Y", 48), max_tokens=60)
    run(b, old, young)
    assert b.preemptions >= 1
    assert young.generated == 60 and old.generated == 60
    assert b.prefix.hits >= 48  # the resumption found the young request's own 3 prompt blocks
    assert b.free_blocks == 10


async def _post(sim: EngineSimulator, path: str, body: dict[str, object]) -> dict[str, Any]:
    client = TestClient(TestServer(sim.app()))
    await client.start_server()
    try:
        response = await client.post(path, json=body)
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_reports_cached_tokens_and_metrics_count_them(stream: bool) -> None:
    sim = EngineSimulator(replace(PROFILES["spark"], **IN_ESTIMATOR_WORLD), name="s", speed=1000)
    system = {"role": "system", "content": text("system prompt", 256)}  # 16 blocks at 4 characters a token

    def body(question: str) -> dict[str, object]:
        return {"model": "cortex", "max_tokens": 2, "messages": [system, {"role": "user", "content": question}]}

    first = await _post(sim, "/v1/chat/completions", body("what is a sluice?"))
    assert "prompt_tokens_details" not in first["usage"]  # nothing cached: vLLM leaves it out
    probe = await _post(sim, "/sim/cache", body("and a weir?"))
    assert probe["cached_tokens"] == 256 and probe["running"] == 0
    if not stream:
        second = await _post(sim, "/v1/chat/completions", body("and a weir?"))
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    else:
        client = TestClient(TestServer(sim.app()))
        await client.start_server()
        try:
            response = await client.post("/v1/chat/completions", json={
                **body("and a weir?"), "stream": True, "stream_options": {"include_usage": True}})
            chunks = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                      if line.startswith("data: {")]
        finally:
            await client.close()
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    assert sim.served[-1]["cached_tokens"] == 256
    answer = await sim.metrics_endpoint(make_mocked_request("GET", "/metrics"))
    assert isinstance(answer.body, bytes)
    series = read_series(answer.body.decode())
    prompt = sim.served[0]["prompt_tokens"] + sim.served[-1]["prompt_tokens"]
    assert series["vllm:prefix_cache_queries_total"][0][1] == prompt
    assert series["vllm:prefix_cache_hits_total"][0][1] == 256
    # Each finished request's computed prompt tokens (its prompt less what the cache held): vLLM's newer histogram.
    assert series["vllm:request_prefill_kv_computed_tokens_sum"][0][1] == prompt - 256
