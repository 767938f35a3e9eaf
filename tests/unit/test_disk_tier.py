"""The disk tier: atomic writes, LRU budget, quarantine, restart, crash and ENOSPC behaviour."""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import ds4pool.kv.disk_files as disk_files
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_files import DirectoryLockedError, DiskEntry
from ds4pool.kv.disk_write import DiskWriteError, SnapshotTooLargeError
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.snapshot import Snapshot, encode_snapshot
from ds4pool.kv.snapshot_header import read_header

FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "bfloat16", "sha256:abc")
BIG = 1 << 16  # tokens in the crash tests' snapshots: ~8 MB, so a kill often lands mid-write
REPO = Path(__file__).resolve().parents[2]


def snap(
    session_id: str = "agent-1",
    version: int = 1,
    num_tokens: int = 6,
    tenant: str = "acme",
    fp: ModelFingerprint = FP,
) -> Snapshot:
    """A snapshot whose every token id and KV value is `version`, so a read tells which one."""
    kv = [
        torch.full(
            (fp.num_planes, num_tokens, fp.num_kv_heads, fp.head_dim),
            float(version),
            dtype=fp.torch_dtype,
        )
        for _ in range(fp.num_layers)
    ]
    return Snapshot.create(tenant, session_id, fp, [version] * num_tokens, f"v{version}", kv)


def same(a: Snapshot | None, b: Snapshot) -> bool:
    return (
        a is not None
        and (a.key, a.token_ids, a.text) == (b.key, b.token_ids, b.text)
        and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.kv, b.kv))
    )


class Errors(list[str]):
    def __call__(self, kind: str) -> None:
        self.append(kind)


def tier(
    path: Path, budget: int = 1 << 30, fp: ModelFingerprint = FP, errors: Errors | None = None
) -> DiskTier:
    return DiskTier(path, budget, fp, on_error=errors)


def files(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.is_file()} - {".lock"}


def test_write_read_delete(tmp_path: Path) -> None:
    with tier(tmp_path) as t:
        s = snap()
        n = t.write(s)
        assert n == t.path_for("acme", "agent-1").stat().st_size == t.used_bytes
        assert t.contains("acme", "agent-1") and t.keys() == [("acme", "agent-1")]
        info = t.info("acme", "agent-1")
        assert info is not None
        assert (info.num_bytes, info.num_tokens, info.num_kv_tokens) == (n, 6, 6)
        assert same(t.read("acme", "agent-1"), s)
        assert t.read("acme", "nope") is None and t.info("acme", "nope") is None
        s2 = snap(version=2, num_tokens=9)  # overwrite: one file, new size
        assert t.write(s2) == t.used_bytes and len(files(tmp_path)) == 1
        assert same(t.read("acme", "agent-1"), s2)
        assert t.delete("acme", "agent-1") and not t.delete("acme", "agent-1")
        assert t.used_bytes == 0 and files(tmp_path) == set()


NASTY = [
    "../x",
    "/etc/passwd",
    "a/../../b",
    "..",
    ".",
    "",
    "\x00",
    "a\x00b",
    "x" * 10_000,
    "\udc80",
    "C:\\con",
    "🦀/" * 50,
    "\n.snap",
]


def test_path_for_never_leaves_the_directory(tmp_path: Path) -> None:
    with tier(tmp_path) as t:
        names = set()
        for tenant in ["acme", *NASTY[:3]]:
            for sid in NASTY:
                p = t.path_for(tenant, sid)
                assert p.parent == tmp_path.resolve()
                assert re.fullmatch(r"[0-9a-f]{64}\.snap", p.name)
                names.add(p.name)
        assert len(names) == 4 * len(NASTY)
        # Concatenations collide, length-prefixed hashes do not.
        assert t.path_for("a", "bc") != t.path_for("ab", "c")
        assert t.path_for("a\x00", "b") != t.path_for("a", "\x00b")
        for sid in NASTY:  # and they round-trip through a real write and read
            s = snap(sid, tenant="../t\x00")
            t.write(s)
            assert same(t.read("../t\x00", sid), s)
        assert len(files(tmp_path)) == len(NASTY)
        assert all(p.name == "quarantine" for p in tmp_path.iterdir() if p.is_dir())


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_quarantined(root: Path, name: str, kind: str) -> None:
    assert name not in files(root)
    moved = [p for p in (root / "quarantine").iterdir() if p.name.startswith(name)]
    reason = [p for p in moved if p.name.endswith(".reason")]
    assert len(moved) == 2 and len(reason) == 1
    assert f"kind: {kind}" in reason[0].read_text()


