"""PromptLimit: what certainly exceeds the context is refused without full tokenization, and
nothing that fits is ever refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4pool.api.prompt_limit import PIECE_CHARS, TYPICAL_CHARS, PromptLimit
from ds4pool.errors import ContextLengthError
from ds4pool.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


class CountingTokenizer:
    """The demo tokenizer, counting the characters it was asked to encode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.chars = inner, 0
        self.backend = inner.backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


def test_max_token_chars_is_the_longest_vocabulary_entry(tokenizer: Tokenizer) -> None:
    limit = PromptLimit.of(tokenizer, 1000)
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    assert limit.max_token_chars == max(len(t) for t in vocab) > 1
    # no token of real text stands for more characters than that
    text = "    def f(x):\n        return x  # " + " " * 300 + "=" * 200
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(text) <= len(ids) * limit.max_token_chars


def test_far_too_long_is_refused_without_tokenizing(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    limit = PromptLimit.of(tokenizer, 1000)
    with pytest.raises(ContextLengthError, match="at least"):
        limit.check(counting, "x" * (1000 * limit.max_token_chars))  # type: ignore[arg-type]
    assert counting.chars == 0


def test_too_long_is_refused_after_about_a_context(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    limit = PromptLimit(limit=20_000, max_token_chars=10**6)  # no early bound: counted
    text = "hello world " * 200_000  # 2.4M characters, ~400k tokens
    with pytest.raises(ContextLengthError, match="more than"):
        limit.check(counting, text)  # type: ignore[arg-type]
    assert counting.chars <= 3 * PIECE_CHARS  # ~20k tokens' worth, not 2.4M characters


def test_short_prompts_are_not_tokenized(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    limit = PromptLimit.of(tokenizer, 1000)
    limit.check(counting, "y" * (1000 * TYPICAL_CHARS - 1))  # type: ignore[arg-type]
    assert counting.chars == 0


WORDS = st.sampled_from(["hello", " ", "  ", "\n", "world", "    ", "é", "🙂", "<|im_end|>", "ab"])


@settings(max_examples=25, deadline=None)
@given(parts=st.lists(WORDS, min_size=1, max_size=30), repeat=st.integers(1, 3000))
def test_nothing_that_fits_is_refused(tokenizer: Tokenizer, parts: list[str], repeat: int) -> None:
    text = "".join(parts) * repeat
    exact = len(tokenizer.encode(text, add_special_tokens=False))
    longest = PromptLimit.of(tokenizer, 1).max_token_chars
    for context in (exact + 1, max(2, exact // 2), exact * 2):
        try:
            PromptLimit(limit=context, max_token_chars=longest).check(tokenizer, text)
        except ContextLengthError:
            assert exact >= context, (exact, context)
