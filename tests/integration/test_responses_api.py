"""POST /v1/responses driven by the official openai SDK against a real server (demo model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.integration.conftest import Server

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
    },
}
# what Codex offers besides its function tools: ds4pool cannot run these and drops them
UNRUNNABLE_TOOLS = [
    {"type": "web_search"},
    {"type": "local_shell"},
    {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
]


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def client(server: Server, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", default_headers=headers, max_retries=0
    )


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_text_streaming_equals_non_streaming(server: Server) -> None:
    c = client(server)
    kw: dict[str, Any] = dict(
        model="demo",
        instructions="be brief",
        input=[user("hello")],
        max_output_tokens=12,
        temperature=0,
        store=False,
    )
    full = c.responses.create(**kw)
    assert full.status == "incomplete" and full.incomplete_details is not None
    assert full.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in full.output] == ["message"]
    assert full.output_text and full.usage is not None
    assert full.usage.output_tokens == 12 and full.usage.input_tokens > 5
    assert full.usage.total_tokens == full.usage.input_tokens + 12

    events = list(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == full.output_text
    last = events[-1].response
    assert last.output_text == full.output_text and last.usage is not None
    assert last.usage.output_tokens == 12


def test_string_input_completes(server: Server) -> None:
    r = client(server).responses.create(model="demo", input="hi", max_output_tokens=3)
    assert r.object == "response" and r.usage is not None and r.usage.output_tokens <= 3


def test_second_turn_of_a_prompt_cache_key_session_reuses_its_kv(server: Server) -> None:
    """Codex's loop: the input list grows by the last output and a new user message; the
    conversation is found again by prompt_cache_key."""
    c = client(server)
    items: list[dict[str, Any]] = [user("list the files")]
    kw: dict[str, Any] = dict(
        model="demo",
        instructions="you are a coding agent",
        tools=[SHELL_TOOL],
        max_output_tokens=8,
        temperature=0,
        store=False,
        prompt_cache_key="codex-conv-1",
    )
    first = c.responses.create(input=items, **kw)
    assert first.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append(user("and now the tests"))
    second = c.responses.create(input=items, **kw)
    assert second.usage is not None
    turn1 = first.usage.input_tokens
    # at least the whole first prompt is reused (its answer too, up to where it diverges)
    assert second.usage.input_tokens_details.cached_tokens >= turn1 - 1
    assert second.usage.input_tokens > turn1 + first.usage.output_tokens


def test_session_id_header_routes_like_x_session_id(server: Server) -> None:
    kw: dict[str, Any] = dict(model="demo", input=[user("remember me")], max_output_tokens=4)
    first = client(server, {"session_id": "codex-session-7"}).responses.create(**kw, temperature=0)
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    again = client(server, {"session_id": "codex-session-7"}).responses.with_raw_response.create(
        **kw, temperature=0
    )
    assert again.headers["x-session-id"] == "codex-session-7"
    usage = again.parse().usage
    assert usage is not None and usage.input_tokens_details.cached_tokens > 0
    # X-Session-Id wins over the Codex header, prompt_cache_key comes last
    both = client(
        server, {"X-Session-Id": "explicit-1", "session_id": "codex-session-7"}
    ).responses.with_raw_response.create(**kw, prompt_cache_key="key-1")
    assert both.headers["x-session-id"] == "explicit-1"
    keyed = client(server).responses.with_raw_response.create(**kw, prompt_cache_key="key-1")
    assert keyed.headers["x-session-id"] == "key-1"


def test_unrunnable_tools_are_dropped_not_refused(server: Server) -> None:
    r = client(server).responses.create(
        model="demo",
        input=[user("hi")],
        tools=[*UNRUNNABLE_TOOLS, SHELL_TOOL],  # type: ignore[list-item]
        tool_choice="auto",
        parallel_tool_calls=False,
        reasoning={"effort": "medium", "summary": "auto"},
        include=["reasoning.encrypted_content"],
        text={"verbosity": "low"},
        metadata={"agent": "codex"},
        max_output_tokens=4,
    )
    assert [t.type for t in r.tools] == ["function"] and r.tools[0].name == "shell"  # type: ignore[union-attr]
    assert r.parallel_tool_calls is False and r.metadata == {"agent": "codex"}


def test_function_call_history_is_accepted(server: Server) -> None:
    """A conversation as Codex sends it after a tool ran: the call, its output, reasoning."""
    items = [
        user("list the files"),
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "I should run ls."}],
            "encrypted_content": None,
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "shell",
            "arguments": '{"command": ["ls"]}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc\n"},
    ]
    r = client(server).responses.create(
        model="demo",
        input=items,
        tools=[SHELL_TOOL],
        max_output_tokens=4,  # type: ignore[arg-type]
    )
    assert r.usage is not None and r.usage.output_tokens >= 1


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": "demo", **body}, timeout=30)


def test_wire_shapes_validate_strictly_against_the_sdk_types(server: Server) -> None:
    """The SDK's client parses leniently; Codex does not. Validate the raw JSON strictly."""
    body = {"input": [user("hello")], "max_output_tokens": 5, "prompt_cache_key": "strict-1"}
    r = post(server, body)
    assert r.status_code == 200
    assert Response.model_validate(r.json()).usage is not None
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    with httpx.stream(
        "POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=30
    ) as s:
        lines = [line for line in s.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [adapter.validate_json(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e.type for e in events] and events[-1].type == "response.incomplete"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [user("x"), {"type": "function_call_output", "output": "ok"}]},
            "input[1].call_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "input[0].name",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        (
            {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
            "tools[0].parameters",
        ),
        ({"input": "hi", "tools": ["shell"]}, "tools[0]"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "text": {"format": "json"}}, "text.format"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "prompt_cache_key": "no spaces allowed"}, "prompt_cache_key"),
        ({"input": []}, "input"),
        ({"input": 7}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split("[")[0] in error["message"]


def test_sdk_raises_bad_request_for_previous_response_id(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).responses.create(model="demo", input="hi", previous_response_id="resp_x")
    assert "previous_response_id" in str(info.value)


def test_stored_responses_are_not_retrievable(server: Server) -> None:
    r = client(server).responses.create(model="demo", input="hi", max_output_tokens=2, store=True)
    with pytest.raises(openai.NotFoundError) as info:
        client(server).responses.retrieve(r.id)
    assert "stores no responses" in str(info.value)
