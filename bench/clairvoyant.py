"""A clairvoyant reference scheduler for ``sluice bench steady``, sans I/O: it knows every request's true output length
and each simulated engine's step rule, and sends each request, from one central FIFO queue, to the engine where it
finishes first.

It is a yardstick, not a product: nothing here is shared with the control plane's estimator (``controlplane/core``).
What it knows comes from the simulator itself: the profile's rates (``enginesim.profiles``) and the batcher's step rule
(``enginesim.batcher``), restated in ``finish_time``:

- a step with ``d`` requests decoding lasts ``1 / per_request_decode_rate(d) x (1 + decode_slowdown_per_1k_tokens x
  mean context / 1000)`` emulated seconds, plus, with chunked prefill, ``min(prefill left, prefill_chunk_tokens) /
  prefill_tokens_per_s``; each decoding request emits one token a step;
- prompt tokens still to prefill share ``prefill_tokens_per_s`` first come first served (beside a decode step at its
  full rate without chunked prefill; inside it, for its chunk, with); a step where nothing decodes lasts at most
  ``MAX_PREFILL_STEP_S``; less than ``PREFILL_RESIDUE`` tokens left is none;
- a request prefilled in one step decodes from the next; the first token is its first decode step's.

**The rule** (``assign``): at every event (an arrival, a first token, a completion) the queue is walked in arrival order
(at most ``LOOKAHEAD`` requests). Each request goes, tentatively, to the engine where it would finish first, given what
that engine runs now and the requests already placed on it in this walk (they enter, in order, as its slots free).
If that engine has a free slot and room in KV now and nothing placed ahead of it, the request is dispatched now;
otherwise it stays in the central queue, and the walk goes on (a later request may take a free slot the earlier one did
not want). Ties go to the engine that can start it now, then to the lower index. An engine is never sent more requests
than ``max_num_seqs``, nor more than its KV holds when every running request's whole prompt and output are counted
(``kv_tokens``), so an engine never queues or preempts.

Finishing first is not the same as starting first: the rule may hold a request for a fast engine's slot while a slower
one idles, and it keeps arrival order instead of shortest job first. So it is a strong reference, not a proven lower
bound on every percentile; the bench says where another arm beat it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from enginesim.batcher import MAX_PREFILL_STEP_S, PREFILL_RESIDUE
from enginesim.profiles import Profile

LOOKAHEAD = 16
"""Queued requests looked at per event: beyond them nothing can start now unless the fleet is idle."""


@dataclass(frozen=True, slots=True)
class EngineRates:
    """What the clairvoyant scheduler knows of one simulated engine: its profile's slots, KV and step rule."""

    name: str
    max_num_seqs: int
    kv_tokens: int
    """KV capacity in tokens (blocks x block size)."""
    prefill_tokens_per_s: float
    decode_aggregate_tokens_per_s: tuple[float, ...]
    """Aggregate decode rate with 1, 2, ... requests decoding (emulated tokens/s), flat beyond the last entry."""
    prefill_chunk_tokens: int = 0
    decode_slowdown_per_1k_tokens: float = 0.0
    chars_per_token: float = 4.0
    template_tokens_per_message: int = 0
    max_model_len: int = 32768

    @classmethod
    def of(cls, name: str, profile: Profile) -> EngineRates:
        return cls(name, profile.max_num_seqs, profile.kv_capacity_tokens, profile.prefill_tokens_per_s,
                   profile.decode_aggregate_tokens_per_s, profile.prefill_chunk_tokens,
                   profile.decode_slowdown_per_1k_tokens, profile.chars_per_token, profile.template_tokens_per_message,
                   profile.max_model_len)

    def prompt_tokens(self, characters: int, messages: int = 1) -> int:
        """A chat prompt's tokens as the simulator counts them: ``ceil(characters / chars_per_token)`` plus the
        template's tokens per message."""
        return max(1, math.ceil(characters / self.chars_per_token) + self.template_tokens_per_message * messages)

    def output_tokens(self, natural: int, max_tokens: int | None, prompt_tokens: int) -> int:
        """What the engine generates: the natural length, cut at ``max_tokens`` (or the context left without it)."""
        return min(natural, max_tokens if max_tokens is not None else self.max_model_len - prompt_tokens)

    def decode_step(self, contexts: Sequence[float]) -> float:
        """Emulated seconds of one decode step for requests with these contexts (prompt + generated tokens)."""
        rates = self.decode_aggregate_tokens_per_s
        n = len(contexts)
        step = n / rates[min(n, len(rates)) - 1]
        if self.decode_slowdown_per_1k_tokens:
            step *= 1.0 + self.decode_slowdown_per_1k_tokens * sum(contexts) / n / 1000.0
        return step


@dataclass(frozen=True, slots=True)
class Work:
    """One request on (or for) an engine: its true lengths and its progress."""

    key: int
    prompt_tokens: int
    output_tokens: int
    prefill_left: float = -1.0
    """Prompt tokens still to prefill; negative: all of them (a request not yet started)."""
    generated: int = 0

    @property
    def reserved(self) -> int:
        """KV tokens the request holds at its end: its whole prompt and output."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send request ``key`` to engine ``engine`` (an index) now; it is expected to finish ``finish_s`` emulated seconds
    from now."""

    key: int
    engine: int
    finish_s: float


