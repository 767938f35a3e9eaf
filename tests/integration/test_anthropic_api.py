"""Anthropic-compatible routes driven by the official anthropic SDK."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest

from tests.integration.conftest import Server

# The SDK no longer has sampling arguments; the API still takes them (default 1.0).
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def client(server: Server, session: str | None = None) -> anthropic.Anthropic:
    headers = {"X-Session-Id": session} if session else None
    return anthropic.Anthropic(
        base_url=server.url, api_key="unused", default_headers=headers, max_retries=0
    )


def test_message_and_stream_agree_with_the_standard_event_sequence(server: Server) -> None:
    c = client(server)
    kw = dict(
        model="demo",
        max_tokens=10,
        system="be brief",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    )
    msg = c.messages.create(**kw)  # type: ignore[arg-type]
    assert msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 10 and msg.usage.input_tokens > 5
    with c.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        kinds = [e.type for e in stream if e.type != "text"]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta", "ping"}
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == "max_tokens"


def test_second_turn_reads_the_cache(server: Server) -> None:
    c = client(server, session="claude-code-1")
    turn = [{"role": "user", "content": "read main.py"}]
    first = c.messages.create(model="demo", max_tokens=8, messages=turn, extra_body=GREEDY)
    assert first.usage.cache_read_input_tokens == 0
    turn += [
        {"role": "assistant", "content": first.content[0].text},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print('hi')"}],
        },
    ]
    second = c.messages.create(model="demo", max_tokens=4, messages=turn)
    cached = second.usage.cache_read_input_tokens
    turn1 = first.usage.input_tokens + first.usage.output_tokens
    # The last sampled token's KV is computed only if the model went on (to sample eos);
    # a turn cut by max_tokens leaves it to the next turn.
    assert cached == (turn1 - 1 if first.stop_reason == "max_tokens" else turn1)
    assert second.usage.input_tokens > 0  # the new, uncached part


def test_stop_sequence_is_reported(server: Server) -> None:
    c = client(server)
    base = c.messages.create(
        model="demo", max_tokens=12, extra_body=GREEDY, messages=[{"role": "user", "content": "hi"}]
    )
    text = base.content[0].text
    stop = text[4:7]
    cut = c.messages.create(
        model="demo",
        max_tokens=12,
        stop_sequences=[stop],
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "hi"}],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_count_tokens(server: Server) -> None:
    c = client(server)
    n = c.messages.count_tokens(model="demo", messages=[{"role": "user", "content": "hi"}])
    msg = c.messages.create(
        model="demo", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
    )
    assert n.input_tokens == msg.usage.input_tokens


def test_errors_use_the_anthropic_format(server: Server) -> None:
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as exc:
        c.messages.create(model="demo", max_tokens=5, messages=[])
    assert exc.value.body["type"] == "error"  # type: ignore[index]
    assert exc.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def claude_code_request(n_tools: int) -> dict[str, Any]:
    """The shape Claude Code 2.x sends: system blocks with cache_control, a system message in
    the middle of messages, thinking / context_management / output_config, many tools (and a
    server tool ds4pool cannot run)."""
    tools: list[dict[str, Any]] = [
        {
            "name": f"Tool{i}",
            "description": f"tool number {i}",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
        for i in range(n_tools)
    ]
    tools.append({"type": "web_search_20250305", "name": "web_search", "max_uses": 5})
    return dict(
        model="demo",
        max_tokens=6,
        system=[
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is in src?"}]},
            {"role": "system", "content": "<system-reminder>plan mode is off</system-reminder>"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "user", "content": "go on"},
        ],
        tools=tools,
        metadata={"user_id": "user_abc_account_def_session_123"},
        extra_body={
            **GREEDY,
            "thinking": {"type": "enabled", "budget_tokens": 4000},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"},
            "service_tier": "auto",
        },
    )


def test_a_claude_code_shaped_request_succeeds(server: Server) -> None:
    c = client(server)
    kw = claude_code_request(30)
    msg = c.messages.create(**kw)  # type: ignore[arg-type]
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 6
    with c.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text  # type: ignore[union-attr]
    start = events[0]
    assert start.type == "message_start"

    # the prompt's size is known when the stream starts (Claude Code reads it there); the
    # second request of the same prompt reads most of it from the shared prefix blocks, which
    # Anthropic's usage counts apart from input_tokens
    def prompt_size(u: object) -> int:
        return u.input_tokens + (u.cache_read_input_tokens or 0)  # type: ignore[attr-defined]

    assert prompt_size(start.message.usage) == prompt_size(msg.usage) > 100
    counted = c.messages.count_tokens(
        model="demo", system=kw["system"], messages=kw["messages"], tools=kw["tools"]
    )
    assert counted.input_tokens == msg.usage.input_tokens


def test_message_start_reports_cached_input_apart(server: Server) -> None:
    c = client(server, session="claude-code-start-usage")
    turn = [{"role": "user", "content": "read main.py"}]
    first = c.messages.create(model="demo", max_tokens=4, messages=turn, extra_body=GREEDY)
    turn += [
        {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
        {"role": "user", "content": "and now?"},
    ]
    with c.messages.stream(model="demo", max_tokens=4, messages=turn) as stream:
        start = next(iter(stream))
        final = stream.get_final_message()
    assert start.type == "message_start"
    assert start.message.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens > 0
    assert start.message.usage.input_tokens == final.usage.input_tokens


def test_root_answers_get_and_head(server: Server) -> None:
    assert httpx.head(server.url + "/").status_code == 200
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_get_one_model(server: Server) -> None:
    r = httpx.get(server.url + "/v1/models/demo")
    assert r.status_code == 200 and r.json()["id"] == "demo"
    missing = httpx.get(server.url + "/v1/models/claude-opus-4")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def _tool_result_turn(content: object) -> list[dict]:
    return [
        {"role": "user", "content": "read it"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}],
        },
    ]


def test_tool_result_content_lists_of_strings_and_of_other_values(server: Server) -> None:
    c = client(server)
    count, create = c.messages.count_tokens, c.messages.create
    # bare strings in the list are text (they used to be a 500)
    as_list = count(model="demo", messages=_tool_result_turn(["abc"]))  # type: ignore[arg-type]
    as_text = count(model="demo", messages=_tool_result_turn("abc"))  # type: ignore[arg-type]
    assert as_list.input_tokens == as_text.input_tokens
    msg = create(model="demo", max_tokens=2, messages=_tool_result_turn(["abc"]))  # type: ignore[arg-type]
    assert msg.usage.output_tokens >= 1
    for bad in ([1], [None], [["x"]]):
        turn = _tool_result_turn(bad)
        for kw in ({}, {"max_tokens": 2}):
            route = create if kw else count
            with pytest.raises(anthropic.BadRequestError) as exc:
                route(model="demo", messages=turn, **kw)  # type: ignore[arg-type,operator]
            message = exc.value.body["error"]["message"]  # type: ignore[index]
            assert "messages[2].content[0].content[0]" in message
