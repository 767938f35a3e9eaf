"""On-disk KV snapshot format: one session's token ids, text and KV cache in one file.

Pure format, no directory logic (that is `kv/disk.py`). The byte layout, all integers
little-endian (docs/KV_SNAPSHOT_FORMAT.md has the full table):

    [0, 24)                 prefix: magic, version, reserved, header_len, header_crc, prefix_crc
    [24, 24 + H)            header: UTF-8 JSON, H = header_len
    [24 + H, file_bytes)    payload: tokens (int32), text (UTF-8), one lz4 frame per KV layer

Version 2 (written when a session relies on shared blocks) lists the chain keys of its
leading shared blocks in the header; their KV lives in block files (`kv/blockfile.py`) and
the KV frames hold only tokens [len(shared) * block_size, num_kv_tokens). Version 1 files
(no shared blocks) are still written when nothing is shared, and always read.

Invariants: a snapshot is only ever returned by `decode_snapshot` after the prefix, header
and every payload section matched their CRC-32 and the model fingerprint matched; the KV
tensors it returns are bitwise equal to the ones encoded (dtypes are moved as raw bytes,
never converted).

The parts: `kv/framing.py` (prefix, sections, CRCs), `kv/fingerprint.py`, `kv/layer_frames.py`
(one KV layer as an lz4 frame), `kv/snapshot_header.py` (the version 1 / 2 header); this
module puts them together into whole snapshots.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import (
    PREFIX_SIZE,
    SnapshotError,
    Source,
    Writable,
    as_reader,
    pack_prefix,
    read_section,
    read_tokens,
    section_of,
)
from ds4pool.kv.layer_frames import COMPRESSION, DEFAULT_SHUFFLE, decode_frame, layer_frame
from ds4pool.kv.snapshot_header import (
    MAGIC,
    SnapshotHeader,
    check_fingerprint,
    header_json,
    read_header,
)


@dataclass
class Snapshot:
    """One session: exact token ids, the text they stand for, KV per layer [P, T, H, D] on CPU
    (P planes: 2 for K/V, 1 for an MLA latent; the fingerprint's kv_layout says which)."""

    header: SnapshotHeader
    token_ids: list[int]
    text: str
    kv: list[torch.Tensor] = field(repr=False)  # all num_kv_tokens, shared blocks included

    @classmethod
    def create(
        cls,
        tenant: str,
        session_id: str,
        fingerprint: ModelFingerprint,
        token_ids: list[int],
        text: str,
        kv: list[torch.Tensor],
        *,
        created: float | None = None,
        shared: Sequence[str] = (),
        block_size: int = 0,
    ) -> Snapshot:
        """`shared`: hex chain keys of the leading blocks of `block_size` tokens to keep in
        block files (written once for every session that shares them)."""
        num_kv_tokens = kv[0].shape[1] if kv else 0
        if shared and (block_size <= 0 or len(shared) * block_size > num_kv_tokens):
            raise ValueError(
                f"{len(shared)} shared blocks of {block_size} tokens, {num_kv_tokens} KV tokens"
            )
        header = SnapshotHeader(
            tenant,
            session_id,
            fingerprint,
            len(token_ids),
            num_kv_tokens,
            time.time() if created is None else float(created),
            shared=tuple(shared),
            block_size=block_size if shared else 0,
        )
        return cls(header, list(token_ids), text, list(kv))

    @property
    def key(self) -> tuple[str, str]:
        return (self.header.tenant, self.header.session_id)

    def block(self, i: int) -> SharedBlock:
        """Shared block i (tokens [i * bs, (i + 1) * bs)) as a block file holds it."""
        h = self.header
        lo, hi = i * h.block_size, (i + 1) * h.block_size
        return SharedBlock(
            h.shared[i],
            h.tenant,
            i,
            h.fingerprint,
            self.token_ids[lo:hi],
            [layer[:, lo:hi] for layer in self.kv],
        )


@dataclass(frozen=True)
class SharedBlock:
    """One full block shared by sessions, as a block file holds it: its chain key (which
    names the whole prefix up to it, tenant salt included), its place in the chain, its
    tokens and its KV per layer [P, block_size, H, D]."""

    key: str  # hex
    tenant: str
    position: int
    fingerprint: ModelFingerprint
    token_ids: list[int]
    kv: list[torch.Tensor] = field(repr=False)


# Reads shared block `position` of a version 2 snapshot: (hex key, tenant, position, its
# expected token ids) -> KV per layer [P, block_size, H, D], or a SnapshotError.
BlockReader = Callable[[str, str, int, list[int]], list[torch.Tensor]]


# ---------------------------------------------------------------------------- encoding


def _check_encodable(s: Snapshot) -> None:
    """Programming errors (a bad Snapshot from the pool) raise ValueError before any write."""
    h, fp = s.header, s.header.fingerprint
    if len(s.token_ids) != h.num_tokens or h.num_kv_tokens > h.num_tokens:
        raise ValueError(
            f"{len(s.token_ids)} token ids, header says {h.num_tokens} "
            f"tokens / {h.num_kv_tokens} KV tokens"
        )
    if len(s.kv) != fp.num_layers:
        raise ValueError(f"{len(s.kv)} KV layers, fingerprint says {fp.num_layers}")
    full = (fp.num_planes, h.num_kv_tokens, fp.num_kv_heads, fp.head_dim)
    for i, t in enumerate(s.kv):
        if tuple(t.shape) != full or t.dtype != fp.torch_dtype or t.device.type != "cpu":
            raise ValueError(
                f"KV layer {i}: {tuple(t.shape)} {t.dtype} on {t.device}, "
                f"expected {full} {fp.torch_dtype} on cpu"
            )
    if s.token_ids and not 0 <= min(s.token_ids) <= max(s.token_ids) < 2**31:
        raise ValueError("token ids must lie in [0, 2**31)")


def _encode_parts(s: Snapshot, shuffle: bool) -> tuple[SnapshotHeader, list[bytes]]:
    """The file as a list of chunks (prefix, header, tokens, text, frames) and its header.
    Layers are compressed before anything is written: the header needs their lengths and
    CRCs. Peak extra memory is the compressed KV, never a second copy of the whole file."""
    _check_encodable(s)
    tokens = array("i", s.token_ids).tobytes()
    assert len(tokens) == 4 * len(s.token_ids)
    text = s.text.encode("utf-8")
    start = s.header.num_shared_tokens  # the shared blocks go to block files
    frames = [layer_frame(t[:, start:], shuffle) for t in s.kv]
    header = replace(
        s.header,
        shuffle=shuffle,
        compression=COMPRESSION,
        tokens=section_of(tokens),
        text=section_of(text),
        kv=tuple(section_of(fr) for fr in frames),
    )
    body = header_json(header)
    prefix = pack_prefix(MAGIC, header.version, body)
    header = replace(header, header_bytes=PREFIX_SIZE + len(body))
    return header, [prefix, body, tokens, text, *frames]


def write_snapshot(f: Writable, s: Snapshot, *, shuffle: bool = DEFAULT_SHUFFLE) -> SnapshotHeader:
    """Write `s` to the binary file `f`; return the header as written (`file_bytes` of it is
    the number of bytes written). Raises ValueError for a malformed Snapshot before writing."""
    header, parts = _encode_parts(s, shuffle)
    for chunk in parts:
        f.write(chunk)
    return header


def encode_snapshot(s: Snapshot, *, shuffle: bool = DEFAULT_SHUFFLE) -> bytes:
    return b"".join(_encode_parts(s, shuffle)[1])


# ---------------------------------------------------------------------------- decoding


def decode_snapshot(
    source: Source,
    expected: ModelFingerprint,
    read_block: BlockReader | None = None,
    *,
    kv: bool = True,
) -> Snapshot:
    """Fully validate and decode a snapshot from bytes or a binary file positioned at its start.
    A version 2 snapshot gets its shared blocks from `read_block` (the disk tier's block
    files; a SnapshotError without one). Raises SnapshotError; never returns data whose CRC
    or fingerprint did not match.
    kv=False stops after the tokens and the text (a session whose KV is to be recomputed):
    the KV sections and block files are neither read nor checked, and `kv` is empty."""
    f = as_reader(source)
    h = read_header(f)
    check_fingerprint(h, expected)
    token_ids = read_tokens(f, h.tokens)
    try:
        text = str(read_section(f, h.text, "text"), "utf-8")
    except UnicodeDecodeError as e:
        raise SnapshotError("format", f"text is not UTF-8: {e}") from e
    if not kv:
        return Snapshot(h, token_ids, text, [])
    dtype = h.fingerprint.torch_dtype
    layers = [
        decode_frame(
            read_section(f, sec, f"KV layer {i}"), h.kv_shape, dtype, h.shuffle, f"KV layer {i}"
        )
        for i, sec in enumerate(h.kv)
    ]
    if f.read(1):
        raise SnapshotError("format", "trailing bytes after the last section")
    if h.shared:
        if read_block is None:
            raise SnapshotError("format", "a version 2 snapshot needs its block files")
        layers = _with_blocks(h, token_ids, layers, read_block)
    return Snapshot(h, token_ids, text, layers)


def _with_blocks(
    h: SnapshotHeader, token_ids: list[int], private: list[torch.Tensor], read_block: BlockReader
) -> list[torch.Tensor]:
    """Full KV per layer [P, num_kv_tokens, H, D]: the shared blocks, then the private part."""
    fp, bs, start = h.fingerprint, h.block_size, h.num_shared_tokens
    blocks = [  # each [L] x [P, bs, H, D]
        read_block(key, h.tenant, i, token_ids[i * bs : (i + 1) * bs])
        for i, key in enumerate(h.shared)
    ]
    out = []
    for layer, tail in enumerate(private):
        full = torch.empty(
            (fp.num_planes, h.num_kv_tokens, fp.num_kv_heads, fp.head_dim), dtype=fp.torch_dtype
        )
        # numpy slice copies over raw bytes: single-threaded and ~2x faster than torch.cat of
        # many blocks (which also fights the model for intra-op threads); dtypes stay bytes
        dst = full.view(torch.uint8).numpy()  # [P, T, H, D * itemsize], full's memory
        for i, b in enumerate(blocks):
            dst[:, i * bs : (i + 1) * bs] = b[layer].view(torch.uint8).numpy()
        dst[:, start:] = tail.view(torch.uint8).numpy()
        out.append(full)
    return out
