"""Capacity-aware prefix affinity: a shared prompt prefix stays on as few engines as its load needs. Pure: no I/O, no
clock.

When the fleet's KV cannot hold every shared prefix on every engine, an engine that takes a prompt it does not hold must
evict other prompts' blocks to cache it, and the requests that would have hit those blocks prefill them again. Choosing
by each request's own finish time alone ignores that cost: a fast engine that prefills a prompt cold still finishes
before a slower engine that holds it, so every group's requests drift to the fast engines, whose caches then hold each
group only briefly (``sluice bench prefix --workload kv-pressure``, bench/results/prefix-kv-pressure.md). The rule
charges a placement what it evicts::

    held(e)      = leading blocks of r's prompt the prefix index expects e to hold (prefix.py, ``match``)
    room(e)      = blocks e's share of the index can still take without evicting (its KV capacity in blocks, at most
                   its share of ``admission.prefix_index_blocks``, less what it holds)
    displaced(e) = max(0, blocks(r) - held(e) - room(e))                      (blocks e would evict to cache r's prompt)
    charge(e)    = prefix_eviction_charge x displaced(e) x block_tokens / prefill_rate(e)
    choice key   = finish(e) + charge(e)                                    (only while some engine holds r's prefix)

``block_tokens`` is ``prefix_block_chars`` over the model's characters per token, ``prefill_rate`` the estimate's
(route.py). The charge applies only to a request whose prefix some engine is expected to hold (a recurring prefix: a
shared system prompt, a conversation's history); a prompt nobody holds is placed as before, so traffic that shares
nothing is decided as without the rule. Where it enters: finish-soonest's order and its margin, the near ties among free
slots, and which busy engines are worth estimating (decide.py, both the full scan and the fleet index). What follows:

- **A group stays on its engines while they have room for it.** Among free slots an engine holding the prefix beats one
  that would evict unless the latter finishes sooner by more than the prefill the fleet would redo.
- **It spreads when its load needs more engines.** When every engine holding it is at its slot or KV limit, the request
  waits for one of them (it parks, ``waiting_for_faster``; the line passes it over for others) while the wait is within
  work conservation's bound, half a service plus the prefill the free slot would redo plus that slot's charge
  (route.py, ``waits_too_long``), and, arriving, while waiting gives it its first token before the free slot's first
  token plus its charge. A group whose load its engines cannot carry makes that wait grow past the bound: the request
  takes a free slot elsewhere, the one with the smallest charged finish, and that engine holds the prefix from then on.
- **Prefixes that fit are not crowded.** An engine with room for the prompt has no charge, so while some engine can
  cache a prefix without evicting, placing it there costs nothing extra; engines that would evict are charged.

Invariants: the charge never adds or removes a candidate and never changes an estimate: caps, KV watermarks, floors,
deadlines and the satisficing band read the plain estimate (fit.py, route.py), so no engine is admitted beyond its slots
or KV; the ticket's expected TTFT and finish are the plain estimate's. It is a function of the prefix index alone, which
every replica derives from every admission (prefix.py, "Several replicas"): replicas holding the same index charge
alike. ``prefix_eviction_charge`` 0 turns it off (the choice is the plain finish time, as before the rule).

Failure modes: the index assumes its engine evicts only when the index's share is full, while a real engine also evicts
for running requests' KV, so ``room`` is optimistic under load; and an evicted block is charged as if it would be asked
for again, which over-charges engines whose index is full of prompts nobody repeats (the request then leans further
toward the engines holding its prefix, never past a bounded wait).
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