@pytest.mark.parametrize("where", ["prefix", "header", "tokens", "middle", "last"])
def test_flipped_byte_is_quarantined_on_read(tmp_path: Path, where: str) -> None:
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        t.write(snap(num_tokens=40))
        path = t.path_for("acme", "agent-1")
        with open(path, "rb") as f:
            header_bytes = read_header(f).header_bytes
        offset = {
            "prefix": 12,
            "header": 40,
            "tokens": header_bytes + 1,
            "middle": (header_bytes + path.stat().st_size) // 2,
            "last": -1,
        }[where]
        flip(path, offset)
        assert t.read("acme", "agent-1") is None
        assert errors == ["checksum"]
        assert not t.contains("acme", "agent-1") and t.used_bytes == 0
        assert_quarantined(tmp_path, path.name, "checksum")
        assert t.read("acme", "agent-1") is None and errors == ["checksum"]  # reported once


@pytest.mark.parametrize("keep", [10, 100, -1])
def test_truncated_file_is_quarantined(tmp_path: Path, keep: int) -> None:
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        t.write(snap(num_tokens=40))
        path = t.path_for("acme", "agent-1")
        data = path.read_bytes()
        path.write_bytes(data[:keep])
        assert t.read("acme", "agent-1") is None
        assert errors == ["truncated"]
        assert_quarantined(tmp_path, path.name, "truncated")


@pytest.mark.parametrize("damage", ["flip-header", "truncate-payload", "misnamed", "garbage"])
def test_bad_files_are_quarantined_at_start(tmp_path: Path, damage: str) -> None:
    with tier(tmp_path) as t:
        t.write(snap())
        t.write(snap("other"))
        path = t.path_for("acme", "agent-1")
    expected = {
        "flip-header": "checksum",
        "truncate-payload": "truncated",
        "misnamed": "format",
        "garbage": "format",
    }[damage]
    if damage == "flip-header":
        flip(path, 30)
    elif damage == "truncate-payload":
        path.write_bytes(path.read_bytes()[:-1])
    elif damage == "misnamed":  # a valid snapshot under another key's name
        path.write_bytes(encode_snapshot(snap("someone-else")))
    else:
        path.write_bytes(b"not a snapshot at all")
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        assert errors == [expected]
        assert t.keys() == [("acme", "other")]
        assert_quarantined(tmp_path, path.name, expected)


def test_foreign_fingerprint_is_quarantined_at_start(tmp_path: Path) -> None:
    with tier(tmp_path) as t:
        for i in range(3):
            t.write(snap(f"s{i}"))
    errors = Errors()
    other = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "bfloat16", "sha256:new-weights")
    with tier(tmp_path, fp=other, errors=errors) as t:
        assert errors == ["fingerprint"] * 3 and t.keys() == [] and files(tmp_path) == set()
        with pytest.raises(ValueError):
            t.write(snap())  # a snapshot of another model is a caller bug
    assert len(list((tmp_path / "quarantine").iterdir())) == 6


