"""`ds4pool serve` as a process: env-var config, graceful SIGTERM with a flush, restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.integration.conftest import free_port


def start(demo_dir: Path, disk: Path, port: int, *extra: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        DS4POOL_CACHE=str(demo_dir.parent),
        DS4POOL_PORT=str(port),
        DS4POOL_KV_DEVICE_GB="0.02",
        DS4POOL_KV_DISK_DIR=str(disk),
        DS4POOL_KV_PERSIST_IDLE_S="0",
        DS4POOL_KV_PERSIST_EVERY_TOKENS="0",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds4pool", "serve", "--model", str(demo_dir), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises SIGTERM: -15 is a clean stop
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out
    return out


def test_sigterm_flushes_sessions_and_a_restart_resumes_them(
    demo_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    proc = start(demo_dir, tmp_path / "kv", port)
    try:
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="x",
            max_retries=0,
            default_headers={"X-Session-Id": "survivor"},
        )
        msgs = [{"role": "user", "content": "remember this conversation"}]
        first = c.chat.completions.create(model="demo", messages=msgs, max_tokens=6, temperature=0)
    finally:
        log = stop(proc)
    assert "model" in log and "KV device" in log  # the startup summary
    assert "session=survivor" in log and "cached=0" in log  # one line per request
    assert list((tmp_path / "kv").glob("*.snap")), "sessions were not flushed at shutdown"

    port = free_port()
    proc = start(demo_dir, tmp_path / "kv", port)
    try:
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="x",
            max_retries=0,
            default_headers={"X-Session-Id": "survivor"},
        )
        msgs += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "and continue"},
        ]
        second = c.chat.completions.create(model="demo", messages=msgs, max_tokens=3)
        turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
        assert second.usage.prompt_tokens_details.cached_tokens == turn1 - 1
    finally:
        stop(proc)


def test_bad_model_fails_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds4pool",
            "serve",
            "--model",
            str(tmp_path / "missing"),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ds4pool: error:")
