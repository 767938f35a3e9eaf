"""The output processor on real model output: text tokenized by the real Qwen3, Llama-3.1 and
DeepSeek-V3 tokenizers and decoded id by id as the scheduler does, reasoning and tool calls."""

from __future__ import annotations

import json

import pytest

from ds4pool.model.tokenizer import Tokenizer
from ds4pool.output.deltas import ReasoningDelta, TextDelta, ToolCallStart
from ds4pool.output.detect import detect_reasoning_format, detect_tool_format
from ds4pool.output.processor import OutputConfig, build_processor
from tests.real_tokenizers import real_tokenizer_dir
from tests.unit.output_helpers import calls_of, check_contract, feed_chunks, text_of, token_chunks

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
]
AUTO = OutputConfig()


def real(name: str) -> Tokenizer:
    return Tokenizer.from_dir(real_tokenizer_dir(name))


def test_auto_detection_from_real_templates_and_tokens() -> None:
    found = {}
    for name in ("qwen3", "deepseek_v3", "llama3_1", "gptoss"):
        tok = real(name)
        template, vocab = tok.chat_template_text(), tok.added_tokens
        found[name] = (
            detect_tool_format(template, vocab),
            detect_reasoning_format(template, vocab),
        )
    assert found["qwen3"] == ("hermes", "think")
    assert found["deepseek_v3"] == ("deepseek_v3", "none")
    # this Llama 3 tokenizer has neither <|python_tag|> nor a tools template: explicit flag
    assert found["llama3_1"] == ("none", "none")
    assert detect_tool_format("", {"<|python_tag|>"}) == "llama3_json"
    assert detect_tool_format("", {"[TOOL_CALLS]"}) == "mistral"
    coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>\n"  # Qwen3-Coder's
    assert detect_tool_format(coder, {"<tool_call>"}) == "qwen3_coder"


def test_qwen3_reasoning_then_two_tool_calls() -> None:
    tok = real("qwen3")
    args = [{"city": "Paris"}, {"path": "src/main.py"}]
    text = "<think>\nThe user wants the weather and a file.\n</think>\n\n" + "".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>\n'
        for n, a in zip(("get_weather", "read_file"), args)
    )
    proc = build_processor(AUTO, tok, tools=TOOLS, prompt_text="<|im_start|>assistant\n")
    chunks = token_chunks(tok, text)
    deltas = feed_chunks(proc, chunks)
    msg = check_contract(deltas)
    assert msg.reasoning == "The user wants the weather and a file."
    assert calls_of(msg) == [("get_weather", args[0]), ("read_file", args[1])]
    assert msg.text == ""
    assert msg.finish is not None and msg.finish.reason == "tool_calls"
    # reasoning streamed before any call, in several pieces
    kinds = [type(d).__name__ for d in deltas]
    assert kinds.index("ToolCallStart") > max(
        i for i, k in enumerate(kinds) if k == "ReasoningDelta"
    )
    assert sum(isinstance(d, ReasoningDelta) for d in deltas) > 3


def test_qwen3_prompt_that_opened_think_and_disabled_thinking() -> None:
    tok = real("qwen3")
    messages = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(messages, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    proc = build_processor(AUTO, tok, tools=None, prompt_text=off)
    msg = check_contract(feed_chunks(proc, token_chunks(tok, "Hello there.")))
    assert (msg.text, msg.reasoning) == ("Hello there.", None)
    # a template that ends the prompt inside <think> (DeepSeek-R1, Qwen3 thinking-2507)
    proc = build_processor(AUTO, tok, tools=None, prompt_text="<|im_start|>assistant\n<think>\n")
    msg = check_contract(feed_chunks(proc, token_chunks(tok, "Hmm, a greeting.\n</think>\n\nHi!")))
    assert (msg.text, msg.reasoning) == ("Hi!", "Hmm, a greeting.")


def test_no_tools_offered_means_no_parsing() -> None:
    tok = real("qwen3")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    proc = build_processor(OutputConfig(reasoning_parser="none"), tok, tools=None, prompt_text="")
    deltas = feed_chunks(proc, token_chunks(tok, text))
    assert text_of(deltas) == text and not any(isinstance(d, ToolCallStart) for d in deltas)


def test_plain_text_passes_through_unchanged() -> None:
    tok = real("qwen3")
    text = "  Some answer <b>bold</b> with < and </ and <th in it.\n\n"
    for tools in (None, TOOLS):
        proc = build_processor(
            OutputConfig(reasoning_parser="none"), tok, tools=tools, prompt_text=""
        )
        deltas = feed_chunks(proc, token_chunks(tok, text))
        assert text_of(deltas) == text
        assert all(isinstance(d, TextDelta) for d in deltas[:-1])


def test_deepseek_v3_calls_through_its_tokenizer() -> None:
    tok = real("deepseek_v3")
    text = (
        "Looking it up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n"
        '{"path": "a.txt"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    chunks = token_chunks(tok, text)
    assert "".join(chunks) == text  # the markers survive decoding
    proc = build_processor(AUTO, tok, tools=TOOLS, prompt_text="")
    msg = check_contract(feed_chunks(proc, chunks))
    assert msg.text == "Looking it up."
    assert calls_of(msg) == [("get_weather", {"city": "Tokyo"}), ("read_file", {"path": "a.txt"})]


def test_llama3_python_tag_survives_decoding_but_eos_does_not() -> None:
    import tokenizers

    path = real_tokenizer_dir("llama3_1") / "tokenizer.json"
    backend = tokenizers.Tokenizer.from_file(str(path))
    backend.add_special_tokens(["<|python_tag|>"])  # special, as in Llama 3.1's own file
    tok = Tokenizer(backend, special_tokens={}, eos_token_ids=[], chat_templates={})
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>'
    chunks = token_chunks(tok, text)
    assert "".join(chunks) == text.removesuffix("<|eot_id|>")
    proc = build_processor(
        OutputConfig(tool_parser="llama3_json"), tok, tools=TOOLS, prompt_text=""
    )
    msg = check_contract(feed_chunks(proc, chunks))
    assert calls_of(msg) == [("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("bad", ["bogus", ""])
def test_output_config_rejects_unknown_parsers(bad: str) -> None:
    with pytest.raises(ValueError, match="tool_parser"):
        OutputConfig(tool_parser=bad)
    with pytest.raises(ValueError, match="reasoning_parser"):
        OutputConfig(reasoning_parser=bad)
