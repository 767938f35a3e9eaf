"""What every generation route shares: tenant and session routing, sampling parameters,
submission to the engine, the first-event check, cancellation on disconnect, logging."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import anyio
from litestar import Request as HttpRequest

from ds4pool.api.config import DEFAULT_TENANT, ServerConfig, TenantConfig
from ds4pool.api.errors import ApiError
from ds4pool.api.prompt_limit import PromptLimit
from ds4pool.engine import Engine
from ds4pool.kv.session import validate_session_id
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import Event, Request, RequestStream

log = logging.getLogger("ds4pool.api")

SESSION_HEADER = "x-session-id"
PRIORITY_HEADER = "x-priority"


@dataclass
class ApiState:
    """Lives on app.state.api; created by the lifespan, never a module global."""

    cfg: ServerConfig
    model_name: str
    engine: Engine | None = None  # None until the model is loaded
    prompt_limit: PromptLimit | None = None  # set with the engine
    metrics: Any = None  # ds4pool.metrics.Metrics when enabled
    draining: bool = False
    inflight: Counter[str] = field(default_factory=Counter)

    def ready_engine(self) -> Engine:
        if self.engine is None:
            raise ApiError(503, "the model is still loading", headers={"Retry-After": "5"})
        if self.draining:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        return self.engine

    def limit(self) -> PromptLimit:
        """The bound on prompts (set before the engine, so there is one once it is ready)."""
        assert self.prompt_limit is not None
        return self.prompt_limit


def api_state(request: HttpRequest) -> ApiState:
    return request.app.state.api  # type: ignore[no-any-return]


def authenticate(request: HttpRequest, state: ApiState) -> TenantConfig:
    """The caller's tenant. Without configured keys everything is tenant 'default'."""
    if not state.cfg.auth_enabled:
        return TenantConfig(DEFAULT_TENANT)
    presented = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        presented = auth[7:].strip()
    found: TenantConfig | None = None
    for key, tenant in state.cfg.api_keys.items():  # compare with every key: constant time
        if hmac.compare_digest(key.encode(), presented.encode()):
            found = tenant
    if found is None:
        raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
    return found


def session_id_of(request: HttpRequest) -> str | None:
    raw = request.headers.get(SESSION_HEADER)
    return None if raw is None else validate_session_id(raw)


def priority_of(request: HttpRequest, body: int | None, tenant: TenantConfig) -> int:
    """The request's priority: X-Priority, else the body's `priority`, else the tenant's.
    Lower runs first, and the tenant's configured priority is the best it may ask for: a
    request can lower its own priority, never raise it above its tenant's."""
    asked = body
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is not None:
        try:
            asked = int(raw)
        except ValueError:
            raise ApiError(400, "X-Priority must be an integer", param="X-Priority") from None
    return tenant.default_priority if asked is None else max(asked, tenant.default_priority)


def sampling_from(
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if min_p is None else min_p,
            presence_penalty=presence_penalty or 0.0,
            frequency_penalty=frequency_penalty or 0.0,
            seed=seed,
        )
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), param=field_name) from None


def check_max_tokens(value: int | None, engine: Engine, param: str) -> int:
    limit = engine.runner.max_model_len
    if value is None:
        return limit  # as much as the context allows
    if value < 1:
        raise ApiError(400, f"{param} must be >= 1", param=param)
    if value > limit:
        raise ApiError(
            400, f"{param}={value} exceeds the model's context of {limit} tokens", param=param
        )
    return value


@dataclass
class Generation:
    """A submitted request whose first event has arrived without an error."""

    stream: RequestStream
    events: AsyncIterator[Event]
    started: float
    tenant: str
    endpoint: str
    first: Event | None = None
    ttft: float | None = None


