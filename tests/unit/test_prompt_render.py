"""Chat rendering of agents' request shapes with real chat templates: system messages in the
middle (Claude Code), the developer role (OpenAI), Responses items, many tools."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ds4pool.api.anthropic import _tools as anthropic_tools
from ds4pool.api.anthropic import to_chat
from ds4pool.api.prompt import merge_system, render_chat
from ds4pool.api.responses_input import to_messages, to_tools
from ds4pool.api.schemas import AnthropicMessage
from ds4pool.model.tokenizer import Tokenizer
from tests.real_tokenizers import real_tokenizer_dir

# the rule of Qwen3-Coder / Qwen3.5 style templates: one system message, first
STRICT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# a template that silently drops every system message but the first
DROPPING_TEMPLATE = (
    STRICT_TEMPLATE.replace(
        "{{- raise_exception('System message must be at the beginning.') -}}", ""
    )
    .replace(
        "{{- '<|im_start|>' + m.role",
        "{%- if m.role != 'system' or loop.first -%}{{- '<|im_start|>' + m.role",
    )
    .replace("<|im_end|>\\n' -}}", "<|im_end|>\\n' -}}{%- endif -%}", 1)
)

CONVERSATION = [
    {"role": "system", "content": "You are Claude Code."},
    {"role": "user", "content": "fix the bug"},
    {"role": "system", "content": "<system-reminder>todo list is empty</system-reminder>"},
    {"role": "assistant", "content": "Looking."},
    {"role": "user", "content": "go on"},
]


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    return Tokenizer.from_dir(real_tokenizer_dir("qwen3"))


def tokenizer_with(template: str, tmp_path: Path) -> Tokenizer:
    src = real_tokenizer_dir("qwen3")
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path)


def test_qwen3_keeps_a_middle_system_message_in_place(qwen3: Tokenizer) -> None:
    text = render_chat(qwen3, CONVERSATION)
    reminder = text.index("<|im_start|>system\n<system-reminder>")
    assert text.index("fix the bug") < reminder < text.index("Looking.")
    # the prompt grows as a prefix: the next turn's rendering starts with this one's
    longer = render_chat(qwen3, [*CONVERSATION, {"role": "assistant", "content": "Done."}])
    assert longer.startswith(text.removesuffix("<|im_start|>assistant\n"))


def test_a_template_that_refuses_it_gets_the_system_prompt_merged(tmp_path: Path) -> None:
    strict = tokenizer_with(STRICT_TEMPLATE, tmp_path)
    text = render_chat(strict, CONVERSATION)
    assert text.startswith(
        "<|im_start|>system\nYou are Claude Code.\n\n<system-reminder>todo list is empty"
    )
    assert text.count("<|im_start|>system") == 1 and text.endswith("<|im_start|>assistant\n")


def test_a_template_that_drops_it_gets_the_system_prompt_merged(tmp_path: Path) -> None:
    dropping = tokenizer_with(DROPPING_TEMPLATE, tmp_path)
    assert "todo list" not in dropping.apply_chat_template(CONVERSATION)  # the template's habit
    assert "todo list is empty" in render_chat(dropping, CONVERSATION)


def test_developer_is_rendered_as_system(qwen3: Tokenizer) -> None:
    msgs = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "hi"},
    ]
    assert "developer" not in qwen3.apply_chat_template(msgs)  # Qwen3 drops the role...
    assert render_chat(qwen3, msgs).startswith("<|im_start|>system\nAnswer in French.<|im_end|>")


def test_merge_system_joins_in_order() -> None:
    merged = merge_system(CONVERSATION)
    assert merged[0]["content"].endswith("todo list is empty</system-reminder>")
    assert [m["role"] for m in merged] == ["system", "user", "assistant", "user"]


def claude_code_tools(n: int) -> list[dict[str, Any]]:
    tools = [
        {
            "name": f"Tool{i}",
            "description": f"tool number {i}",
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
            "cache_control": {"type": "ephemeral"} if i == n - 1 else None,
        }
        for i in range(n)
    ]
    return [*tools, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]


def test_a_claude_code_request_renders_with_qwen3(qwen3: Tokenizer) -> None:
    system = [
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI."},
        {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}},
    ]
    messages = [
        AnthropicMessage("user", [{"type": "text", "text": "what is in src?"}]),
        AnthropicMessage("system", "<system-reminder>plan mode is off</system-reminder>"),
        AnthropicMessage(
            "assistant",
            [
                {"type": "thinking", "thinking": "I will list it.", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "Tool3", "input": {"path": "src"}},
            ],
        ),
        AnthropicMessage(
            "user",
            [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "main.py"}],
                },
                {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}},
            ],
        ),
    ]
    tools = anthropic_tools(claude_code_tools(40))
    assert tools is not None and len(tools) == 40  # the server tool is dropped
    text = render_chat(qwen3, to_chat(system, messages), tools)
    assert text.startswith("<|im_start|>system\nYou are Claude Code, Anthropic's official CLI.")
    assert text.count('{"type": "function", "function": {"name": "Tool') == 40
    assert "plan mode is off" in text and "web_search" not in text
    assert '<tool_call>\n{"name": "Tool3", "arguments": {"path": "src"}}\n</tool_call>' in text
    assert "<tool_response>\nmain.py\n</tool_response>" in text


def test_responses_items_render_with_qwen3(qwen3: Tokenizer) -> None:
    items = [
        {"role": "developer", "content": "Use the shell tool."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell",
         "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
    ]  # fmt: skip
    tools = to_tools([{"type": "function", "name": "shell", "parameters": {"type": "object"}}])
    text = render_chat(qwen3, to_messages("You are Codex.", items), tools)
    assert text.startswith("<|im_start|>system\nYou are Codex.\n\n# Tools")
    assert "<|im_start|>system\nUse the shell tool.<|im_end|>" in text
    # the model's own tool-call format, so that its next reply continues a known prefix
    assert '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>' in text
    assert "<think>\nr\n</think>" in text  # reasoning since the last user turn is shown
    assert text.endswith("<tool_response>\nREADME.md\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")  # fmt: skip
