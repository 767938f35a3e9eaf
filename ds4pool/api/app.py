"""The Litestar application: routes, error handlers, and the engine's lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from litestar import HttpMethod, Litestar, Response, get, route
from litestar import Request as HttpRequest
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig

from ds4pool import __version__
from ds4pool.api import anthropic, openai, responses
from ds4pool.api.body import ApiRequest
from ds4pool.api.common import ApiState, api_state
from ds4pool.api.config import ServerConfig
from ds4pool.api.errors import handle_exception
from ds4pool.api.prefixes import prefix_router
from ds4pool.api.prompt_limit import PromptLimit
from ds4pool.api.sessions import admin_router, end_own_session, own_sessions, require_admin
from ds4pool.engine import Engine
from ds4pool.machine import cpu_topology

log = logging.getLogger("ds4pool.api")


@get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@route("/", http_method=[HttpMethod.GET, HttpMethod.HEAD])
async def root() -> dict[str, str]:
    """Clients probe the base URL before their first request (Claude Code sends HEAD /)."""
    return {"status": "ok", "name": "ds4pool", "version": __version__}


@get("/ready")
async def ready(request: HttpRequest) -> Response:
    """Readiness: the model is loaded and the server is not draining."""
    state = api_state(request)
    ok = state.engine is not None and not state.draining
    status = "ready" if ok else ("draining" if state.draining else "loading")
    return Response({"status": status}, status_code=200 if ok else 503)


@get("/metrics", media_type="text/plain; version=0.0.4; charset=utf-8")
async def metrics_endpoint(request: HttpRequest) -> Response:
    state = api_state(request)
    if state.cfg.metrics_auth:
        require_admin(request)
    if state.metrics is None:
        return Response(b"", media_type="text/plain")
    # render takes the pool lock, which a demotion may hold during a snapshot write
    body, content_type = await anyio.to_thread.run_sync(state.metrics.render, state.engine)
    return Response(body, media_type=content_type.removesuffix("; charset=utf-8"))


def startup_summary(state: ApiState, engine: Engine) -> str:
    cfg, loaded, usage = state.cfg, engine.loaded, engine.pool.usage()
    gb = 1 << 30
    disk = (
        f"{usage.disk_budget_bytes / gb:.1f} GB in {cfg.engine.kv_disk_dir}"
        if (cfg.engine.kv_disk_dir)
        else "off"
    )
    cpu_threads = ""
    if loaded.device.type == "cpu":
        n = engine.cpu_threads or 0
        topo = cpu_topology()  # two logical CPUs may be one core's two hardware threads
        where = f"; {topo['cores']} cores, {topo['logical_cpus']} logical CPUs" if topo else ""
        probe = f", {engine.thread_probe.describe()}" if engine.thread_probe else ""
        cpu_threads = f" ({n} thread{'s' * (n != 1)}{probe}{where})"
    return (
        f"ds4pool {__version__}: model {state.model_name} ({loaded.config.architecture}) on "
        f"{loaded.device} {str(loaded.dtype).removeprefix('torch.')}{cpu_threads}; KV device "
        f"{engine.runner.kv_bytes / gb:.2f} GB ({engine.runner.num_blocks} blocks of "
        f"{engine.runner.block_size}), RAM {usage.ram_budget_bytes / gb:.1f} GB, disk {disk}; "
        f"batching {'off' if cfg.engine.no_batching else 'on'}; auth "
        f"{'on' if cfg.auth_enabled else 'off'}; admin {'on' if cfg.admin_token else 'off'}"
    )


def build_engine(cfg: ServerConfig, metrics: Any) -> Engine:
    return Engine(
        cfg.engine,
        pool_observer=metrics.pool_observer() if metrics else None,
        sched_observer=metrics.scheduler_observer() if metrics else None,
    )


def create_app(
    cfg: ServerConfig,
    engine: Engine | None = None,
    *,
    metrics: Any = None,
    own_engine: bool = True,
) -> Litestar:
    """Build the app. Without `engine`, the lifespan loads one (the server is live but not
    ready meanwhile). The engine is closed at shutdown when `own_engine`."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        state: ApiState = app.state.api
        state.metrics = metrics
        ready = (
            engine
            if engine is not None
            else await anyio.to_thread.run_sync(build_engine, cfg, metrics)
        )
        state.prompt_limit = await anyio.to_thread.run_sync(
            PromptLimit.of, ready.tokenizer, ready.runner.max_model_len
        )
        state.engine = ready
        log.info("%s", startup_summary(state, state.engine))
        try:
            yield
        finally:
            state.draining = True
            if own_engine and state.engine is not None:
                log.info("shutting down: finishing requests and flushing sessions to disk")
                await anyio.to_thread.run_sync(state.engine.close)

    state = ApiState(cfg=cfg, model_name=cfg.served_model_name or cfg.engine.model)
    return Litestar(
        route_handlers=[
            health,
            ready,
            metrics_endpoint,
            root,
            openai.list_models,
            openai.get_model,
            openai.chat_completions,
            openai.completions,
            responses.create_response,
            responses.stored_response,
            anthropic.messages,
            anthropic.count_tokens,
            own_sessions,
            end_own_session,
            admin_router,
            prefix_router,
        ],
        lifespan=[lifespan],
        state=State({"api": state}),
        exception_handlers={Exception: handle_exception},
        request_max_body_size=int(cfg.max_body_mb * (1 << 20)),
        request_class=ApiRequest,  # large bodies are decoded off the event loop
        openapi_config=OpenAPIConfig(title="ds4pool", version=__version__),
        logging_config=None,  # `ds4pool serve` configures logging (--log-level)
        debug=False,
    )
