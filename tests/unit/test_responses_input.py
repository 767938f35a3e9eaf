"""Responses `input` items and tools → chat-template messages: what goes where."""

from __future__ import annotations

import pytest

from ds4pool.api.errors import ApiError
from ds4pool.api.responses_input import to_messages, to_tools


def test_text_then_calls_are_one_assistant_turn_and_outputs_know_their_function() -> None:
    items = [
        {"role": "user", "content": "fix it"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look first"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": '{"c": 1}'},
        {"type": "function_call", "call_id": "call_b", "name": "read", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "call_b", "output": [
            {"type": "input_text", "text": "line 1\n"}, {"type": "input_text", "text": "line 2"}]},
        {"type": "function_call_output", "call_id": "call_a", "output": "ok"},
    ]  # fmt: skip
    msgs = to_messages("be careful", items)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    turn = msgs[2]
    assert turn["content"] == "Looking." and turn["reasoning_content"] == "look first"
    calls = [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in turn["tool_calls"]
    ]
    assert calls == [("call_a", "shell", {"c": 1}), ("call_b", "read", "not json")]
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_b", "content": "line 1\nline 2",
                       "name": "read"}  # fmt: skip
    assert msgs[4]["name"] == "shell"


def test_a_call_after_a_tool_output_starts_a_new_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
    ]
    roles = [m["role"] for m in to_messages(None, items)]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_tools_keep_functions_and_drop_the_rest() -> None:
    tools = to_tools([
        {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": True},
        {"type": "web_search_preview"},
        {"type": "mcp", "server_label": "x", "server_url": "http://x"},
        {"type": "function", "name": "noargs"},
    ])  # fmt: skip
    assert tools == [
        {"type": "function",
         "function": {"name": "shell", "description": "", "parameters": {"type": "object"}}},
        {"type": "function",
         "function": {"name": "noargs", "description": "", "parameters": {"type": "object"}}},
    ]  # fmt: skip
    assert to_tools([{"type": "local_shell"}]) is None


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "function_call_output", "call_id": "", "output": "x"}], "input[0].call_id"),
        ([{"type": "function_call_output", "call_id": "c"}], "input[0].output"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}],
         "input[0].arguments"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
         "input[0].content[0]"),
        (["just a string"], "input[0]"),
        ([{"type": "reasoning", "summary": "x"}], "input[0].summary"),
    ],
)  # fmt: skip
def test_errors_name_the_field(items: list, param: str) -> None:
    with pytest.raises(ApiError) as info:
        to_messages(None, items)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(param)
