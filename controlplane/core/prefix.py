"""Which engine probably holds which prompt prefix in its KV cache: an approximate index of the prompts sluice sent
where (decision 0018). Pure: no I/O, no clock.

- **The prompt, rendered canonically** (``render_prompt``): a chat request's ``tools`` (JSON, keys sorted), then every
  message as ``\\x1e role \\x1f text``; a completion's ``prompt``. Turn n+1 of a conversation renders with turn n's
  rendering as its prefix, as an engine's chat template does.
- **Blocks**: full spans of ``block_chars`` characters (at most ``max_blocks``), chained: ``h_k = blake2b(h_{k-1} || k)``.
- **The index** (``PrefixIndex``): per engine, the block hashes admitted to it, least recently used first, and per hash
  its engines. ``note`` touches a prompt's blocks tail first, so eviction takes tails before heads and the holders of a
  prompt's blocks are nested; ``match`` is O(prompt blocks). An engine's list is bounded by its KV capacity in blocks
  and by an even share of ``admission.prefix_index_blocks``.

An expected hit is an estimate: an engine evicts sooner under KV pressure and splits blocks at token boundaries sluice
does not know. The index forgets an engine that restarted, was drained or was removed.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from controlplane.core.affinity import displaced_blocks
from controlplane.core.engines import EngineSample

RECORD_SEPARATOR = "\x1e"
"""Starts each message of a rendered chat prompt (ASCII RS: never typed, so a message cannot fake a boundary)."""
UNIT_SEPARATOR = "\x1f"
"""Separates a message's role from its text."""
GROUP_SEPARATOR = "\x1d"
"""Ends the tool definitions of a rendered chat prompt."""


def _content_text(content: Any) -> str:
    """A message content's text: a string, or the ``text`` of each content part in order (images and other parts have
    none). Iterative and bounded by the body's nesting, which parsing has already checked."""
    if isinstance(content, str):
        return content
    out: list[str] = []
    pending: list[Any] = [content]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            text = item.get("text")
            if isinstance(text, str):
                out.append(text)
    return "".join(out)


def render_prompt(route: str, body: Mapping[str, Any]) -> str:
    """The prompt of a parsed request body as one string, canonically (see the module docstring); "" when it has none."""
    if route == "/v1/chat/completions":
        parts: list[str] = []
        tools = body.get("tools")
        if tools:
            parts.append(json.dumps(tools, sort_keys=True, separators=(",", ":"), default=str) + GROUP_SEPARATOR)
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, dict):
                role = message.get("role")
                parts.append(f"{RECORD_SEPARATOR}{role if isinstance(role, str) else ''}{UNIT_SEPARATOR}"
                             f"{_content_text(message.get('content'))}")
        return "".join(parts)
    if route == "/v1/completions":
        return _content_text(body.get("prompt"))
    return ""


