"""A tool round trip in the prompt: assistant calls and tool results, from OpenAI and from
Anthropic requests, rendered through the real Qwen3 template (and a template that joins the
arguments as text, as DeepSeek-V3's does)."""

from __future__ import annotations

import json

import tokenizers

from ds4pool.api.anthropic import to_chat
from ds4pool.api.schemas import AnthropicMessage
from ds4pool.model.tokenizer import Tokenizer
from ds4pool.output.processor import OutputConfig, build_processor
from tests.real_tokenizers import real_tokenizer_dir
from tests.unit.output_helpers import calls_of, check_contract, feed_chunks, token_chunks

ARGS = {"city": "Paris", "note": 'ünï "q"'}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": '
    + json.dumps(ARGS, ensure_ascii=False)
    + "}\n</tool_call>"
)


def openai_history(arguments: object) -> list[dict]:
    return [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]


def test_qwen3_renders_openai_and_anthropic_round_trips_alike() -> None:
    tok = Tokenizer.from_dir(real_tokenizer_dir("qwen3"))
    as_string = tok.apply_chat_template(openai_history(json.dumps(ARGS)), tools=TOOLS)
    as_object = tok.apply_chat_template(openai_history(ARGS), tools=TOOLS)
    anthropic_msgs = [
        AnthropicMessage("user", "weather in Paris?"),
        AnthropicMessage(
            "assistant",
            [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS}],
        ),
        AnthropicMessage(
            "user",
            [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"}],
        ),
    ]
    from_anthropic = tok.apply_chat_template(to_chat(None, anthropic_msgs), tools=TOOLS)
    assert as_string == as_object == from_anthropic
    assert "<|im_start|>assistant\n" + CALL_TEXT + "<|im_end|>" in as_string
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in as_string
    # what the model wrote is what the prompt shows next turn: the parser reads it back
    proc = build_processor(OutputConfig(), tok, tools=TOOLS, prompt_text=as_string)
    msg = check_contract(feed_chunks(proc, token_chunks(tok, CALL_TEXT)))
    assert calls_of(msg) == [("get_weather", ARGS)]


def test_templates_that_join_arguments_as_text_get_json() -> None:
    backend = tokenizers.Tokenizer.from_file(str(real_tokenizer_dir("qwen3") / "tokenizer.json"))
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ 'ARGS:' + c.function.arguments + ';' }}{{ c.function.arguments | tojson }}"
        "{% endfor %}{% endfor %}"
    )
    tok = Tokenizer(
        backend, special_tokens={}, eos_token_ids=[], chat_templates={"default": template}
    )
    out = tok.apply_chat_template(openai_history(json.dumps(ARGS)), add_generation_prompt=False)
    expected = json.dumps(ARGS, ensure_ascii=False)
    assert out == f"ARGS:{expected};{expected}"
