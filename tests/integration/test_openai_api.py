"""OpenAI-compatible routes driven by the official openai SDK against a real server."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.integration.conftest import Server


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


def client(server: Server, session: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", default_headers=headers, max_retries=0
    )


def test_models(server: Server) -> None:
    assert [m.id for m in client(server).models.list()] == ["demo"]


def test_chat_non_streaming_and_streaming_agree(server: Server) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    c = client(server)
    full = c.chat.completions.create(model="demo", messages=msgs, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 5
    chunks = list(
        c.chat.completions.create(
            model="demo",
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_completions_endpoint(server: Server) -> None:
    c = client(server)
    r = c.completions.create(model="demo", prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="demo", prompt="def add(a, b):", max_tokens=6, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == r.choices[0].text


def test_two_turns_report_cached_tokens(server: Server) -> None:
    c = client(server, session="agent-1")
    first = [{"role": "user", "content": "list the files in the repo"}]
    r1 = c.chat.completions.create(model="demo", messages=first, max_tokens=10, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "now open README.md"},
    ]
    raw = c.chat.completions.with_raw_response.create(
        model="demo", messages=second, max_tokens=5, temperature=0
    )
    assert raw.headers["x-session-id"] == "agent-1"
    r2 = raw.parse()
    # everything of turn 1 (prompt and completion) is reused, but the completion's last
    # token, whose KV is computed as part of turn 2
    turn1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens == turn1 - 1


def test_sixteen_concurrent_sessions_each_equal_their_solo_run(server: Server) -> None:
    def ask(i: int, session: str) -> str:
        msgs = [{"role": "user", "content": f"task {i}: " + "fix the bug " * (i % 5 + 1)}]
        r = client(server, session).chat.completions.create(
            model="demo", messages=msgs, max_tokens=8 + i, temperature=0
        )
        return r.choices[0].message.content or ""

    solo = [ask(i, f"solo-{i}") for i in range(16)]
    with cf.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(lambda i: ask(i, f"conc-{i}"), range(16)))
    assert together == solo


def test_streaming_client_disconnect_cancels_generation(server: Server) -> None:
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 20000,
            "stream": True,
        },
        headers={"X-Session-Id": "quitter"},
        timeout=30,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # the client goes away mid-stream
    import time

    deadline = time.monotonic() + 10
    while server.engine.scheduler.running:
        assert time.monotonic() < deadline, "generation kept running after the disconnect"
        time.sleep(0.05)
    info = server.engine.pool.get("default", "quitter")
    assert info is not None and not info.in_flight and info.num_computed > 0


def test_own_sessions_list_and_delete(server: Server) -> None:
    c = client(server, session="mine")
    c.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    ids = [s["session_id"] for s in httpx.get(server.url + "/v1/sessions").json()["data"]]
    assert "mine" in ids
    r = httpx.delete(server.url + "/v1/sessions/mine")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert httpx.delete(server.url + "/v1/sessions/mine").status_code == 404
