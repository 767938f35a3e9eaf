"""The output processor: a request's generated text → typed deltas for the renderers.

One processor per request. The API feeds it each chunk of text the scheduler emits and
gets back deltas (ds4pool.output.deltas); at the end `finish` flushes what was held back,
closes open tool calls and emits `Finish`. Renderers (OpenAI chat, Responses, Anthropic)
only format deltas.

Text flows through two stages: the reasoning splitter (when the model has reasoning blocks)
takes `<think>…</think>` out as `ReasoningDelta`s, then the tool-call parser (when the
request offered tools) finds calls in the rest. Each stage holds back only the tail that may
still become one of its markers, or a call whose name is not known yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ds4pool.output.deltas import Delta, Finish, ReasoningDelta, TextDelta, ToolCallEnd
from ds4pool.output.detect import (
    REASONING_FORMATS,
    TOOL_FORMATS,
    detect_reasoning_format,
    detect_tool_format,
)
from ds4pool.output.reasoning import ThinkSplitter, prompt_opens_reasoning
from ds4pool.output.tools import PARSERS, Calls, ToolParser


@dataclass(frozen=True)
class OutputConfig:
    """Server-wide choice of parsers (`--tool-parser`, `--reasoning-parser`)."""

    tool_parser: str = (
        "auto"  # auto | hermes | llama3_json | mistral | deepseek_v3 | qwen3_coder | none
    )
    reasoning_parser: str = "auto"  # auto | think | none

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("tool_parser", self.tool_parser, TOOL_FORMATS),
            ("reasoning_parser", self.reasoning_parser, REASONING_FORMATS),
        ):
            if value not in ("auto", *allowed):
                choices = ", ".join(("auto", *allowed))
                raise ValueError(f"{name} {value!r} is not one of {choices}")


class OutputProcessor:
    def __init__(
        self, reasoning: ThinkSplitter | None = None, tools: ToolParser | None = None
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._finished = False
        # blank text right after a call, dropped unless text follows (None: not after a call)
        self._blank_after_call: str | None = None

    def feed(self, text: str) -> list[Delta]:
        """Deltas for the next chunk of generated text (may hold back a partial marker)."""
        assert not self._finished, "feed after finish"
        if not text:
            return []
        if self._reasoning is None:
            return self._content([TextDelta(text)], final=False)
        return self._content(self._reasoning.feed(text), final=False)

    def finish(self, reason: str, stop_string: str | None = None) -> list[Delta]:
        """Flush, close open tool calls, then `Finish`: reason "tool_calls" when the turn
        stopped on its own (eos, a stop string) after making calls; "length" stays."""
        assert not self._finished, "finish twice"
        self._finished = True
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        out = self._content(pieces, final=True)
        if self._tools is not None and self._tools.calls.num_ended and reason == "stop":
            reason = "tool_calls"
        return [*out, Finish(reason, stop_string)]

    def _content(self, pieces: list[ReasoningDelta | TextDelta], final: bool) -> list[Delta]:
        raw: list[Delta] = []
        for piece in pieces:
            if isinstance(piece, TextDelta) and self._tools is not None:
                raw += self._tools.feed(piece.text)
            else:
                raw.append(piece)
        if final and self._tools is not None:
            raw += self._tools.finish()
        return _merge(self._drop_blank_after_calls(raw))

    def _drop_blank_after_calls(self, deltas: list[Delta]) -> list[Delta]:
        """Blank text between and after calls (the newlines models put there) is no content."""
        out: list[Delta] = []
        for delta in deltas:
            if isinstance(delta, ToolCallEnd):
                self._blank_after_call = ""
            elif isinstance(delta, TextDelta) and self._blank_after_call is not None:
                held = self._blank_after_call + delta.text
                if not held.strip():
                    self._blank_after_call = held
                    continue
                self._blank_after_call, delta = None, TextDelta(held)
            out.append(delta)
        return out


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent text (or reasoning) deltas as one."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if isinstance(delta, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + delta.text)
        elif isinstance(delta, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + delta.text)
        else:
            out.append(delta)
    return out


def tool_names(tools: list[Any] | None) -> frozenset[str]:
    """Names of the offered functions (OpenAI shape {"type": "function", "function": {...}}
    or a bare {"name": ...}); entries of another shape offer nothing."""
    names = set()
    for tool in tools or ():
        spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if isinstance(name, str) and name:
            names.add(name)
    return frozenset(names)


def parameter_types(tools: list[Any] | None) -> dict[str, dict[str, str]]:
    """tool name → parameter → its JSON-schema "type" (where it is one string)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            continue
        params = spec.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(props, Mapping):
            out[spec["name"]] = {
                key: prop["type"]
                for key, prop in props.items()
                if isinstance(prop, Mapping) and isinstance(prop.get("type"), str)
            }
    return out


def resolve_formats(cfg: OutputConfig, tokenizer: Any) -> tuple[str, str]:
    """(tool format, reasoning format) for the model: the configured ones, or for "auto"
    the ones its chat template and added tokens imply."""
    template = tokenizer.chat_template_text()
    vocab = tokenizer.added_tokens
    tool = cfg.tool_parser
    if tool == "auto":
        tool = detect_tool_format(template, vocab)
    reasoning = cfg.reasoning_parser
    if reasoning == "auto":
        reasoning = detect_reasoning_format(template, vocab)
    return tool, reasoning


def build_processor(
    cfg: OutputConfig,
    tokenizer: Any,
    *,
    tools: list[dict[str, Any]] | None,
    prompt_text: str,
) -> OutputProcessor:
    """The processor for one request: the parsers `cfg` names (or, for "auto", the ones
    the tokenizer's chat template implies), told whether tools were offered and whether
    the rendered prompt already opened a reasoning block (e.g. ends with "<think>\\n").
    Tool calls are parsed only when `tools` offers at least one function."""
    tool_format, reasoning_format = resolve_formats(cfg, tokenizer)
    splitter = None
    if reasoning_format == "think":
        splitter = ThinkSplitter(in_reasoning=prompt_opens_reasoning(prompt_text))
    parser = None
    names = tool_names(tools)
    if names and tool_format != "none":
        parser = PARSERS[tool_format](Calls(names, param_types=parameter_types(tools)))
    return OutputProcessor(splitter, parser)
