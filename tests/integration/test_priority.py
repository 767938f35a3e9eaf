"""A tenant's configured priority is the best it may ask for (issue 14 item 5): X-Priority and
the body's `priority` can only lower a request's place in the queue, never raise it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from ds4pool.api.config import TenantConfig
from tests.integration.conftest import Server

KEYS = {
    "key-low": TenantConfig("low", default_priority=1000),
    "key-high": TenantConfig("high", default_priority=0),
}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve(engine_kw={"max_batch_size": 1}, api_keys=KEYS)


def chat(server: Server, key: str, headers: dict[str, str] | None = None, **body: object) -> int:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
        timeout=60,
    )
    return r.status_code


def until(pred: Callable[[], object]) -> None:
    deadline = time.monotonic() + 10
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def waiting(server: Server) -> list[tuple[str, int]]:
    sched = server.engine.scheduler
    with sched.lock:
        return [(s.tenant, s.priority) for s in sched.queue.ordered()]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "how",
    [
        {"headers": {"X-Priority": "-2147483647"}},  # what the probe sent
        {"headers": {"X-Priority": "0"}},
        {"priority": -5},
    ],
    ids=["header-min", "header-zero", "body"],
)
def test_a_tenant_cannot_raise_its_priority(server: Server, how: dict) -> None:
    statuses: list[int] = []

    def send(key: str, **kw: object) -> threading.Thread:
        t = threading.Thread(target=lambda: statuses.append(chat(server, key, **kw)))  # type: ignore[arg-type]
        t.start()
        return t

    threads = []
    with server.engine.worker.engine_lock:  # the device is busy: nothing leaves the queue
        threads.append(send("key-high"))  # takes the one running slot
        until(lambda: server.engine.scheduler.running)
        threads.append(send("key-high"))  # queued first
        until(lambda: len(waiting(server)) == 1)
        threads.append(send("key-low", **how))  # queued second, asking to go first
        until(lambda: len(waiting(server)) == 2)
        order = waiting(server)
    for t in threads:
        t.join(timeout=60)
    assert order == [("high", 0), ("low", 1000)]
    assert statuses == [200, 200, 200]


def test_a_tenant_can_lower_its_priority(server: Server) -> None:
    with server.engine.worker.engine_lock:
        t = threading.Thread(target=chat, args=(server, "key-high"))
        t.start()
        until(lambda: server.engine.scheduler.running)
        t2 = threading.Thread(
            target=chat, args=(server, "key-high"), kwargs={"headers": {"X-Priority": "7"}}
        )
        t2.start()
        until(lambda: waiting(server))
        order = waiting(server)
    t.join(timeout=60)
    t2.join(timeout=60)
    assert order == [("high", 7)]
