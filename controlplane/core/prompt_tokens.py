"""Prompt tokens learned from the engines: what a prompt of ``c`` characters in ``m`` chat messages costs in tokens
(decision 0002).

A Check has no tokenizer. It estimates ``tokens = ceil(c x per_char + m x per_message)``; the prior is the policy's
``chars_per_token`` and no template tokens. Each served request whose engine reported ``usage.prompt_tokens`` is a sample
``(c, m, counted)`` of its (model, engine), and so is each window of an engine's prompt-token counter that accounts for
every prompt counted in it (prompt_counters.py: the window's average request). After ``min_samples`` the pair's figures
are fitted to its last ``SAMPLES``, and the model's rule (KV reservation, TTFT, prefix-block arithmetic, rate-limit
pre-charges) is the largest of its engines' figures, component by component, so that no engine's prompt is
under-reserved. The fit is least squares of ``counted ~ per_char x c + per_message x m`` pulled toward the prior with
``PRIOR_WEIGHT`` of a sample, refitted without samples whose residual exceeds ``OUTLIER_MADS`` median absolute
residuals (at least one token), up to ``TRIM_ROUNDS`` times, bounded by ``PER_CHAR_BOUNDS`` and
``PER_MESSAGE_BOUNDS``.

Pure: no clock, no I/O. Each control-plane replica learns from the access-log entries it receives.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

SAMPLES = 256
"""Samples kept per (model, engine): the fit follows a tokenizer that changed (an engine redeployed) within this many."""
REFIT_EVERY = 8
"""Past ``min_samples``, a pair's figures are fitted again after this many new samples."""
OUTLIER_MADS = 4.0
TRIM_ROUNDS = 3
PRIOR_WEIGHT = 1e-3
"""The prior's pull on a fit, in samples."""
PER_CHAR_BOUNDS = (0.05, 2.0)
PER_MESSAGE_BOUNDS = (0.0, 64.0)


@dataclass(frozen=True, slots=True)
class PromptShape:
    """What a Check counted of a prompt."""

    chars: int
    """Characters of prompt text (messages' contents, a prompt, OpenAI content parts' text)."""
    messages: int = 0
    """Chat messages (0 for a completion's prompt)."""


@dataclass(frozen=True, slots=True)
class TokenRule:
    """Tokens of a prompt: ``ceil(chars x per_char + messages x per_message)``."""

    per_char: float
    per_message: float = 0.0
    samples: int = 0
    """How many samples the figures were fitted to (0: the prior)."""

    def tokens(self, shape: PromptShape) -> int:
        return max(0, math.ceil(shape.chars * self.per_char + shape.messages * self.per_message - 1e-9))

    @property
    def chars_per_token(self) -> float:
        return 1.0 / self.per_char


@dataclass(frozen=True, slots=True)
class PromptTokenRules:
    """What the Check uses: each model's rule, the prior for a model not learned yet. Immutable: the book hands out a
    new one when a rule changes."""

    prior: TokenRule
    by_model: Mapping[str, TokenRule] = field(default_factory=lambda: MappingProxyType({}))

    def rule(self, model: str | None) -> TokenRule:
        return self.by_model.get(model, self.prior) if model is not None else self.prior

    def tokens(self, model: str | None, shape: PromptShape) -> int:
        return self.rule(model).tokens(shape)


@dataclass(frozen=True, slots=True)
class CountedWindow:
    """A closed window of an engine's prompt-token counter (prompt_counters.py): its requests' average prompt as the
    Check counted it and as the engine's counter did."""

    model: str
    engine: str
    requests: int
    chars: float
    """Average characters a request."""
    messages: float
    """Average chat messages a request."""
    counted: float
    """Average prompt tokens a request, from the counter's growth."""
    estimated: float
    """Average of the Check's estimates."""


@dataclass(frozen=True, slots=True)
class PromptTokenSummary:
    """What ``sluice admin engines`` shows of an engine's prompts."""

    rule: TokenRule
    """Its fitted figures, or the prior while it has fewer than ``min_samples``."""
    samples: int
    """Samples held (at most ``SAMPLES``)."""
    error_median: float | None
    """The median of the held samples' count over the Check's estimate; None without one."""


@dataclass(frozen=True, slots=True)
class _Sample:
    """One request, or the average request of a counter window (prompt_counters.py)."""

    chars: float
    messages: float
    counted: float
    estimated: float = 0