async def start(
    request: HttpRequest, state: ApiState, req: Request, tenant: TenantConfig
) -> Generation:
    """Submit and wait for the first event, so that a request that cannot run gets a
    proper 4xx instead of a stream that ends in an error."""
    engine = state.ready_engine()
    limit = tenant.max_concurrent
    if limit and state.inflight[tenant.name] >= limit:
        raise ApiError(
            429,
            f"tenant already has {limit} requests in flight",
            code="too_many_requests",
            headers={"Retry-After": "1"},
        )
    if state.cfg.request_timeout_s:
        req.deadline = time.monotonic() + state.cfg.request_timeout_s
    started = time.monotonic()
    req.received = getattr(request, "received_at", None)
    if engine.shares_store and req.session_id is not None:
        # lease and store look-up: small file I/O, off the event loop
        await anyio.to_thread.run_sync(engine.open_session, req.tenant, req.session_id)
    stream = engine.submit(req)  # QueueFullError → 429 via the exception handler
    state.inflight[tenant.name] += 1
    gen = Generation(stream, _events(stream, request), started, tenant.name, req.endpoint)
    try:
        gen.first = await gen.events.__anext__()
    except BaseException:
        stream.cancel()
        finish(state, gen, None)
        raise
    taken = time.monotonic()
    gen.ttft = taken - started
    if engine.trace is not None:  # --trace-steps
        engine.trace.first_event(req.request_id, stream.first_pushed, taken)
    if gen.first.error is not None:
        fail(state, gen, gen.first)
    return gen


def fail(state: ApiState, gen: Generation, final: Event) -> NoReturn:
    """Record a request that ended in an error event and raise its HTTP error."""
    finish(state, gen, final)
    err = error_for(final)
    err.counted = True  # finish() recorded it
    raise err


def error_for(event: Event) -> ApiError:
    """The HTTP error for a request that ended with an error event (by whose fault)."""
    if event.error_type == "invalid_request":
        return ApiError(400, event.error or "invalid request", code="invalid_request")
    if event.error_type == "busy":
        return ApiError(409, event.error or "session busy", code="session_busy")
    return ApiError(500, "inference failed; see the server log", code="inference_error")


async def _events(stream: RequestStream, request: HttpRequest) -> AsyncIterator[Event]:
    """The stream's events; the request is cancelled if the client goes away."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, stream))
    try:
        async for event in stream:
            yield event
    finally:
        watcher.cancel()
        if not stream.finished:
            stream.cancel()


async def _watch_disconnect(request: HttpRequest, stream: RequestStream) -> None:
    # Once the body has been read, receive() only returns when the client disconnects.
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.cancel()
                return
    except Exception:  # the connection state machine is done: nothing to watch
        return


def finish(state: ApiState, gen: Generation, final: Event | None) -> None:
    """Log one line per request and record its metrics."""
    state.inflight[gen.tenant] -= 1
    duration = time.monotonic() - gen.started
    usage = final.usage if final else None
    status = (final.finish_reason if final else "cancelled") or "unknown"
    req = gen.stream.request
    log.info(
        "request %s session=%s tenant=%s tokens_in=%s cached=%s out=%s ttft=%.3fs "
        "duration=%.3fs finish=%s",
        gen.endpoint,
        req.session_id or "-",
        gen.tenant,
        usage.prompt_tokens if usage else "-",
        usage.cached_tokens if usage else "-",
        usage.completion_tokens if usage else "-",
        gen.ttft or 0.0,
        duration,
        status,
    )
    record: Callable[..., None] | None = getattr(state.metrics, "request_finished", None)
    if record is not None:
        record(endpoint=gen.endpoint, status=status, seconds=duration)


async def replay(gen: Generation) -> AsyncIterator[Event]:
    """Every event of the request, the first one (already received) included."""
    assert gen.first is not None
    yield gen.first
    if not gen.first.finished:
        async for event in gen.events:
            yield event


async def collect(state: ApiState, gen: Generation) -> tuple[str, Event]:
    """All text and the final event of a non-streaming request, recorded by finish();
    a request that ended in an error raises its HTTP error (e.g. the session outgrew the
    KV pool after its first tokens)."""
    parts: list[str] = []
    final = gen.first
    async for event in replay(gen):
        parts.append(event.text)
        final = event
        if event.finished:
            break
    assert final is not None
    if final.error:
        fail(state, gen, final)
    finish(state, gen, final)
    return "".join(parts), final


def sse(data: str, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()
