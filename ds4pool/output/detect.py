"""Which tool-call and reasoning formats a model speaks, read from its chat template and its
added tokens. The grammar-constrained decoder makes the same choice, so it lives here alone."""

from __future__ import annotations

from collections.abc import Container

TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "qwen3_coder", "none")
REASONING_FORMATS = ("think", "none")


def detect_tool_format(chat_template: str | None, vocab: Container[str] = frozenset()) -> str:
    """The tool-call format of a model: one of TOOL_FORMATS ("none" when nothing matches).

    `vocab` holds the model's token strings (its added tokens suffice: every format's marker
    is one: `Tokenizer.added_tokens`); the template is the source text of its chat template(s)
    (`Tokenizer.chat_template_text()`). The output processor chooses its parser with this, so
    anything that makes the model write calls (a grammar) must choose the same way."""
    chat_template = chat_template or ""

    def has(marker: str) -> bool:
        return marker in vocab or marker in chat_template

    if has("<｜tool▁calls▁begin｜>"):
        return "deepseek_v3"
    if has("[TOOL_CALLS]"):
        return "mistral"
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"  # Qwen3-Coder: XML calls inside <tool_call>
    if has("<tool_call>"):
        return "hermes"
    if has("<|python_tag|>") or ('"parameters"' in chat_template and "<|eot_id|>" in chat_template):
        return "llama3_json"
    return "none"


def detect_reasoning_format(chat_template: str, vocab: Container[str]) -> str:
    """ "think" when the model has `<think>` blocks (a token or in its template), else "none"."""
    return "think" if "<think>" in vocab or "<think>" in chat_template else "none"
