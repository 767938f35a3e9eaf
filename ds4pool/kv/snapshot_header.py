"""The session file's header, versions 1 and 2: its fields, their JSON form, and the checked
read of the prefix and header alone (what the disk tier indexes a directory by).

Version 2 (written when a session relies on shared blocks) lists the chain keys of its
leading shared blocks and the block size they were cut at; version 1 has neither and stays
byte for byte what it was. docs/KV_SNAPSHOT_FORMAT.md has the full table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ds4pool.kv.fingerprint import ModelFingerprint, parse_fingerprint
from ds4pool.kv.framing import (
    PREFIX_SIZE,
    Buffer,
    Section,
    SnapshotError,
    Source,
    as_reader,
    get_field,
    is_chain_key,
    parse_section,
    parse_sections,
    read_prefix,
)
from ds4pool.kv.layer_frames import COMPRESSION

MAGIC = b"DS4SNAP\x00"
FORMAT_VERSION = 2  # the newest version this build writes
VERSIONS = (1, 2)  # the versions it reads


@dataclass(frozen=True)
class SnapshotHeader:
    """Everything before the payload. The layout fields (shuffle .. header_bytes) are filled in
    by the encoder; a header built by `Snapshot.create` leaves them at their defaults."""

    tenant: str
    session_id: str
    fingerprint: ModelFingerprint
    num_tokens: int  # len(token_ids)
    num_kv_tokens: int  # T of every KV layer; <= num_tokens (the last sampled id may lack KV)
    created: float  # unix time the snapshot was taken
    shuffle: bool = False
    compression: str = COMPRESSION
    tokens: Section = Section()
    text: Section = Section()
    kv: tuple[Section, ...] = ()
    header_bytes: int = 0  # PREFIX_SIZE + header_len: offset of the payload in the file
    # Version 2: hex chain keys of the leading blocks whose KV is in block files, and the
    # block size they were cut at. () and 0 in version 1.
    shared: tuple[str, ...] = ()
    block_size: int = 0

    @property
    def version(self) -> int:
        return 2 if self.shared else 1

    @property
    def num_shared_tokens(self) -> int:
        return len(self.shared) * self.block_size

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """Shape of each stored KV layer: the private tokens [num_shared_tokens, num_kv_tokens)."""
        fp = self.fingerprint
        n = self.num_kv_tokens - self.num_shared_tokens
        return (fp.num_planes, n, fp.num_kv_heads, fp.head_dim)

    @property
    def payload_bytes(self) -> int:
        return self.tokens.num_bytes + self.text.num_bytes + sum(s.num_bytes for s in self.kv)

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


def header_json(h: SnapshotHeader) -> bytes:
    doc: dict[str, Any] = {
        "tenant": h.tenant,
        "session_id": h.session_id,
        "created": float(h.created),
        "fingerprint": asdict(h.fingerprint),
        "fingerprint_digest": h.fingerprint.digest(),
        "num_tokens": h.num_tokens,
        "num_kv_tokens": h.num_kv_tokens,
        "dtype": h.fingerprint.dtype,
        "kv_shape": list(h.kv_shape),
        "compression": h.compression,
        "shuffle": h.shuffle,
        "tokens": asdict(h.tokens),
        "text": asdict(h.text),
        "kv": [asdict(s) for s in h.kv],
    }
    if h.shared:  # version 2 only: a version 1 file stays byte for byte what it was
        doc["block_size"] = h.block_size
        doc["shared"] = list(h.shared)
    # ensure_ascii: ids with lone surrogates or control characters still encode.
    return json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode()


def _parse_header(body: Buffer, version: int) -> SnapshotHeader:
    doc = json.loads(bytes(body))
    fp = parse_fingerprint(doc)
    shared: tuple[str, ...] = ()
    block_size = 0
    if version >= 2:
        shared = tuple(get_field(doc, "shared", list))
        block_size = get_field(doc, "block_size", int)
        if not shared or block_size <= 0 or not all(is_chain_key(k) for k in shared):
            raise ValueError("version 2 needs shared block keys and a block size")
    h = SnapshotHeader(
        tenant=get_field(doc, "tenant", str),
        session_id=get_field(doc, "session_id", str),
        fingerprint=fp,
        num_tokens=get_field(doc, "num_tokens", int),
        num_kv_tokens=get_field(doc, "num_kv_tokens", int),
        created=float(get_field(doc, "created", float)),
        shuffle=get_field(doc, "shuffle", bool),
        compression=get_field(doc, "compression", str),
        tokens=parse_section(get_field(doc, "tokens", dict)),
        text=parse_section(get_field(doc, "text", dict)),
        kv=parse_sections(doc, "kv"),
        header_bytes=PREFIX_SIZE + len(body),
        shared=shared,
        block_size=block_size,
    )
    # Redundant fields must agree with the ones they repeat.
    if (
        tuple(get_field(doc, "kv_shape", list)) != h.kv_shape
        or h.compression != COMPRESSION
        or len(h.kv) != fp.num_layers
        or not 0 <= h.num_shared_tokens <= h.num_kv_tokens <= h.num_tokens
        or h.tokens.num_bytes != 4 * h.num_tokens
    ):
        raise ValueError("inconsistent header fields")
    return h


def read_header(source: Source) -> SnapshotHeader:
    """Read and validate only the prefix and header (magic, version, both CRCs, field types).
    Leaves a file positioned at the payload. Checks neither the fingerprint nor the payload."""
    version, body = read_prefix(as_reader(source), MAGIC, VERSIONS, "KV snapshot")
    try:
        return _parse_header(body, version)
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise SnapshotError("format", f"bad header: {e}") from e


def check_fingerprint(header: SnapshotHeader, expected: ModelFingerprint) -> None:
    if header.fingerprint.digest() != expected.digest():
        raise SnapshotError(
            "fingerprint", f"snapshot is for model {header.fingerprint}, this one is {expected}"
        )
