"""Simulated engine profiles, each built from measured numbers (their sources: ``PROFILES``).

Output lengths (``output_model="eos"``, the default): each request's natural length is drawn from a lognormal
(``exp(N(ln median, sigma))``, at least one token), then capped by ``max_tokens`` (or ``max_model_len - prompt`` when
the request sets none). The medians and spreads are assumptions, not measurements (seeds 000 and 004 fixed
``max_tokens`` and ignored EOS), picked to resemble chat traffic: ``cortex`` median 180 tokens, sigma 0.8 (p90 ~500,
p99 ~1,150); ``reasoning`` median 300, sigma 1.0 (p90 ~1,080, p99 ~3,070). ``output_model="max_tokens"``: every request
generates exactly ``max_tokens`` (64 when it names none).

The world differs from sluice's estimator on purpose, so that what sluice decides from has to be learned from the
engines: ``cortex`` counts 3.3 characters a token and 5 template tokens a chat message, ``reasoning`` 3.8 and 5; every
profile runs chunked prefill with a 2,048-token budget a step (vLLM V1's default on smaller GPUs) and decodes 1.5%
slower per 1,000 tokens of mean context. These are assumptions, not measurements; ``ESTIMATOR_WORLD`` sets each back to
the estimator's prior (4 characters a token, no template tokens, prefill beside decode, context-free decode).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

OUTPUT_MODELS = ("eos", "max_tokens")


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model: str
    max_num_seqs: int
    num_gpu_blocks: int
    block_size: int
    """Tokens per KV block."""
    prefill_tokens_per_s: float
    """Prompt tokens processed per emulated second (shared by every request in prefill)."""
    decode_aggregate_tokens_per_s: tuple[float, ...]
    """Aggregate generation rate with 1, 2, ... requests decoding; beyond the last entry the aggregate stays flat."""
    max_model_len: int
    version: str
    output_median_tokens: float = 180.0
    """Median natural output length (tokens until end of sequence) under the ``eos`` output model."""
    output_sigma: float = 0.8
    """Spread of the lognormal output length (the standard deviation of its log)."""
    output_model: str = "eos"
    """``eos``: requests stop at a drawn natural length (capped by max_tokens); ``max_tokens``: exactly max_tokens."""
    chars_per_token: float = 3.3
    """The tokenizer's ratio: a prompt of ``n`` characters is ``ceil(n / chars_per_token)`` tokens (about 4 for English
    prose, 3 for code, 1.3 for CJK text)."""
    template_tokens_per_message: int = 5
    """The chat template's tokens around each message (role markers, separators), counted in a chat prompt's tokens."""
    prefill_chunk_tokens: int = 2048
    """Chunked prefill (vLLM V1's default): a step that decodes also prefills up to this many prompt tokens, and lasts
    the decode step plus that chunk's prefill time, so decoding slows while prompts are prefilled. 0: prefill and decode
    progress side by side without slowing each other (the estimator's own model)."""
    decode_slowdown_per_1k_tokens: float = 0.015
    """Decode slows as contexts grow (attention reads the whole KV): a decode step lasts ``1 + this x mean context /
    1000`` times the profile's table (the mean over the requests decoding, prompt and generated tokens). 0: context-free."""

    def __post_init__(self) -> None:
        if self.output_model not in OUTPUT_MODELS:
            raise ValueError(f"output_model must be one of {', '.join(OUTPUT_MODELS)}, not {self.output_model!r}")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, not {self.chars_per_token!r}")
        if self.prefill_chunk_tokens < 0 or self.decode_slowdown_per_1k_tokens < 0:
            raise ValueError("prefill_chunk_tokens and decode_slowdown_per_1k_tokens must be >= 0")
        if self.template_tokens_per_message < 0:
            raise ValueError(f"template_tokens_per_message must be >= 0, not {self.template_tokens_per_message!r}")

    def draw_output_tokens(self, rng: random.Random) -> int:
        """A natural output length (before any max_tokens cap): lognormal around ``output_median_tokens``."""
        return max(1, round(rng.lognormvariate(math.log(self.output_median_tokens), self.output_sigma)))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def per_request_decode_rate(self, decoding: int) -> float:
        """Tokens/s each request gets when ``decoding`` requests share a step: aggregate(n) / n."""
        n = max(1, decoding)
        rates = self.decode_aggregate_tokens_per_s
        aggregate = rates[min(n, len(rates)) - 1]
        return aggregate / n


ESTIMATOR_WORLD = {"chars_per_token": 4.0, "template_tokens_per_message": 0, "prefill_chunk_tokens": 0,
                   "decode_slowdown_per_1k_tokens": 0.0}
"""The ``Profile`` fields that put a simulated engine in the estimator's own world (its priors), for tests of rules
that assume them."""

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="thor",
            model="cortex",
            max_num_seqs=2,
            num_gpu_blocks=8253,  # 4.03 x 32768 tokens / 16
            block_size=16,
            prefill_tokens_per_s=1500.0,
            decode_aggregate_tokens_per_s=(18.18, 50.71),
            max_model_len=32768,
            version="0.10.1",
        ),
        Profile(
            name="spark",
            model="cortex",
            max_num_seqs=2,
            num_gpu_blocks=5939,  # 2.90 x 32768 tokens / 16
            block_size=16,
            prefill_tokens_per_s=4000.0,
            decode_aggregate_tokens_per_s=(49.24, 87.82),
            max_model_len=32768,
            version="0.10.1",
        ),
        Profile(
            name="v100pp2",
            model="reasoning",
            max_num_seqs=4,
            num_gpu_blocks=9527,
            block_size=16,
            prefill_tokens_per_s=262.0,
            decode_aggregate_tokens_per_s=(12.0, 20.0, 26.0, 30.9),
            max_model_len=131072,
            version="0.11.0",
            output_median_tokens=300.0,
            output_sigma=1.0,
            chars_per_token=3.8,
        ),
    )
}
"""The profiles by name. ``thor`` / ``spark``: seed 000 (Jetson AGX Thor vs DGX Spark GB10, ``max_num_seqs=2``):
measured aggregate decode rates (Thor 18.18 tok/s at 1 stream and 50.71 at 2; Spark 49.24 and 87.82) and KV capacity
(Thor holds 4.03x and Spark 2.90x a full 32768-token sequence); their prefill rates were not measured: assumptions in
the same ratio as decode. ``v100pp2``: seed 004 (Qwen3-32B-GPTQ-Int4 on 2x V100, pipeline parallel 2,
``max_num_seqs=4``): 9527 blocks x 16 tokens = 152,432 KV tokens, uncached prefill 262 tok/s contended, decode shaped
to the measured fleet aggregate (~30.9 tok/s). ``cortex`` is Llama-3-style (a header and end-of-turn a message),
``reasoning`` Qwen-style (``<|im_start|>role ... <|im_end|>``)."""
