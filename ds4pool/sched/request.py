"""A generation request, its output events, and the stream that carries them to the caller.

The worker thread produces events; the caller consumes them either synchronously
(iterate the stream) or from asyncio (`async for`), whichever thread or loop it is on.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from enum import Enum

from ds4pool.errors import Ds4poolError
from ds4pool.model.grammar import Constraint
from ds4pool.model.sampler import GREEDY, SamplingParams

_ids = itertools.count(1)


class QueueFullError(Ds4poolError):
    """Admission control refused the request; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float, reason: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class RequestFailedError(Ds4poolError):
    """The request was accepted but could not complete (the message says why)."""


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused (prefix hit)
    completion_tokens: int


@dataclass(frozen=True)
class Event:
    """One item of a request's stream: a text delta, and at the end a finish reason.

    finish_reason: "stop" (eos or a stop string), "length" (max tokens or context),
    "cancelled", or "error" (then `error` holds a one-line message and `error_type` says
    whose fault: "invalid_request" (the request can never run: too long, bad ids),
    "busy" (its session stayed busy too long), or "internal" (a failed step)).
    `usage` is set on the last event and on the first one (prompt and cached tokens known,
    completion tokens so far), for APIs that report the prompt's size up front.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    error_type: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    """What a caller submits. Exactly one of prompt_ids / prompt_text is the prompt;
    prompt_text also enables the session's text-prefix reuse."""

    tenant: str = "default"
    session_id: str | None = None  # None: an ephemeral session, discarded at the end
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    sampling: SamplingParams = GREEDY
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: int = 0  # lower runs first (vLLM's convention)
    deadline: float | None = None  # time.monotonic() after which it is cancelled
    endpoint: str = "engine"  # the API route that made it (a bounded metrics label)
    # output must match this compiled grammar (json_schema, tool_choice); None: free text
    constraint: Constraint | None = None
    request_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    # time.monotonic() when the HTTP handler got it (set by the API; None otherwise): what
    # came before `arrival` (body, chat template, checks) shows in --trace-steps
    received: float | None = None


class RequestStream:
    """Thread-safe single-consumer queue of Events, iterable sync or async."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self._events: deque[Event] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._cancelled = False
        self.finished = False
        self.first_pushed: float | None = None  # time.monotonic() of the first push

    # producer side (worker thread)
    def push(self, event: Event) -> None:
        if self.first_pushed is None:
            self.first_pushed = time.monotonic()
        with self._cond:
            self._events.append(event)
            if event.finished:
                self.finished = True
            self._cond.notify_all()
            loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None:
            try:
                loop.call_soon_threadsafe(wakeup.set)
            except RuntimeError:  # the consumer's loop is closed: nobody listens
                pass

    # consumer side
    def cancel(self) -> None:
        """Ask the worker to stop this request at the next step boundary."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def get(self, timeout: float | None = None) -> Event:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._events), timeout):
                raise TimeoutError("no event within the timeout")
            return self._events.popleft()

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.get()
            yield event
            if event.finished:
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        with self._cond:
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
        while True:
            with self._cond:
                event = self._events.popleft() if self._events else None
                if event is None:
                    self._wakeup.clear()
            if event is None:
                await self._wakeup.wait()
                continue
            yield event
            if event.finished:
                return

    def collect(self, timeout: float | None = None) -> tuple[str, list[int], Event]:
        """Block until finished; return (text, token ids, final event)."""
        text, ids = [], []
        while True:
            event = self.get(timeout)
            text.append(event.text)
            ids.extend(event.token_ids)
            if event.finished:
                return "".join(text), ids, event
