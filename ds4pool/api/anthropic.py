"""Anthropic-compatible routes: POST /v1/messages (with streaming) and count_tokens."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request as HttpRequest
from litestar import Response, post
from litestar.response import Stream

from ds4pool.api.anthropic_output import BlockEvents, content_blocks, stop_reason
from ds4pool.api.common import (
    SESSION_HEADER,
    ApiState,
    Generation,
    api_state,
    authenticate,
    check_max_tokens,
    collect,
    priority_of,
    replay,
    sampling_from,
    session_id_of,
    sse,
    start,
)
from ds4pool.api.common import finish as finish_request
from ds4pool.api.constraints import messages_constraint
from ds4pool.api.errors import ApiError
from ds4pool.api.prompt import checked, count_prompt_tokens, off_loop, render_chat
from ds4pool.api.schemas import AnthropicMessage, CountTokensRequest, MessagesRequest
from ds4pool.output.deltas import Finish
from ds4pool.output.message import assemble
from ds4pool.output.processor import OutputProcessor, build_processor
from ds4pool.sched.request import Event, Request

log = logging.getLogger("ds4pool.api")


def _text_of(blocks: str | list[Any], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, block in enumerate(blocks):
        if isinstance(block, str):  # a bare string in a tool_result's content list is text
            parts.append(block)
            continue
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise ApiError(400, f"{where}[{i}]: only text blocks are supported here")
        parts.append(block["text"])
    return "".join(parts)


def to_chat(
    system: str | list[dict[str, Any]] | None, messages: list[AnthropicMessage]
) -> list[dict[str, Any]]:
    """Anthropic messages → chat-template messages (system, user, assistant, tool)."""
    if not messages:
        raise ApiError(400, "messages: at least one message is required")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        if m.role == "system":  # Claude Code's mid-conversation reminders (see api/prompt.py)
            out.append({"role": "system", "content": _text_of(m.content, f"messages[{i}].content")})
            continue
        if m.role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be 'user', 'assistant' or 'system'")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {
                            "name": block.get("name"),
                            "arguments": block.get("input", {}),
                        },
                    }
                )
            elif kind == "tool_result" and m.role == "user":
                content = block.get("content", "")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id"),
                        "content": _text_of(content, f"messages[{i}].content[{j}].content")
                        if isinstance(content, (str, list))
                        else str(content),
                    }
                )
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not re-fed to the model
            else:
                raise ApiError(
                    400,
                    f"messages[{i}].content[{j}]: block type {kind!r} is not "
                    f"supported for role {m.role!r}",
                )
        if text or calls or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions → the OpenAI-style shape chat templates expect. Server
    tools (web_search_20250305, code_execution_..., ...) run on Anthropic's side, not here:
    they are dropped with a log line rather than shown to the model as functions."""
    if not tools:
        return None
    out, dropped = [], []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ApiError(400, f"tools[{i}]: a tool needs a name")
        if t.get("type") not in (None, "custom"):
            dropped.append(str(t.get("type")))
            continue
        function = {
            "name": t["name"],
            "description": t.get("description", ""),
            "parameters": t.get("input_schema", {}),
        }
        out.append({"type": "function", "function": function})
    if dropped:
        log.info("messages: dropped server tools ds4pool cannot run: %s", ", ".join(dropped))
    return out or None


async def _render(
    state: ApiState,
    system: Any,
    messages: list[AnthropicMessage],
    tools: list[dict[str, Any]] | None,
    thinking: dict[str, Any] | None = None,
) -> str:
    tokenizer = state.ready_engine().tokenizer
    extra = {}
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        # templates with a thinking switch (Qwen3) read it as enable_thinking
        extra["enable_thinking"] = thinking["type"] == "enabled"

    limit = state.limit()

    def render() -> str:
        text = render_chat(tokenizer, to_chat(system, messages), _tools(tools), extra)
        return checked(limit, tokenizer, text)

    return await off_loop(render)


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: HttpRequest, data: CountTokensRequest) -> dict[str, int]:
    state = api_state(request)
    authenticate(request, state)
    text = await _render(state, data.system, data.messages, data.tools)
    tokenizer = state.ready_engine().tokenizer
    return {"input_tokens": await count_prompt_tokens(tokenizer, state.limit(), text)}


