"""Claude Code's request shape through the anthropic SDK, on Qwen3's real tokenizer and chat
template (the scripted model replies): a system message in the middle of `messages`,
thinking / context_management / output_config, dozens of tools and a server tool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from ds4pool.model.loader import LoadedModel
from tests.integration.conftest import Server, scripted_qwen3

READ_CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "src/main.py"}}\n</tool_call>'
RULES = [
    # the reminder must reach the model, rendered in place by Qwen3's template
    {"match": r"<\|im_start\|>system\n<system-reminder>plan mode", "reply": READ_CALL},
    {"match": "what is in src", "reply": "the reminder was lost"},
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    # Overrides conftest's demo model for this module's `serve` fixture.
    return scripted_qwen3(tmp_path_factory.mktemp("rules"), RULES)


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def claude_code_request() -> dict[str, Any]:
    tools: list[dict[str, Any]] = [
        {
            "name": name,
            "description": f"The {name} tool.",
            "input_schema": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {"file_path": {"type": "string"}},
                "required": ["file_path"],
                "additionalProperties": False,
            },
        }
        for name in ["Read", "Write", "Edit", "Glob", "Grep", "Bash", "TodoWrite", "Task"] * 3
    ]
    tools = [{**t, "name": f"{t['name']}{i // 8 or ''}"} for i, t in enumerate(tools)]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    tools.append({"type": "web_search_20250305", "name": "web_search", "max_uses": 8})
    return dict(
        model="claude-opus-4-6",
        max_tokens=16000,  # Claude Code asks for 32000, streamed; the SDK refuses it unstreamed
        system=[
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is in src?"}]},
            {"role": "system", "content": "<system-reminder>plan mode is off</system-reminder>"},
        ],
        tools=tools,
        metadata={"user_id": "user_1_account_2_session_3"},
        extra_body={
            "thinking": {"type": "enabled", "budget_tokens": 8000},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "service_tier": "auto",
        },
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )


def test_claude_code_request_gets_a_tool_use_whole_and_streamed(server: Server) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    kw = claude_code_request()
    msg = c.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.name == "Read" and block.input == {"file_path": "src/main.py"}
    with c.messages.stream(**kw) as stream:
        start = next(iter(stream))
        final = stream.get_final_message()
    assert start.type == "message_start"

    # the repeated prompt now reads most of its tokens from the shared prefix blocks, which
    # Anthropic's usage counts apart from input_tokens: compare the prompt sizes
    def prompt_size(u: object) -> int:
        return u.input_tokens + (u.cache_read_input_tokens or 0)  # type: ignore[attr-defined]

    assert prompt_size(start.message.usage) == prompt_size(msg.usage) > 500
    assert [b.type for b in final.content] == [b.type for b in msg.content]
    counted = c.messages.count_tokens(
        model=kw["model"], system=kw["system"], messages=kw["messages"], tools=kw["tools"]
    )
    assert counted.input_tokens == msg.usage.input_tokens
