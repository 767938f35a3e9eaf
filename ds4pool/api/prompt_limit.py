"""A prompt's length, bounded before it is tokenized in full.

The scheduler tokenizes a prompt on the step thread and refuses it when it does not fit the
context. A 15 MB prompt took 20 s of tokenizing there (the 400 came after it; every other
request waited). `PromptLimit.check` runs first, in an API worker thread, and refuses what
cannot fit while tokenizing at most about one context's worth of text:

    chars >= limit * max_token_chars    no token stands for more than max_token_chars
                                        characters: at least `limit` tokens, refused at once
    chars <  limit * TYPICAL_CHARS      let through: the scheduler's exact check costs a
                                        tokenization of at most a few contexts' worth
    otherwise                           counted piece by piece; refused as soon as the count
                                        passes the limit (plus a slack per cut)

The scheduler still decides exactly (its count is of the tokens it will compute); this only
bounds what an oversized prompt costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4pool.errors import ContextLengthError
from ds4pool.model.tokenizer import Tokenizer

TYPICAL_CHARS = 4  # characters per token of ordinary text and code (more is rare)
PIECE_CHARS = 1 << 16  # text tokenized per count step
CUT_SLACK = 8  # tokens by which a cut at a space may change the count (merges across it)


@dataclass(frozen=True)
class PromptLimit:
    """How long a prompt may be (`limit` tokens, exclusive) and the most characters any one
    token of the model's vocabulary stands for."""

    limit: int
    max_token_chars: int

    @classmethod
    def of(cls, tokenizer: Tokenizer, limit: int) -> PromptLimit:
        """From the vocabulary (tenths of a second for 200k tokens: call it off the loop).
        Vocabulary strings are at least as long as the text they stand for (byte-level BPE
        spells each byte as one character, byte-fallback pieces as <0x..>), so the bound is
        safe for every tokenizer whose normalizer does not delete characters."""
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        return cls(limit=limit, max_token_chars=max(1, max(map(len, vocab), default=1)))

    def check(self, tokenizer: Tokenizer, text: str) -> None:
        """Raise ContextLengthError when `text` certainly has `limit` tokens or more.
        Blocking (it may tokenize up to a context's worth of text): call it off the loop."""
        n = len(text)
        if n < self.limit * TYPICAL_CHARS:
            return
        if n >= self.limit * self.max_token_chars:
            raise self._error(f"at least {n // self.max_token_chars}")
        counted, cuts, start = 0, 0, 0
        while start < n:
            end = _cut(text, start + PIECE_CHARS)
            counted += len(tokenizer.encode(text[start:end], add_special_tokens=False))
            if counted - cuts * CUT_SLACK >= self.limit:
                raise self._error(f"more than {counted - cuts * CUT_SLACK - 1}")
            start, cuts = end, cuts + 1

    def _error(self, how_many: str) -> ContextLengthError:
        return ContextLengthError(
            f"prompt has {how_many} tokens; the model's context is {self.limit}"
        )


def _cut(text: str, at: int) -> int:
    """A cut at or after `at`, before a space that follows a non-space (where the usual
    pre-tokenizers split anyway), within a short distance; else at `at`."""
    if at >= len(text):
        return len(text)
    window = text[at : at + 4096]
    for i, c in enumerate(window):
        if c == " " and not text[at + i - 1].isspace():
            return at + i
    return at
