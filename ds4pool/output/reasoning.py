"""Reasoning blocks in model output: `<think>…</think>` (Qwen3, DeepSeek-R1, QwQ).

The splitter turns a turn's text into reasoning and content pieces. A block opens only at the
very start of the turn (after blank space), or already in the prompt: templates that end the
prompt with "<think>\\n" make the turn start inside the block. The newlines that frame the
block (after `<think>`, before `</think>`, after `</think>`) are not part of either piece.
"""

from __future__ import annotations

from enum import Enum

from ds4pool.output.deltas import ReasoningDelta, TextDelta
from ds4pool.output.markers import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


class _Mode(Enum):
    OPENING = "opening"  # only blank text so far: a block may still open
    REASONING = "reasoning"
    AFTER = "after"  # the block closed; blank space before the content is dropped
    CONTENT = "content"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block."""
    return prompt_text.rstrip().endswith(THINK_START)


class ThinkSplitter:
    def __init__(self, in_reasoning: bool = False) -> None:
        self._mode = _Mode.REASONING if in_reasoning else _Mode.OPENING
        self._buf = ""
        self._started = False  # a reasoning piece was emitted (leading newlines dropped)

    def feed(self, text: str) -> list[ReasoningDelta | TextDelta]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[ReasoningDelta | TextDelta]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[ReasoningDelta | TextDelta]:
        out: list[ReasoningDelta | TextDelta] = []
        if self._mode is _Mode.OPENING:
            body = self._buf.lstrip()
            if body.startswith(THINK_START):
                self._buf, self._mode = body[len(THINK_START) :], _Mode.REASONING
            elif not final and THINK_START.startswith(body):
                return out
            else:
                self._mode = _Mode.CONTENT
        if self._mode is _Mode.REASONING:
            self._reasoning(out, final)
        if self._mode is _Mode.AFTER:
            body = self._buf.lstrip()
            self._buf = body
            if body:
                self._mode = _Mode.CONTENT
        if self._mode is _Mode.CONTENT and self._buf:
            out.append(TextDelta(self._buf))
            self._buf = ""
        return out

    def _reasoning(self, out: list[ReasoningDelta | TextDelta], final: bool) -> None:
        end = self._buf.find(THINK_END)
        if end >= 0:
            piece, self._buf = self._buf[:end].rstrip("\n"), self._buf[end + len(THINK_END) :]
            self._mode = _Mode.AFTER
        elif final:
            piece, self._buf = self._buf, ""
        else:
            # hold a partial "</think>" and trailing newlines (dropped if the block ends there)
            keep = partial_suffix(self._buf, (THINK_END,))
            piece = self._buf[: len(self._buf) - keep]
            piece = piece.rstrip("\n")
            self._buf = self._buf[len(piece) :]
        if not self._started:
            piece = piece.lstrip("\n")
        if piece:
            self._started = True
            out.append(ReasoningDelta(piece))
