"""A replica's view of a shared snapshot store (several replicas, one directory).

Each replica keeps its own disk-tier index of what it wrote (kv/disk.py, `replica_id` set);
this module adds what sharing needs on top:

- leases (kv/store_lease.py): a replica claims a session's lease when a request for it
  arrives (`claim`) and before every snapshot write (`may_write`); a live foreign lease
  means "serve it, do not persist over it". `LeaseKeeper` renews the leases of sessions used
  within the lease ttl, so a replica that dies stops renewing and its sessions' leases
  expire: the replica their requests land on next takes them over.
- `list_store()`: every snapshot in the directory by its header, with its lease (the admin
  CLI's listing; reads headers only, never KV).

Nothing here holds the pool lock: lease I/O runs on the API's worker threads, the writer
thread and the keeper thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from ds4pool.kv.disk_files import SNAP_SUFFIX
from ds4pool.kv.framing import SnapshotError
from ds4pool.kv.session import SessionKey
from ds4pool.kv.snapshot_header import read_header
from ds4pool.kv.store_lease import Claim, ClaimResult, Lease, LeaseError, LeaseStore

log = logging.getLogger(__name__)


class StoreObserver:
    """Metrics hooks of the shared store; the default does nothing."""

    def lease_claimed(self, claim: str) -> None:
        """A claim ended as `claim` (renewed, acquired, taken_over, foreign)."""

    def store_error(self, kind: str) -> None:
        """A lease file could not be read or written (kind "lease")."""


class SharedStore:
    """Leases of one replica and the record of which sessions it served lately."""

    def __init__(
        self,
        directory: Path | str,
        replica_id: str,
        ttl_s: float = 30.0,
        observer: StoreObserver | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.leases = LeaseStore(directory, replica_id, ttl_s, clock)
        self.replica_id = self.leases.replica_id
        self.ttl_s = ttl_s
        self.observer = observer or StoreObserver()
        self._clock = clock
        self._lock = threading.Lock()
        self._active: dict[SessionKey, float] = {}  # sessions we lease → last use (unix)

    def owns(self, key: SessionKey) -> bool:
        """The lease names this replica (live, expired or released): it wrote the file last.
        Used at start-up to pick the snapshots this replica indexes."""
        try:
            lease = self.leases.read(*key)
        except LeaseError:
            return False
        return lease is not None and lease.replica == self.replica_id

    def claim(self, key: SessionKey, *, for_request: bool = True) -> ClaimResult | None:
        """Claim the session's lease (for a request, or before a write); None when the store
        failed (counted: the caller serves without persisting, as under a foreign lease)."""
        try:
            result = self.leases.claim(*key)
        except LeaseError as e:
            log.error("store: lease of a session: %s", e)
            self.observer.store_error("lease")
            return None
        self.observer.lease_claimed(result.claim.value)
        if result.claim in (Claim.ACQUIRED, Claim.TAKEN_OVER):
            log.info(
                "store: session %s/%s: lease %s (held before by %s)",
                *key,
                result.claim.value,
                result.previous or "nobody",
            )
        if result.mine:
            with self._lock:
                self._active[key] = self._clock()
        elif for_request:  # the writer retries idle sessions: logged once, by the request
            log.info(
                "store: session %s/%s: lease held by replica %s, serving without persisting",
                *key,
                result.holder,
            )
        return result

    def may_write(self, key: SessionKey) -> bool:
        """Claim (or renew) the lease before a snapshot write; False under a live foreign
        lease or when the store failed."""
        result = self.claim(key, for_request=False)
        return result is not None and result.mine

    def release(self, key: SessionKey) -> None:
        with self._lock:
            self._active.pop(key, None)
        try:
            self.leases.release(*key)
        except LeaseError as e:
            log.error("store: releasing a lease: %s", e)
            self.observer.store_error("lease")

    def remove(self, key: SessionKey) -> None:
        """A dropped session: its lease file goes with its snapshot."""
        with self._lock:
            self._active.pop(key, None)
        try:
            self.leases.remove(*key)
        except LeaseError as e:
            log.error("store: removing a lease: %s", e)
            self.observer.store_error("lease")

    def renew_active(self, busy: Collection[SessionKey] = ()) -> int:
        """Renew the leases of sessions used within the ttl or `busy` (a request runs);
        forget the rest (their leases run out, so another replica may take them over).
        Returns how many were renewed."""
        now = self._clock()
        with self._lock:
            for k in busy:
                if k in self._active:
                    self._active[k] = now
            keys = [k for k, used in self._active.items() if now - used < self.ttl_s]
            for k in [k for k in self._active if k not in keys]:
                del self._active[k]
        renewed = 0
        for key in keys:
            try:
                result = self.leases.claim(*key)
            except LeaseError as e:
                log.error("store: renewing a lease: %s", e)
                self.observer.store_error("lease")
                continue
            if result.mine:
                renewed += 1
            else:  # lost it (we were late renewing): stop renewing, count it
                log.warning("store: lost a session lease to replica %s", result.holder)
                with self._lock:
                    self._active.pop(key, None)
        return renewed

    def touch(self, key: SessionKey) -> None:
        """A request of the session ended: keep renewing its lease for another ttl."""
        with self._lock:
            if key in self._active:
                self._active[key] = self._clock()

    def release_all(self) -> int:
        """Drain: release every lease this replica renews; returns how many."""
        with self._lock:
            keys = list(self._active)
        for key in keys:
            self.release(key)
        return len(keys)

    def held(self) -> list[SessionKey]:
        with self._lock:
            return list(self._active)


class LeaseKeeper:
    """The `ds4pool-leases` thread: renews active leases every ttl/3. `busy()` lists the
    sessions with a request running (their leases are renewed however long it runs)."""

    def __init__(
        self, store: SharedStore, busy: Callable[[], Collection[SessionKey]] = lambda: ()
    ) -> None:
        self.store = store
        self._busy = busy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds4pool-leases", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.store.ttl_s / 3):
            try:
                self.store.renew_active(self._busy())
            except Exception:  # never let the keeper die: log and carry on
                log.exception("lease keeper: unexpected error")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass(frozen=True)
class StoreEntry:
    """One snapshot in the store, as its header and lease file say."""

    tenant: str
    session_id: str
    file_name: str
    num_bytes: int
    num_tokens: int
    num_kv_tokens: int
    modified: float  # unix time of the last write (or read)
    holder: str | None  # replica of the lease file, None without one
    lease_live: bool

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def list_store(directory: Path | str, clock: Callable[[], float] = time.time) -> list[StoreEntry]:
    """Every valid-looking snapshot in a store directory, newest first. Reads headers only
    (checksums of the KV are verified when a replica loads it); unreadable files are left
    out and logged."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    lease_dir = root / "leases"
    leases = (
        LeaseStore(root, "list", clock=clock).leases() if lease_dir.is_dir() else {}
    )  # reads only: LeaseStore makes the directory, which exists here
    now, out = clock(), []
    for item in os.scandir(root):
        if not item.name.endswith(SNAP_SUFFIX) or not item.is_file(follow_symlinks=False):
            continue
        try:
            with open(item.path, "rb") as f:
                h = read_header(f)
                st = os.fstat(f.fileno())
        except (OSError, SnapshotError) as e:
            log.warning("store: skipping %s: %s", item.name, e)
            continue
        lease: Lease | None = leases.get(item.name)
        out.append(
            StoreEntry(
                h.tenant,
                h.session_id,
                item.name,
                st.st_size,
                h.num_tokens,
                h.num_kv_tokens,
                st.st_mtime,
                lease.replica if lease else None,
                bool(lease and lease.live(now)),
            )
        )
    return sorted(out, key=lambda e: -e.modified)


__all__ = ["Claim", "ClaimResult", "LeaseKeeper", "SharedStore", "StoreEntry", "list_store"]
