"""The EPP-like arm picks an engine as the Gateway API Inference Extension's default endpoint picker does: queue depth,
KV use and prefix match weighted 2 / 2 / 3, the highest total at random among ties, a prefix index that learns from its
own picks and forgets what an engine's LRU evicts; and its proxy streams a real simulator's answer through."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import aiohttp
import pytest

from bench.epp import (DEFAULT_BLOCK_SIZE_TOKENS, MAX_PREFIX_BLOCKS, EndpointMetrics, PrefixIndex, decide,
                       hash_prompt, kv_cache_scores, parse_metrics, pick, queue_scores, user_input, weighted_scores)
from bench.epp_arm import ENDPOINT_HEADER, epp_arm
from bench.workload import bare_sim

EXPOSITION = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="cortex"} 2.0
vllm:num_requests_waiting{engine="0",model_name="cortex"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="cortex"} 0.25
vllm:gpu_cache_usage_perc{engine="0",model_name="cortex"} 0.9
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="384"} 1.0
"""


def idle(kv: float = 0.0, waiting: int = 0) -> EndpointMetrics:
    return EndpointMetrics(waiting, 0, kv, 16, 1000)


def chat(system: str, question: str = "q") -> dict[str, object]:
    return {"model": "cortex", "messages": [{"role": "system", "content": system}, {"role": "user",
                                                                                    "content": question}]}


def test_the_vllm_gauges_and_the_cache_config_labels_are_read() -> None:
    assert parse_metrics(EXPOSITION) == EndpointMetrics(3, 2, 0.25, 16, 384)
    older = EXPOSITION.replace("vllm:kv_cache_usage_perc", "vllm:other")
    assert parse_metrics(older).kv_usage == 0.9
    assert parse_metrics("") == EndpointMetrics(0, 0, 0.0, 0, 0)


@pytest.mark.parametrize(("waiting", "expected"), [
    ({"a": 0, "b": 4, "c": 2}, {"a": 1.0, "b": 0.0, "c": 0.5}),
    ({"a": 3, "b": 3}, {"a": 1.0, "b": 1.0}),
], ids=["min-max-normalised", "all-equal-score-one"])
def test_the_queue_scorer_normalises_waiting_between_the_shortest_and_longest(waiting: dict[str, int],
                                                                             expected: dict[str, float]) -> None:
    assert queue_scores(waiting) == expected


def test_the_kv_scorer_is_one_minus_the_usage_and_the_weights_are_2_2_3() -> None:
    assert kv_cache_scores({"a": 0.25, "b": 1.0}) == {"a": 0.75, "b": 0.0}
    scores = weighted_scores({"a": idle(0.5, 1), "b": idle(0.0, 3)}, {"a": 4}, 8)
    assert scores == pytest.approx({"a": 2 * 1.0 + 2 * 0.5 + 3 * 0.5, "b": 2 * 0.0 + 2 * 1.0 + 3 * 0.0})


def test_the_picker_takes_the_highest_score_and_breaks_ties_at_random() -> None:
    rng = random.Random(1)
    assert pick({"a": 1.0, "b": 3.0, "c": 2.0}, rng) == "b"
    ties = Counter(pick({"a": 2.0, "b": 2.0, "c": 1.0}, rng) for _ in range(400))
    assert set(ties) == {"a", "b"} and min(ties.values()) > 150


def test_prompts_hash_in_chained_blocks_of_four_characters_a_token_seeded_by_the_model() -> None:
    block = DEFAULT_BLOCK_SIZE_TOKENS * 4
    assert hash_prompt("m", b"x" * (block - 1), 16) == ()
    two = hash_prompt("m", b"x" * (2 * block + 5), 16)
    assert len(two) == 2 and two[0] != two[1]  # same bytes, different chain position
    assert hash_prompt("other", b"x" * (2 * block), 16) != two
    assert len(hash_prompt("m", b"y" * (block * (MAX_PREFIX_BLOCKS + 40)), 16)) == MAX_PREFIX_BLOCKS
    long_a, long_b = (hash_prompt("m", b"p" * block * MAX_PREFIX_BLOCKS + tail, 16) for tail in (b"A", b"B" * 999))
    assert long_a == long_b  # past the 256th block two prompts are the same to the EPP
    assert user_input({"messages": [{"role": "user", "content": "hi"}]}) == b'[{"role":"user","content":"hi"}]'
    assert user_input({"prompt": "text"}) == b"text" and user_input({"input": 1}) is None


