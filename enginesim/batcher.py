"""A continuous-batching engine model, sans I/O: the server shell sleeps, this decides what a step does.

Per step the batch is the running set (at most ``max_num_seqs``). Requests still in prefill share ``prefill_tokens_per_s``
FIFO; requests decoding each emit one token. A step lasts ``1 / per_request_decode_rate(decoding)`` emulated seconds when
anything decodes (times ``1 + decode_slowdown_per_1k_tokens x mean context / 1000``), else just long enough to finish the
current prefills (capped at ``MAX_PREFILL_STEP_S``). Without chunked prefill (``prefill_chunk_tokens`` 0) prefill runs
beside a decode step at its full rate; with it, a decode step also prefills up to that many tokens and lasts their
prefill time longer, as vLLM V1's scheduler mixes them in one batch.

KV is allocated in blocks as tokens are computed (vLLM V1): admission needs a free slot and one free block; a running
request that needs a block when none is free preempts the most recently admitted one (recompute: it returns to the head
of the queue and prefills its prompt and output again), counted in ``preemptions``. ``free_blocks`` counts never-used
and cached-but-free blocks (prefixcache.py); ``kv_usage`` excludes the latter, as vLLM does. LoRA adapters: at most
``max_loras`` resident at once (``Batcher``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from enginesim.hist import LATENCY_BUCKETS, Hist
from enginesim.prefixcache import PrefixCache
from enginesim.profiles import Profile

MAX_PREFILL_STEP_S = 0.05
PREFILL_RESIDUE = 1e-6
"""Prompt tokens left below this are none: a chunked step's prefill budget is its duration less its decode step, and
the float residue of that subtraction must not leave a request prefilling a 1e-15 token for ever."""


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrived_at: float
    output_tokens: int | None = None
    """Tokens until end of sequence (the engine stops there, ``finish_reason`` stop); None: it runs to ``max_tokens``."""
    prefill_left: float = 0.0
    """Tokens still to prefill; fractional, so a step's prefill budget is spent exactly."""
    generated: int = 0
    blocks: int = 0
    first_token_at: float | None = None
    prefill_started_at: float | None = None
    finished_at: float | None = None
    preempted: int = 0
    prompt_counted: bool = False
    emitted: list[int] = field(default_factory=list)
    """Token indexes produced by the last step (the shell drains this into the response stream)."""
    block_hashes: tuple[int, ...] = ()
    """Chained hashes of the prompt's full blocks (prefixcache.block_hashes): what the prefix cache can match."""
    shared: list[int] = field(default_factory=list)
    """Hashes of the cached blocks this request holds (hits and blocks it registered), in prompt order; they are among
    ``blocks``."""
    registered: int = 0
    """Prompt blocks already looked at for registration (hits included)."""
    cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache when the request was first scheduled (``usage.prompt_tokens_details``)."""
    adapter: str | None = None
    """The LoRA adapter the request runs with; None: the base model."""
    swapped: bool = False
    """Whether its adapter had to be loaded into a slot when it was first scheduled (a cold request)."""

    def __post_init__(self) -> None:
        self.prefill_left = self.prompt_tokens

    @property
    def target_tokens(self) -> int:
        """What the request will generate: its natural length, cut at ``max_tokens``."""
        if self.output_tokens is None:
            return self.max_tokens
        return min(self.output_tokens, self.max_tokens)

    @property
    def done(self) -> bool:
        return self.generated >= self.target_tokens

    @property
    def finish_reason(self) -> str:
        """``length`` when max_tokens cuts it off, ``stop`` when it reaches end of sequence first (OpenAI's values)."""
        return "length" if self.target_tokens >= self.max_tokens else "stop"

    @property
    def computed_tokens(self) -> float:
        return self.prompt_tokens + self.generated - self.prefill_left


class Batcher:
    """LoRA adapters, like vLLM V1 with ``--enable-lora --max-loras N`` (``max_loras`` > 0): ``max_loras`` adapter slots.
    A request for an adapter is scheduled only if its adapter is resident, or a slot is free, or a resident adapter no
    running request uses can be evicted (least recently used first); otherwise it stays in the queue and later requests
    whose adapter can run pass it (vLLM's scheduler skips it for that step). Loading an adapter into a slot is a swap:
    it stalls the whole batch for ``lora_swap_s`` emulated seconds, counted in ``swaps``. A resident adapter stays until
    evicted, so the distinct adapters of the running set never exceed ``max_loras``."""

    def __init__(self, profile: Profile, metrics_time_scale: float = 1.0, *, max_loras: int = 0,
                 lora_swap_s: float = 0.0) -> None:
        if max_loras < 0 or lora_swap_s < 0:
            raise ValueError("max_loras and lora_swap_s must be >= 0")
        self.profile = profile
        self.metrics_time_scale = metrics_time_scale
        """Published durations = emulated durations x this (1 / speed: a sped-up simulator reports wall-clock time,
        exactly what a real engine that fast would report)."""
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = profile.num_gpu_blocks
        """Blocks that can be allocated: never used, or cached and used by no request (``prefix.evictable``)."""
        self.prefix = PrefixCache()
        self.preemptions = 0
        self.max_running_seen = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished: list[SimRequest] = []
        """Requests finished by the last step (the shell drains this)."""
        self.prefill_seconds_total = 0.0
        """Prefill work in seconds at the profile's rate, summed over requests (llama.cpp's prompt_seconds_total)."""
        self.decode_seconds_total = 0.0
        """Decode time summed over requests: each emitted token adds its step (llama.cpp's tokens_predicted_seconds)."""
        self.inter_token = Hist(LATENCY_BUCKETS)
        """One observation per emitted token: the step that produced it (vLLM/SGLang inter-token latency)."""
        self.max_loras = max_loras
        """Adapter slots on the GPU (vLLM's ``--max-loras``); 0: LoRA is off and every request runs the base model."""
        self.lora_swap_s = lora_swap_s
        """Emulated seconds a load into a slot stalls the batch."""
        self.resident: dict[str, float] = {}
        """Adapters in the slots -> when a request last used them (emulated seconds), least recently used first."""
        self.swaps = 0
        """Adapters loaded into a slot, ever (every load, the first of each adapter included)."""
        self._stall = 0.0
        """Swap time the next step still has to spend before it computes anything."""

    # -- queue changes -------------------------------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> None:
        """The client went away: free everything the request holds."""
        if request in self.running:
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def cached_tokens_for(self, block_hashes: tuple[int, ...], prompt_tokens: int) -> int:
        """Prompt tokens a request with these blocks would find cached if it were scheduled now."""
        return self.prefix.match(block_hashes, (prompt_tokens - 1) // self.profile.block_size) * self.profile.block_size

    @property
    def kv_usage(self) -> float:
        total = self.profile.num_gpu_blocks
        return (total - self.free_blocks) / total

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # -- one step ------------------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> None:
        """Move queued requests into the running set, in order, while a sequence slot and a block are free; a request
        whose adapter can get no slot is passed over (it keeps its place)."""
        skipped: list[SimRequest] = []
        while self.waiting and len(self.running) < self.profile.max_num_seqs and self.free_blocks > 0:
            request = self.waiting.popleft()
            if not self._take_adapter_slot(request, now):
                skipped.append(request)
                continue
            if request.prefill_started_at is None:
                request.prefill_started_at = now
            self._look_up_prefix(request)
            self.running.append(request)
        self.waiting.extendleft(reversed(skipped))
        self.max_running_seen = max(self.max_running_seen, len(self.running))

    def running_adapters(self) -> list[str]:
        """The distinct adapters of the running requests, in the order they were scheduled."""
        return list(dict.fromkeys(r.adapter for r in self.running if r.adapter is not None))

    def waiting_adapters(self) -> list[str]:
        """The distinct adapters of the queued requests, in queue order."""
        return list(dict.fromkeys(r.adapter for r in self.waiting if r.adapter is not None))

    def load_adapter(self, adapter: str, now: float) -> bool:
        """Put ``adapter`` in a slot now (vLLM's ``add_lora`` activates what it loads), evicting the least recently used
        idle one if the slots are full; a load stalls the next step. False when every slot is held by a running request
        (it loads when a request first needs it)."""
        if adapter in self.resident:
            self.resident[adapter] = now
            return True
        busy = set(self.running_adapters())
        if len(self.resident) >= self.max_loras:
            idle = [a for a in self.resident if a not in busy]
            if not idle:
                return False
            del self.resident[idle[0]]
        self.resident[adapter] = now
        self.swaps += 1
        self._stall += self.lora_swap_s
        return True

    def unload_adapter(self, adapter: str) -> None:
        """Free its slot (requests already running with it finish as they are)."""
        self.resident.pop(adapter, None)

    def _take_adapter_slot(self, request: SimRequest, now: float) -> bool:
        """Whether ``request`` may run now as far as adapter slots go; loads its adapter when it has to."""
        if request.adapter is None:
            return True
        if request.adapter in self.resident:
            self.resident.pop(request.adapter)
            self.resident[request.adapter] = now  # most recently used last
            return True
        if not self.load_adapter(request.adapter, now):
            return False
        request.swapped = request.swapped or request.prefill_started_at is None
        return True

    def plan_step(self) -> float:
        """Emulated seconds the next step takes (0 when there is nothing to run). With chunked prefill a step that
        decodes also prefills up to ``prefill_chunk_tokens`` and lasts that much longer."""
        decoding = [r for r in self.running if r.prefill_left == 0]
        prefill = sum(r.prefill_left for r in self.running)
        if decoding:
            step = self._decode_step(decoding)
            if self.profile.prefill_chunk_tokens:
                step += min(prefill, self.profile.prefill_chunk_tokens) / self.profile.prefill_tokens_per_s
            return self._stall + step
        if not prefill:
            return self._stall
        return self._stall + min(MAX_PREFILL_STEP_S, prefill / self.profile.prefill_tokens_per_s)

    def _decode_step(self, decoding: list[SimRequest]) -> float:
        """One decode step of ``decoding``: the profile's per-request rate, slowed by their mean context."""
        step = 1.0 / self.profile.per_request_decode_rate(len(decoding))
        slowdown = self.profile.decode_slowdown_per_1k_tokens
        if slowdown:
            step *= 1.0 + slowdown * sum(r.computed_tokens for r in decoding) / len(decoding) / 1000.0
        return step

    def apply_step(self, duration: float, now: float) -> None:
        """Advance every running request by one step of ``duration`` emulated seconds ending at ``now``; a pending
        adapter swap takes its time out of the step first."""
        for request in self.running:
            request.emitted.clear()
        stall = min(self._stall, duration)
        self._stall -= stall
        work = duration - stall
        decoding = [r for r in self.running if r.prefill_left == 0]
        if decoding and stall and work <= 0:
            return  # the whole step went to loading adapters: nothing was computed
        prefill_s = work - self._decode_step(decoding) if decoding and self.profile.prefill_chunk_tokens else work
        budget = self.profile.prefill_tokens_per_s * max(0.0, prefill_s)
        for request in [r for r in self.running if r.prefill_left > 0]:
            if budget <= 0:
                break
            chunk = min(request.prefill_left, budget)
            if not self._grow(request, chunk):
                continue
            budget -= chunk
            request.prefill_left -= chunk
            if request.prefill_left < PREFILL_RESIDUE:  # float residue of the step's arithmetic: done, not stuck
                request.prefill_left = 0
            self._register_blocks(request)
            self.prefill_seconds_total += chunk / self.profile.prefill_tokens_per_s * self.metrics_time_scale
            if request.prefill_left == 0 and not request.prompt_counted:
                request.prompt_counted = True  # a recompute after preemption is not new prompt work for the counter
                self.prompt_tokens_total += request.prompt_tokens
        for request in decoding:
            if request not in self.running:  # preempted earlier in this step
                continue
            if not self._grow(request, 1):
                continue
            request.generated += 1
            request.emitted.append(request.generated - 1)
            self.generation_tokens_total += 1
            self.decode_seconds_total += duration * self.metrics_time_scale
            self.inter_token.observe(duration * self.metrics_time_scale)
            if request.first_token_at is None:
                request.first_token_at = now
            if request.done:
                request.finished_at = now
                self.running.remove(request)
                self._free(request)
                self.finished.append(request)

    def _grow(self, request: SimRequest, tokens: float) -> bool:
        """Make room in KV for ``tokens`` more tokens of ``request``, preempting younger requests if needed."""
        need = math.ceil((request.computed_tokens + tokens) / self.profile.block_size) - request.blocks
        while need > self.free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        never_used = self.free_blocks - len(self.prefix.evictable)
        for _ in range(max(0, need - never_used)):
            self.prefix.evict()
        self.free_blocks -= max(0, need)
        request.blocks += max(0, need)
        return True

    def _look_up_prefix(self, request: SimRequest) -> None:
        """Scheduling from the queue: share the cached blocks the prompt starts with (vLLM's ``get_computed_blocks``); at
        most ``(tokens - 1) // block_size`` of them, so the last token is always computed. Counted in the prefix-cache
        queries and hits, a preempted request's resumption too."""
        size = self.profile.block_size
        tokens = request.prompt_tokens + request.generated
        hit = self.prefix.match(request.block_hashes, (tokens - 1) // size)
        hashes = request.block_hashes[:hit]
        self.free_blocks -= self.prefix.acquire(hashes)
        request.shared = list(hashes)
        request.blocks = hit
        request.registered = hit
        request.prefill_left = tokens - hit * size
        self.prefix.queries += tokens
        self.prefix.hits += hit * size
        if request.cached_tokens is None:
            request.cached_tokens = hit * size

    def _register_blocks(self, request: SimRequest) -> None:
        """Prompt blocks the request has now computed in full become cached (unless another request cached them first)."""
        size = self.profile.block_size
        full = min(int(request.computed_tokens) // size, len(request.block_hashes))
        for k in range(request.registered, full):
            h = request.block_hashes[k]
            if self.prefix.register(h):
                request.shared.append(h)
        request.registered = max(request.registered, full)

    def _free(self, request: SimRequest) -> None:
        """Give back every block: private ones are empty again, shared ones go to the prefix cache's free queue (tail
        first) when no other request uses them."""
        self.free_blocks += request.blocks - len(request.shared)
        self.free_blocks += self.prefix.release(request.shared)
        request.shared = []
        request.blocks = 0

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.prefill_left = victim.prompt_tokens + victim.generated
        victim.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
