"""Structured tool calls and reasoning through the real server, read by the official openai
and anthropic SDKs: the scripted model writes Qwen3-format output (real Qwen3 tokenizer and
chat template), token by token through the engine, and the API must hand back typed calls."""

from __future__ import annotations

import json
from collections.abc import Callable

import anthropic
import openai
import pytest

from ds4pool.model.loader import LoadedModel
from ds4pool.output.processor import OutputConfig
from tests.integration.conftest import Server, scripted_qwen3

pytest.importorskip("ds4pool.model.scripted", reason="needs the scripted test model")

PARIS = {"city": "Paris", "units": "celsius"}
CODE = {"path": "notes/todo.md", "content": '# TODO\n- ship "tool calls" ✅\n'}
REASONING = "The user wants the weather, and a note written."
CALLS_REPLY = (
    f"<think>\n{REASONING}\n</think>\n\n"
    f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}\n</tool_call>\n'
    f'<tool_call>\n{{"name": "write_file", "arguments": {json.dumps(CODE, ensure_ascii=False)}}}'
    "\n</tool_call>"
)
FINAL_REPLY = "<think>\nBoth tools answered.\n</think>\n\nIt is sunny in Paris; the note is saved."
CODER_REPLY = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\nnotes/todo.md\n</parameter>\n"
    f"<parameter=content>\n{CODE['content']}\n</parameter>\n</function>\n</tool_call>"
)
RULES = [
    {"match": "coder-task", "reply": CODER_REPLY},
    # the second turn: both tool results are in the prompt
    {"match": r"<tool_response>\nsunny[\s\S]*<tool_response>\nwritten", "reply": FINAL_REPLY},
    {"match": r"weather in Paris[\s\S]*<think>\n\n</think>\n\n$", "reply": "No thinking: sunny."},
    {"match": "weather in Paris", "reply": CALLS_REPLY},
    {"match": "rm -rf", "reply": '<tool_call>\n{"name": "shell", "arguments": {}}\n</tool_call>'},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
ASK = "What is the weather in Paris? Then write a todo note."


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    # Overrides conftest's demo model for this module's `serve` fixture.
    return scripted_qwen3(tmp_path_factory.mktemp("rules"), RULES)


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


# --- OpenAI chat completions ---------------------------------------------------------------


def test_openai_message_has_tool_calls_and_reasoning(server: Server) -> None:
    r = oai(server).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": ASK}],
        tools=TOOLS,  # type: ignore[arg-type]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None
    assert (msg.model_extra or {}).get("reasoning_content") == REASONING
    calls = msg.tool_calls or []
    assert [(c.type, c.function.name) for c in calls] == [
        ("function", "get_weather"),
        ("function", "write_file"),
    ]
    assert [json.loads(c.function.arguments) for c in calls] == [PARIS, CODE]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_openai_stream_sends_calls_per_index(server: Server) -> None:
    stream = oai(server).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": ASK}],
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
    )
    reasoning, content, finish = "", "", None
    calls: dict[int, dict] = {}
    pieces: dict[int, int] = {}
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first chunk of a call names it
                assert tc.id and tc.type == "function" and tc.function and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                assert reasoning == REASONING  # the reasoning came first, whole
            else:
                assert tc.id is None and (tc.function is None or tc.function.name is None)
            if tc.function and tc.function.arguments:
                calls[tc.index]["arguments"] += tc.function.arguments
                pieces[tc.index] = pieces.get(tc.index, 0) + 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning == REASONING and content == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "write_file"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [PARIS, CODE]
    assert pieces[1] > 5  # the arguments stream as they are written, not in one piece


def test_openai_tool_round_trip(server: Server) -> None:
    c = oai(server)
    messages: list = [{"role": "user", "content": ASK}]
    first = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    calls = first.choices[0].message.tool_calls or []
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call, result in zip(calls, ("sunny, 21C", "written")):
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    msg = second.choices[0].message
    assert second.choices[0].finish_reason == "stop"
    assert msg.content == "It is sunny in Paris; the note is saved." and not msg.tool_calls
    assert (msg.model_extra or {}).get("reasoning_content") == "Both tools answered."


