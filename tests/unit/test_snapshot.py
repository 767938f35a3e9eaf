"""The KV snapshot format: bitwise round trips, and every corruption is detected."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import zlib
from typing import Any

import pytest
import torch

from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import PREFIX_SIZE, SnapshotError
from ds4pool.kv.snapshot import Snapshot, decode_snapshot, encode_snapshot, write_snapshot
from ds4pool.kv.snapshot_header import FORMAT_VERSION, MAGIC, read_header

DTYPES = ["float32", "bfloat16", "float16"]


def fingerprint(dtype: str = "bfloat16", num_layers: int = 3) -> ModelFingerprint:
    return ModelFingerprint("LlamaForCausalLM", num_layers, 2, 8, dtype, "sha256:abc123")


def random_bits_kv(fp: ModelFingerprint, num_tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """Every bit pattern is fair game (NaNs with payloads, -0.0, inf, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    shape = (fp.num_planes, num_tokens, fp.num_kv_heads, fp.head_dim)
    nbytes = fp.torch_dtype.itemsize * fp.num_planes * num_tokens * fp.num_kv_heads * fp.head_dim
    return [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        .view(fp.torch_dtype)
        .view(shape)
        for _ in range(fp.num_layers)
    ]


def make(
    fp: ModelFingerprint,
    num_tokens: int = 7,
    text: str = "def f(x):\n    return x",
    seed: int = 0,
    num_kv_tokens: int | None = None,
) -> Snapshot:
    T = num_tokens if num_kv_tokens is None else num_kv_tokens
    ids = [(i * 7919 + seed) % 50_000 for i in range(num_tokens)]
    return Snapshot.create(
        "tenant-a", "agent-7", fp, ids, text, random_bits_kv(fp, T, seed), created=1_700_000_000.25
    )


def assert_same(a: Snapshot, b: Snapshot) -> None:
    assert (a.token_ids, a.text, a.key) == (b.token_ids, b.text, b.key)
    assert len(a.kv) == len(b.kv)
    for x, y in zip(a.kv, b.kv):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))  # bitwise, NaNs included


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bitwise(dtype: str, shuffle: bool) -> None:
    fp = fingerprint(dtype)
    snap = make(fp, num_tokens=33)
    out = decode_snapshot(encode_snapshot(snap, shuffle=shuffle), fp)
    assert_same(snap, out)
    assert out.header.shuffle is shuffle
    assert out.header.created == snap.header.created


def test_every_bf16_bit_pattern_survives_shuffle() -> None:
    fp = ModelFingerprint("x", 1, 1, 65536, "bfloat16", "w")
    all_patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    kv = [torch.stack([all_patterns, all_patterns.flip(0)]).view(torch.bfloat16).view(2, 1, 1, -1)]
    snap = Snapshot.create("t", "s", fp, [1], "x", kv)
    for shuffle in (False, True):
        assert_same(snap, decode_snapshot(encode_snapshot(snap, shuffle=shuffle), fp))


@pytest.mark.parametrize("text", ["", "héllo wörld ✓ 日本語 🦀 \u0301 \x00 \r\n\t", "x" * 10_000])
def test_text_round_trips(text: str) -> None:
    fp = fingerprint()
    assert decode_snapshot(encode_snapshot(make(fp, text=text)), fp).text == text


def test_zero_tokens() -> None:
    fp = fingerprint("float32")
    snap = make(fp, num_tokens=0, text="")
    for shuffle in (False, True):
        out = decode_snapshot(encode_snapshot(snap, shuffle=shuffle), fp)
        assert_same(snap, out)
        assert out.token_ids == [] and out.kv[0].shape == (2, 0, 2, 8)


def test_kv_may_lag_the_tokens_by_the_sampled_one() -> None:
    fp = fingerprint()
    snap = make(fp, num_tokens=10, num_kv_tokens=9)
    out = decode_snapshot(encode_snapshot(snap), fp)
    assert_same(snap, out)
    assert (out.header.num_tokens, out.header.num_kv_tokens) == (10, 9)


