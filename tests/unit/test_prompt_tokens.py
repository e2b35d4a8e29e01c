"""Prompt tokens learned from the engines' own counts (core/prompt_tokens.py)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.policy import Policy
from controlplane.core.prompt_tokens import PromptShape, PromptTokenBook, TokenRule
from controlplane.core.request import parse_request


def engine_count(shape: PromptShape, chars_per_token: float, per_message: int) -> int:
    """What an engine with this tokenizer and chat template counts (its tokenizer rounds per message)."""
    return round(shape.chars / chars_per_token) + per_message * shape.messages


def shapes(rng: random.Random, n: int) -> list[PromptShape]:
    return [PromptShape(rng.randint(20, 4000), rng.randint(1, 6)) for _ in range(n)]


def test_the_prior_holds_until_enough_samples_then_the_engines_figures_replace_it() -> None:
    book = PromptTokenBook(chars_per_token=4.0, min_samples=20)
    rng = random.Random(1)
    cjk = PromptShape(1300, 1)
    assert book.rules.tokens("m", cjk) == 325  # the prior: 4 characters a token, no template
    for shape in shapes(rng, 19):
        assert not book.observe("m", "e1", shape, engine_count(shape, 1.3, 7))
    assert book.rules.tokens("m", cjk) == 325, "19 samples are not enough"
    shape = shapes(rng, 1)[0]
    assert book.observe("m", "e1", shape, engine_count(shape, 1.3, 7))
    learned = book.rules.rule("m")
    assert abs(learned.chars_per_token - 1.3) < 0.02 and abs(learned.per_message - 7) < 0.5
    assert abs(book.rules.tokens("m", cjk) - 1007) <= 2
    assert book.rules.tokens("other", cjk) == 325, "another model keeps the prior"


def test_outliers_do_not_move_the_fit() -> None:
    book = PromptTokenBook(chars_per_token=4.0, min_samples=20)
    rng = random.Random(2)
    for i, shape in enumerate(shapes(rng, 200)):
        counted = engine_count(shape, 3.0, 5)
        if i % 10 == 0:
            counted *= 6  # an image part counted as text, a truncated prompt
        book.observe("m", "e1", shape, counted)
    rule = book.rules.rule("m")
    assert abs(rule.chars_per_token - 3.0) < 0.05 and abs(rule.per_message - 5) < 1


def test_engines_of_one_model_with_different_tokenizers_reserve_for_the_larger() -> None:
    book = PromptTokenBook(chars_per_token=4.0, min_samples=20)
    rng = random.Random(3)
    for shape in shapes(rng, 60):
        book.observe("m", "prose", shape, engine_count(shape, 4.2, 4))
        book.observe("m", "code", shape, engine_count(shape, 3.0, 9))
    assert abs(book.engine_rule("m", "prose").chars_per_token - 4.2) < 0.05
    assert abs(book.engine_rule("m", "code").chars_per_token - 3.0) < 0.05
    shape = PromptShape(3000, 2)
    assert book.rules.tokens("m", shape) >= max(engine_count(shape, 4.2, 4), engine_count(shape, 3.0, 9))
    assert book.forget("code")
    assert abs(book.rules.rule("m").chars_per_token - 4.2) < 0.05


def test_identical_prompts_keep_their_total_right() -> None:
    """Every prompt 136 characters in one message, counted 38: the split between characters and template cannot be
    known, but the total is learned."""
    book = PromptTokenBook(chars_per_token=4.0, min_samples=20)
    for _ in range(30):
        book.observe("m", "e", PromptShape(136, 1), 38)
    assert book.rules.tokens("m", PromptShape(136, 1)) in (38, 39)


def test_learning_off_and_a_reload_with_a_new_prior() -> None:
    book = PromptTokenBook(chars_per_token=4.0, min_samples=0)
    for _ in range(50):
        assert not book.observe("m", "e", PromptShape(400, 1), 400)
    assert book.rules.tokens("m", PromptShape(400, 1)) == 100
    book.configure(chars_per_token=2.0, min_samples=10)
    assert book.rules.tokens("m", PromptShape(400, 1)) == 200


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 50), st.integers(1, 200_000)), min_size=1,
                max_size=60))
def test_any_samples_give_bounded_figures(samples: list[tuple[int, int, int]]) -> None:
    book = PromptTokenBook(chars_per_token=4.0, min_samples=1)
    for chars, messages, counted in samples:
        book.observe("m", "e", PromptShape(chars, messages), counted)
    rule = book.rules.rule("m")
    assert 0.05 <= rule.per_char <= 2.0 and 0.0 <= rule.per_message <= 64.0


def test_the_check_estimates_with_the_learned_rule() -> None:
    body = b'{"model": "m", "messages": [{"role": "system", "content": "' + b"x" * 260 + \
        b'"}, {"role": "user", "content": "' + b"y" * 130 + b'"}]}'
    plain = parse_request("POST", "/v1/chat/completions", body, {}, Policy())
    assert (plain.prompt_chars, plain.prompt_messages, plain.prompt_tokens) == (390, 2, 98)
    book = PromptTokenBook(chars_per_token=4.0, min_samples=20)
    for chars in range(100, 4100, 200):  # an engine that counts 1.3 characters a token and 5 template tokens a message
        book.observe("m", "e", PromptShape(chars, 2), round(chars / 1.3) + 10)
    assert book.rules.rule("m") != TokenRule(0.25)
    learned = parse_request("POST", "/v1/chat/completions", body, {}, Policy(), book.rules)
    assert abs(learned.prompt_tokens - (round(390 / 1.3) + 10)) <= 2
