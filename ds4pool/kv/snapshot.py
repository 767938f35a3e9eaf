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
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import sys
import time
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Protocol

import lz4.frame
import numpy as np
import torch

MAGIC = b"DS4SNAP\x00"
FORMAT_VERSION = 2  # the newest version this build writes
VERSIONS = (1, 2)  # the versions it reads
# magic, version, reserved (0), header_len, header_crc (of the JSON), prefix_crc (of bytes 0..20).
# This 24-byte prefix is frozen for every future version, so any reader can check it.
PREFIX = struct.Struct("<8sHHIII")
PREFIX_SIZE = PREFIX.size
MAX_HEADER_BYTES = 16 << 20  # ~100 B per layer: a larger header_len can only be corruption
COMPRESSION = "lz4-frame"
# Byte-plane shuffling shrinks real bf16 KV by ~25% (ratio ~1.37 vs ~1.05) but costs ~3x the
# encode and ~2x the decode CPU (bench/snapshot_lz4.py, docs/BENCHMARKS.md): it only saves
# time on disks slower than a few hundred MB/s. GPU boxes have NVMe, so plain is the default.
DEFAULT_SHUFFLE = False
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

if sys.byteorder != "little":  # KV bytes are stored in native order, which must be little
    raise ImportError("ds4pool snapshots need a little-endian host")


class SnapshotError(Exception):
    """A snapshot that must not be trusted. `kind` says why, for metrics and quarantine."""

    KINDS = ("checksum", "truncated", "fingerprint", "format")

    def __init__(self, kind: str, message: str) -> None:
        assert kind in self.KINDS, kind
        super().__init__(f"{kind}: {message}")
        self.kind = kind


# What each token's KV holds per layer, planes of [num_kv_heads, head_dim] (KVLayout's kinds):
# "kv": K then V of every KV head; "mla": one plane, the compressed latent of multi-head
# latent attention (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim). The file
# format names its own kinds (model/kv_layout.py's KVLayout has the same two): kv/ does not
# import the model.
PLANES_OF: dict[str, int] = {"kv": 2, "mla": 1}
DEFAULT_KV_LAYOUT = "kv"


@dataclass(frozen=True)
class ModelFingerprint:
    """What the KV bytes depend on. Two models with equal digests produce interchangeable KV."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # KV dtype, a key of DTYPES
    weights_id: str  # hash of the weights, supplied by the model loader
    kv_layout: str = DEFAULT_KV_LAYOUT  # a key of PLANES_OF

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {list(DTYPES)}")
        if self.kv_layout not in PLANES_OF:
            raise ValueError(
                f"unsupported KV layout {self.kv_layout!r}; expected one of {list(PLANES_OF)}"
            )

    @property
    def num_planes(self) -> int:
        return PLANES_OF[self.kv_layout]

    def digest(self) -> str:
        """sha256 of the canonical JSON of all fields: stable across processes and versions.
        `kv_layout` joined the fingerprint after the first snapshots were written: at its
        default ("kv") it is left out, so those files keep their digest; any other layout is
        part of it, so a "kv" snapshot and an "mla" one can never match."""
        return self._digest

    @cached_property
    def _digest(self) -> str:  # a block-sharing restore checks one per block file: once
        doc = asdict(self)
        if doc["kv_layout"] == DEFAULT_KV_LAYOUT:
            del doc["kv_layout"]
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Section:
    """One payload section: its stored (compressed) length and the CRC-32 of those bytes."""

    num_bytes: int = 0
    crc32: int = 0


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


# Byte-plane shuffling uses numpy: single-threaded (it runs on the pool's writer thread and
# must not fight the model for torch's intra-op threads) and ~2.5-3 GB/s per core both ways,
# where a torch uint8 transpose copy runs at ~0.2 GB/s.


def _shuffle(t: torch.Tensor) -> np.ndarray:
    """[N] elements of k bytes -> [k, N] uint8: plane j holds byte j of every element."""
    k = t.element_size()
    elems = t.contiguous().view(torch.uint8).numpy().reshape(-1, k)  # [N, k], no copy
    return np.ascontiguousarray(elems.T)  # [k, N]


def _unshuffle(planes: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """Inverse of _shuffle: write [k * N] uint8 planes into `out` (contiguous, N elements)."""
    k = out.element_size()
    elems = out.view(torch.uint8).numpy().reshape(-1, k)  # [N, k], shares out's memory
    for j, plane in enumerate(planes.reshape(k, -1)):
        elems[:, j] = plane  # one strided pass per plane beats one transpose of [k, N]
    return out


def layer_frame(t: torch.Tensor, shuffle: bool) -> bytes:
    """Raw bytes of one layer (optionally byte-plane shuffled), as one lz4 frame."""
    if shuffle and t.element_size() > 1 and t.numel():
        data = _shuffle(t)
    else:
        data = t.contiguous().view(torch.uint8).numpy()  # memory order, little-endian
    return lz4.frame.compress(data, compression_level=0, store_size=True)


def section_of(data: bytes) -> Section:
    return Section(len(data), zlib.crc32(data))


def pack_prefix(magic: bytes, version: int, body: bytes) -> bytes:
    """The frozen 24-byte prefix for a header JSON `body`."""
    prefix = PREFIX.pack(magic, version, 0, len(body), zlib.crc32(body), 0)
    return prefix[:20] + struct.pack("<I", zlib.crc32(prefix[:20]))


def fingerprint_json(fp: ModelFingerprint) -> dict[str, Any]:
    return {"fingerprint": asdict(fp), "fingerprint_digest": fp.digest(), "dtype": fp.dtype}


def _header_json(h: SnapshotHeader) -> bytes:
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
    body = _header_json(header)
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


Buffer = bytes | bytearray | memoryview


class Readable(Protocol):
    def read(self, n: int = -1, /) -> Buffer: ...


class Writable(Protocol):
    def write(self, data: bytes, /) -> object: ...


Source = Buffer | Readable


class _BufferReader:
    """read() over an in-memory buffer returning zero-copy memoryview slices."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view, self._pos = memoryview(data).cast("B"), 0

    def read(self, n: int = -1) -> memoryview:
        end = len(self._view) if n < 0 else min(self._pos + n, len(self._view))
        chunk, self._pos = self._view[self._pos : end], end
        return chunk


