"""Chat messages → prompt text with the model's chat template, off the event loop.

Agents put system messages in the middle of a conversation (Claude Code's reminders) and
send OpenAI's "developer" role. Templates differ: some render a later system message in
place, some raise, some drop it silently. A system message is kept where it stands when the
template renders it there, since that keeps the prompt a growing prefix (the session's KV
is reused); otherwise it is merged into the leading system prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio

from ds4pool.errors import ChatTemplateError
from ds4pool.model.tokenizer import Tokenizer

T = TypeVar("T")


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text for `messages` (roles system, developer, user, assistant, tool)."""
    messages = [_as_system(m) for m in messages]
    kwargs = dict(extra or {})
    later = [m for m in messages[1:] if m.get("role") == "system"]
    if not later:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, **kwargs
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, **kwargs
        )
        if all(str(m.get("content") or "") in text for m in later):
            return text
    except ChatTemplateError:
        pass  # the template refuses a system message there: merge it instead
    return tokenizer.apply_chat_template(
        merge_system(messages), add_generation_prompt=True, tools=tools, **kwargs
    )


def merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message's text joined (blank line apart) into one leading system message."""
    system = [str(m.get("content") or "") for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if system else rest


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    # OpenAI's "developer" is its newer name for the system role; most templates drop it
    if message.get("role") == "developer":
        return {**message, "role": "system"}
    return message


async def off_loop(fn: Callable[[], T]) -> T:
    """`fn()` in a worker thread. Converting a request's messages and rendering them grow with
    the conversation: a 30k-token prompt must not stall every other stream on the event loop.
    What `fn` raises (an ApiError naming a field) is raised here."""
    return await anyio.to_thread.run_sync(fn)


async def render_prompt(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """render_chat in a worker thread."""
    return await off_loop(partial(render_chat, tokenizer, messages, tools, extra))


async def count_prompt_tokens(tokenizer: Tokenizer, text: str) -> int:
    """The number of tokens of rendered prompt text, counted in a worker thread."""
    return len(await off_loop(partial(tokenizer.encode, text, add_special_tokens=False)))
