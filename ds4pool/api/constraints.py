"""tool_choice, parallel_tool_calls and response_format → a compiled Constraint for a Request.

Each API's own fields are read here; the specs come from ds4pool.output.constraints and are
compiled in a worker thread (xgrammar's compile is CPU-bound and the first one imports it),
never on the event loop. Whatever ds4pool cannot honour is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ds4pool.api.errors import ApiError
from ds4pool.api.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest
from ds4pool.engine import Engine
from ds4pool.model.grammar import Constraint, GrammarError, GrammarSpec
from ds4pool.model.tokenizer import Tokenizer
from ds4pool.output.constraints import (
    ConstraintError,
    FunctionTool,
    after_open_reasoning,
    check_schema_size,
    json_object_spec,
    json_schema_spec,
    parse_tools,
    reasoning_open,
)
from ds4pool.output.detect import detect_tool_format
from ds4pool.output.tool_grammar import at_most_one_call_spec, tool_call_spec


async def constrain(
    engine: Engine, build: Callable[[], GrammarSpec | None], prompt_text: str = ""
) -> Constraint | None:
    """Build the spec and compile it in a worker thread (both grow with the request's
    schemas); a field ds4pool cannot honour is a 400 naming it. If the rendered prompt
    opened a reasoning block, the constraint starts after the model closes it."""

    def run() -> Constraint | None:
        spec = build()
        if spec is not None and reasoning_open(prompt_text):
            spec = after_open_reasoning(spec)
        return None if spec is None else engine.compile_constraint(spec)

    try:
        return await asyncio.to_thread(run)
    except (ConstraintError, GrammarError) as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def tool_spec(
    tokenizer: Tokenizer,
    choice: str,
    tools: list[FunctionTool],
    *,
    name: str | None = None,
    parallel: bool = True,
    param: str = "tool_choice",
) -> GrammarSpec | None:
    """The spec for a normalised tool choice: "auto", "none", "required" or "function"
    (with `name`). Shared by chat completions, Responses and Anthropic messages."""
    # the same choice as the output processor's, so the parsers read the forced calls back
    fmt = detect_tool_format(tokenizer.chat_template_text(), tokenizer.added_tokens)
    if choice == "none":  # unconstrained: the routes offer no tools and parse no calls
        return None

    def is_token(text: str) -> bool:
        return tokenizer.token_to_id(text) is not None

    if choice == "auto":
        return None if parallel or not tools else at_most_one_call_spec(fmt, tools, is_token)
    return tool_call_spec(
        fmt,
        tools,
        is_token,
        name=name if choice == "function" else None,
        parallel=parallel,
        param=param,
    )


def response_format_spec(value: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI chat's response_format: text, json_object or json_schema."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec("response_format")
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise ConstraintError(
                "response_format.json_schema must be an object with a name and a schema",
                "response_format.json_schema",
            )
        return json_schema_spec(js.get("schema", {}), "response_format.json_schema.schema")
    raise ConstraintError(
        "response_format.type must be one of text, json_object, json_schema",
        "response_format.type",
    )


def _chat_choice(value: str | dict[str, Any] | None) -> tuple[str, str | None]:
    if value is None or value in ("auto", "none", "required"):
        return value or "auto", None
    fn = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(fn, dict):
        if isinstance(fn.get("name"), str):
            return "function", fn["name"]
    raise ConstraintError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def chat_spec(tokenizer: Tokenizer, data: ChatCompletionRequest) -> GrammarSpec | None:
    """A chat completion's constraint: a forced tool call wins over response_format (a
    turn that calls a tool has no content to format)."""
    choice, name = _chat_choice(data.tool_choice)
    single = data.parallel_tool_calls is False
    tools = parse_tools(data.tools) if choice != "auto" or single else []
    spec = tool_spec(tokenizer, choice, tools, name=name, parallel=not single)
    if choice in ("auto", "none") and (fmt_spec := response_format_spec(data.response_format)):
        spec = fmt_spec
    return spec


async def chat_constraint(
    engine: Engine, data: ChatCompletionRequest, prompt_text: str
) -> Constraint | None:
    if (
        data.tool_choice is None
        and data.response_format is None
        and not (data.parallel_tool_calls is False and data.tools)
    ):
        return None  # the common case pays no thread hop
    return await constrain(engine, lambda: chat_spec(engine.tokenizer, data), prompt_text)


async def completion_constraint(engine: Engine, data: CompletionRequest) -> Constraint | None:
    """Legacy completions take chat's response_format (an extension, as vLLM's)."""
    if data.response_format is None:
        return None
    return await constrain(engine, lambda: response_format_spec(data.response_format))


def _anthropic_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """Anthropic tool definitions ({name, description, input_schema}), validated."""
    check_schema_size(tools, "tools")
    out = []
    for i, t in enumerate(tools or []):
        name, schema = (t.get("name"), t.get("input_schema")) if isinstance(t, dict) else (0, 0)
        if not isinstance(schema, dict):
            raise ConstraintError(f"tools[{i}].input_schema must be a JSON Schema object", "tools")
        fn = {"type": "function", "function": {"name": name, "parameters": schema}}
        try:
            out.extend(parse_tools([fn]))
        except ConstraintError as exc:
            what = "name" if exc.param.endswith(".name") else "input_schema"
            raise ConstraintError(f"tools[{i}].{what}: {exc}", "tools") from None
    if len({t.name for t in out}) != len(out):
        raise ConstraintError("tools: tool names must be unique", "tools")
    return out


def messages_spec(tokenizer: Tokenizer, data: MessagesRequest) -> GrammarSpec | None:
    """Anthropic's tool_choice: auto | any | tool (with name) | none, and
    disable_parallel_tool_use."""
    value = data.tool_choice
    assert value is not None
    kind = value.get("type")
    names = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    if not isinstance(kind, str) or kind not in names:  # a dict or list is unhashable
        raise ConstraintError("tool_choice.type must be auto, any, tool or none", "tool_choice")
    name = value.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise ConstraintError("tool_choice.name is required for type tool", "tool_choice.name")
    parallel = not value.get("disable_parallel_tool_use", False)
    tools = _anthropic_tools(data.tools)
    return tool_spec(tokenizer, names[kind], tools, name=name, parallel=parallel)


async def messages_constraint(
    engine: Engine, data: MessagesRequest, prompt_text: str
) -> Constraint | None:
    if data.tool_choice is None:
        return None
    return await constrain(engine, lambda: messages_spec(engine.tokenizer, data), prompt_text)


# ------------------------------------------------------------------ Responses API helpers


def text_format_spec(value: object) -> GrammarSpec | None:
    """The Responses API's text.format: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "name": ..., "schema": {...}, "strict": ...} (flat, unlike chat)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec("text.format")
    if kind == "json_schema" and isinstance(value, dict):
        if not isinstance(value.get("name"), str):
            raise ConstraintError(
                "text.format.name is required for json_schema", "text.format.name"
            )
        return json_schema_spec(value.get("schema", {}), "text.format.schema")
    raise ConstraintError(
        "text.format.type must be one of text, json_object, json_schema", "text.format.type"
    )