def test_openai_without_tools_or_with_unknown_names_the_call_is_text(server: Server) -> None:
    c = oai(server)
    ask = [{"role": "user", "content": ASK}]
    plain = c.chat.completions.create(model="m", messages=ask)  # type: ignore[arg-type]
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
    assert '<tool_call>\n{"name": "get_weather"' in (plain.choices[0].message.content or "")
    none = c.chat.completions.create(model="m", messages=ask, tools=TOOLS, tool_choice="none")  # type: ignore[arg-type]
    assert not none.choices[0].message.tool_calls
    rm = [{"role": "user", "content": "please rm -rf /"}]
    unknown = c.chat.completions.create(model="m", messages=rm, tools=TOOLS)  # type: ignore[arg-type]
    assert unknown.choices[0].message.tool_calls is None
    assert unknown.choices[0].message.content == (
        '<tool_call>\n{"name": "shell", "arguments": {}}\n</tool_call>'
    )


def test_openai_enable_thinking_false(server: Server) -> None:
    r = oai(server).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "weather in Paris, quickly"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = r.choices[0].message
    assert msg.content == "No thinking: sunny."
    assert "reasoning_content" not in (msg.model_extra or {})


# --- Anthropic messages --------------------------------------------------------------------


def test_anthropic_message_has_thinking_and_tool_use_blocks(server: Server) -> None:
    msg = claude(server).messages.create(
        model="m",
        max_tokens=500,
        tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": ASK}],
    )
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use", "tool_use"]
    assert msg.content[0].thinking == REASONING  # type: ignore[union-attr]
    uses = msg.content[1:]
    assert [(u.name, u.input) for u in uses] == [("get_weather", PARIS), ("write_file", CODE)]  # type: ignore[union-attr]
    assert all(u.id.startswith("toolu_") for u in uses)  # type: ignore[union-attr]


def test_anthropic_stream_blocks_in_order_and_a_round_trip(server: Server) -> None:
    c = claude(server)
    messages: list = [{"role": "user", "content": ASK}]
    kw = dict(model="m", max_tokens=500, tools=ANTHROPIC_TOOLS)
    with c.messages.stream(messages=messages, **kw) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    stops = [e for e in events if e.type == "content_block_stop"]
    assert [e.index for e in starts] == [0, 1, 2] == [e.index for e in stops]
    assert [e.content_block.type for e in starts] == ["thinking", "tool_use", "tool_use"]
    open_block = None
    for e in events:  # every delta belongs to the block open at the time
        if e.type == "content_block_start":
            open_block = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_block
        elif e.type == "content_block_stop":
            open_block = None
    json_deltas = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(json_deltas) > 5
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", PARIS), ("write_file", CODE)]
    assert final.content[0].thinking == REASONING  # type: ignore[union-attr]
    # the round trip: tool_use blocks back as the assistant turn, results as tool_result blocks
    messages.append({"role": "assistant", "content": [b.model_dump() for b in final.content]})
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21C"},
                {
                    "type": "tool_result",
                    "tool_use_id": uses[1].id,
                    "content": [{"type": "text", "text": "written"}],
                },
            ],
        }
    )
    with c.messages.stream(messages=messages, **kw) as stream:  # type: ignore[arg-type]
        answer = stream.get_final_message()
    assert answer.stop_reason == "end_turn"
    assert [b.type for b in answer.content] == ["thinking", "text"]
    assert answer.content[1].text == "It is sunny in Paris; the note is saved."  # type: ignore[union-attr]


def test_anthropic_thinking_disabled(server: Server) -> None:
    msg = claude(server).messages.create(
        model="m",
        max_tokens=100,
        messages=[{"role": "user", "content": "weather in Paris, quickly"}],
        thinking={"type": "disabled"},
    )
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "No thinking: sunny."  # type: ignore[union-attr]


def test_qwen3_coder_xml_calls_with_the_flag(serve: Callable[..., Server]) -> None:
    """--tool-parser qwen3_coder (ServerConfig.output): XML calls, values typed by the schema."""
    server = serve(output=OutputConfig(tool_parser="qwen3_coder"))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "write_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                },
            },
        }
    ]
    ask = [{"role": "user", "content": "coder-task: write the todo note"}]
    r = oai(server).chat.completions.create(model="m", messages=ask, tools=tools)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls or []
    assert call.function.name == "write_file" and json.loads(call.function.arguments) == CODE
    stream = oai(server).chat.completions.create(
        model="m",
        messages=ask,
        tools=tools,
        stream=True,  # type: ignore[arg-type]
    )
    pieces = [
        tc.function.arguments
        for chunk in stream
        for tc in chunk.choices[0].delta.tool_calls or []
        if tc.function and tc.function.arguments
    ]
    assert len(pieces) > 5 and json.loads("".join(pieces)) == CODE
