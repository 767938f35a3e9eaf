"""Bad input gets the right 4xx in the right format, and the server stays healthy."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable

import httpx
import pytest

from tests.integration.conftest import Server

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve(max_body_mb=0.05)


def post(
    server: Server,
    path: str,
    body: object = None,
    *,
    raw: bytes | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> httpx.Response:
    hdrs = [(b"content-type", b"application/json"), *(headers or [])]
    content = raw if raw is not None else httpx.Request("POST", "/", json=body).content
    return httpx.post(server.url + path, content=content, headers=hdrs, timeout=30)


CASES = [
    ("malformed JSON", "/v1/chat/completions", None, b'{"messages": [', 400),
    ("not an object", "/v1/chat/completions", None, b"[1, 2]", 400),
    ("invalid UTF-8", "/v1/chat/completions", None, b'{"messages": "\xff\xfe"}', 400),
    ("wrong type", "/v1/chat/completions", {"messages": "hi"}, None, 400),
    ("wrong nested type", "/v1/chat/completions", {"messages": [{"role": 5}]}, None, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, None, 400),
    (
        "unknown role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        None,
        400,
    ),
    (
        "huge max_tokens",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 10**12},
        None,
        400,
    ),
    (
        "negative max_tokens",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": -1},
        None,
        400,
    ),
    (
        "temperature out of range",
        "/v1/chat/completions",
        {"messages": USER, "temperature": -3},
        None,
        400,
    ),
    ("top_p out of range", "/v1/chat/completions", {"messages": USER, "top_p": 7}, None, 400),
    ("n > 1", "/v1/chat/completions", {"messages": USER, "n": 3}, None, 400),
    (
        "image content",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        None,
        400,
    ),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, 400),
    ("token ids out of vocab", "/v1/completions", {"prompt": [10**9], "max_tokens": 2}, None, 400),
    (
        "deep JSON",
        "/v1/chat/completions",
        None,
        b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
    ),
    ("anthropic: no max_tokens", "/v1/messages", {"model": "m", "messages": USER}, None, 400),
    (
        "anthropic: bad role",
        "/v1/messages",
        # "system" is accepted (Claude Code sends it mid-conversation); "tool" is not Anthropic's
        {"model": "m", "max_tokens": 3, "messages": [{"role": "tool", "content": "x"}]},
        None,
        400,
    ),
    (
        "anthropic: image block",
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "image"}]}],
        },
        None,
        400,
    ),
    ("responses: malformed JSON", "/v1/responses", None, b'{"input": [', 400),
    ("responses: input not a list", "/v1/responses", {"input": {"role": "user"}}, None, 400),
    ("responses: tools not a list", "/v1/responses", {"input": "hi", "tools": "x"}, None, 400),
    (
        "responses: content of the wrong type",
        "/v1/responses",
        {"input": [{"type": "message", "role": "user", "content": 5}]},
        None,
        400,
    ),
    (
        "responses: deeply nested item",
        "/v1/responses",
        None,
        b'{"input": [' + b'{"content": ' * 1500 + b"1" + b"}" * 1500 + b"]}",
        400,
    ),
    (
        "oversized body",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * 100_000}]},
        None,
        413,
    ),
]


@pytest.mark.parametrize("name,path,body,raw,status", CASES, ids=[c[0] for c in CASES])
def test_bad_bodies(
    server: Server, name: str, path: str, body: object, raw: bytes | None, status: int
) -> None:
    r = post(server, path, body, raw=raw)
    assert r.status_code == status, r.text
    doc = r.json()
    if path.startswith("/v1/messages"):
        assert doc["type"] == "error" and doc["error"]["message"]
    else:
        assert doc["error"]["message"] and doc["error"]["type"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize(
    "session_id",
    [b"../x", b"x" * 10_000, "caf\u00e9".encode(), b"a b", b"", b"a/b", b"%2e%2e", b"a;b"],
)
def test_bad_session_ids(server: Server, session_id: bytes) -> None:
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2},
        headers=[(b"x-session-id", session_id)],
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "X-Session-Id"


def test_bad_priority_header(server: Server) -> None:
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2},
        headers=[(b"x-priority", b"high")],
    )
    assert r.status_code == 400


@pytest.mark.parametrize(
    "kwargs",
    [
        {"self": 1},  # issue 14: a TypeError from apply_chat_template, answered 500
        {"messages": []},
        {"add_generation_prompt": False},
        {"documents": [1]},
        {"raise_exception": None},
        {"loop": 1},
        {"range": 1},
        {"__class__": 1},
        {"_private": 1},
        {"a-b": 1},
        {"": 1},
        {"class": 1},
        {"enable_thinking": False, "self": 1},
    ],
)
def test_chat_template_kwargs_that_clash_are_400(server: Server, kwargs: dict) -> None:
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 1, "chat_template_kwargs": kwargs},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_of_the_template_are_accepted(server: Server) -> None:
    body = {"enable_thinking": False, "reasoning_effort": "low", "x1": {"a": [1]}}
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 1, "chat_template_kwargs": body},
    )
    assert r.status_code == 200, r.text


def test_unknown_route_and_method(server: Server) -> None:
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405


def test_server_is_healthy_afterwards(server: Server) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    server.engine.pool.check_integrity()


def test_queue_full_is_429_with_retry_after(serve: Callable[..., Server]) -> None:
    small = serve(engine_kw={"max_waiting": 1, "max_batch_size": 1})
    body = {"messages": USER, "max_tokens": 2}
    with cf.ThreadPoolExecutor(4) as ex:
        with small.engine.worker.engine_lock:  # the device is busy: nothing leaves the queue
            futures = [ex.submit(post, small, "/v1/chat/completions", body) for _ in range(4)]
            time.sleep(1.0)  # one running, one waiting, the rest refused at once
            done = [f.result() for f in futures if f.done()]
        rest = [f.result() for f in futures]  # the device is free again: these complete
    refused = [r for r in done if r.status_code == 429]
    assert refused, [r.status_code for r in done]
    assert int(refused[0].headers["retry-after"]) >= 1
    assert refused[0].json()["error"]["type"] == "rate_limit_error"
    assert sum(r.status_code == 200 for r in rest) == 4 - len(refused)
