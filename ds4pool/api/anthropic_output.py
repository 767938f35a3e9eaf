"""Anthropic messages formatting of the output processor's deltas: the content blocks of a
non-streaming response and the block events of a stream.

Blocks: reasoning → `thinking` (with an empty `signature`: ds4pool signs nothing), text →
`text`, a tool call → `tool_use` with id "toolu_…" and `input` (an object)."""

from __future__ import annotations

import json
from typing import Any

from ds4pool.output.deltas import (
    Delta,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from ds4pool.output.message import OutputMessage


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(reason: str, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the processor's Finish."""
    if reason == "length":
        return "max_tokens", None
    if reason == "tool_calls":
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def content_blocks(msg: OutputMessage) -> list[dict[str, Any]]:
    """The message's blocks in output order; blank text beside other blocks is dropped and a
    message with nothing in it has one empty text block."""
    blocks: list[dict[str, Any]] = []
    for part in msg.parts:
        if part.kind == "reasoning":
            blocks.append({"type": "thinking", "thinking": part.text, "signature": ""})
        elif part.kind == "text":
            blocks.append({"type": "text", "text": part.text})
        elif part.call is not None:
            call = part.call
            blocks.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(call.id),
                    "name": call.name,
                    "input": json.loads(call.arguments),
                }
            )
    if len(blocks) > 1:
        blocks = [b for b in blocks if b["type"] != "text" or b["text"].strip()]
    return blocks or [{"type": "text", "text": ""}]


class BlockEvents:
    """Deltas → content_block_start / _delta / _stop events, one block open at a time,
    indices counting from 0 in the order the blocks open."""

    def __init__(self) -> None:
        self._kind: str | None = None  # the open block's type
        self.num_blocks = 0

    def events(self, deltas: list[Delta]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for delta in deltas:
            if isinstance(delta, TextDelta):
                self._open(out, {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta.text}))
            elif isinstance(delta, ReasoningDelta):
                self._open(out, {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta.text}))
            elif isinstance(delta, ToolCallStart):
                block = {"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name}
                self._open(out, {**block, "input": {}}, new=True)
            elif isinstance(delta, ToolCallArgs):
                out.append(self._delta({"type": "input_json_delta", "partial_json": delta.text}))
            elif isinstance(delta, ToolCallEnd):
                self.close(out)
        return out

    def close(self, out: list[tuple[str, dict[str, Any]]]) -> None:
        """Stop the open block, if any (a thinking block gets its signature first)."""
        if self._kind is None:
            return
        if self._kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(("content_block_stop", {"index": self.num_blocks - 1}))
        self._kind = None

    def ensure_block(self, out: list[tuple[str, dict[str, Any]]]) -> None:
        """A message always has a block: an empty text block if nothing opened one."""
        if self.num_blocks == 0:
            self._open(out, {"type": "text", "text": ""})

    def _open(
        self, out: list[tuple[str, dict[str, Any]]], block: dict[str, Any], new: bool = False
    ) -> None:
        if self._kind == block["type"] and not new:
            return
        self.close(out)
        out.append(("content_block_start", {"index": self.num_blocks, "content_block": block}))
        self._kind = block["type"]
        self.num_blocks += 1

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"index": self.num_blocks - 1, "delta": delta})
