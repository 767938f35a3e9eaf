"""The Responses renderer fed hand-made delta sequences (text, reasoning, tool calls): every
event and the final object must parse with the openai SDK's own types, as Codex parses them."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from ds4pool.api.responses_output import ResponseRenderer
from ds4pool.output.deltas import (
    Delta,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from ds4pool.sched.request import Usage

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
SKELETON = {
    "id": "resp_1",
    "created_at": 0,
    "model": "m",
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
}
USAGE = Usage(prompt_tokens=100, cached_tokens=60, completion_tokens=9)


def render(
    chunks: list[list[Delta]], usage: Usage = USAGE, **kw: Any
) -> tuple[list[Any], Response, ResponseRenderer]:
    r = ResponseRenderer(dict(SKELETON), **kw)
    raw = r.start()
    for chunk in chunks:
        raw += r.feed(chunk, num_tokens=1)
    raw += r.complete(usage)
    events = [EVENT.validate_python(json.loads(json.dumps(e))) for e in raw]
    return events, Response.model_validate(json.loads(json.dumps(r.response))), r


def kinds(events: list[Any]) -> list[str]:
    return [e.type for e in events]


def test_text_only() -> None:
    events, resp, _ = render([[TextDelta("Hel")], [TextDelta("lo")], [Finish("stop")]])
    assert kinds(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.status == "in_progress" and events[2].item.content == []
    assert events[6].text == "Hello" and events[-1].response.output_text == "Hello"
    assert resp.status == "completed" and resp.output_text == "Hello"
    assert resp.usage is not None and resp.usage.input_tokens == 100
    assert resp.usage.input_tokens_details.cached_tokens == 60
    assert resp.usage.total_tokens == 109 and resp.usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_then_tool_call() -> None:
    chunks: list[list[Delta]] = [
        [ReasoningDelta("I should ")],
        [ReasoningDelta("list files.")],
        [],  # a chunk held back by the parser (a partial marker), still reasoning
        [TextDelta("\n\n")],  # whitespace between blocks opens no message
        [ToolCallStart(0, "call_abc", "shell"), ToolCallArgs(0, '{"command": ')],
        [ToolCallArgs(0, '["ls"]}')],
        [ToolCallEnd(0, '{"command": ["ls"]}'), Finish("tool_calls")],
    ]
    events, resp, r = render(chunks)
    assert kinds(events)[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning, call = resp.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "I should list files."
    assert call.type == "function_call" and call.name == "shell" and call.status == "completed"
    assert call.call_id == "call_abc" and call.id == "fc_abc"
    assert json.loads(call.arguments) == {"command": ["ls"]}
    assert events[9].item.arguments == "" and events[9].output_index == 1
    assert r.reasoning_tokens == 3  # the two reasoning chunks and the held-back one
    assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens == 3


def test_text_then_two_parallel_calls_and_parallel_off() -> None:
    chunks: list[list[Delta]] = [
        [TextDelta("Running both.")],
        [ToolCallStart(0, "call_1", "a"), ToolCallArgs(0, "{}"), ToolCallEnd(0, "{}")],
        [ToolCallStart(1, "call_2", "b"), ToolCallArgs(1, '{"x": 1}')],
        [ToolCallEnd(1, '{"x": 1}'), Finish("tool_calls")],
    ]
    _, resp, _ = render(chunks)
    assert [o.type for o in resp.output] == ["message", "function_call", "function_call"]
    assert resp.output_text == "Running both."
    assert [o.name for o in resp.output[1:]] == ["a", "b"]  # type: ignore[union-attr]
    events, single, _ = render(chunks, parallel_tool_calls=False)
    assert [o.type for o in single.output] == ["message", "function_call"]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    calls = [item.name for item in added if item.type == "function_call"]
    assert calls == ["a"]  # no event at all for the second call
    assert not [e for e in events if getattr(e, "output_index", 0) > 1]


def test_length_marks_the_response_and_its_open_item_incomplete() -> None:
    events, resp, _ = render([[TextDelta("partial")], [Finish("length")]])
    assert events[-1].type == "response.incomplete"
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"


def test_an_unclosed_call_is_closed_at_finish() -> None:
    chunks: list[list[Delta]] = [
        [ToolCallStart(0, "call_9", "shell"), ToolCallArgs(0, '{"comm')],
        [Finish("length")],
    ]
    events, resp, _ = render(chunks)
    assert resp.output[0].status == "incomplete"
    assert resp.output[0].arguments == '{"comm'  # type: ignore[union-attr]
    assert kinds(events)[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]


def test_failure_is_response_failed_with_an_error() -> None:
    r = ResponseRenderer(dict(SKELETON))
    r.start()
    r.feed([TextDelta("so far"), Finish("error")])
    (last,) = r.complete(USAGE, "inference failed")
    event = EVENT.validate_python(last)
    assert event.type == "response.failed" and event.response.error is not None
    assert event.response.error.code == "server_error"


def test_text_after_a_call_opens_a_new_message() -> None:
    chunks: list[list[Delta]] = [
        [ToolCallStart(0, "call_1", "a"), ToolCallEnd(0, "{}")],
        [TextDelta("done")],
        [Finish("stop")],
    ]
    _, resp, _ = render(chunks)
    assert [o.type for o in resp.output] == ["function_call", "message"]


@pytest.mark.parametrize("reason", ["stop", "tool_calls"])
def test_no_output_at_all_still_parses(reason: str) -> None:
    _, resp, _ = render([[TextDelta("  ")], [Finish(reason)]])
    assert resp.output == [] and resp.status == "completed"
