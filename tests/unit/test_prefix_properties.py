"""Routing with the prefix index keeps every admission rule: over random interleavings of requests sharing prefixes
(three groups, prompts of several lengths, some repeated exactly), releases, probes, restarts, cancellations and ticks,
no engine goes over its cap, KV is never double-spent past the watermark, floors, FIFO, deadlines and one answer per
request hold (``World.check_invariants`` and ``settle``), with and without ``prefix_max_replicas`` and prefix affinity's
eviction charge."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.policy import Policy
from controlplane.core.prefix import prompt_blocks
from tests.unit.admissionworld import POLICY, World, op, run_and_drain

GROUPS = {group: prompt_blocks(group * 256 * 40, 256, 40) for group in ("g0", "s1", "s2")}


class PrefixWorld(World):
    """Requests carry prefix blocks: the session key picks one of three shared prefixes, the prompt size how much of it
    (so the same group's requests share their first blocks, and identical requests share all of them). Probes also
    reach the prefix index, and every third probe of an engine reports a restart (its counters start again)."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.probes = 0

    def blocks(self, prompt_tokens: int, session: str | None) -> tuple[int, ...]:
        return GROUPS[session or "g0"][:max(1, prompt_tokens // 250)]

    def apply(self, step: tuple[Any, ...]) -> None:
        super().apply(step)
        if step[0] == "probe":
            self.probes += 1
            view = self.views[step[1]]
            assert view.sample is not None
            restarted = self.probes % 3 == 0
            sample = replace(view.sample, prompt_tokens_total=0.0 if restarted else float(self.probes))
            self.core.note_cache_view(replace(view, sample=sample))
        assert self.core.prefixes.held <= self.core.policy.prefix_index_blocks


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=80), st.sampled_from([0, 0, 1, 2]), st.sampled_from([250_000, 30]),
       st.sampled_from([0.0, 1.0, 5.0]))
def test_prefix_routing_keeps_caps_kv_and_every_admission_invariant(steps: list[tuple[Any, ...]], replicas: int,
                                                                     index_blocks: int, charge: float) -> None:
    # index_blocks 30 holds less than one group's 40 blocks per engine: every placement evicts, and the affinity's
    # eviction charge (affinity.py) steers the choice, never past a cap or the KV watermark.
    world = run_and_drain(PrefixWorld(replace(POLICY, prefix_max_replicas=replicas, prefix_index_blocks=index_blocks,
                                              prefix_eviction_charge=charge)), steps)
    assert world.core.prefixes.held <= index_blocks
