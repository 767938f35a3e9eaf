"""Chat messages → prompt text with the model's chat template, off the event loop.

Agents put system messages in the middle of a conversation (Claude Code's reminders) and
send OpenAI's "developer" role. Templates differ: some render a later system message in
place, some raise, some drop it silently. A system message is kept where it stands when the
template renders it there, since that keeps the prompt a growing prefix (the session's KV
is reused); otherwise it is merged into the leading system prompt.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import jinja2.defaults

from ds4pool.api.errors import ApiError
from ds4pool.api.prompt_limit import PromptLimit
from ds4pool.errors import ChatTemplateError
from ds4pool.model.tokenizer import Tokenizer

T = TypeVar("T")

# Names a chat_template_kwargs key may not take: what ds4pool itself passes to the template
# (or as a keyword of apply_chat_template / jinja's render(self, ...)), jinja's globals and
# the names jinja gives meaning to inside a template. Anything else is the template's own
# variable (enable_thinking, reasoning_effort, ...).
RESERVED_TEMPLATE_NAMES = frozenset(
    {"self", "messages", "tools", "documents", "add_generation_prompt"}
    | {"raise_exception", "strftime_now", "loop", "caller", "varargs", "kwargs", "super"}
    | set(jinja2.defaults.DEFAULT_NAMESPACE)
)
PARAM = "chat_template_kwargs"


def template_kwargs(raw: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, checked: each key a template variable name (an
    identifier, not reserved, not private). A 400 names the first bad key."""
    extra = dict(raw or {})
    for key in extra:
        if not key.isidentifier() or keyword.iskeyword(key) or key.startswith("_"):
            raise ApiError(400, f"{PARAM}: {key[:64]!r} is not a variable name", param=PARAM)
        if key in RESERVED_TEMPLATE_NAMES:
            raise ApiError(400, f"{PARAM} cannot set {key!r}", param=PARAM)
    return extra


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text for `messages` (roles system, developer, user, assistant, tool).
    `extra` are template variables (see template_kwargs)."""
    try:
        return _render(tokenizer, [_as_system(m) for m in messages], tools, dict(extra or {}))
    except TypeError as exc:
        if not extra:
            raise
        # a keyword the checks above do not know clashed with a parameter: the client's key
        raise ApiError(400, f"{PARAM}: {str(exc)[:200]}", param=PARAM) from None


def _render(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> str:
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
    limit: PromptLimit,
    messages: Callable[[], list[dict[str, Any]]],
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """render_chat of `messages()` (the request's conversion, which grows with it too) in a
    worker thread; ContextLengthError when the text cannot fit the context."""

    def render() -> str:
        return checked(limit, tokenizer, render_chat(tokenizer, messages(), tools, extra))

    return await off_loop(render)


def checked(limit: PromptLimit, tokenizer: Tokenizer, text: str) -> str:
    """`text`, after limit.check (blocking: in a worker thread)."""
    limit.check(tokenizer, text)
    return text


async def count_prompt_tokens(tokenizer: Tokenizer, limit: PromptLimit, text: str) -> int:
    """The number of tokens of rendered prompt text, counted in a worker thread once the
    text is known to fit the context (a longer one is a ContextLengthError)."""

    def count() -> int:
        return len(tokenizer.encode(checked(limit, tokenizer, text), add_special_tokens=False))

    return await off_loop(count)
