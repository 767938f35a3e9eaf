"""Finding markers in streamed text: what can be emitted now, what must wait for more."""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`: the
    part that must be held back until the next chunk says whether a marker begins there."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def split_at(text: str, marker: str) -> tuple[str, str] | None:
    """(text before `marker`, text after it) at its first occurrence, None if absent."""
    i = text.find(marker)
    return None if i < 0 else (text[:i], text[i + len(marker) :])
