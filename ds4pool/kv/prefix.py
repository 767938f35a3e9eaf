"""Where a new prompt can resume a session's tokens: text boundaries known to match tokens.

A session's tokens are not the canonical tokenization of its text: reply tokens are whatever
the model sampled ("hel" + "lo" where the tokenizer says "hello"), and text-extended prompts
are tokenized piecewise. So when a re-rendered prompt differs from the session's text (the
client dropped a thinking block, re-serialized a tool call), re-tokenizing the whole prompt
and comparing ids would stop at the first such token, maybe turns before the real change.

Instead the session keeps text marks: pairs (n, c) such that token_ids[:n] stand exactly for
text[:c], recorded at each prompt's end and where text-extension joined old and new. A
diverging prompt keeps the tokens up to the last mark inside the common text prefix and
tokenizes only the rest; comparing ids then continues the reuse past the mark as far as the
new tokens agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TextMark = tuple[int, int]  # (num_tokens, num_chars): token_ids[:n] stand for text[:c]


def common_text_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b (binary search on C-speed compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def valid_marks(marks: Sequence[TextMark], num_tokens: int, num_chars: int) -> list[TextMark]:
    """The marks that still fit a state of num_tokens tokens standing for num_chars chars."""
    if not num_chars:
        return []
    return [(n, c) for n, c in marks if 0 < n <= num_tokens and 0 < c <= num_chars]


def resume_point(
    marks: Sequence[TextMark], token_ids: Sequence[int], text: str, prompt_text: str
) -> TextMark:
    """The last known boundary (n, c) with prompt_text[:c] == text[:c]; (0, 0) if none.
    The session's full state (len(token_ids), len(text)) is a boundary when text is known."""
    if not text or not token_ids:
        return (0, 0)  # '' means the text is unknown, not empty
    common = common_text_prefix(text, prompt_text)
    best: TextMark = (0, 0)
    candidates = [*valid_marks(marks, len(token_ids), len(text)), (len(token_ids), len(text))]
    for n, c in candidates:
        if c <= common and n > best[0]:
            best = (n, c)
    return best


@dataclass(frozen=True)
class TextPlan:
    """How a prompt given as text continues a session: keep token_ids[:num_kept] as they are
    and tokenize prompt_text[from_char:] after them. `marks` are the session's marks that
    still hold for the kept tokens (the boundary between kept and new tokens included)."""

    num_kept: int
    from_char: int
    marks: list[TextMark]
    via_text: bool  # the prompt extends the session's text: every token is kept


def plan_text(
    marks: Sequence[TextMark], token_ids: Sequence[int], text: str, prompt_text: str
) -> TextPlan:
    """Only compares text and marks (the caller tokenizes, outside the pool lock)."""
    if text and token_ids and prompt_text.startswith(text):
        end = (len(token_ids), len(text))
        return TextPlan(len(token_ids), len(text), [*marks, end], via_text=True)
    # The text diverged: keep the tokens up to the last boundary known to match.
    n, c = resume_point(marks, token_ids, text, prompt_text)
    kept = [(mn, mc) for mn, mc in marks if mn <= n and mc <= c]
    if n:
        kept.append((n, c))
    return TextPlan(n, c, kept, via_text=False)