def test_the_index_credits_each_engine_up_to_the_first_block_nobody_holds() -> None:
    index = PrefixIndex()
    index.add((1, 2, 3), "a")
    index.add((1, 2), "b")
    assert index.matches((1, 2, 3, 4)) == {"a": 3, "b": 2}
    assert index.matches((9, 1, 2)) == {}
    index.add((1, 5), "c")
    assert index.matches((1, 5)) == {"a": 1, "b": 1, "c": 2}


def test_an_engine_lru_evicts_its_oldest_blocks_and_the_index_forgets_them_for_that_engine_only() -> None:
    index = PrefixIndex()
    index.add((1, 2, 3), "a", capacity=3)
    index.add((1, 2, 3), "b", capacity=100)
    index.add((1,), "a")  # touched: now the most recent
    index.add((7, 8), "a")  # evicts 2 and 3 from a
    assert index.size("a") == 3
    assert index.matches((1, 2, 3)) == {"a": 1, "b": 3}
    assert index.matches((7, 8)) == {"a": 2}


def test_a_request_goes_where_its_prefix_is_cached_unless_that_engine_is_much_busier() -> None:
    index = PrefixIndex()
    rng = random.Random(0)
    system = "words " * 4000
    first = decide(chat(system, "one"), {"a": idle(), "b": idle()}, index, rng)
    other = "b" if first.engine == "a" else "a"
    assert len(first.hashes) == MAX_PREFIX_BLOCKS
    # Same system prompt, a fresh question: the cached engine scores 3 more even with a bit more KV in use.
    metrics = {first.engine: idle(kv=0.3), other: idle(kv=0.0)}
    again = decide(chat(system, "two"), metrics, index, rng)
    assert again.engine == first.engine and again.matched == {first.engine: MAX_PREFIX_BLOCKS}
    # Its queue the longest and its KV full: 0 + 0 + 3 against 2 + 2 + 0, the other engine wins.
    busy = {first.engine: idle(kv=1.0, waiting=5), other: idle(kv=0.0, waiting=0)}
    assert decide(chat(system, "three"), busy, index, rng).engine == other
    # A prompt shorter than one block has no prefix score: the emptier engine wins.
    hi = {"model": "cortex", "messages": [{"role": "user", "content": "hi"}]}
    short = decide(hi, {first.engine: idle(kv=0.4), other: idle(kv=0.1)}, index, rng)
    assert short.hashes == () and short.engine == other


def test_the_proxy_streams_a_simulator_answer_and_sends_a_shared_prefix_back_to_its_engine() -> None:
    with bare_sim("spark", 20.0, "s1") as one, bare_sim("thor", 20.0, "s2") as two, \
            epp_arm({"s1": one, "s2": two}) as arm:
        async def ask(question: str) -> tuple[str, int, list[str]]:
            body = {**chat("shared " * 600, question), "stream": True, "max_tokens": 4,
                    "stream_options": {"include_usage": True}}
            async with aiohttp.ClientSession() as session, \
                    session.post(arm.base + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                lines = [line async for raw in response.content if (line := raw.decode().strip())]
                chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
                usage = next(c["usage"] for c in chunks if c.get("usage"))
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                return response.headers[ENDPOINT_HEADER], int(cached), lines

        first, cold, lines = asyncio.run(ask("first"))
        assert lines[-1] == "data: [DONE]" and cold == 0
        second, warm, _ = asyncio.run(ask("second"))
        assert second == first and warm > 500
        stats = arm.stats()
        assert stats["routed"] == {first: 2} and stats["index_blocks"][first] > 0
