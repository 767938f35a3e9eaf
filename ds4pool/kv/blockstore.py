"""Shared block files of the disk tier: content-addressed, written once, reference counted.

A session snapshot of version 2 lists the chain keys of its leading shared blocks; each one
is a file `<key>.blk` next to the session files (format: kv/blockfile.py). The key is the
block index's chain hash, salted by tenant, so two tenants never name the same file.

Invariants (the disk tier's lock guards every method marked "lock held"):
- `refs[k]` is the number of indexed session files that list k; `pending[k]` the writes
  under way that will. A block file with neither is deleted (`collect`): a block file goes
  when no session file refers to it.
- `used_bytes` is the sum of the indexed block files' sizes: each counts once, however many
  sessions rely on it.
- A block file is either absent or complete: temp file, fsync, rename (as snapshots are).
- One that fails validation is quarantined (`.reason` file) and leaves the index; the disk
  tier then drops every session file that relied on it (their sessions recompute).
- Blocks read lately stay decoded in a small LRU (`cache_bytes`), so that the sessions of
  one system prompt, restored one after another, read its block files once: an entry is
  only what a full read verified, is never handed out (callers copy it), and goes with its
  file. A hit is checked against the tenant, position and tokens the reader expects, as a
  file would be.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ds4pool.kv.blockfile import decode_block, read_block_header, write_block
from ds4pool.kv.disk_files import unlink_quietly
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import SnapshotError, is_chain_key
from ds4pool.kv.snapshot import BlockReader, SharedBlock

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 << 20
_Verified = tuple[str, int, tuple[int, ...]]  # tenant, position, token ids of a decoded block

BLOCK_SUFFIX = ".blk"
SECRET_FILE = ".index_secret"


class BlockFileError(SnapshotError):
    """A shared block a snapshot needs is bad or gone (the session file itself was fine)."""

    def __init__(self, kind: str, message: str, key: str, quarantined: bool = False) -> None:
        super().__init__(kind, message)
        self.key = key
        self.quarantined = quarantined  # False: it was already gone (reported back then)


@dataclass(frozen=True)
class BlockEntry:
    key: str  # hex chain key
    tenant: str
    path: Path
    num_bytes: int  # file size


def index_secret(directory: Path | str) -> bytes:
    """The block index's salt secret, kept in the disk directory (mode 0600) so that chain
    keys, and so block file names, are the same after a restart and for every replica
    sharing the directory. Created once, atomically (the first writer wins)."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = d / SECRET_FILE
    try:
        data = path.read_bytes()
        if len(data) == 16:
            return data
        log.warning("disk tier: %s is malformed (%d bytes); replacing it", path, len(data))
    except FileNotFoundError:
        pass
    fd, name = tempfile.mkstemp(dir=d, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(16))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(name, path)  # fails if another process created it meanwhile: theirs wins
    except FileExistsError:
        pass
    finally:
        os.unlink(name)
    return path.read_bytes()


