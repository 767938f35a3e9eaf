"""Crash safety: SIGKILL `ds4pool serve` at random moments under an agent workload, restart
it on the same disk dir, and check that sessions resume from their last snapshot, that greedy
output equals a server that never crashed, and that no corrupt snapshot is ever loaded.

The subject runs with tiny device and RAM budgets and persists every few tokens, so snapshot
writes are frequent and some kills land in the middle of one. Some restarts also get a fault
planted in the disk dir while the server is down: a half-written temp file, a truncated
snapshot, a flipped byte in a snapshot's KV, a garbage file with a snapshot's name.

Two kinds of conversations run side by side (see helpers.Conversation): 'echo' ones send the
completion back verbatim, as agents do; the server then keeps the exact sampled token ids, and
a resume equals the never-crashed reference only when the snapshot holds the newest state (a
resume from an older one re-tokenizes the newer text, which can give other ids: the
conversation is then restarted under a new id and counted as a lossy resume). 'canon' ones
send it back reformatted, so their completions depend on the prompt text alone and must equal
the reference after every resume, lossy or not.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_files import QUARANTINE_DIR, session_file_name
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.snapshot_header import read_header
from ds4pool.model.tokenizer import Tokenizer
from tests.reliability.helpers import (
    Conversation,
    InProcessServer,
    ServerProcess,
    cached_tokens,
    chat_body,
    expected_reuse,
    http_client,
    really_bad,
    report,
    scan_snapshots,
    size,
    start_in_process,
)

pytestmark = pytest.mark.timeout(size(300, 1800))

SEED = 20261129
N_WORKERS = size(4, 10)
KILLS = size(3, 24)
TURNS_PER_CONVERSATION = 6
MAX_TOKENS = 12
FAULTS = ("tmp", "truncate", "bitflip", "garbage")
TENANT = "default"
REQUEST_TIMEOUT_S = 120.0
RESTART_WAIT_S = 300.0


class CrashRun:
    def __init__(
        self,
        subject: ServerProcess,
        ref: InProcessServer,
        disk: Path,
        fp: ModelFingerprint,
        tok: Tokenizer,
    ) -> None:
        self.subject, self.ref, self.disk, self.fp, self.tok = subject, ref, disk, fp, tok
        self.rng = random.Random(SEED)
        self.lock = threading.Lock()
        self.up = threading.Event()
        self.kills_done = threading.Event()
        self.aborted = threading.Event()  # the killer failed: workers stop
        self.generation = 0  # bumped at every kill, before the restart
        self.snapshots: dict[int, dict] = {0: {}}  # generation → {key: SnapInfo} at its start
        self.corrupted: dict[int, set] = {0: set()}  # keys whose snapshot a fault destroyed
        self.active: set[str] = set()  # session ids of the conversations running now
        self.fig: Counter[str] = Counter()
        self.failures: list[str] = []
        self.injected_bad = 0  # corrupt files planted (each must end up quarantined)
        self.flipped: dict[str, tuple[int, int]] = {}  # file → (mtime_ns, size) as corrupted
        self.unread_flipped = 0

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.fig[key] += n

    def fail(self, msg: str) -> None:
        with self.lock:
            self.failures.append(msg)

    # ------------------------------------------------------------------ the killer

    def killer(self) -> None:
        try:
            plan = [FAULTS[i % len(FAULTS)] for i in range(KILLS)]
            if KILLS > len(FAULTS):  # the full run also has plain kills
                plan = [f if i % 5 else "none" for i, f in enumerate(plan)]
            self.rng.shuffle(plan)
            for k, fault in enumerate(plan, 1):
                time.sleep(self.rng.uniform(0.3, 2.5))
                if k % 2 == 0:  # every other kill aims at a snapshot write in progress
                    self.count("kills_during_a_write", self.wait_for_a_write(3.0))
                self.up.clear()
                with self.lock:
                    self.generation = k
                self.subject.kill()
                self.count("kills", 1)
                good, tmps, bad = scan_snapshots(self.disk, self.fp)
                self.count("tmp_files_after_kill", len(tmps))
                self.count("snapshots_after_kill", len(good))
                unread = 0  # flipped by an earlier fault, never read since: still indexed
                for b in bad:
                    name = b.split(":", 1)[0]
                    if self.flipped.get(name) == self.stat(name):
                        unread += 1
                    else:
                        self.fail(f"kill {k}: a snapshot in place after SIGKILL is invalid: {b}")
                self.unread_flipped = unread
                corrupted = self.inject(fault, good)
                with self.lock:
                    self.snapshots[k], self.corrupted[k] = good, corrupted
                self.subject.start()
                self.check_startup(k, tmps, good)
                self.up.set()
        except BaseException as exc:  # surface it in the test, never leave workers hanging
            self.fail(f"killer: {exc!r}")
            self.aborted.set()
            self.up.set()
        finally:
            self.kills_done.set()

    def stat(self, name: str) -> tuple[int, int]:
        st = os.stat(self.disk / name)
        return (st.st_mtime_ns, st.st_size)

    def wait_for_a_write(self, timeout: float) -> bool:
        """Spin until a snapshot temp file exists (a write is under way); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(n.endswith(".tmp") for n in os.listdir(self.disk)):
                return True
        return False

    def inject(self, fault: str, good: dict) -> set:
        """Plant `fault` in the dir of the dead server; returns the keys it corrupted."""
        self.count(f"fault_{fault}", 1)
        self.planted_tmp = self.planted_bad_at_start = self.truncated = 0
        with self.lock:
            active = sorted(k for k in good if k[1] in self.active)
        targets = active or sorted(good)
        if fault == "tmp":  # a write cut short by the crash: half a snapshot in a temp file
            src = self.disk / session_file_name(*targets[0]) if targets else None
            data = src.read_bytes() if src else os.urandom(4096)
            (self.disk / f".crash{self.generation}.tmp").write_bytes(data[: len(data) // 2])
            self.planted_tmp = 1
            return set()
        if fault == "garbage":  # a foreign or mangled file under a snapshot's name
            name = os.urandom(32).hex() + ".snap"
            (self.disk / name).write_bytes(os.urandom(self.rng.randint(1, 20000)))
            self.injected_bad += 1
            self.planted_bad_at_start = 1
            return set()
        if fault in ("truncate", "bitflip") and targets:
            key = self.rng.choice(targets)
            path = self.disk / session_file_name(*key)
            data = bytearray(path.read_bytes())
            if fault == "truncate":  # what a non-atomic writer would leave
                path.write_bytes(data[: self.rng.randint(1, len(data) - 1)])
                self.planted_bad_at_start = self.truncated = 1
            else:  # a flipped bit in the KV payload: the header still validates
                with open(path, "rb") as f:
                    h = read_header(f)
                kv_start = h.header_bytes + h.tokens.num_bytes + h.text.num_bytes
                data[self.rng.randrange(kv_start, len(data))] ^= 0x10
                path.write_bytes(bytes(data))
                self.flipped[path.name] = self.stat(path.name)  # still in `good`: indexed
            self.injected_bad += 1
            return {key}
        return set()

    def check_startup(self, k: int, tmps: list[Path], good: dict) -> None:
        """The restarted server removed every temp file without indexing it, quarantined
        exactly the files planted bad, and indexed every other snapshot."""
        log = self.subject.current_log()
        leftover = sorted(p.name for p in self.disk.glob(".*.tmp"))
        if leftover:
            self.fail(f"start {k}: temp files survived the restart: {leftover}")
        removed = log.count("removing leftover temp file")
        self.count("tmp_files_removed_at_start", removed)
        if removed != len(tmps) + self.planted_tmp:
            self.fail(f"start {k}: {removed} temp files removed, {len(tmps)} + planted")
        quarantined = log.count("quarantining")
        self.count("quarantined_at_start", quarantined)
        if quarantined != self.planted_bad_at_start:
            self.fail(f"start {k}: {quarantined} files quarantined at start")
        # a flipped KV bit passes the header check: such files are indexed, caught when read
        indexed = len(good) - self.truncated + self.unread_flipped
        if f"disk tier: {indexed} snapshots," not in log:
            line = next((ln for ln in log.splitlines() if "snapshots," in ln), "")
            self.fail(f"start {k}: expected {indexed} snapshots indexed, log: {line!r}")

    # ------------------------------------------------------------------ the agents

    def post_subject(self, client: httpx.Client, body: dict, sid: str) -> tuple[dict, int]:
        """Send until the subject answers; returns (response, generation that answered)."""
        deadline = time.monotonic() + RESTART_WAIT_S * 2
        while not self.aborted.is_set():
            assert time.monotonic() < deadline, "the subject never answered"
            if not self.up.wait(RESTART_WAIT_S):
                raise AssertionError("the subject did not come back")
            with self.lock:
                g = self.generation
            try:
                r = client.post(
                    self.subject.url + "/v1/chat/completions",
                    json=body,
                    headers={"X-Session-Id": sid},
                )
            except httpx.TransportError:
                self.count("requests_cut_by_kill", 1)
                time.sleep(0.05)
                continue
            if r.status_code != 200:
                self.fail(f"{sid}: subject answered {r.status_code}: {r.text[:200]}")
                time.sleep(0.2)
                continue
            return r.json(), g
        raise AssertionError("aborted")

    def worker(self, w: int) -> None:
        client = http_client(timeout=REQUEST_TIMEOUT_S)
        ref = http_client(self.ref.url, REQUEST_TIMEOUT_S)
        mode = "canon" if w % 2 else "echo"
        n_conv = 0

        def new_conversation() -> Conversation:
            nonlocal n_conv
            n_conv += 1
            c = Conversation.new(f"w{w}-c{n_conv}", mode, seed=SEED + 1000 * w + n_conv)
            with self.lock:
                self.active.add(c.session_id)
            return c

        conv = new_conversation()
        state_text = ""  # the newest state of the session the client knows of (echo)
        last_g = 0
        post_final = 0
        try:
            while post_final < 1 and not self.aborted.is_set():
                body = chat_body(conv.messages, MAX_TOKENS)
                prompt = self.tok.apply_chat_template(conv.messages, add_generation_prompt=True)
                doc, g = self.post_subject(client, body, conv.session_id)
                text = doc["choices"][0]["message"]["content"]
                cached, prompt_tokens = cached_tokens(doc), doc["usage"]["prompt_tokens"]
                self.count("turns", 1)
                if cached > prompt_tokens - 1:
                    self.fail(
                        f"{conv.session_id}: cached {cached} of {prompt_tokens} prompt tokens"
                    )
                resumed = g > last_g
                lossy = False
                if resumed:
                    with self.lock:
                        snap = self.snapshots[g].get((TENANT, conv.session_id))
                        if (TENANT, conv.session_id) in self.corrupted[g]:
                            snap = None
                    want = expected_reuse(snap, prompt, self.tok)
                    self.count("resumes_checked", 1)
                    self.count("resumes_from_snapshot", snap is not None)
                    if cached != want:
                        self.fail(
                            f"{conv.session_id} after start {g}: cached {cached}, expected "
                            f"{want} from the snapshot ({snap.num_kv_tokens if snap else 0} KV "
                            "tokens)"
                        )
                    if mode == "echo" and conv.turns and (snap is None or snap.text != state_text):
                        lossy = True
                ref_doc = None
                if not lossy:
                    rr = ref.post(
                        "/v1/chat/completions", json=body, headers={"X-Session-Id": conv.session_id}
                    )
                    assert rr.status_code == 200, rr.text
                    ref_doc = rr.json()
                    self.count("completions_compared", 1)
                    if ref_doc["choices"][0]["message"]["content"] != text:
                        self.fail(
                            f"{conv.session_id} turn {conv.turns} ({mode}, resumed={resumed}): "
                            f"{text!r} != reference {ref_doc['choices'][0]['message']['content']!r}"
                        )
                    elif not resumed and cached != cached_tokens(ref_doc):
                        # seen 1 of ~15 runs in session 33; session 37's log showed a
                        # copy-on-write on a full device rounding the reuse down to a block
                        # (fixed: idle sessions are demoted for the copy). The subject's own
                        # lines on this session and its warnings say why if it recurs
                        said = [
                            ln
                            for ln in self.subject.log().splitlines()
                            if f"session={conv.session_id} " in ln or "WARNING" in ln
                        ]
                        self.fail(
                            f"{conv.session_id} turn {conv.turns}: cached {cached}, the "
                            f"reference {cached_tokens(ref_doc)} (KV lost without a crash); "
                            "the subject's log on it:\n" + "\n".join(said[-12:])
                        )
                last_g = g
                if self.kills_done.is_set() and g == KILLS:
                    post_final += 1
                if lossy:
                    self.count("lossy_resumes", 1)
                    with self.lock:
                        self.active.discard(conv.session_id)
                    conv, state_text = new_conversation(), ""
                    continue
                conv.add_reply(text)
                state_text = prompt + text
                if conv.turns >= TURNS_PER_CONVERSATION:
                    with self.lock:
                        self.active.discard(conv.session_id)
                    conv, state_text = new_conversation(), ""
                    self.count("conversations_finished", 1)
        except BaseException as exc:
            self.fail(f"worker {w}: {exc!r}")
        finally:
            client.close()
            ref.close()


def test_sigkill_restart_resumes_sessions(
    demo_dir: Path, tmp_path: Path, loaded, tokenizer: Tokenizer, fingerprint: ModelFingerprint
) -> None:
    t0 = time.monotonic()
    disk = tmp_path / "kv"
    subject = ServerProcess(
        demo_dir,
        tmp_path / "subject.log",
        "--kv-disk-dir", str(disk),
        "--kv-device-gb", "0.004",
        "--kv-ram-gb", "0.004",
        "--kv-persist-every-tokens", "4",
        "--kv-persist-idle-s", "0.05",
    )  # fmt: skip
    ref = start_in_process(loaded, {"kv_device_gb": 0.2})
    run = CrashRun(subject, ref, disk, fingerprint, tokenizer)
    try:
        subject.start()
        run.up.set()
        workers = [threading.Thread(target=run.worker, args=(w,)) for w in range(N_WORKERS)]
        for t in workers:
            t.start()
        killer = threading.Thread(target=run.killer)
        killer.start()
        killer.join(timeout=KILLS * RESTART_WAIT_S)
        for t in workers:
            t.join(timeout=RESTART_WAIT_S)
            if t.is_alive():
                run.fail(f"{t.name} did not finish")
        rc = subject.stop()
        assert rc in (0, -15), subject.tail()
    finally:
        subject.kill()
        ref.close()

    # Final audit: every snapshot left is read back in full; every bad one gets quarantined.
    tier = DiskTier(disk, 1 << 40, fingerprint)
    try:
        unreadable = [e for e in tier.entries() if tier.read(e.tenant, e.session_id) is None]
    finally:
        tier.close()
    qfiles = (
        [p for p in (disk / QUARANTINE_DIR).glob("*") if not p.name.endswith(".reason")]
        if (disk / QUARANTINE_DIR).exists()
        else []
    )
    not_bad = [p.name for p in qfiles if not really_bad(p, fingerprint)]
    run.fig["quarantined_total"] = len(qfiles)
    run.fig["quarantined_in_final_audit"] = len(unreadable)
    if not_bad:
        run.fail(f"quarantined files that were valid: {not_bad}")
    if len(qfiles) != run.injected_bad:
        run.fail(f"{len(qfiles)} files quarantined, {run.injected_bad} corrupt files planted")
    if list(disk.glob(".*.tmp")):
        run.fail(f"temp files left: {list(disk.glob('.*.tmp'))}")
    report(
        "crash",
        kills=run.fig["kills"],
        restarts=subject.starts - 1,
        faults_injected=sum(run.fig[f"fault_{f}"] for f in FAULTS),
        faults_by_kind={f: run.fig[f"fault_{f}"] for f in FAULTS},
        turns=run.fig["turns"],
        requests_cut_by_kill=run.fig["requests_cut_by_kill"],
        sessions_checked=run.fig["resumes_checked"],
        resumes_from_snapshot=run.fig["resumes_from_snapshot"],
        lossy_resumes=run.fig["lossy_resumes"],
        completions_compared=run.fig["completions_compared"],
        kills_during_a_write=run.fig["kills_during_a_write"],
        tmp_files_after_kill=run.fig["tmp_files_after_kill"],
        quarantined=len(qfiles),
        corrupt_files_planted=run.injected_bad,
        failures=len(run.failures),
        seconds=round(time.monotonic() - t0, 1),
    )
    assert not run.failures, "\n".join(run.failures[:20])
