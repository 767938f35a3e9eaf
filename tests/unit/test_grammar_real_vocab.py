"""Forced tool calls with a real vocabulary and chat template: a tiny random Llama over
Qwen3's tokenizer (151,669 tokens, lm_head padded to 151,936 as Qwen3's is), through the
scheduler. The text the grammar forces must read back as a Qwen3 (Hermes) tool call."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.sampler import SamplingParams
from ds4pool.output.constraints import parse_tools
from ds4pool.output.detect import detect_tool_format
from ds4pool.output.tool_grammar import tool_call_spec
from ds4pool.sched.request import Request
from tests.real_tokenizers import real_tokenizer_dir
from tests.tiny_vocab_model import tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "pattern": "^[a-z/]{1,10}$"},
                    "lines": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["path", "lines"],
            },
        },
    },
    {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object"}}},
]
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    # lm_head wider than the tokenizer's 151,669 ids, as Qwen3's: padding ids never allowed
    loaded = tiny_model(real_tokenizer_dir("qwen3"), vocab_size=151936)
    e = Engine(EngineConfig(kv_device_gb=0.02), loaded=loaded)
    yield e
    e.close()


def test_forced_calls_parse_as_qwen3_tool_calls(engine: Engine) -> None:
    tok = engine.tokenizer
    assert detect_tool_format(tok.chat_template_text(), ()) == "hermes"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "show me main.py"}], tools=TOOLS, enable_thinking=False
    )
    tools = parse_tools(TOOLS)
    is_token = lambda s: tok.token_to_id(s) is not None  # noqa: E731
    params = {t.name: t.parameters for t in tools}
    for name, parallel, seed in ((None, True, 1), ("read_file", False, 2), (None, False, 3)):
        spec = tool_call_spec("hermes", tools, is_token, name=name, parallel=parallel)
        req = Request(
            prompt_text=prompt,
            max_tokens=120,
            sampling=SamplingParams(temperature=1.0, seed=seed),
            constraint=engine.compile_constraint(spec),
        )
        text, ids, final = engine.submit(req).collect(timeout=300)
        assert final.finish_reason == "stop", text
        # the markers are the template's own single tokens, as a trained model writes them
        assert ids[0] == tok.token_to_id("<tool_call>")
        calls = [json.loads(body) for body in CALL.findall(text)]
        assert calls and CALL.sub("", text).strip() == ""
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            assert call["name"] == (name or call["name"]) and call["name"] in params
            jsonschema.validate(call["arguments"], params[call["name"]])
