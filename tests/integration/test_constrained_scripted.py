"""A grammar lets a well-formed reply through unchanged: the scripted model (its reply is
fixed by a rule) with Qwen3's tokenizer writes a real Qwen3 tool call and a JSON answer;
constrained by tool_choice / response_format, the client gets exactly those texts. A reply
that breaks the grammar is bent into it instead (the grammar wins over the model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from ds4pool.model.loader import LoadedModel, load_model
from tests.integration.conftest import Server
from tests.real_tokenizers import real_tokenizer_dir

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/main.py"}}\n</tool_call>'
ANSWER = '{"verdict": "ok", "score": 7}'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
VERDICT = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["ok", "bad"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["verdict", "score"],
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    rules = [
        {"match": "open main", "reply": CALL},
        {"match": "judge it", "reply": ANSWER},
        {"match": "say hi", "reply": "hi there"},
    ]
    path = Path(tmp_path_factory.mktemp("scripted")) / "rules.json"
    path.write_text(json.dumps(rules))
    return load_model(
        f"scripted:{path}",
        torch.device("cpu"),
        torch.float32,
        tokenizer_dir=real_tokenizer_dir("qwen3"),
    )


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def chat(server: Server, text: str, **kw: Any) -> Any:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args: dict[str, Any] = {"max_tokens": 60, "temperature": 0, **kw}
    return c.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": text}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **args,
    ).choices[0]


def test_valid_replies_pass_unchanged(server: Server) -> None:
    free = chat(server, "open main", tools=TOOLS)
    forced = chat(server, "open main", tools=TOOLS, tool_choice="required")
    if forced.message.tool_calls:  # once the output parsers land
        [call] = forced.message.tool_calls
        assert call.function.name == "read_file"
        assert json.loads(call.function.arguments) == {"path": "src/main.py"}
        assert [c.function.arguments for c in free.message.tool_calls] == [call.function.arguments]
    else:
        assert forced.message.content == free.message.content == CALL
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}
    answer = chat(server, "judge it", response_format=fmt)
    assert answer.message.content == ANSWER and answer.finish_reason == "stop"


def test_invalid_reply_is_bent_into_the_grammar(server: Server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}
    r = chat(server, "say hi", response_format=fmt, max_tokens=200)
    value = json.loads(r.message.content)  # not "hi there": the grammar decides
    assert value["verdict"] in ("ok", "bad") and isinstance(value["score"], int)
