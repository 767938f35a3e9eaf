"""response_format and tool_choice enforced by the grammar, through the official SDKs.

The demo model has random weights: what it writes freely is noise, so valid JSON and
well-formed tool calls here come from the grammar alone. Its chat template writes Hermes
tool calls (<tool_call>...</tool_call>), so that is the format forced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.integration.conftest import Server

SCHEMA = {
    "type": "object",
    "properties": {
        # a bound keeps random weights short; maxLength alone once let raw control
        # characters through (xgrammar#800): json.loads below checks it no longer does
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days", "units", "alerts"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "forecast", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "pattern": "^[a-z/._]{1,16}$"}},
                "required": ["path"],
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def tool_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call: structured when the output parsers produce them,
    else read from the Hermes text the grammar forced (nothing else may be in it)."""
    if getattr(message, "tool_calls", None):
        return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    text = message.content
    calls = [json.loads(body) for body in CALL.findall(text)]
    assert CALL.sub("", text).strip() == "", text
    return [(c["name"], c["arguments"]) for c in calls]


def check_calls(calls: list[tuple[str, dict[str, Any]]], names: set[str]) -> None:
    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(args, PARAMS[name])


def test_json_schema_is_obeyed_streaming_or_not(server: Server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    c = oai(server)
    for seed in (1, 2, 3):
        kw: dict[str, Any] = dict(
            model="demo", messages=MESSAGES, response_format=fmt, max_tokens=200, seed=seed
        )
        r = c.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        content = r.choices[0].message.content
        jsonschema.validate(json.loads(content), SCHEMA)
        chunks = list(c.chat.completions.create(**kw, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == content


def test_completions_response_format(server: Server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    c = oai(server)
    r = c.completions.create(
        model="demo",
        prompt="Forecast:",
        max_tokens=200,
        seed=4,
        extra_body={"response_format": fmt},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(
            model="demo", prompt="x", max_tokens=5, extra_body={"response_format": {"type": "x"}}
        )
    assert exc.value.body["param"] == "response_format.type"  # type: ignore[index]


def test_json_object(server: Server) -> None:
    r = oai(server).chat.completions.create(
        model="demo",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=400,
        temperature=0,
    )
    if r.choices[0].finish_reason == "stop":  # free JSON may run to max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_tool_choice_required_and_named(server: Server) -> None:
    c = oai(server)
    for seed in (1, 2):
        r = c.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=300,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(tool_calls(r.choices[0].message), set(PARAMS))
    named = {"type": "function", "function": {"name": "read_file"}}
    kw: dict[str, Any] = dict(
        model="demo",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=300,
        seed=7,
    )
    r = c.chat.completions.create(**kw)
    calls = tool_calls(r.choices[0].message)
    assert len(calls) == 1
    check_calls(calls, {"read_file"})
    if not r.choices[0].message.tool_calls:  # raw text until the output parsers land
        chunks = list(c.chat.completions.create(**kw, stream=True))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == r.choices[0].message.content


def deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):  # would take xgrammar ~30 s to compile, and json.dumps recurses
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_bad_constraints_are_400s_naming_the_field(server: Server) -> None:
    c = oai(server)
    cases = [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "deep", "schema": deep_schema(400)},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 5}}},
            "tool_choice",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, **extra)
        assert exc.value.body["param"] == param, (extra, exc.value.body)  # type: ignore[index]


def test_anthropic_tool_choice_any_and_tool(server: Server) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    msg = c.messages.create(
        model="demo",
        max_tokens=300,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "any"},
    )
    blocks = [b for b in msg.content if b.type == "tool_use"]
    calls = [(b.name, b.input) for b in blocks]
    # parallel calls are allowed, so random weights may go on calling until max_tokens (~1
    # in 20 requests here): then the last call may be cut short, and only it may be partial
    assert msg.stop_reason in ("tool_use", "max_tokens"), msg.stop_reason
    check_calls(calls[:-1] if msg.stop_reason == "max_tokens" else calls, set(PARAMS))  # type: ignore[arg-type]
    assert calls
    one = c.messages.create(  # one call only: it fits in max_tokens and is whole
        model="demo",
        max_tokens=300,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert one.stop_reason == "tool_use"
    check_calls([(b.name, b.input) for b in one.content if b.type == "tool_use"], set(PARAMS))  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as exc:
        c.messages.create(
            model="demo",
            max_tokens=5,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            tool_choice={"type": "tool", "name": "rm"},
        )
    assert "no tool named 'rm'" in exc.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as exc:
        c.messages.create(
            model="demo",
            max_tokens=5,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=[{"name": "x", "input_schema": deep_schema(100)}],  # type: ignore[list-item]
            tool_choice={"type": "any"},
        )
    assert "nested deeper" in exc.value.body["error"]["message"]  # type: ignore[index]
    for choice in ({"type": "weird"}, {"type": "tool"}, {"type": "any"}):
        with pytest.raises(anthropic.BadRequestError):  # the last one: no tools given
            c.messages.create(
                model="demo",
                max_tokens=5,
                messages=MESSAGES,  # type: ignore[arg-type]
                tool_choice=choice,  # type: ignore[arg-type]
            )