def as_reader(source: Source) -> Readable:
    return _BufferReader(source) if isinstance(source, (bytes, bytearray, memoryview)) else source


def _read_exact(f: Readable, n: int, what: str) -> Buffer:
    data = f.read(n)
    if len(data) != n:
        raise SnapshotError("truncated", f"{what}: wanted {n} bytes, file ended after {len(data)}")
    return data


# Field name -> runtime type, for strict parsing (annotations are strings here).
_FINGERPRINT_TYPES = {f.name: int if f.type == "int" else str for f in fields(ModelFingerprint)}
# Keys a header written before they existed may lack: the default is what those files hold.
_FINGERPRINT_DEFAULTS = {"kv_layout": DEFAULT_KV_LAYOUT}


def get_field(doc: dict[str, Any], key: str, kind: type) -> Any:
    value = doc[key]
    # bool is an int subclass: never accept one for the other.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise TypeError(f"{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def parse_section(doc: dict[str, Any]) -> Section:
    sec = Section(get_field(doc, "num_bytes", int), get_field(doc, "crc32", int))
    if sec.num_bytes < 0 or not 0 <= sec.crc32 < 2**32:
        raise ValueError(f"bad section {sec}")
    return sec


def parse_fingerprint(
    doc: dict[str, Any], expected: ModelFingerprint | None = None
) -> ModelFingerprint:
    """The fingerprint of a header doc; its redundant digest and dtype must agree. One equal
    to `expected` is returned as `expected` (its digest is computed once, not per file)."""
    fpd = {**_FINGERPRINT_DEFAULTS, **get_field(doc, "fingerprint", dict)}
    fp = ModelFingerprint(
        **{name: get_field(fpd, name, t) for name, t in _FINGERPRINT_TYPES.items()}
    )
    if expected is not None and fp == expected:
        fp = expected
    if (
        get_field(doc, "fingerprint_digest", str) != fp.digest()
        or get_field(doc, "dtype", str) != fp.dtype
    ):
        raise ValueError("fingerprint digest or dtype disagrees with the fingerprint")
    return fp


def parse_sections(doc: dict[str, Any], key: str) -> tuple[Section, ...]:
    return tuple(parse_section(s) for s in get_field(doc, key, list))


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


_CHAIN_KEY = re.compile(r"[0-9a-f]{32}")


def is_chain_key(k: object) -> bool:
    """A chain key as files name it: 32 lowercase hex digits (16 bytes)."""
    return isinstance(k, str) and _CHAIN_KEY.fullmatch(k) is not None


def read_prefix(
    f: Readable, magic: bytes, versions: Sequence[int], what: str
) -> tuple[int, Buffer]:
    """Check the frozen 24-byte prefix and read the header JSON it announces (CRC checked):
    (version, header bytes). Shared by snapshot and block files (their own magic)."""
    prefix = f.read(PREFIX_SIZE)
    if bytes(prefix[:8]) != magic[: len(prefix)]:  # a short foreign file is foreign, not cut
        raise SnapshotError("format", f"not a ds4pool {what} (bad magic)")
    if len(prefix) < PREFIX_SIZE:
        raise SnapshotError("truncated", f"prefix: file ended after {len(prefix)} bytes")
    _, version, reserved, header_len, header_crc, prefix_crc = PREFIX.unpack(prefix)
    if zlib.crc32(prefix[:20]) != prefix_crc:
        raise SnapshotError("checksum", "prefix CRC mismatch")
    if version not in versions or reserved != 0:
        raise SnapshotError(
            "format",
            f"unsupported {what} version {version}.{reserved}, "
            f"this build reads {', '.join(f'{v}.0' for v in versions)}",
        )
    if header_len > MAX_HEADER_BYTES:
        raise SnapshotError("format", f"header length {header_len} is implausible")
    body = _read_exact(f, header_len, "header")
    if zlib.crc32(body) != header_crc:
        raise SnapshotError("checksum", "header CRC mismatch")
    return version, body


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


def read_section(f: Readable, sec: Section, what: str) -> Buffer:
    data = _read_exact(f, sec.num_bytes, what)
    if zlib.crc32(data) != sec.crc32:
        raise SnapshotError("checksum", f"{what}: CRC mismatch")
    return data


def decode_frame(
    frame: Buffer, shape: tuple[int, ...], dtype: torch.dtype, shuffle: bool, what: str
) -> torch.Tensor:
    """One lz4 frame (its CRC already checked) back into a tensor of `shape`."""
    k = dtype.itemsize
    expected = k * math.prod(shape)
    try:
        raw = lz4.frame.decompress(frame, return_bytearray=True)
    except RuntimeError as e:  # only reachable if the encoder wrote a bad frame: CRC passed
        raise SnapshotError("format", f"{what}: lz4: {e}") from e
    if len(raw) != expected:
        raise SnapshotError("format", f"{what}: {len(raw)} bytes, expected {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if shuffle and k > 1:
        return _unshuffle(np.frombuffer(raw, dtype=np.uint8), torch.empty(shape, dtype=dtype))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)  # no copy


def read_tokens(f: Readable, sec: Section) -> list[int]:
    tokens = array("i")
    tokens.frombytes(read_section(f, sec, "tokens"))
    return tokens.tolist()


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