def responses_spec(
    tokenizer: Tokenizer,
    text_format: object,
    tool_choice: object,
    tools: list[dict[str, Any]] | None,
    parallel_tool_calls: bool | None = None,
) -> GrammarSpec | None:
    """A Responses request's constraint. `tools`: the function tools in chat-completions
    shape ({"type": "function", "function": {...}}); tool_choice "none" | "auto" | "required"
    | {"type": "function", "name": X}. A forced call wins over text.format."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    choice, name = _chat_choice(tool_choice)  # type: ignore[arg-type]
    single = parallel_tool_calls is False
    parsed = parse_tools(tools) if choice != "auto" or single else []
    spec = tool_spec(tokenizer, choice, parsed, name=name, parallel=not single)
    if choice in ("auto", "none") and (fmt_spec := text_format_spec(text_format)):
        spec = fmt_spec
    return spec


async def responses_constraint(
    engine: Engine,
    text_format: object,
    tool_choice: object,
    tools: list[dict[str, Any]] | None,
    parallel_tool_calls: bool | None = None,
    prompt_text: str = "",
) -> Constraint | None:
    """responses_spec, built and compiled off the event loop (400s name the field)."""
    return await constrain(
        engine,
        lambda: responses_spec(
            engine.tokenizer, text_format, tool_choice, tools, parallel_tool_calls
        ),
        prompt_text,
    )
