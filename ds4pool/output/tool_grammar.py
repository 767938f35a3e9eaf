"""Forced tool calls as xgrammar structural tags, in the model's own tool-call format.

The format is the one `ds4pool.output.detect.detect_tool_format` reads off the chat template
(the parsers' own choice), so the output parsers read the forced text back as calls:

  hermes       <tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>   ("\\n" between)
  llama3_json  {"name": "N", "parameters": {...}}                              ("; " between)
  mistral      [TOOL_CALLS][{"name": "N", "arguments": {...}}, ...]
  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}
               \\n```<｜tool▁call▁end｜>  ("\\n" between)  <｜tool▁calls▁end｜>
  qwen3_coder  <tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>
               \\n</tool_call>  ("\\n" between)

Markers that are single tokens of the vocabulary are matched as that token (as the model
writes them), others as text. Arguments JSON allows at most one whitespace character in a
row, so output stays bounded whatever the weights do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ds4pool.model.grammar import GrammarSpec
from ds4pool.output.constraints import ConstraintError, FunctionTool, bounded_strings

# the formats a call can be forced in (ds4pool.output.detect names them)
FORCEABLE = ("hermes", "llama3_json", "mistral", "deepseek_v3", "qwen3_coder")
_DS = {  # DeepSeek-V3's markers
    "calls_begin": "<｜tool▁calls▁begin｜>",
    "calls_end": "<｜tool▁calls▁end｜>",
    "call_begin": "<｜tool▁call▁begin｜>",
    "call_end": "<｜tool▁call▁end｜>",
    "sep": "<｜tool▁sep｜>",
}
# the text that opens a call, per format (free text before an optional call never holds it)
OPENERS = {
    "hermes": "<tool_call>",
    "llama3_json": '{"name"',
    "mistral": "[TOOL_CALLS]",
    "deepseek_v3": _DS["calls_begin"],
    "qwen3_coder": "<tool_call>",
}

IsToken = Callable[[str], bool]  # is this string one token of the vocabulary?


def tool_call_spec(
    fmt: str | None,
    tools: list[FunctionTool],
    is_token: IsToken,
    *,
    name: str | None = None,
    parallel: bool = True,
    param: str = "tool_choice",
) -> GrammarSpec:
    """Output is one (parallel=False) or more tool calls in `fmt`, of `tools` or only of
    the tool `name`, arguments per its parameters schema; then the end of the turn."""
    _check_format(fmt, param)
    if not tools:
        raise ConstraintError(f"{param} requires tools to call; none were given", param)
    if name is not None:
        tools = [t for t in tools if t.name == name]
        if not tools:
            raise ConstraintError(f"{param}: no tool named {name!r} in tools", param)
    assert fmt is not None
    return _tag(_calls(fmt, tools, is_token, parallel), param)


def at_most_one_call_spec(
    fmt: str | None,
    tools: list[FunctionTool],
    is_token: IsToken,
    param: str = "parallel_tool_calls",
) -> GrammarSpec:
    """tool_choice "auto" without parallel calls: text that never opens a call, then at
    most one call (arguments per schema), then the end of the turn."""
    _check_format(fmt, param)
    assert fmt is not None and tools
    text = {"type": "any_text", "excludes": [OPENERS[fmt]]}
    call = {"type": "optional", "content": _calls(fmt, tools, is_token, parallel=False)}
    return _tag(_seq([text, call]), param)


def _check_format(fmt: str | None, param: str) -> None:
    if fmt not in FORCEABLE:
        raise ConstraintError(
            f"{param}: this model's chat template has no tool-call format ds4pool can force",
            param,
        )


def _calls(fmt: str, tools: list[FunctionTool], is_token: IsToken, parallel: bool) -> Format:
    """One call (or, parallel, one or more) of any of `tools`, with the format's wrapper."""
    lit = _literal(is_token)
    one = _or([_CALLS[fmt](t, lit) for t in tools])
    sep = {"llama3_json": "; ", "mistral": ", "}.get(fmt, "\n")
    calls = _seq([one, {"type": "star", "content": _seq([_const(sep), one])}]) if parallel else one
    if fmt == "mistral":
        calls = _seq([*lit("[TOOL_CALLS]"), _const("["), calls, _const("]")])
    elif fmt == "deepseek_v3":
        calls = _seq([*lit(_DS["calls_begin"]), calls, *lit(_DS["calls_end"])])
    return calls


# ------------------------------------------------------------------ structural-tag pieces

Format = dict[str, Any]


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _seq(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _or(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _args(tool: FunctionTool, style: str = "json") -> Format:
    schema = bounded_strings(tool.parameters)
    fmt = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    return fmt if style == "json" else {**fmt, "style": style}


def _literal(is_token: IsToken) -> Callable[[str], list[Format]]:
    def lit(marker: str) -> list[Format]:
        return [{"type": "token", "token": marker} if is_token(marker) else _const(marker)]

    return lit


def _hermes(t: FunctionTool, lit: Callable[[str], list[Format]]) -> Format:
    head = _const(f'\n{{"name": {json.dumps(t.name)}, "arguments": ')
    return _seq([*lit("<tool_call>"), head, _args(t), _const("}\n"), *lit("</tool_call>")])


def _llama3(t: FunctionTool, lit: Callable[[str], list[Format]]) -> Format:
    del lit
    head = _const(f'{{"name": {json.dumps(t.name)}, "parameters": ')
    return _seq([head, _args(t), _const("}")])


def _mistral(t: FunctionTool, lit: Callable[[str], list[Format]]) -> Format:
    del lit
    head = _const(f'{{"name": {json.dumps(t.name)}, "arguments": ')
    return _seq([head, _args(t), _const("}")])


def _deepseek(t: FunctionTool, lit: Callable[[str], list[Format]]) -> Format:
    return _seq(
        [
            *lit(_DS["call_begin"]),
            _const("function"),
            *lit(_DS["sep"]),
            _const(f"{t.name}\n```json\n"),
            _args(t),
            _const("\n```"),
            *lit(_DS["call_end"]),
        ]
    )


def _qwen3_coder(t: FunctionTool, lit: Callable[[str], list[Format]]) -> Format:
    # <parameter=KEY>\nVALUE\n</parameter> per argument: xgrammar's qwen_xml style
    head = _const(f"\n<function={t.name}>\n")
    body = _args(t, "qwen_xml")
    return _seq([*lit("<tool_call>"), head, body, _const("</function>\n"), *lit("</tool_call>")])


_CALLS = {
    "hermes": _hermes,
    "llama3_json": _llama3,
    "mistral": _mistral,
    "deepseek_v3": _deepseek,
    "qwen3_coder": _qwen3_coder,
}


def _tag(fmt: Format, param: str) -> GrammarSpec:
    return GrammarSpec(
        "structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), param
    )
