"""The OpenAI and Anthropic renderers on processor deltas, checked against the official SDKs'
own types (the SDK integration tests drive them through a real server)."""

from __future__ import annotations

import json

import pydantic
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from ds4pool.api.anthropic_output import BlockEvents, content_blocks, stop_reason
from ds4pool.api.openai_output import chat_message, chunk_deltas, finish_reason
from ds4pool.output.message import assemble
from ds4pool.output.processor import OutputProcessor
from ds4pool.output.reasoning import ThinkSplitter
from ds4pool.output.tools import PARSERS, Calls
from tests.unit.output_helpers import feed_chunks

TEXT = (
    "<think>\nPlan: call both.\n</think>\n\nOn it.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "x.md"}}\n</tool_call>'
)


def deltas(chunks: list[str]) -> list:
    calls = Calls(frozenset({"get_weather", "read_file"}))
    proc = OutputProcessor(ThinkSplitter(), PARSERS["hermes"](calls))
    return feed_chunks(proc, chunks)


def test_openai_message_and_stream() -> None:
    msg = assemble(deltas([TEXT]))
    assert msg.finish is not None and finish_reason(msg.finish.reason) == "tool_calls"
    m = ChatCompletionMessage.model_validate(chat_message(msg))
    assert (
        m.content == "On it.\n" and (m.model_extra or {})["reasoning_content"] == "Plan: call both."
    )
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []] == [
        ("get_weather", {"city": "Lima"}),
        ("read_file", {"path": "x.md"}),
    ]
    only_calls = assemble(deltas([TEXT.replace("On it.\n", "")]))
    assert chat_message(only_calls)["content"] is None
    # the stream, as a client accumulates it
    args: dict[int, str] = {}
    for delta in chunk_deltas(deltas(list(TEXT))):
        d = ChoiceDelta.model_validate(delta)
        for tc in d.tool_calls or []:
            if tc.index not in args:
                assert tc.id and tc.function and tc.function.name
                args[tc.index] = ""
            args[tc.index] += (tc.function.arguments or "") if tc.function else ""
    assert [json.loads(a) for a in args.values()] == [{"city": "Lima"}, {"path": "x.md"}]


def test_anthropic_blocks_and_events() -> None:
    msg = assemble(deltas([TEXT]))
    assert msg.finish is not None
    reason, _ = stop_reason(msg.finish.reason, msg.finish.stop_string)
    body = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": content_blocks(msg),
        "stop_reason": reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    m = Message.model_validate(body)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert m.stop_reason == "tool_use" and m.content[2].input == {"city": "Lima"}  # type: ignore[union-attr]
    blocks = BlockEvents()
    events = blocks.events(deltas(list(TEXT)))
    blocks.close(events)
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    parsed = [adapter.validate_python({"type": name, **payload}) for name, payload in events]
    starts = [e for e in parsed if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert [e.index for e in starts] == [0, 1, 2, 3]
    partial = "".join(
        e.delta.partial_json
        for e in parsed
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta" and e.index == 3
    )
    assert json.loads(partial) == {"path": "x.md"}
    assert [e.type for e in parsed].count("content_block_stop") == 4


def test_empty_message_has_one_empty_text_block() -> None:
    assert content_blocks(assemble(deltas([]))) == [{"type": "text", "text": ""}]
