"""A Codex-style tool round trip over POST /v1/responses: the scripted model replies with a
Qwen3-format tool call through the real engine and Qwen3's real tokenizer and template; the
output processor turns it into a `function_call` item; the tool's output gets the answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from ds4pool.model.loader import LoadedModel
from tests.integration.conftest import Server, scripted_qwen3

LS_CALL = '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>'
RULES = [
    # the turn after the tool ran: its output is in the prompt
    {"match": r"<tool_response>\nREADME.md", "reply": "The directory holds README.md and src."},
    {"match": "list the files", "reply": LS_CALL},
    {"match": "look inside src", "reply": f"<think>\nI should run ls.\n</think>\n\n{LS_CALL}"},
    {"match": "judge it", "reply": '{"verdict": "ok", "score": 7}'},
    {"match": "say hi", "reply": "hi there"},
]
VERDICT = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["ok", "bad"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["verdict", "score"],
    "additionalProperties": False,
}
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


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    # Overrides conftest's demo model for this module's `serve` fixture.
    return scripted_qwen3(tmp_path_factory.mktemp("rules"), RULES)


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def request(**kw: Any) -> dict[str, Any]:
    return dict(
        model="m",
        instructions="You are Codex.",
        tools=[SHELL_TOOL, {"type": "web_search"}],
        tool_choice="auto",
        parallel_tool_calls=False,
        store=False,
        **kw,
    )


def test_function_call_then_its_output_gets_the_answer(server: Server) -> None:
    c = client(server)
    items = [user("list the files")]
    first = c.responses.create(input=items, **request(prompt_cache_key="codex-tools-1"))
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "shell" and call.status == "completed"
    assert json.loads(call.arguments) == {"command": ["ls"]}
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    assert first.output_text == ""

    items += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "README.md\nsrc\n"},
    ]
    second = c.responses.create(input=items, **request(prompt_cache_key="codex-tools-1"))
    assert second.output_text == "The directory holds README.md and src."
    assert [o.type for o in second.output] == ["message"]
    assert first.usage is not None and second.usage is not None
    # the first turn (prompt and call) is the prefix of the second: its KV is reused
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_streamed_function_call_matches_the_whole_one(server: Server) -> None:
    c = client(server)
    whole = c.responses.create(input=[user("list the files")], **request())
    events = list(c.responses.create(input=[user("list the files")], stream=True, **request()))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.output_text.delta" not in kinds  # the call's markup is no text
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-2].item
    assert done.type == "function_call" and done.arguments == deltas
    assert json.loads(deltas) == json.loads(whole.output[0].arguments)  # type: ignore[union-attr]
    assert events[-1].response.output[0].name == "shell"  # type: ignore[union-attr]


def test_reasoning_comes_back_as_a_reasoning_item(server: Server) -> None:
    c = client(server)
    r = c.responses.create(input=[user("look inside src")], **request())
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    reasoning = r.output[0]
    assert reasoning.content is not None  # type: ignore[union-attr]
    assert reasoning.content[0].text.strip() == "I should run ls."  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(c.responses.create(input=[user("look inside src")], stream=True, **request()))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text.strip() == "I should run ls."


def test_text_format_json_schema_is_honoured(server: Server) -> None:
    c = client(server)
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    kw: dict[str, Any] = dict(model="m", text={"format": fmt}, max_output_tokens=60)
    r = c.responses.create(input=[user("judge it")], **kw)
    assert json.loads(r.output_text) == {"verdict": "ok", "score": 7}
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    # a reply that is no JSON at all is bent into the schema by the grammar
    bent = c.responses.create(input=[user("say hi")], **kw)
    value = json.loads(bent.output_text)
    assert value["verdict"] in ("ok", "bad") and 0 <= value["score"] <= 10
    events = list(c.responses.create(input=[user("judge it")], stream=True, **kw))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text


def test_tool_choice_required_and_named_force_a_call(server: Server) -> None:
    c = client(server)
    kw = request(max_output_tokens=80)
    assert c.responses.create(input=[user("say hi")], **kw).output_text == "hi there"
    for choice in ("required", {"type": "function", "name": "shell"}):
        kw["tool_choice"] = choice
        r = c.responses.create(input=[user("say hi")], **kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "shell", (choice, r.output)
        assert isinstance(json.loads(calls[0].arguments), dict)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": VERDICT}}}, "text.format.name"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [SHELL_TOOL]},
         "tool_choice"),
    ],
)  # fmt: skip
def test_constraints_it_cannot_honour_are_400s(
    server: Server, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        server.url + "/v1/responses", json={"model": "m", "input": "hi", **body}, timeout=30
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
