"""The prefix index (core/prefix.py): canonical prompts, chained blocks, LRU per engine bounded by KV capacity and by the
index's own bound, nested holders, forgetting on restart and drain; and how expected hits enter routing (route.py,
decide.py): prefill minus the hit, the band's preference, ``prefix_cache``, ``prefix_max_replicas``."""

from __future__ import annotations

import random
from collections.abc import Mapping
import tracemalloc
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.admission import AdmissionCore
from controlplane.core.decide import decide
from controlplane.core.ledger import Ledger
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.model import InferenceRequest, Reason, Verdict
from controlplane.core.policy import Policy
from controlplane.core.prefix import PrefixIndex, blocks_from_text, blocks_text, prompt_blocks, render_prompt
from controlplane.core.request import parse_request

P = Policy(default_max_tokens=100)


def chat_body(*messages: tuple[str, str], tools: object = None) -> dict[str, object]:
    body: dict[str, object] = {"model": "cortex", "messages": [{"role": r, "content": c} for r, c in messages]}
    if tools is not None:
        body["tools"] = tools
    return body


# -- rendering and blocks -----------------------------------------------------------------------------------------------
def test_a_conversation_renders_each_turn_as_the_next_turns_prefix() -> None:
    turn1 = chat_body(("system", "be brief"), ("user", "hello"))
    turn2 = chat_body(("system", "be brief"), ("user", "hello"), ("assistant", "hi"), ("user", "and?"))
    one, two = render_prompt("/v1/chat/completions", turn1), render_prompt("/v1/chat/completions", turn2)
    assert two.startswith(one) and one == "\x1esystem\x1fbe brief\x1euser\x1fhello"
    # Roles are part of the prompt (a system prompt and a user message with the same text differ) ...
    assert render_prompt("/v1/chat/completions", chat_body(("user", "be brief"))) != \
        render_prompt("/v1/chat/completions", chat_body(("system", "be brief")))
    # ... content parts read as their text, and tool definitions come first, keys sorted.
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "image_url", "image_url": {}},
                                                                       {"type": "text", "text": "b"}]}]}
    assert render_prompt("/v1/chat/completions", parts) == "\x1euser\x1fab"
    tools = render_prompt("/v1/chat/completions", chat_body(("user", "x"), tools=[{"b": 1, "a": 2}]))
    assert tools == '[{"a":2,"b":1}]\x1d\x1euser\x1fx'
    assert render_prompt("/v1/completions", {"prompt": "once upon"}) == "once upon"
    assert render_prompt("/v1/embeddings", {"input": "x"}) == ""


def test_blocks_are_chained_whole_spans_up_to_a_bound() -> None:
    text = "a" * 256 + "b" * 256 + "c" * 100
    blocks = prompt_blocks(text, 256, 256)
    assert len(blocks) == 2  # the last 100 characters are not a whole block
    assert prompt_blocks("a" * 256 + "x" * 256, 256, 256)[0] == blocks[0]
    assert prompt_blocks("a" * 256 + "x" * 256, 256, 256)[1] != blocks[1]
    assert prompt_blocks("z" * 256 + "b" * 256, 256, 256)[1] != blocks[1]  # chained: block 1 depends on block 0
    assert prompt_blocks(text * 10, 256, 3) == prompt_blocks(text * 10, 256, 256)[:3]
    assert blocks_from_text(blocks_text(blocks)) == blocks and blocks_from_text("xyz") == ()


def test_parse_request_hashes_the_rendered_prompt_unless_prefix_routing_is_off() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"q" * 600 + b'"}]}'
    on = parse_request("POST", "/v1/chat/completions", body)
    assert on.prefix_blocks == prompt_blocks("\x1euser\x1f" + "q" * 600, 256, 256)
    assert parse_request("POST", "/v1/chat/completions", body, policy=Policy(prefix_routing=False)).prefix_blocks == ()
    assert len(parse_request("POST", "/v1/chat/completions", body,
                             policy=Policy(prefix_block_chars=64)).prefix_blocks) == 9


