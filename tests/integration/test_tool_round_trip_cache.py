"""A session keeps its KV across a tool round trip (Qwen3's real template, the scripted model).

A turn answers with a tool call (after a thinking block); the client sends the call back
re-serialized by the template, without the thinking, plus the tool result. The server must
reuse the session's KV up to where the re-rendered prompt truly diverges from what it holds,
also when earlier replies were sampled as non-canonical tokens ("Hel" + "lo", as real models
do), which re-tokenizing the diverged prompt would not reproduce.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import openai
import pytest
import torch

from ds4pool.kv.match import common_prefix_len
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.tokenizer import Tokenizer
from tests.integration.conftest import Server
from tests.real_tokenizers import real_tokenizer_dir

CALL = {"name": "write_file", "arguments": {"path": "notes.txt", "text": "buy milk"}}
THINKING = "<think>\nThe user wants a note; the write_file tool does that.\n</think>\n\n"
TOOL_CALL_TEXT = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
GREETING = "Hello, world!"
RULES = [
    {"match": "<tool_response>\\nwritten", "reply": "The note is saved in notes.txt."},
    {"match": "write a note", "reply": THINKING + TOOL_CALL_TEXT},
    {"match": "Say hello", "reply_ids": []},  # filled in with a non-canonical split
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                "required": ["path", "text"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    qwen3 = real_tokenizer_dir("qwen3")
    tok = Tokenizer.from_dir(qwen3)
    split = tok.encode("Hel", add_special_tokens=False) + tok.encode(
        GREETING[3:], add_special_tokens=False
    )
    assert tok.decode(split) == GREETING
    assert split != tok.encode(GREETING, add_special_tokens=False)
    RULES[-1]["reply_ids"] = split
    rules = tmp_path_factory.mktemp("rules") / "rules.json"
    rules.write_text(json.dumps(RULES))
    return load_model(f"scripted:{rules}", torch.device("cpu"), torch.float32, tokenizer_dir=qwen3)


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve({"kv_device_gb": 0.01})


def prompt_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    # as the server renders them: a missing content is ""
    messages = [{**m, "content": m.get("content") or ""} for m in messages]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
    return tok.encode(text, add_special_tokens=False)


def tool_call_of(message: openai.types.chat.ChatCompletionMessage) -> dict:
    """The call as the client sends it back: the structured tool call when the server
    parsed one, else the one written in the text (a client that parses it itself)."""
    if message.tool_calls:
        call = message.tool_calls[0]
        return {"id": call.id, "type": "function", "function": call.function.model_dump()}
    body = (message.content or "").split("<tool_call>")[1].split("</tool_call>")[0]
    parsed = json.loads(body)
    function = {"name": parsed["name"], "arguments": json.dumps(parsed["arguments"])}
    return {"id": "call_1", "type": "function", "function": function}


def client(server: Server, session: str) -> openai.OpenAI:
    headers = {"X-Session-Id": session}
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="x", max_retries=0, default_headers=headers
    )


SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 40}
ASK = {"role": "user", "content": "Please write a note: buy milk."}


def test_tool_round_trip_reuses_the_kv_up_to_the_divergence(
    server: Server, loaded: LoadedModel
) -> None:
    tok = loaded.tokenizer
    c = client(server, "tool-trip")
    msgs: list[dict] = [SYSTEM, ASK]
    first = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    call = tool_call_of(first.choices[0].message)
    assert call["function"]["name"] == "write_file"
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]

    held = prompt_ids(tok, msgs) + tok.encode(THINKING + TOOL_CALL_TEXT, add_special_tokens=False)
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "written"},
    ]
    second = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    assert second.choices[0].message.content == "The note is saved in notes.txt."

    turn2 = prompt_ids(tok, msgs)
    common = common_prefix_len(turn2, held)
    details = second.usage.prompt_tokens_details
    assert details is not None
    print(
        f"\nturn 1: {first.usage.prompt_tokens} prompt + {first.usage.completion_tokens} output; "
        f"turn 2: {second.usage.prompt_tokens} prompt, common prefix {common}, "
        f"cached {details.cached_tokens}"
    )
    assert second.usage.prompt_tokens == len(turn2)
    assert details.cached_tokens >= common >= first.usage.prompt_tokens - 5


def test_reuse_survives_non_canonical_tokens_in_earlier_turns(server: Server) -> None:
    """Turn 1's reply was sampled as non-canonical tokens; turn 2's tool call is sent back
    without its thinking. The KV of everything up to turn 2's reply is still reused."""
    c = client(server, "tool-trip-2")
    msgs: list[dict] = [SYSTEM, {"role": "user", "content": "Say hello."}]
    first = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    assert first.choices[0].message.content == GREETING
    msgs += [{"role": "assistant", "content": GREETING}, ASK]
    second = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= first.usage.prompt_tokens
    call = tool_call_of(second.choices[0].message)
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "written"},
    ]
    third = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    assert third.choices[0].message.content == "The note is saved in notes.txt."
    details = third.usage.prompt_tokens_details
    assert details is not None
    print(
        f"\nturn 2: {second.usage.prompt_tokens} prompt; turn 3: {third.usage.prompt_tokens} "
        f"prompt, cached {details.cached_tokens}"
    )
    # Re-tokenizing turn 3's prompt whole would match only up to "Hel" in turn 1's reply.
    assert details.cached_tokens >= second.usage.prompt_tokens
