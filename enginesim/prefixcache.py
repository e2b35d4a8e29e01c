"""Automatic prefix caching the way vLLM V1 does it, sans I/O: the simulator's KV blocks remember which prompt block they
hold, so a later request that starts with the same tokens skips their prefill.

**Tokens and blocks.** The simulator has no tokenizer; it counts a prompt as ``ceil(characters / c)`` tokens, ``c`` its
profile's ``chars_per_token`` (3.3 for ``cortex``; ``CHARS_PER_TOKEN``, 4, where none is given), so KV block ``k``
(``block_size`` 16 tokens, the profiles' value) is characters ``[span k, span (k + 1))`` of the prompt text, ``span =
round(16 c)`` (53 at 3.3, 64 at 4). Only full blocks are cached, as in vLLM. A block's hash is chained: ``h_k =
blake2b(h_{k-1} || the block's characters)``, so a block matches only when everything before it matches too (vLLM:
``hash(parent_hash, token_ids)``).

**Cache life** (vLLM's ``KVCacheManager``/``BlockPool``):

- A request being scheduled looks up its leading block hashes; every hit is a block it shares (its reference count goes
  up) and whose tokens it does not prefill. At most ``(tokens - 1) // block_size`` blocks hit: the last token is always
  computed, to produce the first output's logits (vLLM's ``max_cache_hit_length = num_tokens - 1``).
- A block the request fills while prefilling gets its hash registered; a hash some other request registered first stays a
  private block of this request (vLLM keeps such duplicates out of the lookup table too).
- When a request finishes, is aborted or preempted, its blocks are freed in reverse order: a cached block whose reference
  count reaches zero keeps its contents and goes to the end of the free queue, so the tail of a prompt is evicted before
  its head (a later request still finds the shared head). It is **evicted** (forgotten) only when a free block is needed
  and no never-used one is left: least recently freed first.
- Counters, vLLM V1's ``PrefixCacheStats``: every scheduling of a request from the waiting queue (a preempted request's
  resumption included) adds its token count to ``queries`` and its hit tokens to ``hits``
  (``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``, in tokens).

Simplification: only prompt blocks are hashed. vLLM also caches the blocks of generated tokens, so a conversation's next
turn can hit on the previous answer too; here it hits on the previous turn's prompt only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

CHARS_PER_TOKEN = 4.0
"""The simulator's default token estimate (``ceil(characters / 4)``), the mapping blocks are cut by."""


def block_hashes(text: str, prompt_tokens: int, block_size: int,
                 chars_per_token: float = CHARS_PER_TOKEN) -> tuple[int, ...]:
    """The chained hashes of ``text``'s full blocks, at most ``prompt_tokens // block_size`` of them (a prompt whose token
    count is forced by ``sim_prompt_tokens`` is only as cacheable as the text it carries)."""
    span = max(1, round(block_size * chars_per_token))
    count = min(len(text) // span, prompt_tokens // block_size)
    out = []
    parent = b""
    for k in range(count):
        parent = hashlib.blake2b(parent + text[k * span:(k + 1) * span].encode("utf-8", "surrogatepass"),
                                 digest_size=8).digest()
        out.append(int.from_bytes(parent, "big"))
    return tuple(out)


class PrefixCache:
    """Which KV blocks hold which prompt block, their reference counts and the LRU of cached blocks nobody uses."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        """Every cached block hash -> running requests sharing it (0: cached but free, in ``evictable``)."""
        self.evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request uses, least recently freed first: the first to be reused when blocks run out."""
        self.queries = 0
        """Tokens looked up (``vllm:prefix_cache_queries``)."""
        self.hits = 0
        """Tokens found cached (``vllm:prefix_cache_hits``)."""
        self.evictions = 0

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """How many leading blocks of ``hashes`` (at most ``limit``) are cached now."""
        n = 0
        for h in hashes[:max(0, limit)]:
            if h not in self.refs:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[int]) -> int:
        """A scheduled request shares these cached blocks; returns how many it took off the free queue."""
        taken = 0
        for h in hashes:
            if self.refs[h] == 0:
                del self.evictable[h]
                taken += 1
            self.refs[h] += 1
        return taken

    def register(self, h: int) -> bool:
        """A request filled the block whose hash is ``h``; True if it is now the cached copy (it was not cached yet)."""
        if h in self.refs:
            return False
        self.refs[h] = 1
        return True

    def release(self, hashes: Sequence[int]) -> int:
        """A request let go of its shared blocks (given in prompt order, freed tail first); returns how many became free."""
        freed = 0
        for h in reversed(hashes):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.evictable[h] = None
                freed += 1
        return freed

    def evict(self) -> None:
        """Reuse the least recently freed cached block: its contents are forgotten."""
        h, _ = self.evictable.popitem(last=False)
        del self.refs[h]
        self.evictions += 1

    @property
    def cached_blocks(self) -> int:
        return len(self.refs)
