"""Automatic prefix caching the way vLLM V1 does it, sans I/O: the simulator's KV blocks remember which prompt block they
hold, so a later request that starts with the same tokens skips their prefill.

**Blocks.** With no tokenizer, a prompt is ``ceil(characters / c)`` tokens (``c`` the profile's ``chars_per_token``,
``CHARS_PER_TOKEN`` where none is given), so KV block ``k`` (``block_size`` 16 tokens) is characters ``[span k,
span (k + 1))`` of the prompt text, ``span = round(16 c)``. Only full blocks are cached. Hashes are chained, ``h_k =
blake2b(h_{k-1} || the block's characters)``, so a block matches only when everything before it matches too.

**Cache life** (vLLM's ``KVCacheManager``/``BlockPool``): a request scheduled from the queue shares its leading cached
blocks, at most ``(tokens - 1) // block_size`` (the last token is always computed); the blocks it fills are registered
unless another request registered the hash first; a finished, aborted or preempted request frees its blocks tail
first, and a cached block nobody uses keeps its contents until a block is needed and no never-used one is left (least
recently freed evicted first). ``queries`` and ``hits`` count tokens per scheduling from the queue, resumptions
included. Only prompt blocks are hashed (vLLM also caches generated ones).
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
