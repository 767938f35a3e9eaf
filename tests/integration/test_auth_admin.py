"""API keys, tenant isolation and the admin API, against a real server."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from ds4pool.api.config import TenantConfig
from tests.integration.conftest import Server

KEYS = {"key-alice": TenantConfig("alice"), "key-bob": TenantConfig("bob")}
ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve(api_keys=KEYS, admin_token="admin-secret")


def client(server: Server, key: str, session: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=key, default_headers=headers, max_retries=0
    )


def chat(c: openai.OpenAI, text: str = "hello") -> openai.types.chat.ChatCompletion:
    return c.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0
    )


def test_wrong_or_missing_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        chat(client(server, "not-a-key"))
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        server.url + "/v1/messages",
        headers={"x-api-key": "nope"},
        json={"model": "m", "max_tokens": 1, "messages": []},
    )
    assert r.status_code == 401 and r.json()["type"] == "error"
    # Anthropic-style x-api-key works too
    r = httpx.post(
        server.url + "/v1/messages",
        headers={"x-api-key": "key-alice"},
        json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200


def test_tenants_cannot_touch_each_others_sessions(server: Server) -> None:
    secret = "the launch code is 0000"
    chat(client(server, "key-alice", "shared-name"), secret)
    # Bob uses the same X-Session-Id: a different session, nothing reused from Alice's
    r = chat(client(server, "key-bob", "shared-name"), secret)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    bob = {"Authorization": "Bearer key-bob"}
    listed = httpx.get(server.url + "/v1/sessions", headers=bob).json()["data"]
    assert {s["tenant"] for s in listed} == {"bob"}
    # Bob deletes "his" shared-name: Alice's is untouched
    assert httpx.delete(server.url + "/v1/sessions/shared-name", headers=bob).status_code == 200
    assert server.engine.pool.get("alice", "shared-name") is not None
    assert httpx.delete(server.url + "/v1/sessions/shared-name", headers=bob).status_code == 404
    # Alice continues her own session and does reuse it
    again = chat(client(server, "key-alice", "shared-name"), secret)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # tenants cannot reach /admin with their API keys
    r = httpx.post(
        server.url + "/admin/sessions/alice/shared-name/evict", headers=bob, json={"to": "disk"}
    )
    assert r.status_code == 401
    assert server.engine.pool.get("alice", "shared-name").tier == "device"  # type: ignore[union-attr]


def test_admin_routes_need_the_admin_token(server: Server) -> None:
    for method, path in [
        ("GET", "/admin/sessions"),
        ("GET", "/admin/pool"),
        ("POST", "/admin/flush"),
        ("DELETE", "/admin/sessions/alice/x"),
    ]:
        assert httpx.request(method, server.url + path).status_code == 401, path
        wrong = {"Authorization": "Bearer key-alice"}
        assert httpx.request(method, server.url + path, headers=wrong).status_code == 401


def test_admin_lists_evicts_pins_and_drops(server: Server) -> None:
    chat(client(server, "key-alice", "admin-1"))
    chat(client(server, "key-bob", "admin-2"))
    r = httpx.get(server.url + "/admin/sessions", headers=ADMIN, params={"tenant": "bob"})
    assert {s["session_id"] for s in r.json()["data"]} >= {"admin-2"}
    assert all(s["tenant"] == "bob" for s in r.json()["data"])
    page = httpx.get(server.url + "/admin/sessions", headers=ADMIN, params={"limit": 1}).json()
    assert len(page["data"]) == 1 and page["total"] >= 2
    base = server.url + "/admin/sessions/alice/admin-1"
    assert httpx.get(base, headers=ADMIN).json()["tier"] == "device"
    r = httpx.post(base + "/evict", headers=ADMIN, json={"to": "ram"})
    assert r.status_code == 200 and r.json()["tier"] == "ram"
    r = httpx.post(base + "/evict", headers=ADMIN, json={"to": "tape"})
    assert r.status_code == 400
    assert httpx.post(base + "/pin", headers=ADMIN).json()["pinned"] is True
    assert httpx.post(base + "/unpin", headers=ADMIN).json()["pinned"] is False
    pool = httpx.get(server.url + "/admin/pool", headers=ADMIN).json()
    assert pool["ram_sessions"] >= 1 and "queue_depth" in pool and "running_requests" in pool
    assert httpx.delete(base, headers=ADMIN).status_code == 200
    assert httpx.get(base, headers=ADMIN).status_code == 404
    r = httpx.get(server.url + "/admin/sessions", headers=ADMIN, params={"tier": "moon"})
    assert r.status_code == 400


def test_admin_disabled_without_token(serve: Callable[..., Server]) -> None:
    open_server = serve()
    assert httpx.get(open_server.url + "/admin/pool").status_code == 403
