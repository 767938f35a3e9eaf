"""Streaming a tool call's arguments as their JSON grows, with partial-json-parser.

The model writes arguments token by token; clients want them as they come. A chunk may only
carry text that the finished arguments will start with, so each update re-parses the partial
JSON twice: once keeping an unfinished string (to stream long string values, e.g. a file's
content) and once with only finished atoms. The streamed form is the parsed value re-serialised
(`json.dumps`, so whitespace is normalised), cut before anything that may still change: the
closing brackets, a number or literal still being written, the closing quote of an open string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import partial_json_parser
from partial_json_parser import Allow

_WITH_STRINGS = Allow.ARR | Allow.OBJ | Allow.STR
_FINISHED_ATOMS = Allow.ARR | Allow.OBJ
# Re-parsing is O(length): parse again only after this fraction of new text, so a long call
# costs O(length) in all (a 12 kB body parses in ~2 ms; ~65 parses in its life).
_REPARSE_FRACTION = 64

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
        return Partial(
            partial_json_parser.loads(text, _WITH_STRINGS),
            partial_json_parser.loads(text, _FINISHED_ATOMS),
        )
    except Exception as exc:  # the library raises MalformedJSON, JSONDecodeError, IndexError...
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


class Throttle:
    """Says when a growing text has grown enough since the last parse to parse it again."""

    def __init__(self) -> None:
        self._parsed_len = -1

    def due(self, length: int) -> bool:
        if length - self._parsed_len >= max(1, length // _REPARSE_FRACTION):
            self._parsed_len = length
            return True
        return False
