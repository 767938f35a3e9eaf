"""Shared block files of the disk tier: written once, counted once, reference counted, verified
on every read, quarantined when bad (and every session relying on one dropped), and indexed
again at restart. Snapshots of version 1 keep reading."""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import pytest
import torch

from ds4pool.kv.blockfile import decode_block
from ds4pool.kv.blockstore import BLOCK_SUFFIX, index_secret
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_files import QUARANTINE_DIR, DiskEntry
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import PREFIX_SIZE, SnapshotError
from ds4pool.kv.snapshot import Snapshot, decode_snapshot, encode_snapshot

FP = ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "bfloat16", "sha256:abc")
BS = 4
PREFIX = list(range(100, 100 + 3 * BS))  # three full shared blocks
KEYS = [f"{i:032x}" for i in (0xA1, 0xA2, 0xA3)]


def session(sid: str, tail: list[int], shared: int = 3, tenant: str = "acme") -> Snapshot:
    """A session whose tokens are PREFIX + tail, its first `shared` blocks shared. Every KV
    value of token i is a function of (token id, position): sessions agree on the prefix."""
    ids = PREFIX + tail
    n = len(ids)
    tok = torch.tensor(ids, dtype=torch.float32)[:, None, None]  # [T, 1, 1]
    pos = torch.arange(n, dtype=torch.float32)[:, None, None]
    head = torch.arange(FP.num_kv_heads, dtype=torch.float32)[None, :, None]
    dim = torch.arange(FP.head_dim, dtype=torch.float32)[None, None, :]
    noisy = torch.sin(tok * 1.37 + pos * 0.11 + head * 0.7 + dim * 0.013)  # [T, H, D]
    kv = [
        torch.stack([noisy * (layer + 1), -noisy]).to(FP.torch_dtype)  # [P, T, H, D]
        for layer in range(FP.num_layers)
    ]
    return Snapshot.create(
        tenant, sid, FP, ids, f"text {sid}", kv, shared=KEYS[:shared], block_size=BS
    )


def same(a: Snapshot | None, b: Snapshot) -> bool:
    return (
        a is not None
        and (a.key, a.token_ids, a.text) == (b.key, b.token_ids, b.text)
        and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.kv, b.kv))
    )


def blocks(root: Path) -> list[Path]:
    return sorted(root.glob(f"*{BLOCK_SUFFIX}"))


def sizes(root: Path) -> int:
    return sum(p.stat().st_size for p in [*root.glob("*.snap"), *blocks(root)])


def test_shared_blocks_are_written_once_and_counted_once(tmp_path: Path) -> None:
    a, b = session("a", [1, 2, 3, 4, 5]), session("b", [6, 7])
    with DiskTier(tmp_path, 1 << 20, FP) as d:
        d.write(a)
        first = {p.name: p.stat().st_mtime_ns for p in blocks(tmp_path)}
        d.write(b)
        assert [p.name for p in blocks(tmp_path)] == [f"{k}{BLOCK_SUFFIX}" for k in KEYS]
        assert {p.name: p.stat().st_mtime_ns for p in blocks(tmp_path)} == first  # not rewritten
        assert d.used_bytes == sizes(tmp_path)  # each block file once
        d.check_integrity()
        assert d.block_bytes == sum(p.stat().st_size for p in blocks(tmp_path))
        assert same(d.read("acme", "a"), a) and same(d.read("acme", "b"), b)
        # the session files hold only their private tokens' KV
        private = encode_snapshot(Snapshot.create("acme", "b", FP, b.token_ids, b.text, b.kv))
        assert d.path_for("acme", "b").stat().st_size < len(private)
    with DiskTier(tmp_path, 1 << 20, FP) as d:  # restart: block files indexed again
        assert d.used_bytes == sizes(tmp_path)
        d.check_integrity()
        assert same(d.read("acme", "a"), a) and same(d.read("acme", "b"), b)


def test_a_block_file_goes_with_the_last_session_relying_on_it(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 20, FP) as d:
        d.write(session("a", [1]))
        d.write(session("b", [2], shared=2))
        d.delete("acme", "a")
        assert [p.name[:32] for p in blocks(tmp_path)] == KEYS[:2]  # b still needs two
        assert d.used_bytes == sizes(tmp_path)
        d.check_integrity()
        d.write(session("b", [2], shared=0))  # b's newer snapshot shares nothing: version 1
        assert blocks(tmp_path) == [] and d.block_bytes == 0
        assert d.used_bytes == sizes(tmp_path)
        d.check_integrity()
        assert d.path_for("acme", "b").read_bytes()[8:10] == struct.pack("<H", 1)


