"""Streaming a tool call's arguments as their JSON grows, with partial-json-parser.

The model writes arguments token by token; clients want them as they come. A chunk may only
carry text that the finished arguments will start with. The streamed form is the parsed value
re-serialised (`json.dumps`, so whitespace is normalised), cut before anything that may still
change: the closing brackets, a number or literal at the end, the closing quote of an open
string (long string values, e.g. a file's content, stream as they are written).

Two parses: `parse_partial` (twice the library's cost) also gives the value with only finished
atoms, which tells whether a call's name is complete; `parse_growing` (one completion by the
library, then the C json parser) is what an announced call's arguments are re-parsed with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import partial_json_parser
from partial_json_parser import Allow

_WITH_STRINGS = Allow.ARR | Allow.OBJ | Allow.STR
_FINISHED_ATOMS = Allow.ARR | Allow.OBJ
# Re-parsing is O(length) (more with many quotes: the library's escape check slices): parse
# again only after 1/32 of new text, so a long call costs O(length) in all: a 30 kB file
# written into a call parses ~100 times, ~0.2 s in all, the longest ~4 ms.
_REPARSE_FRACTION = 32
_ATOM_CHARS = "0123456789+-.eEtrufalsnINaiy"  # what a number or literal can end with

MISSING = object()


class Malformed(Exception):
    """The text is not the beginning of any JSON value."""


@dataclass(frozen=True)
class Partial:
    """A partial JSON value two ways: open strings kept, and only finished atoms."""

    value: Any
    finished: Any


def parse_partial(text: str) -> Partial | None:
    """The partial value of `text`; None while it holds no value yet (blank); Malformed if it
    cannot start a JSON value."""
    if not text.strip():
        return None
    try:
        text = text.lstrip()  # the library drops an open string's last char after blanks
        return Partial(
            partial_json_parser.loads(text, _WITH_STRINGS),
            partial_json_parser.loads(text, _FINISHED_ATOMS),
        )
    except Exception as exc:  # the library raises MalformedJSON, JSONDecodeError, IndexError...
        raise Malformed(str(exc)) from None


@dataclass(frozen=True)
class Growing:
    """A partial JSON value, open strings kept, and whether the text stops inside a string."""

    value: Any
    open_string: bool


def parse_growing(text: str) -> Growing | None:
    """Like parse_partial at half the cost, without the finished-atoms view."""
    if not text.strip():
        return None
    try:
        head, tail = partial_json_parser.fix(text.lstrip())  # (see parse_partial)
        return Growing(json.loads(head + tail), tail.startswith('"'))
    except Exception as exc:  # MalformedJSON, PartialJSON, AssertionError, JSONDecodeError...
        raise Malformed(str(exc)) from None


def parse_complete(text: str) -> Any:
    """The value of `text` if it is complete JSON, else MISSING."""
    try:
        return json.loads(text)
    except ValueError:
        return MISSING


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def stable_prefix(value: Any, finished: Any) -> str:
    """The start of the final serialisation that `value` (open strings kept) and `finished`
    (finished atoms only) already determine."""
    safe = dumps(finished).rstrip("]}")
    text = dumps(value).rstrip("]}")
    if text == safe or not text.endswith('"') or not text.startswith(safe):
        return safe
    text = text[:-1]  # the open string's closing quote is not written yet
    if text and "\ud800" <= text[-1] <= "\udbff":
        text = text[:-1]  # half of a surrogate pair written as an escape
    return text


def growing_prefix(value: Any, open_string: bool) -> str:
    """stable_prefix for a Growing value: cut an open string's closing quote, or the number or
    literal the text ends with (it may still grow; it is emitted once something follows)."""
    text = dumps(value).rstrip("]}")
    if open_string and text.endswith('"'):
        text = text[:-1]
        if text and "\ud800" <= text[-1] <= "\udbff":
            text = text[:-1]
        return text
    return text.rstrip(_ATOM_CHARS)


class Throttle:
    """Says when a growing text has grown enough since the last parse to parse it again."""

    def __init__(self) -> None:
        self._parsed_len = -1

    def due(self, length: int) -> bool:
        if length - self._parsed_len >= max(1, length // _REPARSE_FRACTION):
            self._parsed_len = length
            return True
        return False