def prompt_blocks(text: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """The chained 64-bit hashes of ``text``'s full ``block_chars``-character blocks, at most ``max_blocks``. The
    simulator's cache (enginesim/prefixcache.py) chains its blocks the same way, on purpose apart: the control plane never
    imports the engine it fronts, and a real engine's own hashes are not sluice's to reproduce (this index is a guess)."""
    count = min(len(text) // block_chars, max_blocks)
    out = []
    parent = b""
    for k in range(count):
        parent = hashlib.blake2b(parent + text[k * block_chars:(k + 1) * block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=8).digest()
        out.append(int.from_bytes(parent, "big"))
    return tuple(out)


def restarted(before: EngineSample, after: EngineSample) -> bool:
    """Whether an engine restarted between two probes: one of its cumulative counters went backwards (its prefix cache
    is empty then)."""
    return any(x is not None and y is not None and y < x for x, y in (
        (before.prompt_tokens_total, after.prompt_tokens_total),
        (before.generation_tokens_total, after.generation_tokens_total),
        (before.prefix_cache_queries_total, after.prefix_cache_queries_total),
        (before.finished_requests_total, after.finished_requests_total)))


def blocks_text(blocks: Sequence[int]) -> str:
    """Block hashes as one string (16 hex digits each): how they travel in the shared store's events."""
    return "".join(f"{h:016x}" for h in blocks)


def blocks_from_text(text: str) -> tuple[int, ...]:
    """The inverse of ``blocks_text``; "" (or anything malformed) is no blocks."""
    if len(text) % 16:
        return ()
    try:
        return tuple(int(text[i:i + 16], 16) for i in range(0, len(text), 16))
    except ValueError:
        return ()


RECENT_ARRIVALS = 512
"""Arrivals whose first block ``PrefixIndex.share`` counts: a prefix's share of the recent traffic."""
SHARE_MIN_ARRIVALS = 32
"""Below this many arrivals counted, ``share`` is unknown (0): too few to tell a prefix's load."""
DEMAND_REFRESH_ARRIVALS = 16
"""``demand`` is computed again after this many arrivals (one pass over the distinct prompts of the recent arrivals)."""


class PrefixIndex:
    """Per engine, the block hashes of the prompts sent to it (LRU, bounded); per hash, the engines holding it; the first
    blocks of the last ``RECENT_ARRIVALS`` prompts that arrived."""

    def __init__(self, limit_blocks: int) -> None:
        self.limit_blocks = limit_blocks
        """The whole index's bound (``admission.prefix_index_blocks``); each engine gets an even share of it."""
        self._lru: dict[str, OrderedDict[int, None]] = {}
        """engine -> its blocks, least recently used first."""
        self._holders: dict[int, set[str]] = {}
        self._capacity: dict[str, int] = {}
        """engine -> KV capacity in blocks, when the engine reports one."""
        self._engines: set[str] = set()
        """Every engine the index has heard of (its share of ``limit_blocks`` is per engine)."""
        self.held = 0
        """Entries (engine, block) held now."""
        self._recent: deque[int] = deque()
        self._recent_counts: Counter[int] = Counter()
        self._demand: dict[str, float] | None = None
        """``demand``'s last result (None: to compute), and the arrivals since."""
        self._since_demand = 0

    # -- what the engines are --------------------------------------------------------------------------------------
    def set_capacity(self, engine: str, blocks: int | None) -> None:
        """``engine`` exists and its KV holds at most ``blocks`` blocks of prompt (None: unknown)."""
        if engine not in self._engines:
            self._engines.add(engine)
            self._trim_all()  # every engine's share just shrank
        if blocks is None:
            self._capacity.pop(engine, None)
        elif self._capacity.get(engine) != blocks:
            self._capacity[engine] = blocks
            self._trim(engine)

    def set_limit(self, limit_blocks: int) -> None:
        self.limit_blocks = limit_blocks
        self._trim_all()

    def bound(self, engine: str) -> int:
        """Blocks ``engine`` may hold: its KV capacity in blocks, and at most its share of the index's bound."""
        share = self.limit_blocks // max(1, len(self._engines))
        capacity = self._capacity.get(engine)
        return share if capacity is None else min(share, capacity)

    # -- changes ---------------------------------------------------------------------------------------------------
    def note(self, engine: str, blocks: Sequence[int]) -> tuple[int, ...]:
        """A prompt with these blocks was sent to ``engine``: it holds them now, most recently used, head last. Returns
        the blocks it did not hold before (the tail of the prompt beyond what it held: ``remove`` takes them back)."""
        if not blocks:
            return ()
        if engine not in self._engines:
            self._engines.add(engine)
            self._trim_all()
        lru = self._lru.setdefault(engine, OrderedDict())
        new = []
        for h in reversed(blocks):  # the head ends up most recent: tails are evicted first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(engine)
                self.held += 1
                new.append(h)
        self._trim(engine)
        return tuple(reversed(new))

    def remove(self, engine: str, blocks: Iterable[int]) -> None:
        """Take back blocks a ``note`` added (the admission was undone: the shared store refused it). Blocks another
        admission to the same engine added meanwhile go too: the index is an estimate, and this race is rare."""
        lru = self._lru.get(engine)
        if not lru:
            return
        for h in blocks:
            if h in lru:
                del lru[h]
                holders = self._holders[h]
                holders.discard(engine)
                if not holders:
                    del self._holders[h]
                self.held -= 1

    def forget(self, engine: str) -> int:
        """``engine`` holds nothing any more (restarted, drained): how many blocks it was believed to hold."""
        lru = self._lru.pop(engine, None)
        if not lru:
            return 0
        self._demand = None
        for h in lru:
            holders = self._holders[h]
            holders.discard(engine)
            if not holders:
                del self._holders[h]
        self.held -= len(lru)
        return len(lru)

    def keep(self, engines: Iterable[str]) -> None:
        """Only ``engines`` exist now (a reload removed the others): forget the rest."""
        wanted = set(engines)
        for engine in [e for e in self._engines if e not in wanted]:
            self.forget(engine)
            self._engines.discard(engine)
            self._capacity.pop(engine, None)
        self._trim_all()

    # -- reading ---------------------------------------------------------------------------------------------------
    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """Each engine believed to hold the start of ``blocks``, and how many leading blocks it holds (engines holding
        none are left out). The holders of consecutive blocks are nested, so the walk stops at the first block nobody
        holds and looks at a holder set's members only where it shrinks."""
        if not blocks:
            return {}
        current = self._holders.get(blocks[0])
        if not current:
            return {}
        depth: dict[str, int] = {}
        matched = 1
        for h in blocks[1:]:
            holders = self._holders.get(h)
            if not holders:
                break
            if len(holders) != len(current):
                for engine in current - holders:
                    depth[engine] = matched
            current = holders
            matched += 1
        for engine in current:
            depth[engine] = matched
        return depth

    def share(self, blocks: Sequence[int], arriving: bool = False) -> float:
        """The share of the last ``RECENT_ARRIVALS`` prompts that ``arrived`` which began with ``blocks``' first block;
        0 when fewer than ``SHARE_MIN_ARRIVALS`` arrived, or ``blocks`` is empty. Arrivals, not admissions: a burst of
        one prefix raises its share while its requests still wait, so it may spread. ``arriving``: the share once
        ``arrived(blocks)`` has run, nothing changed."""
        if not blocks:
            return 0.0
        recent, count = len(self._recent), self._recent_counts.get(blocks[0], 0)
        if arriving:
            if recent >= RECENT_ARRIVALS and self._recent[0] == blocks[0]:
                count -= 1  # the arrival pushes this prefix's oldest out
            recent, count = min(recent + 1, RECENT_ARRIVALS), count + 1
        if recent < SHARE_MIN_ARRIVALS:
            return 0.0
        return count / recent

    def demand(self) -> Mapping[str, float]:
        """Per engine, the share of the recent arrivals (as ``share`` counts them) whose prompt's first block it holds,
        each prompt's share split evenly among the engines holding it: what the prefixes an engine holds ask of it.
        Empty while shares are unknown. Computed again every ``DEMAND_REFRESH_ARRIVALS`` arrivals and when an engine is
        forgotten, so it may lag the index by that many admissions."""
        if self._demand is None or self._since_demand >= DEMAND_REFRESH_ARRIVALS:
            recent, demand = len(self._recent), dict[str, float]()
            if recent >= SHARE_MIN_ARRIVALS:
                for root, count in self._recent_counts.items():
                    holders = self._holders.get(root)
                    if holders:
                        part = count / recent / len(holders)
                        for engine in holders:
                            demand[engine] = demand.get(engine, 0.0) + part
            self._demand, self._since_demand = demand, 0
        return self._demand

    def arrived(self, blocks: Sequence[int]) -> None:
        """A request with a prompt of ``blocks`` arrived (a Check, on this replica): counted for ``share``."""
        if not blocks:
            return
        self._since_demand += 1
        root = blocks[0]
        if len(self._recent) >= RECENT_ARRIVALS:
            old = self._recent.popleft()
            self._recent_counts[old] -= 1
            if not self._recent_counts[old]:
                del self._recent_counts[old]
        self._recent.append(root)
        self._recent_counts[root] += 1

    def blocks_of(self, engine: str) -> int:
        lru = self._lru.get(engine)
        return len(lru) if lru else 0

    def room(self, engine: str) -> int:
        """Blocks ``engine`` can still take without evicting any (its ``bound`` less what it holds)."""
        return max(0, self.bound(engine) - self.blocks_of(engine))

    def displaced(self, blocks: Sequence[int], held: Mapping[str, int]) -> dict[str, int]:
        """Each engine that would evict blocks to cache a prompt of ``blocks``, and how many
        (affinity.displaced_blocks), given ``held``: the leading blocks each engine holds (``match``). Engines the index
        has not heard of evict nothing. O(engines the index knows)."""
        out = {}
        for engine in self._engines:
            evicted = displaced_blocks(len(blocks), held.get(engine, 0), self.room(engine))
            if evicted:
                out[engine] = evicted
        return out

    # -- internals -------------------------------------------------------------------------------------------------
    def _trim(self, engine: str) -> None:
        lru = self._lru.get(engine)
        if not lru:
            return
        bound = self.bound(engine)
        while len(lru) > bound:
            h, _ = lru.popitem(last=False)
            holders = self._holders[h]
            holders.discard(engine)
            if not holders:
                del self._holders[h]
            self.held -= 1

    def _trim_all(self) -> None:
        for engine in list(self._lru):
            self._trim(engine)
