"""Request bodies, as msgspec Structs: Litestar validates them and documents them in the
OpenAPI schema. Unknown fields are accepted (clients send many); fields we cannot honour
are rejected explicitly by the handlers, never silently ignored."""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct):
    """Fields shared by chat completions and completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: bool | int | None = None
    echo: bool | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    priority: int | None = None
    ignore_eos: bool = False
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, a one-string list, or token ids
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # as chat's (vLLM's extension)


class AnthropicMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]]


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    priority: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class EvictRequest(msgspec.Struct):
    to: str


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses. Items and tools stay plain dicts: their many types are checked
    one by one (ds4pool.api.responses_input) so that an error names the item's field."""

    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    priority: int | None = None


class PinPrefixRequest(msgspec.Struct, kw_only=True):
    """POST /admin/prefixes: a prefix (a system prompt) for a tenant's sessions to share.
    `text` is prompt text as the model sees it; `messages` are rendered by the chat template
    (without a generation prompt)."""

    tenant: str = "default"
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