def test_write_to_file_and_read_back(tmp_path) -> None:
    fp = fingerprint("float16")
    snap = make(fp, num_tokens=20)
    path = tmp_path / "s.snap"
    with open(path, "wb") as f:
        written = write_snapshot(f, snap, shuffle=True)
    assert path.stat().st_size == written.file_bytes
    with open(path, "rb") as f:
        header = read_header(f)
        assert f.tell() == header.header_bytes  # read_header stops at the payload
    assert header == written
    with open(path, "rb") as f:
        assert_same(snap, decode_snapshot(f, fp))


def test_header_fields() -> None:
    fp = fingerprint()
    snap = make(fp, num_tokens=5)
    data = encode_snapshot(snap, shuffle=True)
    h = read_header(data)
    assert data[:8] == MAGIC and h.file_bytes == len(data)
    assert (h.tenant, h.session_id, h.fingerprint, h.num_tokens) == ("tenant-a", "agent-7", fp, 5)
    assert h.kv_shape == (2, 5, 2, 8) and len(h.kv) == fp.num_layers and h.shuffle


def test_fingerprint_digest_is_stable() -> None:
    # The digest lands in files on disk: changing how it is computed orphans every snapshot.
    fp = ModelFingerprint("LlamaForCausalLM", 2, 4, 64, "bfloat16", "abc")
    assert fp.digest() == dataclasses.replace(fp).digest()
    assert fp.digest() == "5c14f6926ce04bb30c3a6c7851768945fab281bde557cefc8e6dad496ca7ba4d"
    changes: list[tuple[str, Any]] = [
        ("architecture", "Qwen2"),
        ("num_layers", 3),
        ("num_kv_heads", 8),
        ("head_dim", 128),
        ("dtype", "float16"),
        ("weights_id", "abd"),
        ("kv_layout", "mla"),
    ]
    digests = {dataclasses.replace(fp, **{f: v}).digest() for f, v in changes}
    assert len(digests | {fp.digest()}) == 8


def mla_fingerprint(dtype: str = "bfloat16") -> ModelFingerprint:
    # DeepSeek-V3's latent: kv_lora_rank 512 + qk_rope_head_dim 64, here 16 + 8
    return ModelFingerprint("DeepseekV3ForCausalLM", 3, 1, 24, dtype, "sha256:abc123", "mla")


@pytest.mark.parametrize("shuffle", [False, True])
def test_mla_latent_round_trips_bitwise(shuffle: bool) -> None:
    fp = mla_fingerprint()
    s = make(fp, num_tokens=9)
    assert s.kv[0].shape == (1, 9, 1, 24)  # one plane: the latent, no K/V pair
    got = decode_snapshot(encode_snapshot(s, shuffle=shuffle), fp)
    assert got.header.kv_shape == (1, 9, 1, 24)
    for a, b in zip(got.kv, s.kv):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_kv_and_mla_snapshots_never_load_into_each_other() -> None:
    mla = mla_fingerprint()
    # same counts on both sides, only the layout differs
    kv = dataclasses.replace(mla, kv_layout="kv")
    for written, running in ((kv, mla), (mla, kv)):
        with pytest.raises(SnapshotError) as e:
            decode_snapshot(encode_snapshot(make(written)), running)
        assert e.value.kind == "fingerprint"


def test_header_without_kv_layout_reads_as_kv() -> None:
    # Files written before the fingerprint had kv_layout: their header lacks the key.
    fp = fingerprint()
    data = encode_snapshot(make(fp))
    header_len = struct.unpack_from("<I", data, 12)[0]
    doc = json.loads(data[PREFIX_SIZE : PREFIX_SIZE + header_len])
    del doc["fingerprint"]["kv_layout"]
    body = json.dumps(doc, separators=(",", ":")).encode()
    prefix = struct.pack("<8sHHII", MAGIC, 1, 0, len(body), zlib.crc32(body))
    old = prefix + struct.pack("<I", zlib.crc32(prefix)) + body + data[PREFIX_SIZE + header_len :]
    got = decode_snapshot(old, fp)
    assert got.header.fingerprint == fp and got.header.fingerprint.kv_layout == "kv"


