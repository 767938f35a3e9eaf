"""`ds4pool serve` as a process: env-var config, graceful SIGTERM with a flush, restart."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

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
    # a clean drain exits 0 (uvicorn re-raises SIGTERM, which was -15: issue 14 item 7)
    assert proc.returncode == 0, out
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
    # the start-up's objects were frozen: full collections while serving skip them
    assert re.search(r"[1-9]\d* start-up objects moved out of the garbage collector", log)
    assert "GIL switch interval 200 µs" in log  # the step thread gets the GIL back sooner
    assert "HTTP httptools on uvloop" in log  # uvicorn's C parser and loop (dependencies)
    cores = r"(; (\d+) cores, (\d+) logical CPUs)?"
    probe = r"(, (\d+) of (\d+)-(\d+) by a start-up probe: a step \d+ ms with \d+, "
    probe += r"\d+ ms with \d+)?"
    threads = re.search(rf"on cpu float32 \((\d+) threads?{probe}{cores}\)", log)
    assert threads, log  # on CPU it names the model's threads, and how auto chose them
    if Path("/sys/devices/system/cpu/cpu0/topology").is_dir():  # and the cores under them
        assert threads[6] and 1 <= int(threads[7]) <= int(threads[8]), log
    if "OMP_NUM_THREADS" not in os.environ:
        assert 1 <= int(threads[1]) <= (os.cpu_count() or 1)
    if threads[2]:  # auto on more than one core: one left free, or all where that was faster
        chosen, fewer, more = int(threads[3]), int(threads[4]), int(threads[5])
        assert fewer == more - 1 and chosen in (fewer, more) and int(threads[1]) == chosen, log
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


def test_the_pure_python_http_stack_still_serves_streams(demo_dir: Path, tmp_path: Path) -> None:
    """--http h11 --loop asyncio (the stack before httptools and uvloop were dependencies,
    and what auto picks where they are not installed) streams a completion to the SDK."""
    port = free_port()
    proc = start(demo_dir, tmp_path / "kv", port, "--http", "h11", "--loop", "asyncio")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "stream a few words"}]
        stream = c.chat.completions.create(
            model="demo", messages=msgs, max_tokens=8, stream=True, temperature=0
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        whole = c.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0)
    finally:
        log = stop(proc)
    assert text and text == whole.choices[0].message.content
    assert "HTTP h11 on asyncio" in log


def serve_refused(demo_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS4POOL_CACHE=str(demo_dir.parent), DS4POOL_KV_DEVICE_GB="0.02")
    cmd = [sys.executable, "-m", "ds4pool", "serve", "--model", str(demo_dir), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ds4pool: error:"), proc.stderr
    assert all(w in last for w in words), last


def test_start_up_refusals_are_one_line(demo_dir: Path, tmp_path: Path) -> None:
    """Issue 14 item 4: a disk dir locked by another server and a taken port were
    tracebacks; each is one line on stderr and exit status 1."""
    locked = tmp_path / "locked"
    locked.mkdir()
    fd = os.open(locked / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running server's DiskTier holds it
        assert_one_line(
            serve_refused(demo_dir, "--kv-disk-dir", str(locked), "--port", "0"), "another"
        )
    finally:
        os.close(fd)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert_one_line(serve_refused(demo_dir, "--port", port), port)
    assert_one_line(serve_refused(demo_dir, "--cpu-threads", "0", "--port", "0"), "cpu_threads")
    assert_one_line(serve_refused(demo_dir, "--gil-switch-us", "0"), "--gil-switch-us")


def test_unusable_disk_dir_is_one_line(
    demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Other OSErrors at start (a read-only --kv-disk-dir: EROFS, EACCES; a file in its
    place) are one line too; in-process through the CLI's main, which the process runs."""
    from ds4pool.cli import main

    monkeypatch.setenv("DS4POOL_CACHE", str(demo_dir.parent))
    (tmp_path / "a-file").write_text("x")
    cases = [(tmp_path / "a-file", "a-file")]
    if os.geteuid() != 0:  # root writes through the mode bits
        (tmp_path / "read-only").mkdir(mode=0o500)
        cases.append((tmp_path / "read-only", "Permission denied"))
    for path, words in cases:
        args = ["serve", "--model", str(demo_dir), "--kv-device-gb", "0.02", "--port", "0"]
        assert main([*args, "--kv-disk-dir", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ds4pool: error:") and words in err, err
        assert "Traceback" not in err


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
