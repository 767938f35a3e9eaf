"""Load: many sessions, many concurrent clients, device and RAM budgets that hold only a
handful of sessions, so sessions keep moving device → RAM → disk → device.

Checks: every completion equals the same session's requests run alone, one at a time, on a
separate in-process engine with room for everything (no cross-session mix-up, no state lost
in a tier move); no request is lost; the server's RSS stays within its KV budgets plus a
stated overhead (see RSS_OVERHEAD).
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import httpx
import pytest

from ds4pool.model.tokenizer import Tokenizer
from tests.reliability.helpers import (
    Conversation,
    ServerProcess,
    cached_tokens,
    chat_body,
    drive,
    http_client,
    metric,
    report,
    rss_bytes,
    size,
    start_in_process,
)

pytestmark = pytest.mark.timeout(size(300, 1800))

SEED = 777
SESSIONS = size(48, 256)
CLIENTS = size(8, 32)
TURNS = size(2, 4)
MAX_TOKENS = 16
SYSTEM_WORDS = 150  # ~350 prompt tokens: ~1.5 MB of fp32 KV per session with the demo model
KV_DEVICE_GB = 0.008  # 131 blocks of 16 tokens: about 4 sessions
KV_RAM_GB = 0.008  # about 4 sessions
MiB = 1 << 20
# RSS budget: baseline + RAM budget + RSS_OVERHEAD.
# - The baseline is measured once the server is ready; it already holds the device KV pool
#   (torch zero-fills it at start-up, so its pages are resident), the model and the runtime.
# - The RAM tier is bounded by --kv-ram-gb (its LRU counts bytes).
# - RSS_OVERHEAD: transient copies of the sessions being moved (gather_to_host, the lz4 frames
#   of a snapshot being written and of one being read, torch.stack on restore: a few copies of
#   a ~1.5 MB session at once, on the worker and on the persist thread), allocator slack
#   (glibc keeps freed chunks of these few-MB buffers in its per-thread arenas), Python
#   objects per session (token ids, texts) and the HTTP buffers of CLIENTS connections.
#   With --cpu-linear auto (the CPU default) also oneDNN's primitives for the row buckets
#   that the steps reach (model/cpu_linear.py): measured ~20 MiB more growth than F.linear.
# A tier leak (every session's KV kept) would add SESSIONS x ~1.5 MB on top: 72 MB reduced,
# 384 MB full.
RSS_OVERHEAD = 96 * MiB


def conversations() -> list[Conversation]:
    return [
        Conversation.new(f"load-{i}", "echo", seed=SEED + i, system_words=SYSTEM_WORDS)
        for i in range(SESSIONS)
    ]


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.samples = pid, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
                self.samples += 1
            except (OSError, AssertionError):
                return
            self._stop.wait(0.05)


def test_many_sessions_tiny_budgets(
    demo_dir: Path,
    tmp_path: Path,
    loaded,  # noqa: ANN001
    tokenizer: Tokenizer,
) -> None:
    t0 = time.monotonic()
    server = ServerProcess(
        demo_dir,
        tmp_path / "server.log",
        "--kv-device-gb", str(KV_DEVICE_GB),
        "--kv-ram-gb", str(KV_RAM_GB),
        "--kv-disk-dir", str(tmp_path / "kv"),
        "--kv-disk-gb", "4",
        "--kv-persist-idle-s", "2",
    )  # fmt: skip
    convs = conversations()
    turns: dict[str, list[tuple[dict, str]]] = {c.session_id: [] for c in convs}
    try:
        server.start()
        baseline = rss_bytes(server.pid)
        with RssSampler(server.pid) as rss:
            out = drive(
                server.url, None, convs, TURNS, tokenizer, clients=CLIENTS, max_tokens=MAX_TOKENS
            )
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert server.stop() in (0, -15), server.tail()
    finally:
        server.kill()
    load_s = time.monotonic() - t0

    # The subject's prompts and answers, per session, rebuilt from the conversations.
    for conv in convs:
        msgs = conv.messages
        # messages: system, user, then (assistant, user) per turn
        for t in range(conv.turns):
            body = chat_body(copy.deepcopy(msgs[: 2 + 2 * t]), MAX_TOKENS)
            turns[conv.session_id].append((body, msgs[2 + 2 * t]["content"]))

    # The reference: each session alone, its turns one by one, on a roomy in-process engine.
    mismatches: list[str] = []
    ref = start_in_process(loaded, {"kv_device_gb": 0.05})
    try:
        with http_client(ref.url) as c:
            for sid, seq in turns.items():
                for t, (body, text) in enumerate(seq):
                    r = c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
                    assert r.status_code == 200, r.text
                    if r.json()["choices"][0]["message"]["content"] != text:
                        got = r.json()["choices"][0]["message"]["content"]
                        mismatches.append(f"{sid} turn {t}: {text!r} != reference {got!r}")
                    if t:
                        assert cached_tokens(r.json()) > 0
                assert c.delete(f"/v1/sessions/{sid}").status_code == 200
    finally:
        ref.close()

    sent = SESSIONS * TURNS
    answered = sum(len(v) for v in turns.values())
    allowed = baseline + int(KV_RAM_GB * (1 << 30)) + RSS_OVERHEAD
    moves = metric(metrics, "ds4pool_session_moves_total")
    report(
        "load",
        sessions=SESSIONS,
        clients=CLIENTS,
        turns_per_session=TURNS,
        requests=out.requests,
        answered=answered,
        lost=sent - answered,
        failures=len(out.failures) + len(mismatches),
        mismatches=len(mismatches),
        tier_moves=int(moves),
        moves_to_disk=int(metric(metrics, "ds4pool_session_moves_total", to="disk")),
        restores_from_disk=int(metric(metrics, "ds4pool_session_moves_total", **{"from": "disk"})),
        preemptions=int(metric(metrics, "ds4pool_preemptions_total")),
        rss_baseline_mib=round(baseline / MiB, 1),
        rss_peak_mib=round(rss.peak / MiB, 1),
        rss_allowed_mib=round(allowed / MiB, 1),
        rss_growth_mib=round((rss.peak - baseline) / MiB, 1),
        device_pool_mib=round(KV_DEVICE_GB * 1024, 1),
        ram_budget_mib=round(KV_RAM_GB * 1024, 1),
        overhead_allowed_mib=RSS_OVERHEAD // MiB,
        all_sessions_kv_mib=round(SESSIONS * 1.5, 0),
        load_seconds=round(load_s, 1),
        seconds=round(time.monotonic() - t0, 1),
    )
    assert not out.failures, "\n".join(out.failures[:20])
    assert answered == sent == out.requests
    assert not mismatches, mismatches[:20]
    assert moves > SESSIONS, "sessions did not move between tiers"
    assert rss.peak <= allowed, f"RSS peak {rss.peak / MiB:.0f} MiB > {allowed / MiB:.0f} MiB"


def test_preempted_request_whose_kv_is_lost(
    loaded,  # noqa: ANN001
    tokenizer: Tokenizer,
) -> None:
    """Regression: a request preempted to RAM whose KV then could not be kept (RAM budget 0,
    no disk tier) resumed as if its KV were still there (500s, or garbage attention)."""
    t0 = time.monotonic()
    subject = start_in_process(
        loaded, {"kv_device_gb": 0.003, "kv_ram_gb": 0.0, "max_batch_tokens": 64}
    )
    ref = start_in_process(loaded, {"kv_device_gb": 0.2})
    convs = [Conversation.new(f"lost-{i}", "echo", seed=i, system_words=120) for i in range(6)]
    try:
        out = drive(subject.url, ref.url, convs, 2, tokenizer, max_tokens=16, clients=3)
        subject.engine.pool.check_integrity()
        errors = subject.statuses.server_errors()
    finally:
        subject.close()
        ref.close()
    report(
        "preempt_kv_lost",
        sessions=len(convs),
        requests=out.requests,
        completions_compared=out.compared,
        responses_5xx=errors,
        failures=len(out.failures),
        seconds=round(time.monotonic() - t0, 1),
    )
    assert errors == 0 and not out.failures, "\n".join(out.failures[:10])
