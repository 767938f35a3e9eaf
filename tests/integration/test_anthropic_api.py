"""Anthropic-compatible routes driven by the official anthropic SDK."""

from __future__ import annotations

from collections.abc import Callable

import anthropic
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
