"""Disk tier: one snapshot file per session, shared block files, an in-memory index, an LRU
byte budget.

Invariants:
- The index holds exactly the snapshots whose header validated and whose fingerprint is this
  model's, and whose shared block files (kv/blockstore.py) are indexed too; `used_bytes` is
  the sum of their file sizes plus each block file once, and never exceeds `budget_bytes`
  after a call returns (a temp file being written is not counted).
- A block file stays while a session file lists it; the last one to go takes it along. A
  block file that fails validation is quarantined and every session file listing it is
  deleted (those sessions recompute): nothing is loaded from a block that did not verify.
- A file in the directory is either absent, a complete older snapshot, or a complete newer
  one: writes go to a temp file that is fsynced and then renamed over the old one.
- Anything that fails validation is moved to `quarantine/` with a `.reason` file, reported
  through `on_error(kind)`, and never loaded.
- LRU order is the time of the last successful write() or read() of a key. On disk it is the
  file mtime (read() bumps it), so the order survives a restart.

Thread-safety: one lock guards the index and every rename/unlink in the directory; encoding,
writing and fsyncing a temp file and decoding a snapshot happen outside it. One DiskTier per
directory (enforced with an flock on `.lock`, across processes too).

Shared store (`replica_id` set, several replicas on one directory; kv/store.py): each
replica holds a shared flock on `.lock` (so a private DiskTier cannot open a shared store)
and an exclusive one on `replicas/<id>.lock`; it indexes at start only the snapshots `owns()`
accepts (their lease names it), `adopt()`s another replica's snapshot on a miss, and unlinks
(eviction) only a file it wrote itself: the inode it wrote is remembered, and a file another
replica has rewritten since is forgotten instead of deleted. Temp files carry the replica id,
so a start removes only its own leftovers.

DiskTier holds the lock and the hooks; its parts, each with the lock as the tier takes it:
`disk_files.py` (one file operation each), `disk_index.py` (index, LRU, budget),
`disk_write.py`, `disk_read.py`, `disk_scan.py` (start-up and adoption), `disk_hooks.py`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ds4pool.kv.blockstore import BlockFiles
from ds4pool.kv.disk_files import (
    QUARANTINE_DIR,
    DiskEntry,
    SessionKey,
    lock_directory,
    quarantine_file,
    read_entry,
    session_file_name,
)
from ds4pool.kv.disk_hooks import DiskHooks
from ds4pool.kv.disk_index import DiskIndex
from ds4pool.kv.disk_read import DiskReader
from ds4pool.kv.disk_scan import index_blocks_of, rebuild_index
from ds4pool.kv.disk_write import DiskWriter
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import SnapshotError
from ds4pool.kv.layer_frames import DEFAULT_SHUFFLE
from ds4pool.kv.snapshot import Snapshot

log = logging.getLogger(__name__)


class DiskTier:
    """The cold tier of the session pool (see the module docstring for the invariants).
    write() runs on the pool's writer thread, read() on its worker thread.

    on_error(kind) is called for every failure (kinds: kv/disk_hooks.py's ERROR_KINDS).
    on_evict(entry) is called for every snapshot that write() deleted to stay within the
    budget, after the fact and outside the tier's lock (so it may call back into the pool);
    not for delete(), quarantine or the evictions done at start-up (entries() never lists
    those)."""

    def __init__(
        self,
        directory: Path | str,
        budget_bytes: int,
        fingerprint: ModelFingerprint,
        *,
        shuffle: bool = DEFAULT_SHUFFLE,
        on_error: Callable[[str], None] | None = None,
        on_evict: Callable[[DiskEntry], None] | None = None,
        replica_id: str | None = None,
        owns: Callable[[SessionKey], bool] | None = None,
        on_io: Callable[[str, int], None] | None = None,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.directory = Path(directory).resolve()
        self.quarantine_dir = self.directory / QUARANTINE_DIR
        self.fingerprint = fingerprint
        self.shuffle = shuffle
        self._hooks = DiskHooks(on_error, on_evict, on_io)
        self.replica_id = replica_id
        self._owns = owns
        self._tmp_prefix = f".{replica_id}." if replica_id else "."
        self._lock = threading.Lock()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # a replica shares block files with the others: it never deletes one (kv/blockstore.py)
        self._blocks = BlockFiles(
            self.directory, fingerprint, shuffle, self._quarantine, shared=bool(replica_id)
        )
        self._index = DiskIndex(self._blocks, budget_bytes, replica_id)
        self._reader = DiskReader(
            self._lock, self._index, fingerprint, self._hooks, self._quarantine
        )
        self._writer = DiskWriter(
            self._lock, self._index, self.directory, self._tmp_prefix, shuffle, self._hooks
        )
        self._lock_fds = lock_directory(self.directory, self.replica_id)
        self._rebuild_index()

    # ------------------------------------------------------------------ public API

    @property
    def budget_bytes(self) -> int:
        return self._index.budget_bytes

    @property
    def used_bytes(self) -> int:
        """Session files plus every block file once."""
        with self._lock:
            return self._index.total_bytes

    @property
    def block_bytes(self) -> int:
        """The shared block files' part of used_bytes."""
        with self._lock:
            return self._blocks.used_bytes

    def has_block(self, key: str) -> bool:
        """True when block file `key` (hex chain key) is indexed: a snapshot listing it in
        its `shared` keys costs no block write."""
        with self._lock:
            return key in self._blocks.entries

    def path_for(self, tenant: str, session_id: str) -> Path:
        path = self.directory / session_file_name(tenant, session_id)
        assert path.parent == self.directory, path
        return path

    def contains(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            return (tenant, session_id) in self._index.entries

    def keys(self) -> list[SessionKey]:
        """All keys, least recently used first."""
        with self._lock:
            return list(self._index.entries)

    def entries(self) -> list[DiskEntry]:
        """All entries, least recently used first (what the pool rebuilds its sessions from)."""
        with self._lock:
            return list(self._index.entries.values())

    def info(self, tenant: str, session_id: str) -> DiskEntry | None:
        with self._lock:
            return self._index.entries.get((tenant, session_id))

    def write(self, snapshot: Snapshot) -> int:
        """Persist atomically, then evict LRU snapshots (never this one) down to the budget.
        Returns the file size. Raises DiskWriteError (old snapshot intact) or
        SnapshotTooLargeError (key now absent), after calling on_error. The KV tensors must
        not change until this returns, and writes of one key must not race each other
        (the pool's single writer thread orders them): the last rename wins."""
        fp = snapshot.header.fingerprint
        if fp != self.fingerprint:
            raise ValueError(f"snapshot fingerprint {fp} is not this tier's")
        return self._writer.write(snapshot, self.path_for(*snapshot.key))

    def read(self, tenant: str, session_id: str, *, kv: bool = True) -> Snapshot | None:
        """The validated snapshot (its shared blocks read from their block files), or None if
        absent or invalid (then quarantined, reported). A bad block file is quarantined and
        every session file relying on it is deleted: on_evict is called for those others.
        kv=False: its tokens and text only (decode_snapshot's kv=False: no block file read)."""
        return self._reader.read((tenant, session_id), kv=kv)

    def check_integrity(self) -> None:
        """Raise AssertionError if the index, the block files' reference counts and the byte
        counts disagree (a block file's count == the indexed session files listing it)."""
        with self._lock:
            self._index.check_integrity()

    def delete(self, tenant: str, session_id: str) -> bool:
        with self._lock:
            return self._index.drop((tenant, session_id)) is not None

    def adopt(self, tenant: str, session_id: str) -> DiskEntry | None:
        """Shared store: index the key's snapshot as the store holds it now (written by
        another replica, or rewritten since we indexed it), header validated; None if there
        is none or it is invalid (then quarantined and reported). It stays another
        replica's file until we write it: eviction forgets it, never deletes it."""
        key, path = (tenant, session_id), self.path_for(tenant, session_id)
        try:
            entry = read_entry(path, self.fingerprint)
            if (entry.tenant, entry.session_id) != key:
                raise SnapshotError("format", f"file holds {entry.tenant, entry.session_id}")
        except FileNotFoundError:
            with self._lock:
                self._index.forget(key)
            return None
        except SnapshotError as e:
            with self._lock:
                self._index.forget(key)
                self._quarantine(path, e)
            self._hooks.error(e.kind)
            return None
        except OSError as e:
            log.error("disk tier: cannot read %s: %s", path.name, e)
            self._hooks.error("io")
            return None
        with self._lock:
            self._index.forget(key)
            error = index_blocks_of(self._index, entry, self._quarantine)
            if error is None:
                self._index.put(entry)
                evicted = self._index.evict_to_budget(keep=key)
        if error is not None:
            self._hooks.error(error)
            return None
        for old in evicted:
            self._hooks.evicted(old)
        return entry

    def close(self) -> None:
        """Release the directory lock. The files stay; a new DiskTier will index them."""
        for fd in self._lock_fds:
            os.close(fd)  # closing the fd drops the flock
        self._lock_fds = []

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _quarantine(self, path: Path, error: SnapshotError) -> None:
        quarantine_file(self.quarantine_dir, path, error)

    # ------------------------------------------------------------------ start-up

    def _rebuild_index(self) -> None:
        errors = rebuild_index(
            self._index,
            self.directory,
            self.fingerprint,
            self._tmp_prefix,
            self._owns,
            self._quarantine,
        )
        for kind in errors:
            self._hooks.error(kind)
