"""OpenAI Responses API: POST /v1/responses (with streaming), as Codex CLI uses it.

ds4pool keeps no response objects: the conversation lives in the session's KV, and each
request carries the whole `input` (Codex sends `store: false`). The session is X-Session-Id,
else Codex's `session_id` header, else `prompt_cache_key`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from litestar import HttpMethod, Response, post, route
from litestar import Request as HttpRequest
from litestar.response import Stream

from ds4pool.api.common import (
    SESSION_HEADER,
    ApiState,
    Generation,
    api_state,
    authenticate,
    check_max_tokens,
    fail,
    finish,
    priority_of,
    replay,
    sampling_from,
    session_id_of,
    sse,
    start,
)
from ds4pool.api.constraints import responses_constraint
from ds4pool.api.errors import ApiError
from ds4pool.api.prompt import checked, off_loop, render_chat
from ds4pool.api.prompt_limit import PromptLimit
from ds4pool.api.responses_input import bad, to_messages, to_tools
from ds4pool.api.responses_output import Json, ResponseRenderer, new_id
from ds4pool.api.schemas import ResponsesRequest
from ds4pool.kv.session import InvalidSessionIdError, validate_session_id
from ds4pool.model.tokenizer import Tokenizer
from ds4pool.output.processor import OutputProcessor, build_processor
from ds4pool.sched.request import Event, Request

CODEX_SESSION_HEADERS = ("session_id", "session-id")


@post("/v1/responses", status_code=200)
async def create_response(request: HttpRequest, data: ResponsesRequest) -> Response | Stream:
    state = api_state(request)
    tenant = authenticate(request, state)
    _refuse_unsupported(data)
    engine = state.ready_engine()
    session_id = _session_id(request, data)
    prompt = partial(_prompt, engine.tokenizer, state.limit(), data)
    tools, offered, prompt_text = await off_loop(prompt)
    req = Request(
        tenant=tenant.name,
        session_id=session_id,
        prompt_text=prompt_text,
        sampling=sampling_from(temperature=data.temperature, top_p=data.top_p, top_k=None),
        max_tokens=check_max_tokens(data.max_output_tokens, engine, "max_output_tokens"),
        priority=priority_of(request, data.priority, tenant),
        endpoint="responses",
    )
    # text.format json_schema / json_object, tool_choice required / a named function,
    # parallel_tool_calls false: grammar-constrained decoding (400s name the field)
    req.constraint = await responses_constraint(
        engine,
        (data.text or {}).get("format"),
        data.tool_choice,
        offered,
        data.parallel_tool_calls,
        prompt_text,
    )
    processor = build_processor(
        state.cfg.output, engine.tokenizer, tools=offered, prompt_text=prompt_text
    )
    renderer = ResponseRenderer(
        _skeleton(state, data, tools),
        parallel_tool_calls=data.parallel_tool_calls is not False,
        keeps_kv=req.session_id is not None,
    )
    gen = await start(request, state, req, tenant)
    headers = {SESSION_HEADER: req.session_id} if req.session_id else {}
    if data.stream:
        events = _stream(state, gen, processor, renderer)
        return Stream(events, media_type="text/event-stream", headers=headers)
    final: Event | None = None
    async for _, event in _run(gen, processor, renderer):
        final = event
    assert final is not None and final.finished
    if final.error:
        fail(state, gen, final)
    finish(state, gen, final)
    renderer.complete(final.usage)
    return Response(renderer.response, headers=headers)


@route("/v1/responses/{response_id:str}", http_method=[HttpMethod.GET, HttpMethod.DELETE])
async def stored_response(request: HttpRequest, response_id: str) -> None:
    """Retrieval and deletion of stored responses: there are none (`store` is accepted, but
    ds4pool keeps the conversation as session KV, not as response objects)."""
    authenticate(request, api_state(request))
    raise ApiError(
        404,
        f"response {response_id!r} not found: ds4pool stores no responses",
        param="response_id",
        code="response_not_found",
    )


def _prompt(
    tokenizer: Tokenizer, limit: PromptLimit, data: ResponsesRequest
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None, str]:
    """(the function tools, those offered to the model, the prompt text); in a worker thread.
    tool_choice "none" offers none: the model is not told about tools it may not call."""
    messages = to_messages(data.instructions, data.input)
    tools = to_tools(data.tools)
    offered = None if data.tool_choice == "none" else tools
    return tools, offered, checked(limit, tokenizer, render_chat(tokenizer, messages, offered))


def _refuse_unsupported(data: ResponsesRequest) -> None:
    """Fields ds4pool cannot honour: a 400 naming the field, never silently ignored."""
    if data.previous_response_id is not None:
        raise bad(
            "previous_response_id",
            "ds4pool stores no responses; send the whole conversation in input",
        )
    if data.conversation is not None:
        raise bad("conversation", "ds4pool stores no conversations; send them in input")
    if data.background:
        raise bad("background", "background responses are not supported")
    if data.prompt is not None:
        raise bad("prompt", "stored prompt templates are not supported")
    if data.truncation not in (None, "disabled"):
        raise bad("truncation", "only truncation 'disabled' is supported")
    if data.text is not None and not isinstance(data.text.get("format", {}), dict):
        raise bad("text.format", "text.format must be an object")


def _session_id(request: HttpRequest, data: ResponsesRequest) -> str | None:
    """X-Session-Id wins, then Codex's session_id header, then prompt_cache_key."""
    found = session_id_of(request)
    if found is not None:
        return found
    candidates = [(h, request.headers.get(h)) for h in CODEX_SESSION_HEADERS]
    candidates.append(("prompt_cache_key", data.prompt_cache_key))
    for name, raw in candidates:
        if raw is None:
            continue
        try:
            return validate_session_id(raw)
        except InvalidSessionIdError as exc:
            raise ApiError(400, f"{name}: {exc}", param=name, code="invalid_session_id") from None
    return None


