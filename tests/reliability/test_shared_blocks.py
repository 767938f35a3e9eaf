"""Shared block files under faults: sessions sharing a system prompt keep its KV in block
files written once (kv/blockstore.py). A block file corrupted on disk (a flipped byte, cut
short), found while serving or at a restart, is quarantined; every session that relied on it
recomputes, and its greedy output equals a reference that never evicted anything. A SIGKILL
in the middle of a block-file write leaves no partial block file visible, and a restart
indexes the block files that are there."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.blockfile import decode_block, read_block_header
from ds4pool.kv.blockstore import BLOCK_SUFFIX
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_files import QUARANTINE_DIR
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.pool import PoolObserver
from ds4pool.kv.snapshot import Snapshot
from ds4pool.model.loader import LoadedModel
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import Request
from tests.reliability.helpers import report, size

pytestmark = pytest.mark.timeout(size(300, 900))

GREEDY = SamplingParams(temperature=0.0)
BS = 16
SESSIONS = size(5, 12)
REPO = Path(__file__).resolve().parents[2]


class Errors(PoolObserver):
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def snapshot_error(self, kind: str) -> None:
        self.kinds.append(kind)


def engine(loaded: LoadedModel, disk: Path | None, observer: PoolObserver | None = None) -> Engine:
    cfg = EngineConfig(
        kv_device_gb=0.05, kv_disk_dir=disk, kv_persist_idle_s=0, kv_persist_every_tokens=0
    )
    return Engine(cfg, loaded=loaded, pool_observer=observer)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def run(e: Engine, prompt: list[int], sid: str) -> tuple[list[int], int]:
    req = Request(tenant="t", session_id=sid, prompt_ids=prompt, max_tokens=8, sampling=GREEDY)
    _, out, final = e.submit(req).collect(timeout=120)
    assert final.error is None and final.usage is not None, final.error
    e.pool.check_integrity()
    return out, final.usage.cached_tokens


def how_kind(how: str) -> str:
    return "checksum" if how == "flip" else "truncated"


def damage(path: Path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) - 7] ^= 0x10  # inside the last KV frame: only a full read sees it
        path.write_bytes(bytes(data))
    else:
        os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize(
    "how,when", [("flip", "live"), ("flip", "restart"), ("truncate", "restart")]
)
def test_a_bad_shared_block_file_makes_its_sessions_recompute_exactly(
    loaded: LoadedModel, tmp_path: Path, how: str, when: str
) -> None:
    system = ids(0, 8 * BS + 3)
    first = {f"s{i}": system + ids(100 + i, 5 + i) for i in range(SESSIONS)}

    # the reference never evicts: the same two turns on one engine without a disk tier
    ref = engine(loaded, None)
    try:
        want: dict[str, list[int]] = {}
        second: dict[str, list[int]] = {}
        for sid, p in first.items():
            out, _ = run(ref, p, sid)
            second[sid] = p + out + ids(200, 6)
        for sid, p in second.items():
            want[sid] = run(ref, p, sid)[0]
    finally:
        ref.close()

    disk = tmp_path / "kv"
    errors = Errors()
    e = engine(loaded, disk, errors)
    try:
        for sid, p in first.items():
            run(e, p, sid)
        for sid in first:
            e.pool.evict("t", sid, "disk")  # every session now lives in files only
        e.pool.drop_cached_blocks()  # and nothing of the system prompt stays on the device
        blocks = sorted(disk.glob(f"*{BLOCK_SUFFIX}"))
        assert len(blocks) == 8  # the system prompt's full blocks, once
        bad = blocks[3]
        if when == "restart":
            e.close()
            damage(bad, how)
            errors.kinds.clear()
            e = engine(loaded, disk, errors)
        else:
            damage(bad, how)
        got = {sid: run(e, p, sid) for sid, p in second.items()}
        disk_tier = e.pool.disk
        assert disk_tier is not None
        assert disk_tier.used_bytes <= disk_tier.budget_bytes
    finally:
        e.close()

    for sid, (out, _) in got.items():
        assert out == want[sid], f"{sid}: {out} != {want[sid]}"
    quarantined = list((disk / QUARANTINE_DIR).glob(f"{bad.name}.*[0-9]"))
    assert len(quarantined) == 1, sorted(os.listdir(disk / QUARANTINE_DIR))
    reason = quarantined[0].with_name(quarantined[0].name + ".reason").read_text()
    assert how_kind(how) in reason
    # found by the first read (live) or at start-up: counted once, its sessions dropped with it
    assert errors.kinds == [how_kind(how)]
    # no session resumed from its own snapshot: each one recomputed (or took the system
    # prompt from one that had recomputed it), never a block that did not verify
    own = [cached for _, cached in got.values()]
    assert max(own) <= len(system) - len(system) % BS, own
    report(
        f"shared_blocks[{how}-{when}]",
        sessions=SESSIONS,
        block_files=8,
        cached_after=sum(own),
        errors=len(errors.kinds),
    )


# ---------------------------------------------------------------------------- SIGKILL

FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 64, "bfloat16", "sha256:kill")
KILL_BS = 256  # large blocks: a block file takes long enough to write that a kill lands in one

CHILD = """
import sys, time, torch
import ds4pool.kv.blockstore as blockstore
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.snapshot import Snapshot
fp = ModelFingerprint(*{fp!r})
bs, mode, directory = {bs}, sys.argv[1], sys.argv[2]
t = DiskTier(directory, 1 << 34, fp)
def snap(i, n_shared):
    n = n_shared * bs + 7
    g = torch.Generator().manual_seed(i)
    kv = [torch.randn((2, n, fp.num_kv_heads, fp.head_dim), generator=g).to(torch.bfloat16)
          for _ in range(fp.num_layers)]
    keys = [f"{{i:016x}}{{j:016x}}" for j in range(n_shared)]
    return Snapshot.create("acme", f"s{{i}}", fp, [i % 200] * n, "", kv, shared=keys, block_size=bs)