def test_mla_snapshots_survive_a_restart_and_a_gqa_tier_quarantines_them(tmp_path: Path) -> None:
    mla = ModelFingerprint("DeepseekV3ForCausalLM", 2, 1, 24, "bfloat16", "sha256:abc", "mla")
    written = snap("s", 3, fp=mla)
    with tier(tmp_path, fp=mla) as t:
        t.write(written)
    with tier(tmp_path, fp=mla) as t:  # a restart: the index is rebuilt from the headers
        assert t.keys() == [("acme", "s")]
        assert same(t.read("acme", "s"), written)
    errors = Errors()
    gqa = ModelFingerprint("DeepseekV3ForCausalLM", 2, 1, 24, "bfloat16", "sha256:abc", "kv")
    with tier(tmp_path, fp=gqa, errors=errors) as t:
        assert errors == ["fingerprint"] and t.keys() == []


def test_index_is_rebuilt_from_headers_in_lru_order(tmp_path: Path) -> None:
    originals = {f"s{i}": snap(f"s{i}", version=i) for i in range(5)}
    with tier(tmp_path) as t:
        for s in originals.values():
            t.write(s)
        assert t.read("acme", "s1") is not None  # s1 becomes most recently used
        used, infos = t.used_bytes, {k: t.info(*k) for k in t.keys()}
    (tmp_path / ".crash.tmp").write_bytes(b"half a snapshot")
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        assert errors == [] and ".crash.tmp" not in files(tmp_path)
        assert t.keys() == [("acme", s) for s in ["s0", "s2", "s3", "s4", "s1"]]
        assert t.used_bytes == used
        for key, info in infos.items():
            assert info is not None and t.info(*key) == info
        for sid, s in originals.items():
            assert same(t.read("acme", sid), s)


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    size = len(encode_snapshot(snap("s00")))
    budget = 10 * size + size // 2
    model: OrderedDict[str, int] = OrderedDict()  # the documented policy, LRU first
    evicted: list[DiskEntry] = []
    with DiskTier(tmp_path, budget, FP, on_evict=evicted.append) as t:
        for i in range(60):
            sid = f"s{i:02d}"
            model[sid] = t.write(snap(sid))
            model.move_to_end(sid)
            expected_evicted = []
            while sum(model.values()) > budget:
                expected_evicted.append(model.popitem(last=False)[0])
            assert [e.session_id for e in evicted] == expected_evicted
            evicted.clear()
            if i % 3 == 0:  # keep s00 hot: it must survive 60 writes into a 10-file budget
                assert t.read("acme", "s00") is not None
                model.move_to_end("s00")
            assert t.used_bytes <= budget
            assert t.used_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.snap"))
            assert t.keys() == [("acme", k) for k in model]
            assert [(e.tenant, e.session_id) for e in t.entries()] == t.keys()
        assert ("acme", "s00") in t.keys() and len(t.keys()) == 10


def test_budget_shrunk_between_runs(tmp_path: Path) -> None:
    with tier(tmp_path) as t:
        sizes = [t.write(snap(f"s{i}")) for i in range(6)]
    with tier(tmp_path, budget=sum(sizes[-2:])) as t:
        assert t.keys() == [("acme", "s4"), ("acme", "s5")]
        assert len(files(tmp_path)) == 2


def test_snapshot_larger_than_the_budget(tmp_path: Path) -> None:
    errors = Errors()
    with tier(tmp_path, budget=2000, errors=errors) as t:
        t.write(snap(num_tokens=1))
        with pytest.raises(SnapshotTooLargeError):
            t.write(snap(num_tokens=500))
        assert errors == ["too_large"] and t.keys() == [] and files(tmp_path) == set()


