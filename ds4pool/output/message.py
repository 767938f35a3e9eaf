"""A whole turn's deltas gathered into one message, for the non-streaming renderers."""

from __future__ import annotations

from dataclasses import dataclass, field

from ds4pool.output.deltas import (
    Delta,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class Part:
    """One piece of the message in output order: "text", "reasoning" or "tool_call"."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


@dataclass
class OutputMessage:
    parts: list[Part] = field(default_factory=list)
    finish: Finish | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if p.kind == "text")

    @property
    def reasoning(self) -> str | None:
        pieces = [p.text for p in self.parts if p.kind == "reasoning"]
        return "".join(pieces) if pieces else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [p.call for p in self.parts if p.call is not None]


def assemble(deltas: list[Delta]) -> OutputMessage:
    """The message the deltas of one turn stand for (adjacent text of a kind joined)."""
    msg = OutputMessage()
    started: dict[int, ToolCallStart] = {}
    for delta in deltas:
        if isinstance(delta, (TextDelta, ReasoningDelta)):
            kind = "text" if isinstance(delta, TextDelta) else "reasoning"
            if msg.parts and msg.parts[-1].kind == kind:
                msg.parts[-1].text += delta.text
            else:
                msg.parts.append(Part(kind, delta.text))
        elif isinstance(delta, ToolCallStart):
            started[delta.index] = delta
        elif isinstance(delta, ToolCallEnd):
            start = started[delta.index]
            call = ToolCall(start.id, start.name, delta.arguments)
            msg.parts.append(Part("tool_call", call=call))
        elif isinstance(delta, Finish):
            msg.finish = delta
        else:
            assert isinstance(delta, ToolCallArgs)
    return msg