@pytest.mark.parametrize(
    "field,value",
    [
        ("architecture", "Qwen2ForCausalLM"),
        ("num_layers", 4),
        ("dtype", "float16"),
        ("weights_id", "sha256:other"),
    ],
)
def test_foreign_fingerprint_is_rejected(field: str, value: Any) -> None:
    fp = fingerprint()
    data = encode_snapshot(make(fp))
    with pytest.raises(SnapshotError) as e:
        decode_snapshot(data, dataclasses.replace(fp, **{field: value}))
    assert e.value.kind == "fingerprint"


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_single_flipped_byte_is_detected(shuffle: bool) -> None:
    fp = fingerprint(num_layers=2)
    data = encode_snapshot(make(fp, num_tokens=3, text="hi ✓"), shuffle=shuffle)
    for i in range(len(data)):  # exhaustive: a few thousand decodes of a tiny file
        bad = bytearray(data)
        bad[i] ^= 0x01 if i % 2 else 0xFF
        with pytest.raises(SnapshotError) as e:
            decode_snapshot(bytes(bad), fp)
        assert e.value.kind in ("checksum", "format"), (i, e.value)
        if i >= 8:  # past the magic, a flip is always a checksum failure
            assert e.value.kind == "checksum", (i, e.value)


def test_every_truncation_is_detected() -> None:
    fp = fingerprint(num_layers=2)
    data = encode_snapshot(make(fp, num_tokens=3))
    for n in range(len(data)):
        with pytest.raises(SnapshotError) as e:
            decode_snapshot(data[:n], fp)
        assert e.value.kind == "truncated", (n, e.value)


def test_trailing_bytes_are_rejected() -> None:
    fp = fingerprint()
    with pytest.raises(SnapshotError) as e:
        decode_snapshot(encode_snapshot(make(fp)) + b"\x00", fp)
    assert e.value.kind == "format"


def test_not_a_snapshot() -> None:
    with pytest.raises(SnapshotError) as e:
        read_header(io.BytesIO(b"GGUF" + bytes(100)))
    assert e.value.kind == "format"


def test_future_version_is_refused_as_format() -> None:
    fp = fingerprint()
    data = bytearray(encode_snapshot(make(fp)))
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    struct.pack_into("<I", data, 20, zlib.crc32(data[:20]))  # a valid prefix of a newer writer
    with pytest.raises(SnapshotError, match="version") as e:
        decode_snapshot(bytes(data), fp)
    assert e.value.kind == "format"
    assert PREFIX_SIZE == 24


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.kv.pop(),  # a layer missing
        lambda s: s.kv.__setitem__(0, s.kv[0].float()),  # wrong dtype
        lambda s: s.kv.__setitem__(0, s.kv[0][:, :-1]),  # wrong length
        lambda s: s.token_ids.append(1),  # header/tokens disagree
        lambda s: s.token_ids.__setitem__(0, -1),  # not a token id
    ],
)
def test_malformed_snapshot_is_refused_before_writing(mutate) -> None:
    snap = make(fingerprint())
    mutate(snap)
    sink = io.BytesIO()
    with pytest.raises(ValueError):
        write_snapshot(sink, snap)
    assert sink.getvalue() == b""


def test_a_tokens_only_read_skips_the_kv_and_still_checks_the_tokens() -> None:
    """decode_snapshot(kv=False) (a session whose KV is to be recomputed, kv/cost.py): the
    tokens and text, checksummed; the KV sections are neither read nor decoded."""
    fp = fingerprint()
    snap = make(fp, num_tokens=40)
    data = bytearray(encode_snapshot(snap))
    data[-5] ^= 0xFF  # inside the last KV section
    short = decode_snapshot(bytes(data), fp, kv=False)
    assert short.token_ids == snap.token_ids and short.text == snap.text and short.kv == []
    with pytest.raises(SnapshotError) as e:
        decode_snapshot(bytes(data), fp)
    assert e.value.kind == "checksum"
    (header_len,) = struct.unpack_from("<I", data, 12)
    start = 24 + header_len  # the first byte of the tokens section
    data[start] ^= 0xFF
    with pytest.raises(SnapshotError) as e:
        decode_snapshot(bytes(data), fp, kv=False)
    assert e.value.kind == "checksum"
