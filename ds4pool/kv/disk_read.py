"""The disk tier's read path: a session file decoded and verified outside the tier's lock,
its shared blocks from their block files (verified ones cached), and what a failed file
costs: a bad session file is quarantined; a bad block file is quarantined and every session
file listing it deleted (those sessions recompute).

The lock is the tier's (`kv/disk.py`); it guards the index and every open, rename and unlink,
so a file opened under it is the indexed one, and a file a concurrent write() replaced is
never quarantined in its successor's place.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ds4pool.kv.blockstore import BlockFileError
from ds4pool.kv.disk_files import Quarantine, SessionKey
from ds4pool.kv.disk_hooks import DiskHooks
from ds4pool.kv.disk_index import DiskIndex
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.framing import SnapshotError
from ds4pool.kv.snapshot import Snapshot, decode_snapshot

log = logging.getLogger(__name__)


class DiskReader:
    def __init__(
        self,
        lock: threading.Lock,
        index: DiskIndex,
        fingerprint: ModelFingerprint,
        hooks: DiskHooks,
        quarantine: Quarantine,
    ) -> None:
        self._lock = lock
        self._index = index
        self.fingerprint = fingerprint
        self._hooks = hooks
        self._quarantine = quarantine

    def read(self, key: SessionKey, *, kv: bool = True) -> Snapshot | None:
        """DiskTier.read: the file opened under the lock, decoded and verified outside it."""
        with self._lock:
            entry = self._index.entries.get(key)
            if entry is None:
                return None
            try:
                f = open(entry.path, "rb")  # opened under the lock (vs rename), read outside it
            except OSError as e:
                log.error("disk tier: cannot open %s: %s", entry.path.name, e)
                if isinstance(e, FileNotFoundError):
                    self._index.drop(key)
                f = None
        if f is None:
            self._hooks.error("io")
            return None
        with f:
            try:
                snap = decode_snapshot(f, self.fingerprint, self._read_block, kv=kv)
                if snap.key != key:
                    raise SnapshotError("format", f"file holds {snap.key}, expected {key}")
            except BlockFileError as e:
                self._lost_block(e, key)
                return None
            except SnapshotError as e:
                self._quarantine_if_current(key, os.fstat(f.fileno()), e)
                self._hooks.error(e.kind)
                return None
            except OSError as e:
                log.error("disk tier: reading %s: %s", entry.path.name, e)
                self._hooks.error("io")
                return None
        self._touch(key)
        self._hooks.io("read", entry.num_bytes)
        return snap

    def _read_block(self, key: str, tenant: str, position: int, ids: list[int]) -> list[Any]:
        """decode_snapshot's BlockReader: one shared block, fully verified, or BlockFileError
        (quarantined now, when its file failed; `quarantined` False when it was gone)."""
        with self._lock:
            hit = self._index.blocks.cached(key, tenant, position, ids)
            opened = None if hit is not None else self._index.blocks.open(key)
        if hit is not None:
            return hit  # verified when read; _with_blocks copies it, never hands it out
        if opened is None:
            raise BlockFileError("format", f"block file {key} is missing", key)
        entry, f = opened
        with f:
            try:
                if entry.tenant != tenant:
                    raise SnapshotError("format", f"block {key} belongs to another tenant")
                kv = self._index.blocks.decode(f, key, tenant, position, ids)
            except SnapshotError as e:
                with self._lock:
                    done = self._index.blocks.quarantine_if_current(key, os.fstat(f.fileno()), e)
                raise BlockFileError(e.kind, str(e), key, quarantined=done) from e
        with self._lock:
            self._index.blocks.remember(key, tenant, position, ids, kv)
        return kv

    def _lost_block(self, error: BlockFileError, reading: SessionKey) -> None:
        """Every session file listing a block that failed (or is gone) goes: nothing of it can
        be loaded. The one being read is reported by read() returning None, the others
        through on_evict (the pool forgets them; their next request recomputes)."""
        if error.quarantined:
            self._hooks.error(error.kind)
        with self._lock:
            dropped = [e for k, e in list(self._index.entries.items()) if error.key in e.blocks]
            for e in dropped:
                self._index.drop((e.tenant, e.session_id))
        log.warning(
            "disk tier: block %s failed (%s): %d session file(s) relying on it deleted",
            error.key,
            error,
            len(dropped),
        )
        for e in dropped:
            if (e.tenant, e.session_id) != reading:
                self._hooks.evicted(e)

    def _touch(self, key: SessionKey) -> None:
        now = time.time()
        with self._lock:
            entry = self._index.touch(key, now)
        if entry is None:
            return  # deleted or evicted meanwhile
        try:
            os.utime(entry.path, (now, now))  # persist the LRU position for the next start
        except OSError:
            pass  # only the order after a restart suffers

    def _quarantine_if_current(
        self, key: SessionKey, opened: os.stat_result, error: SnapshotError
    ) -> None:
        with self._lock:
            entry = self._index.entries.get(key)
            try:
                st = os.stat(entry.path) if entry else None
            except OSError:
                st = None
            # A concurrent write() may have replaced the bad file: never quarantine its successor.
            if entry and st and (st.st_ino, st.st_dev) == (opened.st_ino, opened.st_dev):
                self._index.unindex(key)
                self._quarantine(entry.path, error)
