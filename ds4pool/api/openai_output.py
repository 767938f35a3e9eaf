"""OpenAI chat/completions formatting of the output processor's deltas: the message of a
non-streaming response and the `delta` objects of a stream's chunks."""

from __future__ import annotations

from typing import Any

from ds4pool.output.deltas import Delta, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from ds4pool.output.message import OutputMessage


def finish_reason(reason: str) -> str:
    """OpenAI's finish_reason for the processor's Finish.reason."""
    return reason if reason in ("length", "tool_calls") else "stop"


def chat_message(msg: OutputMessage) -> dict[str, Any]:
    """`choices[0].message`: content (null when the turn is only tool calls), tool_calls,
    reasoning_content (when the model reasoned)."""
    calls = msg.tool_calls
    text = msg.text
    out: dict[str, Any] = {
        "role": "assistant",
        "content": None if calls and not text.strip() else text,
    }
    if msg.reasoning is not None:
        out["reasoning_content"] = msg.reasoning
    if calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return out


def chunk_deltas(deltas: list[Delta]) -> list[dict[str, Any]]:
    """One chunk `delta` per text, reasoning or tool-call delta (Finish and ToolCallEnd add
    nothing: the finish reason goes in the last chunk, a call ends when the stream does)."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if isinstance(delta, TextDelta):
            out.append({"content": delta.text})
        elif isinstance(delta, ReasoningDelta):
            out.append({"reasoning_content": delta.text})
        elif isinstance(delta, ToolCallStart):
            call = {
                "index": delta.index,
                "id": delta.id,
                "type": "function",
                "function": {"name": delta.name, "arguments": ""},
            }
            out.append({"tool_calls": [call]})
        elif isinstance(delta, ToolCallArgs):
            call = {"index": delta.index, "function": {"arguments": delta.text}}
            out.append({"tool_calls": [call]})
    return out