class PromptTokenBook:
    """The samples and fitted figures of every (model, engine), and the rules the Check reads (``rules``)."""

    def __init__(self, chars_per_token: float, min_samples: int) -> None:
        self.min_samples = min_samples
        """0: never learn (the prior always)."""
        self._prior = TokenRule(1.0 / chars_per_token)
        self._samples: dict[tuple[str, str], deque[_Sample]] = {}
        self._since_fit: dict[tuple[str, str], int] = {}
        self._fitted: dict[tuple[str, str], TokenRule] = {}
        self.rules = PromptTokenRules(self._prior)

    def configure(self, chars_per_token: float, min_samples: int) -> None:
        """A policy reload: a new prior or threshold applies to every pair at once."""
        self._prior, self.min_samples = TokenRule(1.0 / chars_per_token), min_samples
        self._fitted = {pair: rule for pair, rule in self._fitted.items() if min_samples and rule.samples >= min_samples}
        self._publish()

    def observe(self, model: str, engine: str, shape: PromptShape, counted: int, estimated: int = 0) -> bool:
        """One served request's prompt as its engine counted it (and as the Check estimated it). True when the Check's
        rules changed."""
        if counted <= 0 or shape.chars < 0:
            return False
        return self._add((model, engine), _Sample(shape.chars, shape.messages, counted, estimated))

    def observe_window(self, window: CountedWindow) -> bool:
        """A closed counter window (prompt_counters.py): its average request is one sample of its (model, engine). True
        when the Check's rules changed."""
        if window.counted <= 0 or window.chars < 0:
            return False
        return self._add((window.model, window.engine),
                         _Sample(window.chars, window.messages, window.counted, window.estimated))

    def _add(self, pair: tuple[str, str], sample: _Sample) -> bool:
        samples = self._samples.setdefault(pair, deque(maxlen=SAMPLES))
        samples.append(sample)
        if self.min_samples <= 0:
            return False
        since = self._since_fit.get(pair, 0) + 1
        if len(samples) < self.min_samples or (pair in self._fitted and since < REFIT_EVERY):
            self._since_fit[pair] = since
            return False
        self._since_fit[pair] = 0
        before = self.rules
        self._fitted[pair] = fit(samples, self._prior)
        self._publish()
        return self.rules != before

    def engine_rule(self, model: str, engine: str) -> TokenRule:
        """The pair's fitted figures, or the prior while it has too few samples."""
        return self._fitted.get((model, engine), self._prior)

    def summary(self, model: str, engine: str) -> PromptTokenSummary:
        samples = self._samples.get((model, engine), ())
        errors = sorted(s.counted / s.estimated for s in samples if s.estimated > 0)
        return PromptTokenSummary(self.engine_rule(model, engine), len(samples),
                                  errors[(len(errors) - 1) // 2] if errors else None)

    def forget(self, engine: str) -> bool:
        """``engine`` restarted (perhaps with another tokenizer) or left: its samples say nothing of what comes next."""
        pairs = [pair for pair in self._samples if pair[1] == engine]
        for pair in pairs:
            self._samples.pop(pair, None)
            self._since_fit.pop(pair, None)
        had = [pair for pair in self._fitted if pair[1] == engine]
        for pair in had:
            del self._fitted[pair]
        if had:
            self._publish()
        return bool(had)

    def _publish(self) -> None:
        per_model: dict[str, TokenRule] = {}
        for (model, _), rule in sorted(self._fitted.items()):
            held = per_model.get(model)
            per_model[model] = rule if held is None else TokenRule(
                max(held.per_char, rule.per_char), max(held.per_message, rule.per_message),
                min(held.samples, rule.samples))
        self.rules = PromptTokenRules(self._prior, MappingProxyType(per_model))


def fit(samples: deque[_Sample] | list[_Sample], prior: TokenRule) -> TokenRule:
    """The figures that best explain ``samples`` (module docstring): ridge toward ``prior``, outliers dropped, bounded."""
    kept = list(samples)
    rule = _least_squares(kept, prior)
    for _ in range(TRIM_ROUNDS):
        residuals = [abs(s.counted - s.chars * rule.per_char - s.messages * rule.per_message) for s in samples]
        spread = max(1.0, sorted(residuals)[len(residuals) // 2])
        inliers = [s for s, r in zip(samples, residuals) if r <= OUTLIER_MADS * spread]
        if not inliers or len(inliers) == len(kept):
            break
        kept = inliers
        rule = _least_squares(kept, prior)
    return TokenRule(min(PER_CHAR_BOUNDS[1], max(PER_CHAR_BOUNDS[0], rule.per_char)),
                     min(PER_MESSAGE_BOUNDS[1], max(PER_MESSAGE_BOUNDS[0], rule.per_message)), len(kept))


def _least_squares(samples: list[_Sample], prior: TokenRule) -> TokenRule:
    n = len(samples)
    scc = sum(s.chars * s.chars for s in samples)
    smm = sum(s.messages * s.messages for s in samples)
    scm = sum(s.chars * s.messages for s in samples)
    sct = sum(s.chars * s.counted for s in samples)
    smt = sum(s.messages * s.counted for s in samples)
    # The prior as a thousandth of a sample per figure, scaled to the samples' own magnitudes: enough to decide a split
    # the samples cannot (identical prompts), too little to bias one they can.
    wc, wm = PRIOR_WEIGHT * scc / n, PRIOR_WEIGHT * max(smm / n, 1.0)
    a11, a12, a22 = scc + wc, scm, smm + wm
    b1, b2 = sct + wc * prior.per_char, smt + wm * prior.per_message
    det = a11 * a22 - a12 * a12
    if det <= 0 or a11 <= 0:
        return prior
    return TokenRule((b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det)
