"""Prefix sharing as clients see it, against a real server with the official openai SDK:
opencode's two conversations under one X-Session-Id, agents sharing a system prompt, and
tenants kept apart."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from ds4pool.api.config import TenantConfig
from tests.integration.conftest import Server

KEYS = {"key-alice": TenantConfig("alice"), "key-bob": TenantConfig("bob")}
SYSTEM = "You are opencode, a coding agent. " + " ".join(f"rule {i}: test it." for i in range(60))


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server]) -> Server:
    return serve(api_keys=KEYS)


def ask(
    server: Server, key: str, session: str, messages: list[dict[str, str]]
) -> tuple[str, int, int]:
    """(reply, prompt tokens, cached tokens) of one greedy turn."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    r = c.chat.completions.create(
        model="demo",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Session-Id": session},
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens or 0
    return r.choices[0].message.content or "", r.usage.prompt_tokens, cached


def test_title_request_between_turns_keeps_the_main_conversation_warm(server: Server) -> None:
    main = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "read src/app.py and fix the failing test " * 10},
    ]
    reply, prompt1, _ = ask(server, "key-alice", "oc-1", main)
    # opencode's title request: another conversation, the same session id
    title = [
        {"role": "system", "content": "Generate a short title for this conversation."},
        {"role": "user", "content": main[1]["content"]},
    ]
    ask(server, "key-alice", "oc-1", title)
    main += [{"role": "assistant", "content": reply}, {"role": "user", "content": "now run it"}]
    _, prompt2, cached = ask(server, "key-alice", "oc-1", main)
    print(f"main turn 2: {cached} of {prompt2} prompt tokens cached (turn 1: {prompt1})")
    assert cached >= 0.9 * prompt1, (cached, prompt1)  # was 5 of 1,829 before sharing
    # and the title conversation, when it comes back, finds its own history too
    _, title_prompt, _ = ask(server, "key-alice", "oc-1", title)
    _, _, cached_title = ask(server, "key-alice", "oc-1", title)
    assert cached_title >= 0.9 * title_prompt
    server.engine.pool.check_integrity()


def test_agents_share_a_system_prompt_within_a_tenant_only(server: Server) -> None:
    def first(key: str, agent: str) -> tuple[int, int]:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": agent}]
        _, prompt, cached = ask(server, key, agent, msgs)
        return prompt, cached

    first("key-alice", "agent-a")
    prompt, cached = first("key-alice", "agent-b")
    assert cached >= 0.8 * prompt  # everything but the last block and the task
    _, cached_bob = first("key-bob", "agent-c")
    assert cached_bob == 0  # alice's blocks give bob nothing