@pytest.mark.parametrize("fail_in", ["write", "fsync", "rename"])
def test_enospc_keeps_the_old_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_in: str
) -> None:
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        old = snap(version=1)
        t.write(old)
        before = (t.used_bytes, files(tmp_path))

        def full(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def half_then_full(f, s, **kwargs):  # type: ignore[no-untyped-def]
            f.write(encode_snapshot(s)[:100])
            full()

        if fail_in == "write":
            monkeypatch.setattr(disk_files, "write_snapshot", half_then_full)
        else:
            monkeypatch.setattr(os, "fsync" if fail_in == "fsync" else "replace", full)
        with pytest.raises(DiskWriteError) as e:
            t.write(snap(version=2, num_tokens=50))
        monkeypatch.undo()
        assert e.value.errno == errno.ENOSPC and errors == ["write"]
        assert (t.used_bytes, files(tmp_path)) == before  # no temp file left behind
        assert same(t.read("acme", "agent-1"), old)


def test_one_tier_per_directory(tmp_path: Path) -> None:
    t = tier(tmp_path)
    with pytest.raises(DirectoryLockedError):
        tier(tmp_path)
    t.close()
    tier(tmp_path).close()


def test_concurrent_writer_and_reader(tmp_path: Path) -> None:
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        keys = [f"s{i}" for i in range(8)]

        def writer() -> None:
            for v in range(80):
                t.write(snap(keys[v % 8], version=v))

        th = threading.Thread(target=writer)
        th.start()
        reads = 0
        while th.is_alive() or reads < 50:
            got = t.read("acme", random.choice(keys))
            if got is not None:  # a complete version, never a mix of two
                v = got.token_ids[0]
                assert same(got, snap(got.header.session_id, version=v))
                reads += 1
        th.join()
        assert errors == [] and len(t.keys()) == 8


CHILD = """
import os, sys, time
import ds4pool.kv.disk_files as disk_files
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.snapshot import encode_snapshot
sys.path.insert(0, {tests!r})
from test_disk_tier import BIG, snap
mode, directory = sys.argv[1], sys.argv[2]
t = DiskTier(directory, 1 << 30, ModelFingerprint(*{fp!r}))
if mode == "loop":
    for v in range(1, 10**6):
        t.write(snap(version=v, num_tokens=BIG))
        print(v, flush=True)
if mode == "pause-second":
    t.write(snap(version=1, num_tokens=BIG))
def half_then_hang(f, s, **kw):
    data = encode_snapshot(s, **kw)
    f.write(data[: len(data) // 2])
    f.flush()
    print("MIDWRITE", flush=True)
    time.sleep(60)
disk_files.write_snapshot = half_then_hang
t.write(snap(version=2, num_tokens=BIG))
"""


def spawn(mode: str, directory: Path) -> subprocess.Popen[str]:
    fp = (FP.architecture, FP.num_layers, FP.num_kv_heads, FP.head_dim, FP.dtype, FP.weights_id)
    code = CHILD.format(tests=str(Path(__file__).parent), fp=fp)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, mode, str(directory)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def kill9(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("mode", ["pause-first", "pause-second"])
def test_sigkill_mid_write_leaves_old_or_nothing(tmp_path: Path, mode: str) -> None:
    proc = spawn(mode, tmp_path)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "MIDWRITE"
    kill9(proc)
    assert any(n.endswith(".tmp") for n in files(tmp_path))  # the half-written temp file
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        assert errors == [] and not any(n.endswith(".tmp") for n in files(tmp_path))
        got = t.read("acme", "agent-1")
        if mode == "pause-first":
            assert got is None and t.keys() == []
        else:
            assert same(got, snap(version=1, num_tokens=BIG))


def got_name(t: DiskTier) -> str:
    return t.path_for("acme", "agent-1").name


def test_sigkill_at_a_random_moment(tmp_path: Path) -> None:
    proc = spawn("loop", tmp_path)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "1"
    time.sleep(random.uniform(0.0, 0.5))
    kill9(proc)
    done = [int(line) for line in proc.stdout.read().split()] or [1]
    errors = Errors()
    with tier(tmp_path, errors=errors) as t:
        got = t.read("acme", "agent-1")
        assert errors == [] and got is not None and list(files(tmp_path)) == [got_name(t)]
        v = got.token_ids[0]
        assert v in (max(done), max(done) + 1)  # the last finished write, or one in flight
        assert same(got, snap(version=v, num_tokens=BIG))