def _skeleton(state: ApiState, data: ResponsesRequest, tools: Any) -> Json:
    """The Response object's fields that echo the request."""
    return {
        "id": new_id("resp"),
        "created_at": int(time.time()),
        "model": state.model_name,
        "instructions": data.instructions,
        "max_output_tokens": data.max_output_tokens,
        "metadata": data.metadata,
        "parallel_tool_calls": data.parallel_tool_calls is not False,
        "previous_response_id": None,
        "prompt_cache_key": data.prompt_cache_key,
        "reasoning": data.reasoning,
        "store": bool(data.store),
        "temperature": data.temperature,
        "top_p": data.top_p,
        "text": {"format": {"type": "text"}, **(data.text or {})},
        "tool_choice": data.tool_choice or "auto",
        # the function tools as the client sent them (flat); dropped types are not echoed
        "tools": [t for t in data.tools or [] if t.get("type") == "function"] if tools else [],
        "truncation": "disabled",
        "user": data.user,
    }


async def _run(
    gen: Generation, processor: OutputProcessor, renderer: ResponseRenderer
) -> AsyncIterator[tuple[list[Json], Event]]:
    """Each engine event through the processor and the renderer: (stream events, the engine
    event); the last one is the finished event."""
    async for event in replay(gen):
        deltas = processor.feed(event.text)
        if event.finished:
            reason = "error" if event.error else (event.finish_reason or "stop")
            deltas += processor.finish(reason, event.stop_string)
        yield renderer.feed(deltas, len(event.token_ids)), event
        if event.finished:
            return


async def _stream(
    state: ApiState, gen: Generation, processor: OutputProcessor, renderer: ResponseRenderer
) -> AsyncIterator[bytes]:
    final: Event | None = None
    try:
        for e in renderer.start():
            yield _sse(e)
        async for events, event in _run(gen, processor, renderer):
            for e in events:
                yield _sse(e)
            final = event if event.finished else None
        assert final is not None
        error = "inference failed; see the server log" if final.error else None
        for e in renderer.complete(final.usage, error):
            yield _sse(e)
    finally:
        finish(state, gen, final)


def _sse(event: Json) -> bytes:
    return sse(json.dumps(event), event=event["type"])
