"""Pinned prefixes from the admin API and the CLI, against a real server: a tenant's agents
share a pinned system prompt from their first turn; other tenants never do."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from ds4pool.api.config import TenantConfig
from ds4pool.cli import main as cli_main
from tests.integration.conftest import Server

KEYS = {"key-alice": TenantConfig("alice"), "key-bob": TenantConfig("bob")}
ADMIN = {"Authorization": "Bearer admin-secret"}
SYSTEM = "You are a careful coding agent. " + " ".join(f"Rule {i}: be exact." for i in range(40))


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve(api_keys=KEYS, admin_token="admin-secret")


def first_turn(server: Server, key: str, session: str) -> int:
    """Cached prompt tokens of a new session's first turn under SYSTEM."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    r = c.chat.completions.create(
        model="demo",
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"task for {session}"},
        ],
        max_tokens=2,
        temperature=0,
        extra_headers={"X-Session-Id": session},
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


def test_a_pinned_system_prompt_is_shared_from_the_first_turn(server: Server) -> None:
    body = {"tenant": "alice", "messages": [{"role": "system", "content": SYSTEM}]}
    r = httpx.post(server.url + "/admin/prefixes", headers=ADMIN, json=body, timeout=120)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["num_blocks"] > 10 and info["blocks_on_device"] == info["num_blocks"]
    # computed once at pin time: alice's very first agent starts warm
    assert first_turn(server, "key-alice", "agent-1") >= 16 * info["num_blocks"]
    assert first_turn(server, "key-bob", "agent-1") == 0  # bob shares nothing of alice's
    assert server.engine.pool.usage().device_blocks_pinned == info["num_blocks"]

    listed = httpx.get(server.url + "/admin/prefixes", headers=ADMIN).json()["data"]
    assert [p["id"] for p in listed] == [info["id"]]
    r = httpx.delete(server.url + f"/admin/prefixes/{info['id']}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["unpinned"] is True
    assert server.engine.pool.usage().device_blocks_pinned == 0
    r = httpx.delete(server.url + f"/admin/prefixes/{info['id']}", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "prefix_not_found"
    server.engine.pool.check_integrity()


def test_bad_pins_are_4xx_in_the_api_format(server: Server) -> None:
    url = server.url + "/admin/prefixes"
    assert httpx.post(url, json={"text": SYSTEM}).status_code == 401
    for body in ({"tenant": "alice"}, {"text": "a", "messages": []}, {"text": "too short"}):
        r = httpx.post(url, headers=ADMIN, json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"], body
    r = httpx.post(url, headers=ADMIN, json={"messages": "not a list"})
    assert r.status_code == 400


def test_the_cli_pins_lists_and_unpins(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sessions", "--url", server.url, "--admin-token", "admin-secret"]
    assert cli_main([*base, "pin-prefix", "--tenant", "bob", "--system", SYSTEM]) == 0
    pinned = json.loads(capsys.readouterr().out)
    assert pinned["tenant"] == "bob" and pinned["blocks_on_device"] == pinned["num_blocks"]
    assert cli_main([*base, "prefixes"]) == 0
    assert [p["id"] for p in json.loads(capsys.readouterr().out)["data"]] == [pinned["id"]]
    assert cli_main([*base, "unpin-prefix", pinned["id"]]) == 0
    capsys.readouterr()
    assert cli_main([*base, "unpin-prefix", pinned["id"]]) == 1  # one line on stderr
    assert "HTTP 404" in capsys.readouterr().err
