"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from litestar import Request as HttpRequest
from litestar import Response, get, post
from litestar.response import Stream

from ds4pool.api.common import (
    SESSION_HEADER,
    ApiState,
    Generation,
    api_state,
    authenticate,
    check_max_tokens,
    collect,
    finish,
    priority_of,
    replay,
    sampling_from,
    session_id_of,
    sse,
    start,
)
from ds4pool.api.config import TenantConfig
from ds4pool.api.constraints import chat_constraint, completion_constraint
from ds4pool.api.errors import ApiError
from ds4pool.api.openai_output import chat_message, chunk_deltas, finish_reason
from ds4pool.api.prompt import off_loop, render_prompt, template_kwargs
from ds4pool.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from ds4pool.errors import ContextLengthError
from ds4pool.output.message import assemble
from ds4pool.output.processor import OutputProcessor, build_processor
from ds4pool.sched.request import Event, Request

ROLES = ("system", "developer", "user", "assistant", "tool")


@get("/v1/models")
async def list_models(request: HttpRequest) -> dict[str, Any]:
    state = api_state(request)
    authenticate(request, state)
    return {
        "object": "list",
        "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "ds4pool"}],
    }


@get("/v1/models/{model_id:path}")
async def get_model(request: HttpRequest, model_id: str) -> dict[str, Any]:
    state = api_state(request)
    authenticate(request, state)
    model_id = model_id.removeprefix("/")  # a path parameter: served names may hold "/"
    if model_id != state.model_name:
        raise ApiError(
            404, f"model {model_id!r} is not served here", param="model", code="model_not_found"
        )
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "ds4pool"}


def _unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported", param="n")
    if body.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported", param="best_of")
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 16 or any(not s for s in stops):
        raise ApiError(400, "stop must be up to 16 non-empty strings", param="stop")
    return tuple(stops)


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    if m.role not in ROLES:
        raise ApiError(
            400,
            f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
            param=f"messages[{i}].role",
        )
    out: dict[str, Any] = {"role": m.role}
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise ApiError(
                    400,
                    f"messages[{i}]: content part type {part.type!r} is not supported (text only)",
                    param=f"messages[{i}].content",
                )
            texts.append(part.text)
        out["content"] = "".join(texts)
    else:
        out["content"] = m.content or ""
    for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        value = getattr(m, name)
        if value is not None:
            out[name] = value
    return out


def _sampling_request(
    body: ChatCompletionRequest | CompletionRequest,
    request: HttpRequest,
    state: ApiState,
    tenant: TenantConfig,
    endpoint: str,
    max_tokens: int | None,
    **prompt: Any,
) -> Request:
    engine = state.ready_engine()
    _unsupported(body)
    req = Request(
        tenant=tenant.name,
        session_id=session_id_of(request),
        sampling=sampling_from(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
        ),
        max_tokens=check_max_tokens(
            max_tokens, engine, "max_completion_tokens" if endpoint == "chat" else "max_tokens"
        ),
        stop=_stop(body.stop),
        ignore_eos=body.ignore_eos,
        priority=priority_of(request, body.priority, tenant),
        endpoint=endpoint,
        **prompt,
    )
    return req


def _headers(req: Request) -> dict[str, str]:
    return {SESSION_HEADER: req.session_id} if req.session_id else {}


def _usage(final: Event) -> dict[str, Any]:
    u = final.usage
    assert u is not None
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _usage_chunk(state: ApiState, rid: str, kind: str, created: int, final: Event) -> bytes:
    """The last chunk of a stream with stream_options.include_usage: no choices, usage."""
    body = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": state.model_name,
        "choices": [],
        "usage": _usage(final),
    }
    return sse(json.dumps(body))


