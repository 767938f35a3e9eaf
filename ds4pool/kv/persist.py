"""Write-behind persistence: one thread writes session snapshots off the request path.

Triggers: demotion to RAM, `persist_every_tokens` new tokens at release, idleness longer
than `persist_idle_s` (checked on a timer here), an explicit flush, and shutdown.

Ordering: every snapshot carries the session's version (a pool-wide counter bumped on
every change of its tokens/KV). `SnapshotOrder` serialises writes and refuses one older
than what was last written or dropped for the key, so a slow write can never replace a
newer snapshot or resurrect a dropped session.

The same thread writes the snapshots of sessions spilling out of the RAM tier (see
`tiers.py`): their host copies wait in memory, restorable, until the write lands.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_write import DiskWriteError, SnapshotTooLargeError
from ds4pool.kv.session import SessionKey
from ds4pool.kv.snapshot import Snapshot

log = logging.getLogger(__name__)


class SnapshotOrder:
    """Serialises disk writes and keeps, per key, the newest version written or dropped.

    A drop never waits for a write: it records its version at once (an older write then
    refuses to start) and deletes the file, or, when a write of that key is under way,
    leaves the delete to that write, which does it as soon as its rename landed. So a
    dropped session is never resurrected, and the pool lock (held by callers of drop) is
    never held across a disk write.

    Lock order: the pool lock may be held when entering drop; `_lock` (the version map,
    held only for dictionary updates and an unlink) is never held across I/O of a write;
    `_write_lock` (held across a write) is never taken with the pool lock held: a write may
    call the disk tier's eviction hook, which takes the pool lock."""

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._newest: dict[SessionKey, int] = {}
        self._writing: dict[SessionKey, int] = {}  # key → version whose write is under way

    def write(self, snap: Snapshot, version: int) -> bool:
        """Write unless a newer version of the key was written or dropped; True if written."""
        key = snap.key
        with self._write_lock:
            with self._lock:
                newest = self._newest.get(key, -1)
                if newest >= version:
                    # versions are unique: equal means this exact state is already on disk
                    return newest == version
                self._writing[key] = version
            try:
                self.disk.write(snap)
                written = True
            except (DiskWriteError, SnapshotTooLargeError) as exc:
                log.warning("snapshot of a session not written: %s", exc)
                written = False  # counted by the disk tier's on_error
            with self._lock:
                del self._writing[key]
                if self._newest.get(key, -1) > version:  # dropped while we wrote
                    self.disk.delete(*key)
                    return False
                if written:
                    self._newest[key] = version
                return written

    def drop(self, key: SessionKey, version: int) -> None:
        with self._lock:
            self._newest[key] = version
            if key not in self._writing:
                self.disk.delete(*key)


class PersistWriter:
    """The `ds4pool-persist` thread. `persist(key)` writes one session's snapshot (False if
    there was nothing to write); `idle_keys(idle_s)` lists the sessions dirty and idle that
    long. Both come from the pool's tiers, so this module knows nothing of the pool."""

    def __init__(
        self,
        persist: Callable[[SessionKey], bool],
        idle_keys: Callable[[float], list[SessionKey]],
        idle_s: float,
    ) -> None:
        self._persist = persist
        self._idle_keys = idle_keys
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: deque[SessionKey] = deque()
        self._queued: set[SessionKey] = set()
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ds4pool-persist", daemon=True)
        self._thread.start()

    def enqueue(self, key: SessionKey) -> None:
        with self._cond:
            if key not in self._queued:
                self._queued.add(key)
                self._queue.append(key)
                self._cond.notify_all()

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued snapshot is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        tick = max(0.05, min(1.0, self.idle_s / 4)) if self.idle_s > 0 else 1.0
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    self._cond.wait(tick)
                if self._stopping and not self._queue:
                    return
                key = self._queue.popleft() if self._queue else None
                if key is not None:
                    self._queued.discard(key)
                    self._busy = True
            try:
                if key is not None:
                    self._persist(key)
                elif self.idle_s > 0:
                    for idle in self._idle_keys(self.idle_s):
                        self.enqueue(idle)
            except Exception:  # never let the writer die: log and carry on
                log.exception("persist writer: unexpected error")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