def test_budget_eviction_frees_block_files_once_unreferenced(tmp_path: Path) -> None:
    a, b, c = session("a", [1]), session("b", [2]), session("c", [3], shared=0, tenant="other")
    with DiskTier(tmp_path / "probe", 1 << 20, FP) as probe:
        probe.write(a)
        probe.write(b)
        used_ab, a_file = probe.used_bytes, probe.info("acme", "a").num_bytes
        c_file = probe.write(c)
    evicted: list[DiskEntry] = []
    # c fits once a (but not its blocks: b relies on them) is gone; the slack covers the
    # few bytes a header's `created` may differ by
    budget = used_ab - a_file + c_file + 64
    with DiskTier(tmp_path / "d", budget, FP, on_evict=evicted.append) as d:
        d.write(a)
        d.write(b)
        d.write(c)
        assert [e.session_id for e in evicted] == ["a"]
        assert len(blocks(tmp_path / "d")) == 3
        assert d.used_bytes == sizes(tmp_path / "d") <= budget
        d.check_integrity()
        d.delete("acme", "b")
        assert blocks(tmp_path / "d") == [] and d.used_bytes == sizes(tmp_path / "d")


def flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last KV frame
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_bad_block_file_is_quarantined_and_every_session_using_it_dropped(
    tmp_path: Path, damage: str
) -> None:
    errors: list[str] = []
    evicted: list[DiskEntry] = []
    with DiskTier(tmp_path, 1 << 20, FP, on_error=errors.append, on_evict=evicted.append) as d:
        d.write(session("a", [1]))
        d.write(session("b", [2]))
        d.write(session("c", [3], shared=0))
        path = tmp_path / f"{KEYS[1]}{BLOCK_SUFFIX}"
        if damage == "flip":
            flip_payload(path)
        else:
            os.truncate(path, path.stat().st_size - 5)
        assert d.read("acme", "a") is None  # nothing of it is loaded
        assert errors == ["checksum" if damage == "flip" else "truncated"]
        assert [e.session_id for e in evicted] == ["b"]  # the other one relying on it
        assert d.keys() == [("acme", "c")] and blocks(tmp_path) == []
        assert d.used_bytes == sizes(tmp_path)
        d.check_integrity()
        (bad,) = (tmp_path / QUARANTINE_DIR).glob(f"{KEYS[1]}{BLOCK_SUFFIX}.*[0-9]")
        reason = bad.with_name(bad.name + ".reason").read_text()
        assert ("checksum" if damage == "flip" else "truncated") in reason


def test_a_truncated_block_file_is_quarantined_at_start(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 20, FP) as d:
        d.write(session("a", [1]))
        d.write(session("b", [2], shared=1))
    path = tmp_path / f"{KEYS[2]}{BLOCK_SUFFIX}"
    os.truncate(path, PREFIX_SIZE + 10)
    errors: list[str] = []
    with DiskTier(tmp_path, 1 << 20, FP, on_error=errors.append) as d:
        assert errors == ["truncated"]
        assert d.keys() == [("acme", "b")]  # a lost a block; b relies on the first only
        assert [p.name[:32] for p in blocks(tmp_path)] == KEYS[:1]
        assert d.read("acme", "b") is not None
        assert d.used_bytes == sizes(tmp_path)
        d.check_integrity()


def test_a_block_file_of_another_session_content_is_never_loaded(tmp_path: Path) -> None:
    """A valid block file under a name a session lists, holding other tokens (or another
    tenant's block): refused as `format`, whatever its name says."""
    with DiskTier(tmp_path, 1 << 20, FP) as d:
        d.write(session("a", [1]))
    kv = [t[:, :12] for t in session("z", [0]).kv]
    other = Snapshot.create("acme", "x", FP, [9] * 12, "", kv, shared=KEYS, block_size=BS)
    with DiskTier(tmp_path / "other", 1 << 20, FP) as o:
        o.write(other)
    os.replace(
        tmp_path / "other" / f"{KEYS[0]}{BLOCK_SUFFIX}", tmp_path / f"{KEYS[0]}{BLOCK_SUFFIX}"
    )
    errors: list[str] = []
    with DiskTier(tmp_path, 1 << 20, FP, on_error=errors.append) as d:
        assert d.read("acme", "a") is None
        assert errors == ["format"]


