"""Two control-plane replicas over one store, in random interleavings: two real ``AdmissionService``s (each with its own
``AdmissionCore`` and mirror) share one ``MemoryState``, and their Checks, releases (through either replica, as Envoy's
access log reaches any of them) and the store's events interleave on one event loop. Whatever the interleaving:

- no engine ever has more open tickets in the store than its cap, and never more KV reserved than its limit;
- parked requests are admitted in the order they parked, across both replicas (strict FIFO: no LIFO, no backfill);
- every Check is answered once everything is released, and nothing is left in the store or a mirror;
- both replicas derive the same prefix index: every admission's event carries its prompt's blocks. (With the memory
  store no ``reserve`` suspends, so these replicas never race to a refusal; that an admission the store refused is taken
  back out of its replica's index is tests/unit/test_prefix_index.py's.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.core.model import InferenceRequest
from tests.unit.replicaworld import PROMPTS, Replicas

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 1), st.sampled_from([100, 2_000, 6_000]),
              st.sampled_from([100, 1_000, 4_000])),
    st.tuples(st.just("release"), st.integers(0, 40), st.integers(0, 1)),
    st.tuples(st.just("burst"), st.integers(2, 8), st.sampled_from([100, 2_000, 6_000]),
              st.sampled_from([100, 1_000, 4_000])),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(op, min_size=1, max_size=60))
# Found by bursts: a refused woken request restored behind requests parked in the same instant disagreed with the
# store's line (both replicas waited for a head the other never offered); and a ticket learned from a refusal's list
# never got its prompt's blocks from its admission event (the replicas' indexes differed).
@example(ops=[("submit", 0, 100, 100)] * 4 + [("burst", 6, 100, 100)])
@example(ops=[("submit", 0, 100, 100)] * 4 + [("burst", 2, 100, 1000)])
def test_two_replicas_keep_caps_kv_and_line_order(ops: list[tuple[Any, ...]]) -> None:
    async def run() -> None:
        world = Replicas()
        await world.start()
        try:
            for kind, *args in ops:
                if kind == "submit":
                    await world.submit(*args)
                elif kind == "burst":
                    await world.burst(*args)
                else:
                    await world.release(*args)
            await world.drain()
            assert all(not s.core.tickets() for s in world.services), "a mirror kept a released ticket"
            first, second = (s.core for s in world.services)
            for prompt, blocks in PROMPTS.items():
                probe = InferenceRequest("POST", "/v1/chat/completions", "m", prompt_tokens=prompt, prefix_blocks=blocks)
                assert first.expected_cached(probe) == second.expected_cached(probe), "the replicas' indexes differ"
            assert first.prefixes.held == second.prefixes.held
        finally:
            await world.stop()
    asyncio.run(run())
