"""What a request's output must match, as GrammarSpecs for xgrammar: JSON schemas, and the
tool definitions forced calls are built from (ds4pool.output.tool_grammar).

API-neutral: the OpenAI chat, Responses and Anthropic routes translate their own fields
(response_format, text.format, tool_choice, ...) into calls of these functions, then compile
the spec off the event loop (Engine.compile_constraint). Errors are `ConstraintError`s naming
the request field, for a 400 in the API's own format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ds4pool.errors import Ds4poolError
from ds4pool.model.grammar import GrammarSpec

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Compile time grows steeply with schema nesting (depth 200: ~2 s, 490: ~50 s on one core)
# and with many optional properties; these bounds keep one compile well under a second.
MAX_SCHEMA_DEPTH = 32  # nested JSON objects/arrays in one schema document
MAX_SCHEMA_VALUES = 5000  # JSON values (objects, arrays, scalars) over all schemas of a request


class ConstraintError(Ds4poolError):
    """A request field asks for output ds4pool cannot constrain; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments object


def check_schema_size(value: object, param: str, budget: int = MAX_SCHEMA_VALUES) -> int:
    """Raise ConstraintError if `value` nests deeper than MAX_SCHEMA_DEPTH or holds more than
    `budget` JSON values; else return the number of values. Iterative: no recursion limit."""
    stack: list[tuple[object, int]] = [(value, 1)]
    count = 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > budget:
            raise ConstraintError(f"{param}: schema too large (over {budget} JSON values)", param)
        if isinstance(item, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise ConstraintError(
                    f"{param}: schema nested deeper than {MAX_SCHEMA_DEPTH} levels", param
                )
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return count


def parse_tools(tools: object, param: str = "tools") -> list[FunctionTool]:
    """OpenAI-style tool definitions ({"type": "function", "function": {name, parameters}})."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ConstraintError(f"{param} must be a list", param)
    check_schema_size(tools, param)
    out = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ConstraintError(
                f'{where} must be {{"type": "function", "function": {{...}}}}', where
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConstraintError(
                f"{where}.function.name must be 1-128 letters, digits, _ . : or -",
                f"{where}.function.name",
            )
        params = fn.get("parameters")
        if params is None:
            params = _EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise ConstraintError(
                f"{where}.function.parameters must be a JSON Schema object",
                f"{where}.function.parameters",
            )
        out.append(FunctionTool(name, params))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ConstraintError(f"{param}: function names must be unique", param)
    return out


def json_schema_spec(schema: object, param: str) -> GrammarSpec:
    """Output is one JSON value matching `schema` (a JSON Schema object)."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"{param} must be a JSON Schema object", param)
    check_schema_size(schema, param)
    return GrammarSpec("json_schema", json.dumps(bounded_strings(schema)), param)


def bounded_strings(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where string length bounds are a pattern: xgrammar 0.2.9 compiles
    minLength/maxLength to a character class that lets raw control characters through,
    which is invalid JSON (mlc-ai/xgrammar#800); its pattern path does not. Both forbid
    escapes inside the string, so the language is otherwise the same."""
    out: dict[str, Any] = json.loads(json.dumps(schema))
    stack: list[object] = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        low, high = node.get("minLength", 0), node.get("maxLength", "")
        if (
            node.get("type") == "string"
            and ("minLength" in node or "maxLength" in node)
            and "pattern" not in node
            and "format" not in node
            and _is_count(low)
            and (high == "" or _is_count(high))
        ):
            node.pop("minLength", None)
            node.pop("maxLength", None)
            node["pattern"] = f"^.{{{low},{high}}}$"
    return out


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def json_object_spec(param: str) -> GrammarSpec:
    """Output is one JSON object (any keys)."""
    return GrammarSpec("json_object", "", param)


def reasoning_open(prompt_text: str) -> bool:
    """Did the rendered prompt open a <think> block it does not close (templates of
    reasoning models that start the reply inside it)? Then the reply's format begins after
    the model's </think>."""
    return prompt_text.rfind("<think>") > prompt_text.rfind("</think>")


def after_open_reasoning(spec: GrammarSpec) -> GrammarSpec:
    """`spec`, preceded by free reasoning text up to </think> (and its blank line): the
    constraint governs the answer, not the reasoning inside the block the prompt opened."""
    if spec.kind == "structural_tag":
        body = json.loads(spec.source)["format"]
    else:
        schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
        body = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
    gap = {"type": "optional", "content": {"type": "const_string", "value": "\n\n"}}
    fmt = {"type": "sequence", "elements": [think, gap, body]}
    return GrammarSpec(
        "structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), spec.param
    )
