"""Session routes: a client's own sessions under /v1/sessions, every tenant's under /admin.

Every call into the pool runs in a worker thread: they take the pool lock (held by the step
thread during tier moves) and evict / drop / flush may copy KV or write snapshots."""

from __future__ import annotations

import hmac
from dataclasses import asdict
from typing import Any

import anyio
from litestar import Request as HttpRequest
from litestar import Router, delete, get, post
from litestar.params import FromPath, Parameter

from ds4pool.api.common import api_state, authenticate
from ds4pool.api.errors import ApiError
from ds4pool.api.schemas import EvictRequest
from ds4pool.kv.session import SessionInfo, SessionNotFoundError, validate_session_id

TIERS = ("device", "ram", "disk", "none")


def _public(info: SessionInfo) -> dict[str, Any]:
    return asdict(info)


@get("/v1/sessions")
async def own_sessions(request: HttpRequest) -> dict[str, Any]:
    state = api_state(request)
    tenant = authenticate(request, state)
    engine = state.ready_engine()
    sessions = await anyio.to_thread.run_sync(lambda: engine.pool.list_sessions(tenant.name))
    return {"object": "list", "data": [_public(i) for i in sessions]}


@delete("/v1/sessions/{session_id:str}", status_code=200)
async def end_own_session(request: HttpRequest, session_id: FromPath[str]) -> dict[str, Any]:
    state = api_state(request)
    tenant = authenticate(request, state)
    engine = state.ready_engine()
    validate_session_id(session_id)
    # another tenant's id is simply not found
    await anyio.to_thread.run_sync(engine.pool.drop, tenant.name, session_id)
    return {"id": session_id, "object": "session", "deleted": True}


def require_admin(request: HttpRequest) -> None:
    token = api_state(request).cfg.admin_token
    if not token:
        raise ApiError(403, "the admin API is disabled (start the server with --admin-token)")
    auth = request.headers.get("authorization") or ""
    presented = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), presented.encode()):
        raise ApiError(401, "admin token required (Authorization: Bearer ...)")


async def _info(request: HttpRequest, tenant: str, session_id: str) -> SessionInfo:
    pool = api_state(request).ready_engine().pool
    info = await anyio.to_thread.run_sync(pool.get, tenant, session_id)
    if info is None:
        raise SessionNotFoundError(f"no session {session_id!r} for tenant {tenant!r}")
    return info


@get("/sessions")
async def admin_list(
    request: HttpRequest,
    tenant: str | None = None,
    tier: str | None = None,
    limit: int = Parameter(default=100, ge=1, le=1000),
    offset: int = Parameter(default=0, ge=0),
) -> dict[str, Any]:
    require_admin(request)
    if tier is not None and tier not in TIERS:
        raise ApiError(400, f"tier must be one of {', '.join(TIERS)}", param="tier")
    pool = api_state(request).ready_engine().pool
    sessions = await anyio.to_thread.run_sync(pool.list_sessions, tenant, tier)
    page = sessions[offset : offset + limit]
    return {
        "object": "list",
        "total": len(sessions),
        "offset": offset,
        "data": [_public(i) for i in page],
    }


@get("/sessions/{tenant:str}/{session_id:str}")
async def admin_show(
    request: HttpRequest, tenant: FromPath[str], session_id: FromPath[str]
) -> dict[str, Any]:
    require_admin(request)
    return _public(await _info(request, tenant, session_id))


@post("/sessions/{tenant:str}/{session_id:str}/evict", status_code=200)
async def admin_evict(
    request: HttpRequest, tenant: FromPath[str], session_id: FromPath[str], data: EvictRequest
) -> dict[str, Any]:
    require_admin(request)
    if data.to not in ("ram", "disk"):
        raise ApiError(400, "'to' must be 'ram' or 'disk'", param="to")
    pool = api_state(request).ready_engine().pool
    return _public(await anyio.to_thread.run_sync(pool.evict, tenant, session_id, data.to))


@delete("/sessions/{tenant:str}/{session_id:str}", status_code=200)
async def admin_drop(
    request: HttpRequest, tenant: FromPath[str], session_id: FromPath[str]
) -> dict[str, Any]:
    require_admin(request)
    await anyio.to_thread.run_sync(api_state(request).ready_engine().pool.drop, tenant, session_id)
    return {"tenant": tenant, "id": session_id, "deleted": True}


@post("/sessions/{tenant:str}/{session_id:str}/pin", status_code=200)
async def admin_pin(
    request: HttpRequest, tenant: FromPath[str], session_id: FromPath[str]
) -> dict[str, Any]:
    require_admin(request)
    pool = api_state(request).ready_engine().pool
    return _public(await anyio.to_thread.run_sync(pool.set_pinned, tenant, session_id, True))


@post("/sessions/{tenant:str}/{session_id:str}/unpin", status_code=200)
async def admin_unpin(
    request: HttpRequest, tenant: FromPath[str], session_id: FromPath[str]
) -> dict[str, Any]:
    require_admin(request)
    pool = api_state(request).ready_engine().pool
    return _public(await anyio.to_thread.run_sync(pool.set_pinned, tenant, session_id, False))


@get("/pool")
async def admin_pool(request: HttpRequest) -> dict[str, Any]:
    require_admin(request)
    engine = api_state(request).ready_engine()
    sched = engine.scheduler
    usage = await anyio.to_thread.run_sync(engine.pool.usage)
    return {
        **asdict(usage),
        "queue_depth": len(sched.queue),
        "queue_depth_by_priority": {str(k): v for k, v in sched.queue.depth_by_priority().items()},
        "running_requests": len(sched.running),
    }


@post("/flush", status_code=200)
async def admin_flush(request: HttpRequest) -> dict[str, Any]:
    require_admin(request)
    written = await anyio.to_thread.run_sync(api_state(request).ready_engine().pool.flush)
    return {"flushed": written}


admin_router = Router(
    path="/admin",
    route_handlers=[
        admin_list,
        admin_show,
        admin_evict,
        admin_drop,
        admin_pin,
        admin_unpin,
        admin_pool,
        admin_flush,
    ],
)
