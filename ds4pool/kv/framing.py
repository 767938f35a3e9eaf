"""Framing shared by snapshot and block files: the frozen 24-byte prefix, payload sections
with their CRC-32, strict typed reads of header JSON fields, and the error that says a file
must not be trusted. Knows neither the KV nor any one file kind's header (`kv/snapshot_header.py`,
`kv/blockfile.py`)."""

from __future__ import annotations

import re
import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# magic, version, reserved (0), header_len, header_crc (of the JSON), prefix_crc (of bytes 0..20).
# This 24-byte prefix is frozen for every future version, so any reader can check it.
PREFIX = struct.Struct("<8sHHIII")
PREFIX_SIZE = PREFIX.size
MAX_HEADER_BYTES = 16 << 20  # ~100 B per layer: a larger header_len can only be corruption


class SnapshotError(Exception):
    """A snapshot that must not be trusted. `kind` says why, for metrics and quarantine."""

    KINDS = ("checksum", "truncated", "fingerprint", "format")

    def __init__(self, kind: str, message: str) -> None:
        assert kind in self.KINDS, kind
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class Section:
    """One payload section: its stored (compressed) length and the CRC-32 of those bytes."""

    num_bytes: int = 0
    crc32: int = 0


def section_of(data: bytes) -> Section:
    return Section(len(data), zlib.crc32(data))


def pack_prefix(magic: bytes, version: int, body: bytes) -> bytes:
    """The frozen 24-byte prefix for a header JSON `body`."""
    prefix = PREFIX.pack(magic, version, 0, len(body), zlib.crc32(body), 0)
    return prefix[:20] + struct.pack("<I", zlib.crc32(prefix[:20]))


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


def parse_sections(doc: dict[str, Any], key: str) -> tuple[Section, ...]:
    return tuple(parse_section(s) for s in get_field(doc, key, list))


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


def read_section(f: Readable, sec: Section, what: str) -> Buffer:
    data = _read_exact(f, sec.num_bytes, what)
    if zlib.crc32(data) != sec.crc32:
        raise SnapshotError("checksum", f"{what}: CRC mismatch")
    return data


def read_tokens(f: Readable, sec: Section) -> list[int]:
    tokens = array("i")
    tokens.frombytes(read_section(f, sec, "tokens"))
    return tokens.tolist()
