"""Pinned prefixes under /admin/prefixes: a system prompt that a tenant's sessions share and
that stays on the device whatever the pressure (as pinned sessions do).

Pinning computes the prefix at once when its blocks are not on the device (one request
without a session), so the first agent that uses it already finds it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import anyio
from litestar import Request as HttpRequest
from litestar import Router, delete, get, post
from litestar.params import FromPath

from ds4pool.api.common import api_state
from ds4pool.api.errors import ApiError
from ds4pool.api.schemas import PinPrefixRequest
from ds4pool.api.sessions import require_admin
from ds4pool.engine import Engine


def _prefix_tokens(engine: Engine, data: PinPrefixRequest) -> list[int]:
    """The prefix's token ids, tokenized as the scheduler tokenizes prompt text."""
    tok = engine.tokenizer
    if data.messages is not None:
        text = tok.apply_chat_template(data.messages, add_generation_prompt=False)
    else:
        assert data.text is not None
        text = data.text
    return list(tok.encode(text, add_special_tokens=False))


@post("/", status_code=200)
async def pin_prefix(request: HttpRequest, data: PinPrefixRequest) -> dict[str, Any]:
    require_admin(request)
    if (data.text is None) == (data.messages is None):
        raise ApiError(400, "give exactly one of 'text' or 'messages'", param="text")
    if not data.tenant or len(data.tenant) > 128:
        raise ApiError(400, "'tenant' must be 1-128 characters", param="tenant")
    engine = api_state(request).ready_engine()
    ids = await anyio.to_thread.run_sync(_prefix_tokens, engine, data)
    info = await anyio.to_thread.run_sync(engine.pin_prefix, data.tenant, ids)
    return asdict(info)


@get("/")
async def list_prefixes(request: HttpRequest) -> dict[str, Any]:
    require_admin(request)
    pool = api_state(request).ready_engine().pool
    infos = await anyio.to_thread.run_sync(pool.pinned_prefixes)
    return {"object": "list", "data": [asdict(i) for i in infos]}


@get("/{prefix_id:str}")
async def show_prefix(request: HttpRequest, prefix_id: FromPath[str]) -> dict[str, Any]:
    require_admin(request)
    pool = api_state(request).ready_engine().pool
    return asdict(await anyio.to_thread.run_sync(pool.prefix, prefix_id))


@delete("/{prefix_id:str}", status_code=200)
async def unpin_prefix(request: HttpRequest, prefix_id: FromPath[str]) -> dict[str, Any]:
    require_admin(request)
    pool = api_state(request).ready_engine().pool
    info = await anyio.to_thread.run_sync(pool.unpin_prefix, prefix_id)
    return {**asdict(info), "unpinned": True}


prefix_router = Router(
    path="/admin/prefixes", route_handlers=[pin_prefix, list_prefixes, show_prefix, unpin_prefix]
)
