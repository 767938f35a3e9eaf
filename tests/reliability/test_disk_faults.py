"""Disk full and I/O errors during snapshot writes: serving goes on, errors are counted,
and nothing half-written is ever loaded.

1. `ds4pool serve` with its disk dir on a tiny tmpfs (real ENOSPC from the kernel): short
   sessions' snapshots fit, long ones never do. Skipped where tmpfs cannot be mounted.
2. An in-process engine whose snapshot writer fails on purpose (monkeypatched): EIO before
   writing, ENOSPC half-way through a file, EIO on the rename into place. Runs everywhere.

Both then restart on the same dir and check that exactly the valid snapshots are indexed and
that every session resumes from its newest valid snapshot (or fresh) with the right output.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import ds4pool.kv.disk_files as disk_files
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.pool import PoolObserver
from ds4pool.kv.snapshot import encode_snapshot
from ds4pool.model.tokenizer import Tokenizer
from tests.reliability.helpers import (
    Conversation,
    Drive,
    ServerProcess,
    drive,
    expected_reuse,
    http_client,
    one_turn,
    report,
    scan_snapshots,
    size,
    snapshot_errors,
    start_in_process,
)

pytestmark = pytest.mark.timeout(size(300, 1200))

SEED = 4242
SESSIONS = size(8, 24)
TURNS = size(3, 8)
TMPFS_SIZE = "512k"


def conversations(prefix: str) -> list[Conversation]:
    """Half long (their snapshots never fit the tiny tmpfs), half short; echo and canon."""
    return [
        Conversation.new(
            f"{prefix}{i}",
            "echo" if i % 2 else "canon",
            seed=SEED + i,
            system_words=120 if i % 4 < 2 else 2,
        )
        for i in range(SESSIONS)
    ]


def resume_turn(
    convs: list[Conversation],
    url: str,
    ref_url: str,
    tok: Tokenizer,
    snaps: dict,
    state: dict[str, str],
    tenant: str = "default",
) -> Drive:
    """One more turn per session after a restart: cached tokens as the newest valid snapshot
    says; completions equal the reference where the restored state is the newest one."""
    out = Drive()
    with (
        http_client(url) as subject,
        http_client(ref_url) as ref,
    ):
        for conv in convs:
            snap = snaps.get((tenant, conv.session_id))

            def check(doc: dict, prompt: str, snap=snap) -> str | None:  # noqa: ANN001
                want = expected_reuse(snap, prompt, tok)
                got = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
                return None if got == want else f"resumed with {got} cached, expected {want}"

            lossless = conv.mode == "canon" or (
                snap is not None and snap.text == state[conv.session_id]
            )
            one_turn(conv, subject, ref if lossless else None, tok, out, 12, check)
    return out


# ---------------------------------------------------------------------------- 1. real ENOSPC


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "kv"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the in-process test runs")
    try:
        yield mnt
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        else:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_on_tmpfs(
    demo_dir: Path,
    tmp_path: Path,
    tiny_tmpfs: Path,
    loaded,  # noqa: ANN001
    tokenizer: Tokenizer,
    fingerprint: ModelFingerprint,
) -> None:
    t0 = time.monotonic()
    server = ServerProcess(
        demo_dir,
        tmp_path / "server.log",
        "--kv-disk-dir", str(tiny_tmpfs),
        "--kv-device-gb", "0.006",
        "--kv-ram-gb", "0.002",
        "--kv-persist-every-tokens", "4",
        "--kv-persist-idle-s", "0.05",
    )  # fmt: skip
    ref = start_in_process(loaded, {"kv_device_gb": 0.2})
    convs = conversations("full-")
    try:
        server.start()
        first = drive(server.url, ref.url, convs, TURNS, tokenizer, clients=4)
        time.sleep(0.5)  # let the write-behind thread try its last snapshots
        errors_before_restart = snapshot_errors(server.url, "write")
        assert server.stop() in (0, -15), server.tail()  # the shutdown flush hits ENOSPC too
        log = server.current_log()
        state = dict(first.state)

        good, tmps, bad = scan_snapshots(tiny_tmpfs, fingerprint)
        assert not bad, bad
        assert not tmps, f"a failed write left temp files: {tmps}"
        server.start()
        log2 = server.current_log()
        assert f"disk tier: {len(good)} snapshots," in log2, log2[-2000:]
        assert "quarantining" not in log2
        second = resume_turn(convs, server.url, ref.url, tokenizer, good, state)
        errors_total = errors_before_restart + snapshot_errors(server.url, "write")
        assert server.stop() in (0, -15), server.tail()
    finally:
        server.kill()
        ref.close()
    failures = first.failures + second.failures
    report(
        "disk_full_tmpfs",
        tmpfs=TMPFS_SIZE,
        sessions=len(convs),
        requests=first.requests + second.requests,
        completions_compared=first.compared + second.compared,
        write_errors_counted=int(errors_total),
        enospc_in_log=(log + log2).count("No space left on device"),
        snapshots_indexed_after_restart=len(good),
        sessions_checked=len(convs),
        failures=len(failures),
        seconds=round(time.monotonic() - t0, 1),
    )
    assert errors_before_restart > 0, "no snapshot write failed: the tmpfs is too large"
    assert good, "no snapshot fitted: the tmpfs is too small for the short sessions"
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------------------- 2. injected faults


class CountingObserver(PoolObserver):
    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.lock = threading.Lock()

    def snapshot_error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] += 1


def test_injected_write_faults_in_process(
    tmp_path: Path,
    loaded,  # noqa: ANN001
    tokenizer: Tokenizer,
    fingerprint: ModelFingerprint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t0 = time.monotonic()
    disk = tmp_path / "kv"
    rng = random.Random(SEED)
    lock = threading.Lock()
    faults: Counter[str] = Counter()
    writes: Counter[str] = Counter()
    real_write, real_replace = disk_files.write_snapshot, os.replace

    def faulty_write(f, snapshot, *, shuffle=False):  # noqa: ANN001, ANN202
        with lock:
            r = rng.random()
            writes["attempts"] += 1
        if r < 0.2:
            with lock:
                faults["eio_before_write"] += 1
            raise OSError(errno.EIO, "injected EIO")
        if r < 0.4:  # half a file, then the disk is full
            data = encode_snapshot(snapshot, shuffle=shuffle)
            f.write(data[: len(data) // 2])
            f.flush()
            with lock:
                faults["enospc_mid_write"] += 1
            raise OSError(errno.ENOSPC, "injected ENOSPC")
        return real_write(f, snapshot, shuffle=shuffle)

    def faulty_replace(src, dst, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(src).endswith(disk_files.TMP_SUFFIX) and Path(src).parent == disk.resolve():
            with lock:
                hit = rng.random() < 0.25
                faults["eio_on_rename"] += hit
            if hit:
                raise OSError(errno.EIO, "injected EIO on rename")
        return real_replace(src, dst, *a, **kw)

    observer = CountingObserver()
    engine_kw = {
        "kv_device_gb": 0.006,
        "kv_ram_gb": 0.002,
        "kv_disk_dir": disk,
        "kv_persist_every_tokens": 4,
        "kv_persist_idle_s": 0.05,
    }
    ref = start_in_process(loaded, {"kv_device_gb": 0.2})
    convs = conversations("eio-")
    try:
        with monkeypatch.context() as mp:
            mp.setattr(disk_files, "write_snapshot", faulty_write)
            mp.setattr(disk_files.os, "replace", faulty_replace)
            srv = start_in_process(loaded, engine_kw, observer=observer)
            try:
                first = drive(srv.url, ref.url, convs, TURNS, tokenizer, clients=4)
                srv.engine.pool.writer.drain()
                srv.engine.pool.check_integrity()
                server_errors = srv.statuses.server_errors()
                error_detail = list(srv.statuses.errors)
            finally:
                srv.close()  # the shutdown flush meets faults too
        good, tmps, bad = scan_snapshots(disk, fingerprint)
        assert not tmps, f"failed writes left temp files: {tmps}"
        assert not bad, f"a half-written snapshot is in place: {bad}"
        observer2 = CountingObserver()
        srv = start_in_process(loaded, engine_kw, observer=observer2)
        try:
            indexed = {(i.tenant, i.session_id) for i in srv.engine.pool.list_sessions()}
            assert indexed == set(good), (sorted(indexed), sorted(good))
            second = resume_turn(convs, srv.url, ref.url, tokenizer, good, dict(first.state))
            srv.engine.pool.check_integrity()
            server_errors += srv.statuses.server_errors()
        finally:
            srv.close()
    finally:
        ref.close()
    failures = first.failures + second.failures
    injected = sum(faults.values())
    report(
        "disk_write_faults_in_process",
        sessions=len(convs),
        requests=first.requests + second.requests,
        completions_compared=first.compared + second.compared,
        write_attempts=writes["attempts"],
        faults_injected=injected,
        faults_by_kind=dict(faults),
        write_errors_counted=observer.errors["write"],
        snapshots_indexed_after_restart=len(good),
        sessions_checked=len(convs),
        responses_5xx=server_errors,
        failures=len(failures),
        seconds=round(time.monotonic() - t0, 1),
    )
    assert injected > 0 and len(good) > 0
    assert observer.errors["write"] == injected, (dict(observer.errors), dict(faults))
    assert set(observer.errors) == {"write"} and not observer2.errors
    assert server_errors == 0, error_detail + failures[:10]
    assert not failures, "\n".join(failures[:20])
