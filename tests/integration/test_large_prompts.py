"""A huge prompt is refused quickly and freezes nothing (issue 14 item 1): the body is decoded,
the template rendered and the prompt's length bounded off the event loop, before the prompt
is tokenized in full, so other connections keep being answered."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.integration.conftest import Server

TEXT = "hello world " * (15_000_000 // 12)  # 15 MB: ~7.5M tokens before this fix was 20 s
USER = [{"role": "user", "content": "hi"}]
BIG = [{"role": "user", "content": TEXT}]
ROUTES = {
    "/v1/chat/completions": {"messages": BIG, "max_tokens": 1},
    "/v1/completions": {"prompt": TEXT, "max_tokens": 1},
    "/v1/messages": {"model": "m", "max_tokens": 1, "messages": BIG},
    "/v1/messages/count_tokens": {"model": "m", "messages": BIG},
    "/v1/responses": {"input": TEXT, "max_output_tokens": 1},
}


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()  # the default --max-body-mb 16


def post(server: Server, path: str, raw: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=120)


def test_others_are_answered_while_a_15_mb_prompt_arrives(server: Server) -> None:
    raw = json.dumps(ROUTES["/v1/chat/completions"]).encode()
    assert len(raw) > 15_000_000
    big: list[tuple[httpx.Response, float]] = []

    def send() -> None:
        t0 = time.monotonic()
        big.append((post(server, "/v1/chat/completions", raw), time.monotonic() - t0))

    thread = threading.Thread(target=send)
    health, chats = [], []
    with httpx.Client(base_url=server.url, timeout=60) as other:  # another connection
        other.get("/health")
        thread.start()
        while thread.is_alive():
            t0 = time.monotonic()
            assert other.get("/health").status_code == 200
            health.append(time.monotonic() - t0)
            t0 = time.monotonic()
            r = other.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
            assert r.status_code == 200, r.text
            chats.append(time.monotonic() - t0)
    thread.join()
    (resp, seconds) = big[0]
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert seconds < 10, seconds  # was 16-20 s, all of it tokenizing
    assert health and max(health) < 1.0, health
    assert chats and max(chats) < 1.0, chats


@pytest.mark.parametrize("path", list(ROUTES)[1:])
def test_every_route_refuses_a_15_mb_prompt_quickly(server: Server, path: str) -> None:
    t0 = time.monotonic()
    r = post(server, path, json.dumps(ROUTES[path]).encode())
    seconds = time.monotonic() - t0
    assert r.status_code == 400, r.text
    doc = r.json()
    if path.startswith("/v1/messages"):
        assert doc["type"] == "error" and "context" in doc["error"]["message"]
    else:
        assert doc["error"]["code"] == "context_length_exceeded"
    assert seconds < 10, seconds


def test_a_prompt_of_many_tokens_is_refused_after_counting_a_context(server: Server) -> None:
    """Between the bounds (4 to max_token_chars characters per token of the context) the
    prompt is counted piece by piece: refused once the count passes the context."""
    text = "hello world " * 40_000  # 480k characters, ~80k tokens: counted, then refused
    r = post(server, "/v1/completions", json.dumps({"prompt": text, "max_tokens": 1}).encode())
    assert r.status_code == 400, r.text
    assert "more than" in r.json()["error"]["message"]


def test_token_id_prompts_longer_than_the_context_are_refused(server: Server) -> None:
    ids = [1] * 2_000_000
    r = post(server, "/v1/completions", json.dumps({"prompt": ids, "max_tokens": 1}).encode())
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


PAD = "p" * 70_000  # past api/body.py's OFF_LOOP_BYTES: decoded in a worker thread
BAD = [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": 5}]}, "messages[0].role"),
    ({"max_tokens": 1}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": "high"}, "top_p"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_large_bad_bodies_get_the_same_400_as_small_ones(
    server: Server, body: dict, param: str
) -> None:
    small = post(server, "/v1/chat/completions", json.dumps(body).encode())
    large = post(server, "/v1/chat/completions", json.dumps({**body, "pad": PAD}).encode())
    assert small.status_code == large.status_code == 400, (small.text, large.text)
    assert small.json()["error"]["param"] == large.json()["error"]["param"] == param
    assert small.json()["error"]["message"] == large.json()["error"]["message"]


def test_large_malformed_and_deep_bodies_are_400(server: Server) -> None:
    for raw in (
        b'{"messages": [' + b" " * 70_000,
        b'{"pad": "' + PAD.encode() + b'", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"messages": [{"role": "user", "content": "\xff\xfe' + PAD.encode() + b'"}]}',
        b"[" + b"1," * 40_000 + b"1]",
    ):
        r = post(server, "/v1/chat/completions", raw)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