def _usage(final: Event) -> dict[str, int]:
    u = final.usage
    assert u is not None
    # Anthropic counts cache reads apart from input_tokens
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    }


@post("/v1/messages", status_code=200)
async def messages(request: HttpRequest, data: MessagesRequest) -> Response | Stream:
    state = api_state(request)
    tenant = authenticate(request, state)
    engine = state.ready_engine()
    if data.temperature is not None and not 0.0 <= data.temperature <= 1.0:
        raise ApiError(400, "temperature must be in [0, 1]")
    stops = tuple(data.stop_sequences or ())
    if any(not s for s in stops):
        raise ApiError(400, "stop_sequences must be non-empty strings")
    prompt_text = await _render(state, data.system, data.messages, data.tools, data.thinking)
    offered = None if (data.tool_choice or {}).get("type") == "none" else _tools(data.tools)
    proc = build_processor(
        state.cfg.output, engine.tokenizer, tools=offered, prompt_text=prompt_text
    )
    req = Request(
        tenant=tenant.name,
        session_id=session_id_of(request),
        prompt_text=prompt_text,
        sampling=sampling_from(temperature=data.temperature, top_p=data.top_p, top_k=data.top_k),
        max_tokens=check_max_tokens(data.max_tokens, engine, "max_tokens"),
        stop=stops,
        priority=priority_of(request, data.priority, tenant),
        endpoint="messages",
        constraint=await messages_constraint(engine, data, prompt_text),
    )
    gen = await start(request, state, req, tenant)
    mid = f"msg_{uuid.uuid4().hex}"
    headers = {SESSION_HEADER: req.session_id} if req.session_id else {}
    if data.stream:
        events = _events(state, gen, proc, mid)
        return Stream(events, media_type="text/event-stream", headers=headers)
    text, final = await collect(state, gen)
    msg = assemble(proc.feed(text) + proc.finish(final.finish_reason or "stop", final.stop_string))
    assert msg.finish is not None
    reason, seq = stop_reason(msg.finish.reason, msg.finish.stop_string)
    body = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": state.model_name,
        "content": content_blocks(msg),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": _usage(final),
    }
    return Response(body, headers=headers)


async def _events(
    state: ApiState, gen: Generation, proc: OutputProcessor, mid: str
) -> AsyncIterator[bytes]:
    def event(name: str, payload: dict[str, Any]) -> bytes:
        return sse(json.dumps({"type": name, **payload}), event=name)

    final: Event | None = None
    blocks = BlockEvents()
    pinged = False
    assert gen.first is not None
    # the engine reports the prompt's counts with the first token (Claude Code reads them here)
    first_usage = _usage(gen.first) if gen.first.usage else {"input_tokens": 0, "output_tokens": 0}
    try:
        yield event(
            "message_start",
            {
                "message": {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": state.model_name,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": first_usage,
                }
            },
        )
        async for ev in replay(gen):
            deltas = proc.feed(ev.text)
            if ev.finished and not ev.error:
                deltas += proc.finish(ev.finish_reason or "stop", ev.stop_string)
            for name, payload in blocks.events(deltas):
                yield event(name, payload)
                if not pinged:  # the official order: the first block's start, then a ping
                    pinged = True
                    yield event("ping", {})
            if ev.finished:
                final = ev
                break
        assert final is not None
        if final.error:
            yield event("error", {"error": {"type": "api_error", "message": "inference failed"}})
            return
        tail: list[tuple[str, dict[str, Any]]] = []
        blocks.ensure_block(tail)
        blocks.close(tail)
        for name, payload in tail:
            yield event(name, payload)
        finish = deltas[-1]
        assert isinstance(finish, Finish)
        reason, seq = stop_reason(finish.reason, finish.stop_string)
        yield event(
            "message_delta",
            {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": _usage(final)},
        )
        yield event("message_stop", {})
    finally:
        finish_request(state, gen, final)
