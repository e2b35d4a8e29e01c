"""Capacity-aware prefix affinity: a placement is charged the prefill its evictions make the fleet redo (decision
0018). Pure: no I/O, no clock. For a request ``r`` whose prefix some engine is expected to hold::

    held(e)      = leading blocks of r's prompt the prefix index expects e to hold (prefix.py, ``match``)
    room(e)      = blocks e's share of the index can still take without evicting
    displaced(e) = max(0, blocks(r) - held(e) - room(e))
    charge(e)    = prefix_eviction_charge x displaced(e) x block_tokens / prefill_rate(e)
    choice key   = finish(e) + charge(e) + stall(e)                     (``charged_finish``; stall: route.estimate)

Invariants: the charge only orders candidates (finish-soonest and its margin, near ties, the busy engines worth
estimating, work conservation's bound); it never adds or removes one and never changes an estimate, so caps, KV,
floors, deadlines and the band read the plain estimate, and a ticket's expected times are the plain ones. It depends on
the prefix index alone, which every replica derives from every admission: replicas charge alike. A request whose prefix
nobody holds is charged nothing; ``prefix_eviction_charge`` 0 turns the rule off.
"""

from __future__ import annotations

from controlplane.core.route import Estimate


def displaced_blocks(prompt_blocks: int, held: int, room: int) -> int:
    """Blocks an engine would evict from its share of the prefix index to cache a prompt of ``prompt_blocks`` blocks,
    when it holds the first ``held`` of them and has ``room`` blocks free: ``max(0, prompt_blocks - held - room)``."""
    return max(0, prompt_blocks - max(0, held) - max(0, room))


def charged_finish(x: Estimate) -> float:
    """The key the choice among engines compares: the estimated finish plus the eviction charge
    (``Estimate.displaced_s``, 0 for an engine that evicts nothing) plus the adapter swap's stall of the requests the
    engine already runs (``Estimate.stall_s``, route.py; 0 without a swap)."""
    return x.finish_s + x.displaced_s + x.stall_s
