"""On-disk format of a shared block file: one full KV block that several sessions' snapshots
rely on, written once (kv/blockstore.py keeps the directory of them).

Same frozen 24-byte prefix as a snapshot (kv/framing.py), its own magic:

    [0, 24)                 prefix: b"DS4BLK\\0\\0", version 1, reserved, header_len, CRCs
    [24, 24 + H)            header: UTF-8 JSON (key, tenant, position, block size, fingerprint,
                            sections)
    [24 + H, file_bytes)    payload: the block's tokens (int32), one lz4 frame per KV layer

The file carries everything a reader needs to trust it without trusting its name: the chain
key it holds, the tenant, its place in the chain, its tokens (compared with the session's),
the model fingerprint and a CRC per section. Any replica sharing the directory can check it.
"""

from __future__ import annotations

import json
import time
from array import array
from dataclasses import asdict, dataclass

import torch

from ds4pool.kv.fingerprint import ModelFingerprint, fingerprint_json, parse_fingerprint
from ds4pool.kv.framing import (
    PREFIX_SIZE,
    Readable,
    Section,
    SnapshotError,
    Source,
    Writable,
    as_reader,
    get_field,
    is_chain_key,
    pack_prefix,
    parse_section,
    parse_sections,
    read_prefix,
    read_section,
    read_tokens,
    section_of,
)
from ds4pool.kv.layer_frames import COMPRESSION, decode_frame, layer_frame
from ds4pool.kv.snapshot import SharedBlock

BLOCK_MAGIC = b"DS4BLK\x00\x00"
BLOCK_VERSION = 1


@dataclass(frozen=True)
class BlockHeader:
    key: str  # hex chain key; the file is named `<key>.blk`
    tenant: str
    position: int  # block i of the chain: tokens [i * block_size, (i + 1) * block_size)
    block_size: int
    fingerprint: ModelFingerprint
    created: float
    shuffle: bool
    tokens: Section
    kv: tuple[Section, ...]
    header_bytes: int = 0

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        fp = self.fingerprint
        return (fp.num_planes, self.block_size, fp.num_kv_heads, fp.head_dim)

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.tokens.num_bytes + sum(s.num_bytes for s in self.kv)


def write_block(f: Writable, block: SharedBlock, *, shuffle: bool) -> BlockHeader:
    """Write one shared block to the binary file `f`; returns its header as written."""
    bs = len(block.token_ids)
    fp = block.fingerprint
    shape = (fp.num_planes, bs, fp.num_kv_heads, fp.head_dim)
    if bs == 0 or len(block.kv) != fp.num_layers or any(tuple(t.shape) != shape for t in block.kv):
        raise ValueError(f"block {block.key}: KV does not match {bs} tokens of {fp}")
    tokens = array("i", block.token_ids).tobytes()
    frames = [layer_frame(t, shuffle) for t in block.kv]
    header = BlockHeader(
        block.key,
        block.tenant,
        block.position,
        bs,
        fp,
        time.time(),
        shuffle,
        section_of(tokens),
        tuple(section_of(fr) for fr in frames),
    )
    doc = {
        "key": header.key,
        "tenant": header.tenant,
        "position": header.position,
        "block_size": bs,
        "created": header.created,
        **fingerprint_json(fp),
        "kv_shape": list(shape),
        "compression": COMPRESSION,
        "shuffle": shuffle,
        "tokens": asdict(header.tokens),
        "kv": [asdict(s) for s in header.kv],
    }
    body = json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode()
    for chunk in (pack_prefix(BLOCK_MAGIC, BLOCK_VERSION, body), body, tokens, *frames):
        f.write(chunk)
    return BlockHeader(**{**header.__dict__, "header_bytes": PREFIX_SIZE + len(body)})


def read_block_header(source: Source, expected: ModelFingerprint | None = None) -> BlockHeader:
    """Prefix and header only (CRCs, field types); leaves a file at the payload. `expected`:
    the model's fingerprint, if known (saves recomputing its digest per block)."""
    _, body = read_prefix(as_reader(source), BLOCK_MAGIC, (BLOCK_VERSION,), "KV block file")
    try:
        doc = json.loads(bytes(body))
        fp = parse_fingerprint(doc, expected)
        h = BlockHeader(
            key=get_field(doc, "key", str),
            tenant=get_field(doc, "tenant", str),
            position=get_field(doc, "position", int),
            block_size=get_field(doc, "block_size", int),
            fingerprint=fp,
            created=float(get_field(doc, "created", float)),
            shuffle=get_field(doc, "shuffle", bool),
            tokens=parse_section(get_field(doc, "tokens", dict)),
            kv=parse_sections(doc, "kv"),
            header_bytes=PREFIX_SIZE + len(body),
        )
        if (
            not is_chain_key(h.key)
            or h.block_size <= 0
            or h.position < 0
            or get_field(doc, "compression", str) != COMPRESSION
            or tuple(get_field(doc, "kv_shape", list)) != h.kv_shape
            or len(h.kv) != fp.num_layers
            or h.tokens.num_bytes != 4 * h.block_size
        ):
            raise ValueError("inconsistent header fields")
    except (ValueError, TypeError, KeyError) as e:
        raise SnapshotError("format", f"bad block header: {e}") from e
    return h


def decode_block(
    f: Readable,
    expected: ModelFingerprint,
    key: str,
    tenant: str,
    position: int,
    token_ids: list[int],
) -> list[torch.Tensor]:
    """The KV per layer [P, block_size, H, D] of the block file `f`, after checking every CRC,
    the fingerprint, and that it is block `position` of `tenant`'s chain `key` holding exactly
    `token_ids`. Raises SnapshotError (a block that is not what the session needs is
    `format`: never loaded, whatever its name says)."""
    h = read_block_header(f, expected)
    if h.fingerprint.digest() != expected.digest():
        raise SnapshotError("fingerprint", f"block is for model {h.fingerprint}")
    want = (key, tenant, position, len(token_ids))
    got = (h.key, h.tenant, h.position, h.block_size)
    if got != want:
        raise SnapshotError("format", f"block file holds {got}, expected {want}")
    if read_tokens(f, h.tokens) != token_ids:
        raise SnapshotError("format", f"block {key} holds other tokens than the session's")
    dtype = expected.torch_dtype
    kv = [
        decode_frame(
            read_section(f, sec, f"block layer {i}"), h.kv_shape, dtype, h.shuffle, "block"
        )
        for i, sec in enumerate(h.kv)
    ]
    if f.read(1):
        raise SnapshotError("format", "trailing bytes after the last section")
    return kv