# -- the index --------------------------------------------------------------------------------------------------------
def chain(tag: str, n: int) -> tuple[int, ...]:
    return prompt_blocks(tag * 16 * n, 16, n)


def test_match_reports_each_engines_leading_blocks() -> None:
    index = PrefixIndex(10_000)
    shared, a_tail, b_tail = chain("s", 4), (101, 102), (201,)
    index.note("a", shared + a_tail)
    index.note("b", shared[:2])
    index.note("c", (999,))
    assert index.match(shared + a_tail) == {"a": 6, "b": 2}
    assert index.match(shared + b_tail) == {"a": 4, "b": 2}
    assert index.match((555,) + shared) == {}  # a different first block: nobody holds this prompt's start
    assert index.held == 6 + 2 + 1


def test_an_engine_holds_at_most_its_kv_capacity_least_recently_used_first_tail_first() -> None:
    index = PrefixIndex(10_000)
    index.set_capacity("a", 5)
    first, second = chain("f", 3), chain("g", 3)
    index.note("a", first)
    index.note("a", second)  # 6 blocks > 5: the oldest entry goes, and that is first's tail
    assert index.match(first) == {"a": 2} and index.match(second) == {"a": 3}
    index.note("a", first[:1])  # touching first's head keeps it; the next eviction takes first's remaining tail
    index.note("a", chain("h", 1))
    assert index.match(first) == {"a": 1} and index.blocks_of("a") == 5


def test_the_index_bound_is_shared_evenly_and_held_never_exceeds_it() -> None:
    index = PrefixIndex(12)
    index.note("a", chain("a", 10))
    assert index.held == 10  # alone, a may hold up to the whole bound
    index.note("b", chain("b", 10))  # now each engine gets 6
    assert index.blocks_of("a") == 6 and index.blocks_of("b") == 6 and index.held == 12
    index.set_limit(4)
    assert index.held == 4
    index.keep(["b"])  # a reload removed a
    assert index.blocks_of("a") == 0 and index.blocks_of("b") == 2 and index.bound("b") == 4  # b may grow again


def test_forget_drops_an_engine_and_only_it() -> None:
    index = PrefixIndex(1_000)
    blocks = chain("x", 5)
    index.note("a", blocks)
    index.note("b", blocks)
    assert index.forget("a") == 5
    assert index.match(blocks) == {"b": 5} and index.held == 5 and index.forget("a") == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["note", "note", "note", "forget", "capacity"]), st.integers(0, 2),
                          st.integers(0, 3), st.integers(1, 8)), max_size=60),
       st.integers(1, 30))
def test_holders_stay_nested_and_the_bound_holds(ops: list[tuple[str, int, int, int]], limit: int) -> None:
    """Whatever is noted, evicted and forgotten: every engine holding block k of a prompt holds blocks 0..k-1 (so a match
    is a prefix), the index never holds more than its bound, and ``held`` counts exactly."""
    index = PrefixIndex(limit)
    prompts = {p: chain(str(p), 8) for p in range(4)}
    for op, engine, prompt, n in ops:
        name = f"e{engine}"
        if op == "note":
            index.note(name, prompts[prompt][:n])
        elif op == "forget":
            index.forget(name)
        else:
            index.set_capacity(name, n)
        assert index.held <= limit
        assert index.held == sum(index.blocks_of(f"e{e}") for e in range(3))
    for blocks in prompts.values():
        depth = index.match(blocks)
        for k, h in enumerate(blocks):
            holders = {e for e, d in depth.items() if d > k}
            for e in range(3):
                lru: Mapping[int, None] = index._lru.get(f"e{e}", {})
                if h in lru:
                    assert all(blocks[j] in lru for j in range(k)), "a block is held without its parent"
            assert holders == {f"e{e}" for e in range(3) if all(b in index._lru.get(f"e{e}", {}) for b in blocks[:k + 1])}


