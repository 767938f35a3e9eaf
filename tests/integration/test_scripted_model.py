"""The scripted test model behind the real server: official SDKs, sessions, tiers, restarts."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Callable
from pathlib import Path

import anthropic
import openai
import pytest
import torch

from ds4pool.model.loader import LoadedModel, load_model
from tests.integration.conftest import Server, free_port
from tests.integration.test_serve_cli import start, stop
from tests.real_tokenizers import real_tokenizer_dir

RULES = [
    # Turn 2 of the memory conversation: matches only when turn 1 is in the prompt.
    {"match": r"code word is PAPAYA[\s\S]*what was the code word", "reply": "It was PAPAYA."},
    {"match": "code word is PAPAYA", "reply": "Noted, I will remember it."},
    {"match": "agent-(\\d)", "reply": "reply for agent \\1"},  # the reply is literal text
    {"match": "hello", "reply": "Hello from the script! 你好 🙂"},
]


def write_rules(directory: Path) -> Path:
    path = directory / "rules.json"
    path.write_text(json.dumps(RULES))
    return path


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    # Overrides conftest's demo model for this module's `serve` fixture.
    rules = write_rules(tmp_path_factory.mktemp("rules"))
    qwen3 = real_tokenizer_dir("qwen3")
    return load_model(f"scripted:{rules}", torch.device("cpu"), torch.float32, tokenizer_dir=qwen3)


@pytest.fixture(scope="module")
def server(serve: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    disk = tmp_path_factory.mktemp("kv")
    return serve({"kv_device_gb": 0.01, "kv_disk_dir": disk, "kv_persist_idle_s": 0})


def client(url: str, session: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=url + "/v1", api_key="x", default_headers=headers, max_retries=0)


def test_reply_streamed_and_whole_is_the_script(server: Server) -> None:
    c = client(server.url)
    msgs = [{"role": "user", "content": "hello"}]
    full = c.chat.completions.create(model="m", messages=msgs, temperature=0.8, seed=1)
    assert full.choices[0].message.content == "Hello from the script! 你好 🙂"
    assert full.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model="m", messages=msgs, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == full.choices[0].message.content


def test_concurrent_sessions_each_get_their_reply(server: Server) -> None:
    def ask(i: int) -> str:
        c = client(server.url, f"agent-{i}")
        msgs = [{"role": "user", "content": f"I am agent-{i}"}]
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=50)
        return r.choices[0].message.content or ""

    with cf.ThreadPoolExecutor(6) as ex:
        assert list(ex.map(ask, range(6))) == [r"reply for agent \1"] * 6


def test_history_comes_back_from_disk(server: Server) -> None:
    """Turn 2's rule needs turn 1's text, which the model reads from the session's KV: after
    the session went to disk and came back, it is still there (and reused, not recomputed)."""
    c = client(server.url, "memory")
    msgs = [{"role": "user", "content": "The code word is PAPAYA."}]
    first = c.chat.completions.create(model="m", messages=msgs)
    assert first.choices[0].message.content == "Noted, I will remember it."
    server.engine.pool.evict("default", "memory", "disk")
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "So, what was the code word?"},
    ]
    second = c.chat.completions.create(model="m", messages=msgs)
    assert second.choices[0].message.content == "It was PAPAYA."
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= first.usage.prompt_tokens


def test_serve_cli_scripted_survives_a_restart(tmp_path: Path, demo_dir: Path) -> None:
    rules = write_rules(tmp_path)
    qwen3 = str(real_tokenizer_dir("qwen3"))
    flags = ("--model", f"scripted:{rules}", "--tokenizer", qwen3, "--kv-device-gb", "0.01")
    msgs = [{"role": "user", "content": "The code word is PAPAYA."}]
    port = free_port()
    proc = start(demo_dir, tmp_path / "kv", port, *flags)
    try:
        c = client(f"http://127.0.0.1:{port}", "survivor")
        first = c.chat.completions.create(model="m", messages=msgs)
    finally:
        log = stop(proc)
    assert first.choices[0].message.content == "Noted, I will remember it."
    assert "ScriptedForCausalLM" in log  # the startup summary names the model
    msgs += [
        {"role": "assistant", "content": "Noted, I will remember it."},
        {"role": "user", "content": "what was the code word?"},
    ]
    port = free_port()
    proc = start(demo_dir, tmp_path / "kv", port, *flags)
    try:
        c = client(f"http://127.0.0.1:{port}", "survivor")
        second = c.chat.completions.create(model="m", messages=msgs)
    finally:
        stop(proc)
    assert second.choices[0].message.content == "It was PAPAYA."
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= first.usage.prompt_tokens


def test_anthropic_messages_get_the_script(server: Server) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]
    full = c.messages.create(model="m", max_tokens=100, messages=msgs)  # type: ignore[arg-type]
    assert [b.text for b in full.content if b.type == "text"] == ["Hello from the script! 你好 🙂"]
    assert full.stop_reason == "end_turn"
    with c.messages.stream(model="m", max_tokens=100, messages=msgs) as stream:  # type: ignore[arg-type]
        assert "".join(stream.text_stream) == "Hello from the script! 你好 🙂"
