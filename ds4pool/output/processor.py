"""The output processor: a request's generated text → typed deltas for the renderers.

One processor per request. The API feeds it each chunk of text the scheduler emits and
gets back deltas (ds4pool.output.deltas); at the end `finish` flushes what was held back,
closes open tool calls and emits `Finish`. Renderers (OpenAI chat, Responses, Anthropic)
only format deltas.

This first version passes text through (no tool-call or reasoning parsing); the parsers
plug in behind the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds4pool.output.deltas import Delta, Finish, TextDelta


@dataclass(frozen=True)
class OutputConfig:
    """Server-wide choice of parsers (`--tool-parser`, `--reasoning-parser`)."""

    tool_parser: str = "auto"  # auto | hermes | llama3_json | mistral | deepseek_v3 | none
    reasoning_parser: str = "auto"  # auto | think | none


class OutputProcessor:
    def __init__(self) -> None:
        self._finished = False

    def feed(self, text: str) -> list[Delta]:
        """Deltas for the next chunk of generated text (may hold back a partial marker)."""
        assert not self._finished, "feed after finish"
        return [TextDelta(text)] if text else []

    def finish(self, reason: str, stop_string: str | None = None) -> list[Delta]:
        """Flush, close open tool calls, then `Finish` (reason "tool_calls" when the turn
        ended on a complete tool call)."""
        assert not self._finished, "finish twice"
        self._finished = True
        return [Finish(reason, stop_string)]


def build_processor(
    cfg: OutputConfig,
    tokenizer: Any,
    *,
    tools: list[dict[str, Any]] | None,
    prompt_text: str,
) -> OutputProcessor:
    """The processor for one request: the parsers `cfg` names (or, for "auto", the ones
    the tokenizer's chat template implies), told whether tools were offered and whether
    the rendered prompt already opened a reasoning block (e.g. ends with "<think>\\n")."""
    del cfg, tokenizer, tools, prompt_text
    return OutputProcessor()
