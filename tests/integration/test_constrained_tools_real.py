"""Forced tool calls through the official SDKs on a real server whose model speaks a real
tokenizer and chat template (a tiny random Llama over Qwen3's vocabulary): the grammar
writes Qwen3's own tool-call format, which parses back into the offered call."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from ds4pool.model.loader import LoadedModel
from tests.integration.conftest import Server
from tests.real_tokenizers import real_tokenizer_dir
from tests.tiny_vocab_model import tiny_model

PARAMS = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "maxLength": 10},
        "recursive": {"type": "boolean"},
    },
    "required": ["path", "recursive"],
}
TOOLS = [{"type": "function", "function": {"name": "list_files", "parameters": PARAMS}}]
MESSAGES = [{"role": "user", "content": "What is in src/?"}]
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:  # overrides the demo model for this module's servers
    return tiny_model(real_tokenizer_dir("qwen3"), vocab_size=151936)


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def parsed(message: Any) -> list[tuple[str, dict[str, Any]]]:
    if getattr(message, "tool_calls", None):  # structured once the output parsers land
        return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    text = message.content
    assert CALL.sub("", text).strip() == "", text
    return [(c["name"], c["arguments"]) for c in map(json.loads, CALL.findall(text))]


def test_openai_required_and_streamed(server: Server) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        seed=5,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    [(name, args)] = parsed(r.choices[0].message)
    assert name == "list_files"
    jsonschema.validate(args, PARAMS)
    chunks = [ch for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    parts = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []]
    assert "".join(p.function.name or "" for p in parts if p.function) == "list_files"
    streamed_args = "".join(p.function.arguments or "" for p in parts if p.function)
    assert json.loads(streamed_args) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_named_tool(server: Server) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = c.messages.create(
        model="tiny",
        max_tokens=120,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[{"name": "list_files", "input_schema": PARAMS}],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "list_files", "disable_parallel_tool_use": True},
    )
    blocks = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and blocks
    if blocks:
        calls = [(b.name, b.input) for b in blocks]
    else:
        text = "".join(b.text for b in msg.content if b.type == "text")
        assert CALL.sub("", text).strip() == "", text
        calls = [(x["name"], x["arguments"]) for x in map(json.loads, CALL.findall(text))]
    assert len(calls) == 1 and calls[0][0] == "list_files"
    jsonschema.validate(calls[0][1], PARAMS)