@dataclass(slots=True)
class _Seq:
    key: int
    prompt: int
    target: int
    prefill_left: float
    generated: int


def _seq(w: Work) -> _Seq:
    return _Seq(w.key, w.prompt_tokens, w.output_tokens, w.prompt_tokens if w.prefill_left < 0 else w.prefill_left,
                w.generated)


def fits(engine: EngineRates, running: Sequence[Work], request: Work) -> bool:
    """A free slot, and KV for every running request's whole prompt and output plus this one's."""
    return (len(running) < engine.max_num_seqs
            and sum(w.reserved for w in running) + request.reserved <= engine.kv_tokens)


def finish_time(engine: EngineRates, running: Sequence[Work], queued: Sequence[Work], key: int) -> float:
    """Emulated seconds from now until request ``key`` (running or queued) emits its last token, when ``running`` run
    on ``engine`` and ``queued`` enter in order as slots and KV free (the step rule in the module docstring); ``inf``
    when ``key`` never fits."""
    rate, chunk = engine.prefill_tokens_per_s, engine.prefill_chunk_tokens
    active = [_seq(w) for w in running]
    waiting = deque(_seq(w) for w in queued)
    reserved = sum(s.prompt + s.target for s in active)
    now = 0.0
    while True:
        while (waiting and len(active) < engine.max_num_seqs
               and reserved + waiting[0].prompt + waiting[0].target <= engine.kv_tokens):
            admitted = waiting.popleft()
            active.append(admitted)
            reserved += admitted.prompt + admitted.target
        if not active:
            return math.inf
        decoding = [s for s in active if s.prefill_left <= 0]
        prefill = sum(s.prefill_left for s in active if s.prefill_left > 0)
        if decoding:
            decode = engine.decode_step([s.prompt + s.generated for s in decoding])
            step = decode + (min(prefill, chunk) / rate if chunk else 0.0)
            budget = rate * (step - decode if chunk else step)
            steps = 1
            if prefill <= 0 and not engine.decode_slowdown_per_1k_tokens:
                steps = min(s.target - s.generated for s in decoding)  # nothing changes until the next finish
        else:
            step = min(MAX_PREFILL_STEP_S, prefill / rate)
            budget, steps = rate * step, 1
        now += step * steps
        for s in active:
            if budget <= 0:
                break
            if s.prefill_left > 0:
                spent = min(s.prefill_left, budget)
                s.prefill_left -= spent
                budget -= spent
                if s.prefill_left < PREFILL_RESIDUE:  # the simulator's rule: a float residue is a finished prompt
                    s.prefill_left = 0.0
        for s in decoding:
            s.generated += steps
        done = [s for s in active if s.prefill_left <= 0 and s.generated >= s.target]
        for s in done:
            if s.key == key:
                return now
            active.remove(s)
            reserved -= s.prompt + s.target


def assign(engines: Sequence[EngineRates], running: Sequence[Sequence[Work]], queue: Sequence[Sequence[Work]],
           lookahead: int = LOOKAHEAD) -> list[Dispatch]:
    """The requests of ``queue`` (arrival order) to dispatch now, and where (the rule in the module docstring).
    ``running[i]``: what engine ``i`` runs now, with its progress; ``queue[j][i]``: queued request ``j`` as engine ``i``
    would run it (engines may count the same prompt differently)."""
    now_running = [list(r) for r in running]
    placed: list[list[Work]] = [[] for _ in engines]
    out: list[Dispatch] = []
    for versions in queue[:lookahead]:
        if not any(fits(e, r, w) and not p for e, r, p, w in zip(engines, now_running, placed, versions)):
            break  # nothing can start now; later requests would only be placed
        options = []
        for i, (engine, request) in enumerate(zip(engines, versions)):
            startable = not placed[i] and fits(engine, now_running[i], request)
            runs = now_running[i] + [request] if startable else now_running[i]
            waits = [] if startable else [*placed[i], request]
            options.append((finish_time(engine, runs, waits, request.key), not startable, i))
        finish, later, best = min(options)
        if math.isinf(finish):
            continue  # fits nowhere, even alone: the shell refuses it
        if later:
            placed[best].append(versions[best])
        else:
            now_running[best].append(versions[best])
            out.append(Dispatch(versions[best].key, best, finish))
    return out


def progress(work: Work, tokens_seen: int, elapsed_s: float, engine: EngineRates) -> Work:
    """A dispatched request's progress as its client sees it ``elapsed_s`` emulated seconds after dispatch: the tokens
    streamed so far, or, before the first, its prompt prefilled at the engine's full rate meanwhile (optimistic when two
    prompts share the rate)."""
    if tokens_seen > 0:
        return replace(work, prefill_left=0.0, generated=min(tokens_seen, work.output_tokens))
    return replace(work, prefill_left=max(0.0, work.prompt_tokens - engine.prefill_tokens_per_s * elapsed_s))
