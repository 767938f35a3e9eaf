"""Shared pieces of the reliability suite: sizes, figures, server processes, workloads.

Sizes: every test runs a REDUCED size by default (CI); DS4POOL_RELIABILITY_FULL=1 selects
the full size (docs/RELIABILITY.md holds the figures of a full run).

Figures: `report(test, **figures)` prints one line, keeps it for the terminal summary, and
appends it as one JSON object per line to $DS4POOL_RELIABILITY_REPORT when that is set.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ds4pool.kv.blockstore import directory_reader
from ds4pool.kv.disk_files import session_file_name
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import SnapshotError
from ds4pool.kv.snapshot import decode_snapshot
from ds4pool.model.tokenizer import Tokenizer

FULL = os.environ.get("DS4POOL_RELIABILITY_FULL", "").strip().lower() not in ("", "0", "false")
SIZE = "full" if FULL else "reduced"
REPORT_ENV = "DS4POOL_RELIABILITY_REPORT"

# Figures of this session's tests, printed again in the terminal summary (conftest.py).
REPORTED: list[str] = []


def size(reduced: int, full: int) -> int:
    return full if FULL else reduced


def report(test: str, **figures: Any) -> None:
    """Print the test's figures on one line and append them to $DS4POOL_RELIABILITY_REPORT."""
    line = f"[reliability:{SIZE}] {test}: " + ", ".join(f"{k}={v}" for k, v in figures.items())
    print(line, flush=True)
    REPORTED.append(line)
    path = os.environ.get(REPORT_ENV)
    if path:
        doc = {"test": test, "size": SIZE, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        doc.update(figures)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(doc, default=str) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_client(base_url: str = "", timeout: float = 300.0) -> httpx.Client:
    """An httpx client that drops idle connections after 2 s, before uvicorn closes them (5 s
    keep-alive): reusing a connection the server is closing races ("Server disconnected
    without sending a response"), a client-side artefact no test should trip over."""
    return httpx.Client(
        base_url=base_url, timeout=timeout, limits=httpx.Limits(keepalive_expiry=2.0)
    )


def wait_until(pred: Callable[[], bool], timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(step)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class ServerProcess:
    """`python -m ds4pool serve` as a child process on a fixed port (kept across restarts),
    its output appended to `log_path` (a file, never a pipe: a pipe nobody reads would
    block the server once it fills)."""

    def __init__(
        self, demo_dir: Path, log_path: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.demo_dir = demo_dir
        self.log_path = log_path
        self.args = list(args)
        self.env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._log_offset = 0  # where the current run's output starts in the log

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 180.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        # restore policy "always": these tests count what a restore brings back; whether the
        # cost model would rather recompute depends on the machine's load (kv/cost.py, tested
        # in tests/unit/test_restore_cost.py)
        env = {
            **os.environ,
            "DS4POOL_CACHE": str(self.demo_dir.parent),
            "DS4POOL_RESTORE_POLICY": "always",
            **self.env,
        }
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== test harness: start #{self.starts} ===\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ds4pool",
                    "serve",
                    "--model",
                    str(self.demo_dir),
                    "--port",
                    str(self.port),
                    *self.args,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not ready after {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: no flush, no shutdown handler, like a power cut for the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (graceful: running requests finish, sessions are flushed)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"server ignored SIGTERM for {timeout:.0f}s") from None
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def current_log(self) -> str:
        """The output of the current (or last) run only."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return self.log()[-n:]


# ---------------------------------------------------------------------------- workloads

WORDS = (
    "read list grep patch build test commit file module function class error trace import "
    "return value branch merge diff line token cache session agent tool result parse write "
    "config server client request response queue worker thread lock batch kernel tensor"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Conversation:
    """One agent's multi-turn chat. mode 'echo': the assistant's text goes back verbatim (what
    agents do; the server reuses the exact sampled ids). mode 'canon': it goes back reformatted,
    so the server re-tokenizes the history and the completion depends on the prompt text only."""

    session_id: str
    mode: str
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0

    @classmethod
    def new(cls, session_id: str, mode: str, seed: int, system_words: int = 40) -> Conversation:
        rng = random.Random(seed)
        c = cls(session_id, mode, rng)
        c.messages.append(
            {"role": "system", "content": f"agent {session_id}: " + words(rng, system_words)}
        )
        c.messages.append({"role": "user", "content": "task: " + words(rng, 8)})
        return c

    def add_reply(self, text: str, next_user_words: int = 8) -> None:
        content = text if self.mode == "echo" else f"(reply {self.turns}) {text}"
        self.messages.append({"role": "assistant", "content": content})
        self.messages.append(
            {"role": "user", "content": "tool result: " + words(self.rng, next_user_words)}
        )
        self.turns += 1


def chat_body(messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "demo",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def cached_tokens(doc: dict[str, Any]) -> int:
    return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])


# ---------------------------------------------------------------------------- snapshots on disk


@dataclass(frozen=True)
class SnapInfo:
    token_ids: list[int]
    text: str
    num_kv_tokens: int


def expected_reuse(snap: SnapInfo | None, prompt: str, tok: Tokenizer) -> int:
    """The prefix a session restored from `snap` must reuse for `prompt`: what
    SessionLease.prepare specifies (text extension keeps the exact ids, else the longest
    common token prefix), capped by the KV in the snapshot and by one token left to compute."""
    if snap is None:
        return 0

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    if snap.text and snap.token_ids and prompt.startswith(snap.text):
        ids = snap.token_ids + encode(prompt[len(snap.text) :])
    else:
        ids = encode(prompt)
    common = 0
    for a, b in zip(ids, snap.token_ids):
        if a != b:
            break
        common += 1
    return max(0, min(common, snap.num_kv_tokens, len(ids) - 1))


def scan_snapshots(disk: Path, fp: ModelFingerprint) -> tuple[dict, list[Path], list[str]]:
    """Every *.snap in the dir, fully validated: {key: SnapInfo}, temp files, bad files."""
    good: dict[tuple[str, str], SnapInfo] = {}
    bad: list[str] = []
    for path in sorted(disk.glob("*.snap")):
        try:
            snap = decode_snapshot(path.read_bytes(), fp, directory_reader(disk, fp))
            assert path.name == session_file_name(*snap.key), path.name
        except (SnapshotError, AssertionError) as exc:
            bad.append(f"{path.name}: {exc}")
            continue
        good[snap.key] = SnapInfo(snap.token_ids, snap.text, snap.header.num_kv_tokens)
    return good, sorted(disk.glob(".*.tmp")), bad


def really_bad(path: Path, fp: ModelFingerprint) -> bool:
    """A quarantined file (named <original>.<ns>) is bad if it fails full validation or does
    not belong under its original name."""
    original = path.name.rsplit(".", 1)[0]
    try:
        # its shared blocks are read from the live directory (the quarantine dir's parent)
        snap = decode_snapshot(path.read_bytes(), fp, directory_reader(path.parent.parent, fp))
    except SnapshotError:
        return True
    return session_file_name(*snap.key) != original


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (Prometheus text format) whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(r"^" + re.escape(name) + r"(?:\{(.*?)\})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def snapshot_errors(url: str, kind: str = "write") -> float:
    """ds4pool_snapshot_errors_total{kind=...} from a server's /metrics (0 if absent)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return metric(text, "ds4pool_snapshot_errors_total", kind=kind)


# ---------------------------------------------------------------------------- in-process servers


class StatusCounter:
    """ASGI middleware that counts the status of every HTTP response the app sends."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.counts: Counter[int] = Counter()
        self.errors: list[str] = []  # "STATUS METHOD PATH: body" of every 5xx
        self.lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        status = 0

        async def counting_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                with self.lock:
                    self.counts[status] += 1
            elif message["type"] == "http.response.body" and status >= 500:
                body = bytes(message.get("body", b""))[:200].decode(errors="replace")
                with self.lock:
                    self.errors.append(f"{status} {scope['method']} {scope['path']}: {body}")
                status = 0  # one entry per response
            await send(message)

        await self.app(scope, receive, counting_send)

    def server_errors(self) -> int:
        with self.lock:
            return sum(n for status, n in self.counts.items() if status >= 500)

    def total(self) -> int:
        with self.lock:
            return sum(self.counts.values())


@dataclass
class InProcessServer:
    url: str
    engine: Any
    statuses: StatusCounter
    server: Any
    thread: threading.Thread

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close()


def start_in_process(
    loaded: Any, engine_kw: dict[str, Any] | None = None, **server_kw: Any
) -> InProcessServer:
    """An Engine on `loaded` behind the real app on uvicorn, in a thread of this process."""
    import uvicorn

    from ds4pool.api.app import create_app
    from ds4pool.api.config import ServerConfig
    from ds4pool.engine import Engine, EngineConfig

    engine_cfg = EngineConfig(
        **{"kv_device_gb": 0.05, "restore_policy": "always", **(engine_kw or {})}
    )
    engine = Engine(engine_cfg, loaded=loaded, pool_observer=server_kw.pop("observer", None))
    cfg = ServerConfig(engine=engine_cfg, port=free_port(), **server_kw)
    statuses = StatusCounter(create_app(cfg, engine, own_engine=False))
    server = uvicorn.Server(
        uvicorn.Config(statuses, host="127.0.0.1", port=cfg.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 60, "the in-process server")
    return InProcessServer(f"http://127.0.0.1:{cfg.port}", engine, statuses, server, thread)


# ---------------------------------------------------------------------------- driving agents


@dataclass
class Drive:
    """Figures and failures of `drive()`; `state` holds each session's newest text state
    (prompt + completion of its last turn), what a resume from its newest snapshot restores."""

    requests: int = 0
    compared: int = 0
    failures: list[str] = field(default_factory=list)
    state: dict[str, str] = field(default_factory=dict)
    cached: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def one_turn(
    conv: Conversation,
    subject: httpx.Client,
    ref: httpx.Client | None,
    tok: Tokenizer,
    out: Drive,
    max_tokens: int,
    check: Callable[[dict, str], str | None] | None = None,
) -> None:
    """Send the conversation's next turn to the subject (and the reference, comparing the
    completions), then append the reply. `check(doc, prompt)` may return a failure."""
    body = chat_body(conv.messages, max_tokens)
    prompt = tok.apply_chat_template(conv.messages, add_generation_prompt=True)
    headers = {"X-Session-Id": conv.session_id}
    r = subject.post("/v1/chat/completions", json=body, headers=headers)
    with out.lock:
        out.requests += 1
    if r.status_code != 200:
        with out.lock:
            out.failures.append(f"{conv.session_id}: {r.status_code} {r.text[:200]}")
        return
    doc = r.json()
    text = doc["choices"][0]["message"]["content"]
    problems = []
    if cached_tokens(doc) >= doc["usage"]["prompt_tokens"]:
        problems.append(f"cached {cached_tokens(doc)} >= prompt {doc['usage']['prompt_tokens']}")
    if check is not None and (p := check(doc, prompt)):
        problems.append(p)
    if ref is not None:
        rr = ref.post("/v1/chat/completions", json=body, headers=headers)
        if rr.status_code != 200:
            problems.append(f"reference answered {rr.status_code}")
        elif (want := rr.json()["choices"][0]["message"]["content"]) != text:
            problems.append(f"turn {conv.turns}: {text!r} != reference {want!r}")
    with out.lock:
        out.compared += ref is not None
        out.cached[conv.session_id] = cached_tokens(doc)
        out.failures.extend(f"{conv.session_id}: {p}" for p in problems)
        out.state[conv.session_id] = prompt + text
    conv.add_reply(text)


def drive(
    subject_url: str,
    ref_url: str | None,
    convs: list[Conversation],
    turns: int,
    tok: Tokenizer,
    *,
    max_tokens: int = 12,
    clients: int = 8,
    out: Drive | None = None,
    timeout: float = 300.0,
) -> Drive:
    """`clients` threads; each owns every clients-th conversation and runs `turns` turns of
    each, round-robin, so a session sits idle (and moves down the tiers) between its turns."""
    out = out or Drive()

    def client(i: int) -> None:
        mine = convs[i::clients]
        with (
            http_client(subject_url, timeout) as subject,
            http_client(ref_url or subject_url, timeout) as ref,
        ):
            for _ in range(turns):
                for conv in mine:
                    try:
                        one_turn(conv, subject, ref if ref_url else None, tok, out, max_tokens)
                    except Exception as exc:  # a transport error is a lost request
                        with out.lock:
                            out.failures.append(f"{conv.session_id}: {exc!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout * turns * max(1, len(convs) // clients))
        if t.is_alive():
            out.failures.append("a client thread did not finish")
    return out
