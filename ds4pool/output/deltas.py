"""The typed deltas the output processor emits and the API renderers format.

A request's generated text is turned, chunk by chunk, into a sequence of these. The
OpenAI chat/completions, Responses and Anthropic renderers only format them; none of
them parses model text itself.

Order guarantees of a stream of deltas:
- `ToolCallStart(index=i)` comes before any `ToolCallArgs(index=i)`, which come before
  `ToolCallEnd(index=i)`; indices count from 0 in the order the calls were opened.
- the concatenation of a call's `ToolCallArgs.text` equals its `ToolCallEnd.arguments`
  (a JSON object, as text).
- `Finish` is last, exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str  # stable for the call: "call_..." (renderers may re-prefix, e.g. "toolu_")
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str  # a chunk of the arguments' JSON text


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: str  # the whole arguments JSON object, as text


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" | "tool_calls" | "cancelled" | "error"
    stop_string: str | None = None


Delta = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgs | ToolCallEnd | Finish