t.write(snap(0, 2))
print("READY", flush=True)
if mode == "hang":
    real = blockstore.write_block
    def half_then_hang(f, block, **kw):
        class Half:
            data = []
            def write(self, b): self.data.append(bytes(b))
        h = Half()
        real(h, block, **kw)
        whole = b"".join(h.data)
        f.write(whole[: len(whole) // 2])
        f.flush()
        print("MIDWRITE", flush=True)
        time.sleep(60)
    blockstore.write_block = half_then_hang
    t.write(snap(1, 3))
for i in range(1, 10**6):
    t.write(snap(i, 3))
    print(i, flush=True)
"""


def spawn(mode: str, directory: Path) -> subprocess.Popen[str]:
    fp = (FP.architecture, FP.num_layers, FP.num_kv_heads, FP.head_dim, FP.dtype, FP.weights_id)
    code = CHILD.format(fp=fp, bs=KILL_BS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, mode, str(directory)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


def kill9(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def check_dir_after_kill(directory: Path) -> int:
    """Every visible block file is complete and valid; a restart indexes them, removes the
    temp files, and every session it indexes reads back whole. Returns the sessions."""
    for path in directory.glob(f"*{BLOCK_SUFFIX}"):
        with open(path, "rb") as f:
            h = read_block_header(f)
        assert path.stat().st_size == h.file_bytes, path.name
        with open(path, "rb") as f:
            decode_block(f, FP, h.key, h.tenant, h.position, read_tokens_of(path))
    errors: list[str] = []
    with DiskTier(directory, 1 << 34, FP, on_error=errors.append) as t:
        assert errors == [], errors
        assert not list(directory.glob(".*.tmp"))
        keys = t.keys()
        for key in keys:
            snap = t.read(*key)
            assert isinstance(snap, Snapshot) and snap.key == key
        listed = {k for e in t.entries() for k in e.blocks}
        on_disk = {p.name[: -len(BLOCK_SUFFIX)] for p in directory.glob(f"*{BLOCK_SUFFIX}")}
        assert listed == on_disk  # no orphan survives the restart, none is missing
        assert errors == [], errors
    return len(keys)


def read_tokens_of(path: Path) -> list[int]:
    from ds4pool.kv.framing import read_tokens

    with open(path, "rb") as f:
        h = read_block_header(f)
        return read_tokens(f, h.tokens)


def test_sigkill_in_the_middle_of_a_block_file_write(tmp_path: Path) -> None:
    proc = spawn("hang", tmp_path)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "MIDWRITE"
    kill9(proc)
    assert list(tmp_path.glob(".*.tmp"))  # the half-written block, never under its name
    assert len(list(tmp_path.glob(f"*{BLOCK_SUFFIX}"))) == 2  # s0's, complete
    assert check_dir_after_kill(tmp_path) == 1


def test_sigkill_at_random_moments_of_block_file_writes(tmp_path: Path) -> None:
    rng = random.Random(77)
    for _ in range(size(3, 10)):
        proc = spawn("loop", tmp_path)
        time.sleep(rng.uniform(0.05, 0.6))
        kill9(proc)
        check_dir_after_kill(tmp_path)