def test_memory_per_entry_is_bounded() -> None:
    """What the ``sluice_prefix_index_blocks`` gauge costs: about 240 bytes an entry (bound 300) (200,000 entries over 8 engines, the
    hashes mostly shared between two engines each, as hot prefixes are)."""
    rng = random.Random(1)
    prompts = [tuple(rng.getrandbits(64) for _ in range(50)) for _ in range(2_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(10**9)
    for i, blocks in enumerate(prompts):
        index.note(f"e{i % 8}", blocks)
        index.note(f"e{(i + 1) % 8}", blocks)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.held == 200_000
    assert used / index.held < 300, used / index.held


# -- the core's use of it ------------------------------------------------------------------------------------------------
def view(name: str, *, running: int = 0, seqs: int = 2, prefill: float = 1000.0, decode: float = 20.0,
         capacity: int = 100_000, taken_at: float = 0.0, prompt_total: float | None = None,
         drained: bool = False) -> EngineView:
    return EngineView(name=name, url="", max_num_seqs=seqs, models=(ServedModel("cortex", 32_768),), version="0.10.1",
                      sample=EngineSample(taken_at, running=running, waiting=0, kv_usage=0.0,
                                          kv_capacity_tokens=capacity, prompt_tokens_total=prompt_total),
                      last_ok_at=taken_at, stale=False, chip_class=name, anchor_prefill_tokens_per_s=prefill,
                      anchor_decode_tokens_per_s=decode, drained=drained)


def prompt_request(text: str, ttft_ms: int | None = None, session: str | None = None, max_tokens: int = 20,
                   policy: Policy = P) -> InferenceRequest:
    body = ('{"model": "cortex", "max_tokens": %d, "messages": [{"role": "user", "content": "%s"}]}'
            % (max_tokens, text)).encode()
    headers = {"x-sluice-max-ttft-ms": str(ttft_ms)} if ttft_ms else {}
    if session:
        headers["x-sluice-session"] = session
    return parse_request("POST", "/v1/chat/completions", body, headers, policy)


SYSTEM = "s" * 8000  # 2,000 tokens of shared prefix


def test_expected_hits_follow_admissions_and_a_restart_or_drain_forgets_them() -> None:
    core = AdmissionCore(P, Ledger(600))
    views = [view("thor", prompt_total=10.0), view("spark", prompt_total=10.0)]
    for v in views:
        core.note_cache_view(v)
    first = core.check("r1", prompt_request(SYSTEM + "q1"), core.fleet(views, 1.0), 1.0)
    assert first.ticket is not None and first.decision.reason is Reason.FINISH_SOONEST
    home = first.ticket.engine
    expected = core.expected_cached(prompt_request(SYSTEM + "q2"))
    assert expected == {home: 31 * 64}  # 31 whole 256-character blocks of the 8,007 rendered characters
    assert core.note_cache_view(view(home, taken_at=2.0, prompt_total=20.0)) is None  # counters only grew
    assert core.note_cache_view(view(home, taken_at=3.0, prompt_total=5.0)) == "restart"
    assert core.expected_cached(prompt_request(SYSTEM + "q2")) == {}
    second = core.check("r2", prompt_request(SYSTEM + "q3"), core.fleet(views, 4.0), 4.0)
    assert second.ticket is not None and set(core.expected_cached(prompt_request(SYSTEM + "q4"))) == {second.ticket.engine}
    drained = replace(view(second.ticket.engine, taken_at=5.0, prompt_total=30.0), drained=True)
    assert core.note_cache_view(drained) == "drained"
    assert core.prefixes.held == 0


def test_a_hit_on_a_slower_engine_beats_a_cold_fast_one_when_prefill_dominates() -> None:
    """8,000-character system prompt. thor prefills 500 tok/s, spark 4,000: cold, spark finishes first; with thor holding
    1,984 of ~2,002 tokens, thor's prefill is 0.04 s against spark's 0.5 s, and thor wins on time, not by a bonus."""
    views = [view("thor", prefill=500.0, decode=50.0), view("spark", prefill=4000.0, decode=50.0)]
    core = AdmissionCore(P, Ledger(600))
    request = prompt_request(SYSTEM + "question")
    cold = decide(request, core.fleet(views, 0.0), P, 0.0)
    assert cold.engine == "spark" and cold.reason is Reason.FINISH_SOONEST and cold.cached_tokens == 0
    warm = decide(request, core.fleet(views, 0.0), P, 0.0, cached={"thor": 1984})
    assert warm.engine == "thor" and warm.reason is Reason.PREFIX_CACHE and warm.cached_tokens == 1984
    assert "1984 prompt tokens expected cached" in warm.detail
    # A small hit does not pay for the slower prefill: the rest still costs thor more than the whole prompt costs spark.
    small = decide(request, core.fleet(views, 0.0), P, 0.0, cached={"thor": 64})
    assert small.engine == "spark" and small.reason is Reason.FINISH_SOONEST


def test_a_busy_holder_spills_to_a_free_engine_when_waiting_would_cost_more() -> None:
    """thor holds the prompt but is full with long requests; waiting for it would exceed the work-conserving bound, so
    spark prefills it cold (and then holds it too)."""
    views = [view("thor", running=2, prefill=4000.0, decode=50.0), view("spark", prefill=4000.0, decode=50.0)]
    core = AdmissionCore(P, Ledger(600))
    outcome = core.check("r", prompt_request(SYSTEM + "q"), core.fleet(views, 0.0), 0.0)
    assert outcome.decision.engine == "spark"
    core.prefixes.note("thor", prompt_request(SYSTEM).prefix_blocks)
    assert set(core.expected_cached(prompt_request(SYSTEM + "x"))) == {"thor", "spark"}


def test_the_band_prefers_the_engine_holding_the_prefix_but_the_session_comes_first() -> None:
    views = [view("thor", prefill=4000.0, decode=50.0), view("spark", prefill=4000.0, decode=50.0)]
    core = AdmissionCore(P, Ledger(600))
    request = prompt_request(SYSTEM + "q", ttft_ms=5000)
    for pick in (0.0, 0.5, 0.99):
        chosen = decide(request, core.fleet(views, 0.0), P, 0.0, pick=pick, cached={"spark": 1984})
        assert chosen.engine == "spark" and chosen.reason is Reason.PREFIX_CACHE
    sticky = decide(request, core.fleet(views, 0.0), P, 0.0, affinity="thor", cached={"spark": 1984})
    assert sticky.engine == "thor" and sticky.reason is Reason.SESSION_AFFINITY


def test_a_cache_hit_can_meet_a_deadline_no_cold_prefill_could() -> None:
    """2,000 tokens at 1,000 tok/s is 2 s: a 1 s deadline is unmeetable cold, but not where the prompt is cached."""
    views = [view("thor"), view("spark")]
    core = AdmissionCore(P, Ledger(600))
    request = prompt_request(SYSTEM + "q", ttft_ms=1000)
    assert decide(request, core.fleet(views, 0.0), P, 0.0).reason is Reason.TTFT_UNMEETABLE
    served = decide(request, core.fleet(views, 0.0), P, 0.0, cached={"thor": 1984})
    assert served.verdict is Verdict.ADMIT and served.engine == "thor"


def test_waiting_for_the_holder_may_last_as_long_as_the_prefill_it_saves() -> None:
    """thor holds the prompt and is full; spark is free. The wait for thor (one service, ~2 s) is more than half a service
    (the work-conserving bound), but less than that plus the 1,984 tokens spark would prefill again (~2 s at 1,000
    tok/s): the request waits for thor. Without the hit it takes spark's free slot."""
    views = [view("thor", running=2), view("spark")]
    core = AdmissionCore(P, Ledger(600))
    request = prompt_request(SYSTEM + "q", max_tokens=20)
    waits = decide(request, core.fleet(views, 0.0), P, 0.0, cached={"thor": 1984})
    assert waits.verdict is Verdict.PARK and waits.reason is Reason.WAITING_FOR_FASTER
    cold = decide(request, core.fleet(views, 0.0), P, 0.0)
    assert cold.engine == "spark"
    # A long answer makes thor's wait (a service of 10 s) longer than half of it plus the saved prefill: spill.
    assert decide(prompt_request(SYSTEM + "q", max_tokens=200), core.fleet(views, 0.0), P, 0.0,
                  cached={"thor": 1984}).engine == "spark"


def test_max_replicas_keeps_a_prefix_on_its_engines() -> None:
    """With prefix_max_replicas 1 a prefix held by thor waits for thor when thor is full, instead of spreading to spark;
    without the limit it spills (a long answer: waiting for thor would cost more than the prefill it saves)."""
    views = [view("thor", running=2), view("spark")]
    request = prompt_request(SYSTEM + "q", max_tokens=200)
    capped = Policy(default_max_tokens=100, prefix_max_replicas=1)
    core = AdmissionCore(capped, Ledger(600))
    parked = decide(request, core.fleet(views, 0.0), capped, 0.0, cached={"thor": 1984})
    assert parked.verdict is Verdict.PARK and parked.reason is Reason.CAP
    spilled = decide(request, core.fleet(views, 0.0), P, 0.0, cached={"thor": 1984})
    assert spilled.engine == "spark"
    # Two holders with a limit of 2: the third engine is not a candidate either, whichever has a free slot.
    views3 = [view("thor", running=2), view("spark"), view("v100")]
    two = Policy(default_max_tokens=100, prefix_max_replicas=2)
    assert decide(request, core.fleet(views3, 0.0), two, 0.0, cached={"thor": 1984, "spark": 1984}).engine == "spark"


def test_a_reload_with_new_blocks_starts_an_empty_index() -> None:
    core = AdmissionCore(P, Ledger(600))
    core.prefixes.note("thor", chain("a", 3))
    core.set_policy(replace(P, prefix_index_blocks=2), admit_stale=True)
    assert core.prefixes.held == 2  # same blocks, smaller bound: trimmed
    core.set_policy(replace(P, prefix_block_chars=128), admit_stale=True)
    assert core.prefixes.held == 0


def test_an_admission_the_store_refused_leaves_no_blocks_behind() -> None:
    """The replica that made an admission the shared store refused takes its blocks back, so its index stays what every
    other replica derives from the store's events (only written admissions are published)."""
    core = AdmissionCore(P, Ledger(600))
    views = [view("thor"), view("spark")]
    core.check("r0", prompt_request(SYSTEM[:1000] + "q"), core.fleet(views, 0.0), 0.0)  # 3 blocks held somewhere
    before = core.prefixes.held
    outcome = core.check("r1", prompt_request(SYSTEM + "q"), core.fleet(views, 1.0), 1.0)
    assert outcome.ticket is not None and outcome.noted and core.prefixes.held > before
    core.retract(outcome, 1.0)
    assert core.prefixes.held == before


def test_a_backlog_behind_the_request_does_not_push_its_prefix_holder_away() -> None:
    """Parked requests behind r count in a busy engine's slot wait (that engine would have to absorb them too), but not
    in the wait for an engine holding r's prefix: the backlog's requests go where their own prefixes are."""
    from controlplane.core.route import estimate

    views = [view("thor", running=2)]
    core = AdmissionCore(P, Ledger(600))
    fleet = core.fleet(views, 0.0)
    request = prompt_request(SYSTEM + "q")
    cold = [estimate(views[0], request, False, fleet, P, 0.0, True, behind) for behind in (0, 6)]
    assert cold[1].slot_wait_s > cold[0].slot_wait_s
    held = [estimate(views[0], request, False, fleet, P, 0.0, True, behind, 1984) for behind in (0, 6)]
    assert held[1].slot_wait_s == held[0].slot_wait_s