class BlockFiles:
    def __init__(
        self,
        directory: Path,
        fingerprint: ModelFingerprint,
        shuffle: bool,
        quarantine: Callable[[Path, SnapshotError], None],
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        shared: bool = False,
    ) -> None:
        self.directory = directory
        # a shared store (replicas, kv/store.py): other replicas' snapshots may list a block
        # file this index no longer counts, so collect() forgets it and never deletes it
        self.shared = shared
        self.fingerprint = fingerprint
        self.shuffle = shuffle
        self._quarantine = quarantine
        self.entries: dict[str, BlockEntry] = {}
        self.refs: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()
        self.used_bytes = 0
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, tuple[_Verified, list[torch.Tensor]]] = OrderedDict()
        self._cached_bytes = 0

    def path_for(self, key: str) -> Path:
        path = self.directory / f"{key}{BLOCK_SUFFIX}"
        assert path.parent == self.directory and len(key) == 32, key
        return path

    # ------------------------------------------------------------ writing

    def write_temp(self, block: SharedBlock) -> tuple[Path, int]:
        """Encode into a fsynced temp file in the directory (no lock); (temp path, size).
        Raises OSError after removing the temp file."""
        fd, name = tempfile.mkstemp(dir=self.directory, prefix=".", suffix=".tmp")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                written = write_block(f, block, shuffle=self.shuffle)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            unlink_quietly(tmp)
            raise
        return tmp, written.file_bytes

    def install(self, key: str, tenant: str, tmp: Path, num_bytes: int) -> None:
        """Rename a written temp file into place (lock held); a key that appeared meanwhile
        keeps its file (same content) and the temp one goes."""
        if key in self.entries:
            unlink_quietly(tmp)
            return
        path = self.path_for(key)
        os.replace(tmp, path)
        self.entries[key] = BlockEntry(key, tenant, path, num_bytes)
        self.used_bytes += num_bytes

    # ------------------------------------------------------------ references (lock held)

    def ref(self, keys: Iterable[str]) -> None:
        self.refs.update(keys)

    def unref(self, keys: Iterable[str]) -> None:
        self.refs.subtract(keys)

    def hold(self, keys: Iterable[str]) -> None:
        self.pending.update(keys)

    def unhold(self, keys: Iterable[str]) -> None:
        self.pending.subtract(keys)

    def unreferenced_bytes(self, keys: Iterable[str]) -> int:
        """Bytes of these indexed block files no session file refers to yet."""
        return sum(self.entries[k].num_bytes for k in set(keys) if not self.refs[k])

    def collect(self, keys: Iterable[str]) -> int:
        """Delete those of these block files that no session file refers to and no write
        will; returns the bytes freed."""
        freed = 0
        for key in set(keys):
            for counter in (self.refs, self.pending):
                assert counter[key] >= 0, f"block {key}: negative count"
                if not counter[key]:
                    del counter[key]
            if key in self.refs or key in self.pending or key not in self.entries:
                continue
            entry = self.entries.pop(key)
            self.used_bytes -= entry.num_bytes
            freed += entry.num_bytes
            self._uncache(key)
            if not self.shared:
                unlink_quietly(entry.path)
        return freed

    # ------------------------------------------------------------ decoded blocks (lock held)

    def cached(
        self, key: str, tenant: str, position: int, ids: list[int]
    ) -> list[torch.Tensor] | None:
        """A verified decoded block, if cached and it is what the reader expects."""
        hit = self._cache.get(key)
        if hit is None or hit[0] != (tenant, position, tuple(ids)):
            return None
        self._cache.move_to_end(key)
        return hit[1]

    def remember(
        self, key: str, tenant: str, position: int, ids: list[int], kv: list[torch.Tensor]
    ) -> None:
        size = sum(t.numel() * t.element_size() for t in kv)
        if key not in self.entries or key in self._cache or size > self.cache_bytes:
            return
        self._cache[key] = ((tenant, position, tuple(ids)), kv)
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            self._uncache(next(iter(self._cache)))

    def _uncache(self, key: str) -> None:
        hit = self._cache.pop(key, None)
        if hit is not None:
            self._cached_bytes -= sum(t.numel() * t.element_size() for t in hit[1])

    # ------------------------------------------------------------ reading

    def open(self, key: str) -> tuple[BlockEntry, BinaryIO] | None:
        """The entry and an open binary file of block `key` (lock held: vs rename); None when
        it is not indexed or cannot be opened."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            return entry, open(entry.path, "rb")
        except OSError as e:
            log.error("disk tier: cannot open block %s: %s", entry.path.name, e)
            return None

    def decode(
        self, f: BinaryIO, key: str, tenant: str, position: int, ids: list[int]
    ) -> list[torch.Tensor]:
        """Decode an opened block file (no lock); SnapshotError if it is not exactly that."""
        return decode_block(f, self.fingerprint, key, tenant, position, ids)

    def quarantine_if_current(self, key: str, opened: os.stat_result, error: SnapshotError) -> bool:
        """Quarantine block `key` if its indexed file is still the one read (lock held)."""
        entry = self.entries.get(key)
        try:
            st = os.stat(entry.path) if entry else None
        except OSError:
            st = None
        if entry is None or st is None or (st.st_ino, st.st_dev) != (opened.st_ino, opened.st_dev):
            return False
        del self.entries[key]
        self.used_bytes -= entry.num_bytes
        self._uncache(key)
        self._quarantine(entry.path, error)
        return True

    # ------------------------------------------------------------ start-up

    def index_file(self, path: Path) -> BlockEntry:
        """Check a block file's header, name, fingerprint and size; add it (refs come later).
        Raises SnapshotError (the caller quarantines) or OSError."""
        with open(path, "rb") as f:
            h = read_block_header(f)
            size = os.fstat(f.fileno()).st_size
        if h.fingerprint.digest() != self.fingerprint.digest():
            raise SnapshotError("fingerprint", f"block is for model {h.fingerprint}")
        if path.name != f"{h.key}{BLOCK_SUFFIX}":
            raise SnapshotError("format", "block file name does not match its key")
        if size != h.file_bytes:
            kind = "truncated" if size < h.file_bytes else "format"
            raise SnapshotError(kind, f"block file has {size} bytes, header says {h.file_bytes}")
        entry = BlockEntry(h.key, h.tenant, path, size)
        self.entries[h.key] = entry
        self.used_bytes += size
        return entry


def directory_reader(directory: Path, fingerprint: ModelFingerprint) -> BlockReader:
    """A BlockReader over the block files of a snapshot directory, without a DiskTier (no
    index, no lock, no quarantine): for tools and tests that check files as they lie."""

    def read(key: str, tenant: str, position: int, ids: list[int]) -> list[torch.Tensor]:
        if not is_chain_key(key):
            raise BlockFileError("format", f"bad block key {key!r}", key)
        try:
            with open(directory / f"{key}{BLOCK_SUFFIX}", "rb") as f:
                return decode_block(f, fingerprint, key, tenant, position, ids)
        except FileNotFoundError:
            raise BlockFileError("format", f"block file {key} is missing", key) from None
        except SnapshotError as e:
            raise BlockFileError(e.kind, str(e), key) from e

    return read
