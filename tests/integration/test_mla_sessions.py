"""A latent-attention model (DeepSeek-V3 architecture) behind the real server: sessions
survive the tiers, over the official OpenAI SDK."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch

from ds4pool.model.loader import LoadedModel, load_model
from tests.integration.conftest import Server

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:  # overrides conftest's demo model for `serve`
    return load_model(
        "random:deepseek-v3-tiny", torch.device("cpu"), torch.float32, tokenizer_dir=demo_dir
    )


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    disk = tmp_path_factory.mktemp("snapshots")
    return serve({"kv_disk_dir": disk}, admin_token="admin-secret")


def chat(server: Server, session: str, messages: list[dict[str, str]]):  # type: ignore[no-untyped-def]
    c = openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="x",
        default_headers={"X-Session-Id": session},
        max_retries=0,
    )
    return c.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )


def test_a_session_restored_from_disk_answers_as_one_that_never_left(server: Server) -> None:
    assert server.engine.runner.layout.kind == "mla"  # the cache holds the latent
    first = [{"role": "user", "content": "Write a haiku about paged latent caches."}]
    replies = {}
    block = server.engine.runner.block_size
    for session in ("moved", "stayed"):
        r = chat(server, session, first)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens
        # "stayed" may reuse the full latent blocks "moved" computed (one tenant), no more
        assert cached == 0 if session == "moved" else cached % block == 0
        assert cached < r.usage.prompt_tokens
        replies[session] = r.choices[0].message.content
    assert replies["moved"] == replies["stayed"]

    evicted = httpx.post(
        server.url + "/admin/sessions/default/moved/evict", headers=ADMIN, json={"to": "disk"}
    )
    assert evicted.status_code == 200 and evicted.json()["tier"] == "disk"

    second = first + [
        {"role": "assistant", "content": replies["moved"] or ""},
        {"role": "user", "content": "Another one, please."},
    ]
    again = {}
    for session in ("moved", "stayed"):
        r = chat(server, session, second)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens > 0, session  # resumed, not re-read
        again[session] = r.choices[0].message.content
    assert again["moved"] == again["stayed"]
    info = httpx.get(server.url + "/admin/sessions/default/moved", headers=ADMIN).json()
    assert info["tier"] == "device"