def test_orphan_block_files_and_temp_files_go_at_start(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 20, FP) as d:
        d.write(session("a", [1]))
    os.unlink(tmp_path / next(tmp_path.glob("*.snap")).name)  # as if killed before the rename
    (tmp_path / ".x.tmp").write_bytes(b"half a block")
    with DiskTier(tmp_path, 1 << 20, FP) as d:
        assert d.keys() == [] and d.used_bytes == 0
    assert blocks(tmp_path) == [] and not list(tmp_path.glob("*.tmp"))


def test_a_version_2_snapshot_needs_its_blocks_and_version_1_still_reads(tmp_path: Path) -> None:
    a = session("a", [1, 2])
    with pytest.raises(SnapshotError, match="block files") as e:
        decode_snapshot(encode_snapshot(a), FP)
    assert e.value.kind == "format"
    plain = Snapshot.create("acme", "p", FP, a.token_ids, a.text, a.kv)
    data = encode_snapshot(plain)
    assert struct.unpack_from("<H", data, 8) == (1,)
    assert same(decode_snapshot(data, FP), plain)
    # a version-2 prefix on a header without shared keys is malformed, not guessed at
    body_len = struct.unpack_from("<I", data, 12)[0]
    body = data[PREFIX_SIZE : PREFIX_SIZE + body_len]
    prefix = struct.pack("<8sHHII", data[:8], 2, 0, len(body), zlib.crc32(body))
    v2 = prefix + struct.pack("<I", zlib.crc32(prefix)) + data[PREFIX_SIZE:]
    with pytest.raises(SnapshotError, match="shared") as e:
        decode_snapshot(v2, FP)
    assert e.value.kind == "format"


def test_the_index_secret_is_kept_in_the_directory(tmp_path: Path) -> None:
    s = index_secret(tmp_path / "d")
    assert len(s) == 16 and index_secret(tmp_path / "d") == s
    assert (tmp_path / "d" / ".index_secret").stat().st_mode & 0o777 == 0o600
    assert index_secret(tmp_path / "e") != s


def test_a_session_listing_a_cached_block_with_other_tokens_is_refused(tmp_path: Path) -> None:
    """The decoded-block cache is checked like a file: a session whose tokens are not the
    block's gets nothing from it (and the block, not what it claims, is quarantined)."""
    a = session("a", [1])
    kv = [t[:, :12] for t in session("z", [0]).kv]
    forged = Snapshot.create("acme", "x", FP, [9] * 12, "", kv, shared=KEYS[:1], block_size=BS)
    errors: list[str] = []
    with DiskTier(tmp_path, 1 << 20, FP, on_error=errors.append) as d:
        d.write(a)
        assert same(d.read("acme", "a"), a)  # its blocks are cached now
        d.write(forged)  # lists a's first block file (already there: not rewritten)
        assert d.read("acme", "x") is None
        assert errors == ["format"]
        assert d.read("acme", "a") is None and d.keys() == []  # a relied on it too


def test_every_flipped_byte_of_a_block_file_is_caught(tmp_path: Path) -> None:
    a = session("a", [1])
    with DiskTier(tmp_path, 1 << 20, FP) as d:
        d.write(a)
    path = tmp_path / f"{KEYS[1]}{BLOCK_SUFFIX}"
    data = path.read_bytes()
    ids = a.token_ids[BS : 2 * BS]
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(SnapshotError):
            decode_block(io.BytesIO(bytes(bad)), FP, KEYS[1], "acme", 1, ids)
    assert len(decode_block(io.BytesIO(data), FP, KEYS[1], "acme", 1, ids)) == FP.num_layers


def test_a_tokens_only_read_reads_no_block_file(tmp_path: Path) -> None:
    """kv=False (a session to recompute, kv/cost.py): tokens and text, no block file opened."""
    a = session("a", [1, 2])
    errors: list[str] = []
    with DiskTier(tmp_path, 1 << 20, FP, on_error=errors.append) as d:
        d.write(a)
        flip_payload(tmp_path / f"{KEYS[0]}{BLOCK_SUFFIX}")
        got = d.read("acme", "a", kv=False)
        assert got is not None and (got.token_ids, got.text, got.kv) == (a.token_ids, a.text, [])
        assert errors == [] and len(blocks(tmp_path)) == 3
        assert d.read("acme", "a") is None and errors == ["checksum"]  # a full read checks
