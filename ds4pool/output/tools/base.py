"""What every tool-call parser shares: the calls of one turn and the deltas they emit.

A parser gets the content text of a turn (reasoning already split off) chunk by chunk and
returns deltas: text outside calls as `TextDelta`, calls as `ToolCallStart` / `ToolCallArgs` /
`ToolCallEnd`. A call is announced (`ToolCallStart`) only once its name is complete and names
an offered tool; until then its text is held, and if it turns out malformed (bad JSON, unknown
function) that text is given back as `TextDelta`. Once announced, a call is always closed, with
the arguments parsed so far if the model's JSON breaks off.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from ds4pool.output.deltas import Delta, TextDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from ds4pool.output.jsonstream import (
    MISSING,
    Growing,
    Malformed,
    Throttle,
    dumps,
    growing_prefix,
    parse_growing,
    stable_prefix,
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Calls:
    """The calls of one turn: indices in opening order, one stable id each."""

    def __init__(
        self,
        tool_names: frozenset[str],
        make_id: Callable[[], str] = new_call_id,
        param_types: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.tool_names = tool_names
        # tool → parameter → JSON-schema type, for formats that write values untyped (XML)
        self.param_types = param_types or {}
        self._make_id = make_id
        self.num_started = 0
        self.num_ended = 0

    def known(self, name: object) -> bool:
        return isinstance(name, str) and name in self.tool_names

    def open(self, name: str) -> CallStream:
        call = CallStream(self.num_started, self._make_id(), name, self)
        self.num_started += 1
        return call


class CallStream:
    """One announced call: streams its arguments' stable prefix, then ends exactly once."""

    def __init__(self, index: int, call_id: str, name: str, calls: Calls) -> None:
        self.index = index
        self.calls = calls
        self.sent = ""  # argument text emitted so far
        self.last: Any = {}  # the latest partial arguments (open strings cut where they stop)
        self.start = ToolCallStart(index, call_id, name)
        self._throttle = Throttle()

    def stream(self, value: Any, finished: Any) -> list[Delta]:
        """Emit what `value`/`finished` (partial arguments, see parse_partial) add."""
        if not isinstance(value, dict) or not isinstance(finished, dict):
            return []
        return self._emit(value, stable_prefix(value, finished))

    def stream_growing(self, value: Any, open_string: bool) -> list[Delta]:
        """Emit what `value` (partial arguments, see parse_growing) adds."""
        if not isinstance(value, dict):
            return []
        return self._emit(value, growing_prefix(value, open_string))

    def due(self, length: int) -> bool:
        """Whether a body of `length` chars is worth re-parsing now (see Throttle)."""
        return self._throttle.due(length)

    def stream_text(self, raw: str, force: bool = False) -> list[Delta]:
        """Stream the partial arguments JSON text `raw` (re-parsed when the throttle allows)."""
        if not (force or self.due(len(raw))):
            return []
        grown = _growing(raw)
        return [] if grown is None else self.stream_growing(grown.value, grown.open_string)

    def append(self, piece: str) -> list[Delta]:
        """Emit argument text the parser wrote itself (it keeps the whole a JSON object)."""
        if not piece:
            return []
        self.sent += piece
        return [ToolCallArgs(self.index, piece)]

    def end_written(self) -> list[Delta]:
        """Close a call whose arguments the parser wrote with `append`."""
        self.calls.num_ended += 1
        return [ToolCallEnd(self.index, self.sent)]

    def _emit(self, value: dict, prefix: str) -> list[Delta]:
        self.last = value
        if len(prefix) <= len(self.sent) or not prefix.startswith(self.sent):
            return []
        piece, self.sent = prefix[len(self.sent) :], prefix
        return [ToolCallArgs(self.index, piece)]

    def end(self, arguments: Any = MISSING) -> list[Delta]:
        """Close the call with its final arguments (the last partial ones when MISSING or not
        an object). The last chunk completes the streamed text to the final JSON."""
        args = arguments if isinstance(arguments, dict) else self.last
        final = dumps(args)
        out: list[Delta] = []
        if final.startswith(self.sent) and len(final) > len(self.sent):
            out.append(ToolCallArgs(self.index, final[len(self.sent) :]))
        self.calls.num_ended += 1
        return [*out, ToolCallEnd(self.index, final)]


class ToolParser(ABC):
    """Content text of one turn → text and tool-call deltas."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    @abstractmethod
    def feed(self, text: str) -> list[Delta]:
        """Deltas for the next chunk; a partial marker or an undecided call is held."""

    @abstractmethod
    def finish(self) -> list[Delta]:
        """Flush held text; close an announced call that the output left open."""


def _growing(raw: str) -> Growing | None:
    try:
        return parse_growing(raw)
    except Malformed:
        return None


def stream_body(call: CallStream, body: str, force: bool = False) -> list[Delta]:
    """Stream the arguments of an announced call whose partial JSON object body (name and
    "arguments" or "parameters") is `body`, when the throttle allows."""
    if not (force or call.due(len(body))):
        return []
    grown = _growing(body)
    if grown is None or not isinstance(grown.value, dict):
        return []
    args = grown.value.get("arguments", grown.value.get("parameters"))
    return call.stream_growing(args, grown.open_string)


def text(piece: str) -> list[Delta]:
    return [TextDelta(piece)] if piece else []
