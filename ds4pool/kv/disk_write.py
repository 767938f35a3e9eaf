"""The disk tier's write path: a session's new block files first, then its session file
(encoded into a fsynced temp file outside the tier's lock, renamed into place under it),
then eviction down to the budget.

Order on disk: block files, their directory fsync, the session file's rename, its directory
fsync. A crash in between leaves orphan block files (deleted at the next start), never a
session file without its blocks, and never a half-written session file under its name.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

from ds4pool.kv.disk_files import (
    DiskEntry,
    fsync_directory,
    unlink_quietly,
    write_temp,
)
from ds4pool.kv.disk_hooks import DiskHooks
from ds4pool.kv.disk_index import DiskIndex
from ds4pool.kv.snapshot import Snapshot
from ds4pool.kv.snapshot_header import SnapshotHeader

log = logging.getLogger(__name__)


class DiskWriteError(OSError):
    """Writing a snapshot failed (ENOSPC, EIO, ...); the previous snapshot of the key is intact."""


class SnapshotTooLargeError(ValueError):
    """One snapshot alone exceeds the disk budget. It was not kept, nor was the key's older one."""


class DiskWriter:
    def __init__(
        self,
        lock: threading.Lock,
        index: DiskIndex,
        directory: Path,
        tmp_prefix: str,
        shuffle: bool,
        hooks: DiskHooks,
    ) -> None:
        self._lock = lock
        self._index = index
        self.directory = directory
        self._tmp_prefix = tmp_prefix
        self.shuffle = shuffle
        self._hooks = hooks

    def write(self, snapshot: Snapshot, path: Path) -> int:
        """DiskTier.write (fingerprint checked) to `path`, its shared blocks held meanwhile."""
        h = snapshot.header
        with self._lock:
            self._index.blocks.hold(h.shared)  # no eviction may take them until the rename below
        try:
            return self._write_held(snapshot, path)
        finally:
            with self._lock:
                self._index.blocks.unhold(h.shared)
                self._index.blocks.collect(h.shared)

    def _write_held(self, snapshot: Snapshot, path: Path) -> int:
        """write(), its shared blocks held: block files first (those not on disk yet), then
        the session file that lists them, so a crash in between leaves only orphan block
        files (deleted at the next start), never a session without its blocks."""
        h = snapshot.header
        key, now = snapshot.key, time.time()
        self._write_blocks(snapshot)
        tmp, written = self._write_temp(snapshot, now)
        with self._lock:
            blocks = [self._index.blocks.entries.get(k) for k in dict.fromkeys(h.shared)]
            need = written.file_bytes + sum(b.num_bytes for b in blocks if b is not None)
        if need > self._index.budget_bytes:
            unlink_quietly(tmp)
            with self._lock:
                self._index.drop(key)
            self._hooks.error("too_large")
            raise SnapshotTooLargeError(
                f"snapshot of {need} bytes (its shared blocks included) exceeds the "
                f"disk budget of {self._index.budget_bytes}"
            )
        try:
            with self._lock:
                if any(k not in self._index.blocks.entries for k in h.shared):
                    # a read quarantined one meanwhile: never list a missing block file
                    raise OSError(errno.EIO, "a shared block file was quarantined")
                os.replace(tmp, path)  # the only other call here that can raise
                if self._index.replica_id:
                    self._index.ours[key] = os.stat(path).st_ino
                self._index.put(
                    DiskEntry(
                        *key,
                        path,
                        written.file_bytes,
                        h.num_tokens,
                        h.num_kv_tokens,
                        now,
                        h.shared,
                    )
                )
                evicted = self._index.evict_to_budget(keep=key)
        except OSError as e:
            unlink_quietly(tmp)
            self._hooks.error("write")
            raise DiskWriteError(e.errno, f"renaming snapshot into place: {e}") from e
        fsync_directory(self.directory)  # the rename durable; a crash before keeps the old file
        self._hooks.io("write", written.file_bytes)
        for entry in evicted:
            log.info("disk tier: evicted %s (%d bytes, LRU)", entry.path.name, entry.num_bytes)
            self._hooks.evicted(entry)
        return written.file_bytes

    def _write_blocks(self, snapshot: Snapshot) -> None:
        """Write the snapshot's shared blocks that have no file yet (held by the caller)."""
        h, wrote = snapshot.header, False
        for i, k in enumerate(h.shared):
            with self._lock:
                if k in self._index.blocks.entries:
                    continue
            try:
                tmp, num_bytes = self._index.blocks.write_temp(snapshot.block(i))
                with self._lock:
                    self._index.blocks.install(k, h.tenant, tmp, num_bytes)
                wrote = True
            except OSError as e:
                log.error("disk tier: writing block %s of %s: %s", k, snapshot.key, e)
                self._hooks.error("write")
                raise DiskWriteError(e.errno or errno.EIO, f"writing a block file: {e}") from e
        if wrote:
            fsync_directory(self.directory)  # the block renames are durable before the session's

    def _write_temp(self, snapshot: Snapshot, now: float) -> tuple[Path, SnapshotHeader]:
        try:
            return write_temp(self.directory, self._tmp_prefix, snapshot, self.shuffle, now)
        except OSError as e:
            log.error("disk tier: writing %s: %s", snapshot.key, e)
            self._hooks.error("write")
            raise DiskWriteError(e.errno or errno.EIO, f"writing snapshot: {e}") from e