def _finish_reason(final: Event) -> str:
    return "length" if final.finish_reason == "length" else "stop"


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: HttpRequest, data: ChatCompletionRequest) -> Response | Stream:
    state = api_state(request)
    tenant = authenticate(request, state)
    if not data.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    engine = state.ready_engine()
    extra = template_kwargs(data.chat_template_kwargs)
    prompt_text = await render_prompt(
        engine.tokenizer,
        state.limit(),
        lambda: [_message(m, i) for i, m in enumerate(data.messages)],
        data.tools,
        extra,
    )
    proc = build_processor(
        state.cfg.output,
        engine.tokenizer,
        tools=None if data.tool_choice == "none" else data.tools,
        prompt_text=prompt_text,
    )
    req = _sampling_request(
        data,
        request,
        state,
        tenant,
        "chat",
        data.max_completion_tokens or data.max_tokens,
        prompt_text=prompt_text,
    )
    req.constraint = await chat_constraint(engine, data, prompt_text)
    gen = await start(request, state, req, tenant)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        chunks = _chat_chunks(state, gen, proc, rid, created, include_usage)
        return Stream(chunks, media_type="text/event-stream", headers=_headers(req))
    text, final = await collect(state, gen)
    msg = assemble(proc.feed(text) + proc.finish(final.finish_reason or "stop", final.stop_string))
    assert msg.finish is not None
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "choices": [
            {
                "index": 0,
                "message": chat_message(msg),
                "logprobs": None,
                "finish_reason": finish_reason(msg.finish.reason),
            }
        ],
        "usage": _usage(final),
    }
    return Response(body, headers=_headers(req))


async def _chat_chunks(
    state: ApiState,
    gen: Generation,
    proc: OutputProcessor,
    rid: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish_reason: str | None) -> bytes:
        return sse(
            json.dumps(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": state.model_name,
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": finish_reason,
                        }
                    ],
                }
            )
        )

    final: Event | None = None
    try:
        yield chunk({"role": "assistant", "content": ""}, None)
        reason = "stop"
        async for event in replay(gen):
            deltas = proc.feed(event.text)
            if event.finished and not event.error:
                deltas += proc.finish(event.finish_reason or "stop", event.stop_string)
                reason = finish_reason(deltas[-1].reason)  # type: ignore[union-attr]
            for delta in chunk_deltas(deltas):
                yield chunk(delta, None)
            if event.finished:
                final = event
                break
        assert final is not None
        if final.error:
            yield sse(
                json.dumps(
                    {
                        "error": {
                            "message": "inference failed",
                            "type": "server_error",
                            "param": None,
                            "code": "inference_error",
                        }
                    }
                )
            )
        else:
            yield chunk({}, reason)
            if include_usage:
                yield _usage_chunk(state, rid, "chat.completion.chunk", created, final)
        yield sse("[DONE]")
    finally:
        finish(state, gen, final)


@post("/v1/completions", status_code=200)
async def completions(request: HttpRequest, data: CompletionRequest) -> Response | Stream:
    state = api_state(request)
    tenant = authenticate(request, state)
    prompt = data.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "a list of several prompts is not supported", param="prompt")
        prompt = prompt[0]
    if data.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    limit = state.limit()
    if isinstance(prompt, list):
        if len(prompt) >= limit.limit:  # before looking at each of them
            raise ContextLengthError(
                f"prompt has {len(prompt)} tokens; the model's context is {limit.limit}"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
    else:
        await off_loop(partial(limit.check, state.ready_engine().tokenizer, prompt))
    kw = {"prompt_text": prompt} if isinstance(prompt, str) else {"prompt_ids": list(prompt)}
    req = _sampling_request(data, request, state, tenant, "completions", data.max_tokens, **kw)
    if req.max_tokens == state.ready_engine().runner.max_model_len and data.max_tokens is None:
        req.max_tokens = 16  # OpenAI's default for legacy completions
    req.constraint = await completion_constraint(state.ready_engine(), data)
    gen = await start(request, state, req, tenant)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(
            _completion_chunks(state, gen, rid, created, include_usage),
            media_type="text/event-stream",
            headers=_headers(req),
        )
    text, final = await collect(state, gen)
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(final)}
        ],
        "usage": _usage(final),
    }
    return Response(body, headers=_headers(req))


async def _completion_chunks(
    state: ApiState, gen: Generation, rid: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    final: Event | None = None

    def chunk(text: str, finish_reason: str | None) -> bytes:
        return sse(
            json.dumps(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": state.model_name,
                    "choices": [
                        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
                    ],
                }
            )
        )

    try:
        async for event in replay(gen):
            if event.finished:
                final = event
                if not event.error:
                    yield chunk(event.text, _finish_reason(event))
                break
            if event.text:
                yield chunk(event.text, None)
        if final is not None and include_usage and not final.error:
            yield _usage_chunk(state, rid, "text_completion", created, final)
        yield sse("[DONE]")
    finally:
        finish(state, gen, final)
