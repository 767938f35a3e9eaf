"""Tier moves of one session's KV (device ⇄ RAM ⇄ disk) and its snapshots.

The one KV copy of a session moves, never two live:

    device ──demote(pressure/evict)──► RAM ──LRU overflow──► disk ──LRU overflow──► gone
       ▲                                │                      │
       └────────────── restore ─────────┴──────────────────────┘

- RAM over budget → its LRU entries go to disk. Already-persisted ones are just dropped;
  dirty ones *spill*: the host copy leaves the LRU but stays with the session (tier RAM,
  readable and restorable) while the writer thread writes its snapshot, and the session
  becomes DISK when that write lands. A failed write loses that KV (the session keeps its
  tokens and re-prefills), counted as a snapshot error; so does a spill past
  `spill_bytes` of host copies already waiting for the writer.
- A DISK session whose request is queued is read ahead (`read_ahead`, on the prefetch
  thread, off the pool lock) into the RAM LRU; the pool then places it on the device there
  too when free blocks allow (`SessionPool.restore_ahead`), so the step thread copies
  nothing, or at most host → device.
- Disk over budget → the LRU snapshot file is deleted; a session living only there is gone.
- A DISK-tier session keeps only its index entry in memory; its tokens and text are read
  back with its KV (`load`).
- A snapshot puts the session's leading blocks that others share (held by another session
  on the device, or already in a block file) in block files written once for all of them
  (`snapshot`, kv/blockstore.py); a restore still copies to the device only what the block
  index does not hold (`share_for_restore`, then `copy_in` from there).

Which session moves, and when, is the pool's decision (`pool.py`); block ids come from the
pool's `BlockIndex`; a demotion lets go of the session's blocks, and those others hold or
the index keeps stay on the device.

`Tiers` is one object over one set of state (the RAM LRU, the disk tier, the spills), written
in three files by direction: the way down and evictions here, the way up (`load`,
`read_ahead`, the restore copies) in kv/tier_restore.py, snapshots and their writes
(`copy_out`, `snapshot`, `persist`, `flush`) in kv/tier_snapshot.py.

Locking: every method that takes a Session runs with the pool lock held by its caller
(`lock` is that RLock); `persist`, `read_ahead` and the disk tier's eviction callback take
it themselves, and do their disk I/O without it. Nothing here waits for a
disk write while holding the pool lock (a write may call back into `_on_disk_evict`, which
takes it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ds4pool.kv.config import PoolConfig, PoolObserver
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_files import DiskEntry
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.persist import PersistWriter, SnapshotOrder
from ds4pool.kv.ram import RamTier, nbytes
from ds4pool.kv.session import Session, SessionKey, Tier
from ds4pool.kv.store import LeaseKeeper, SharedStore
from ds4pool.kv.tier_restore import RestoreMove, TierRestores
from ds4pool.kv.tier_snapshot import Spill, TierSnapshots
from ds4pool.kv.transfer import DeviceKV, gather_to_host

__all__ = ["RestoreMove", "Spill", "Tiers"]  # RestoreMove and Spill: their old home


class Tiers(TierRestores, TierSnapshots):
    def __init__(
        self,
        cfg: PoolConfig,
        kv: DeviceKV,
        blocks: BlockIndex,
        fingerprint: ModelFingerprint,
        observer: PoolObserver,
        sessions: dict[SessionKey, Session],
        lock: threading.Condition,
        next_version: Callable[[], int],
        reap: Callable[[torch.Tensor], None] = lambda t: None,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.blocks = blocks
        self.fingerprint = fingerprint
        self.observer = observer
        self._sessions = sessions
        self._lock = lock
        self._next_version = next_version
        self._reap = reap  # frees a dropped host tensor off the lock (the prefetch thread)
        self.ram = RamTier(cfg.ram_bytes, self._on_ram_evict)
        self.disk: DiskTier | None = None
        self.order: SnapshotOrder | None = None
        self.store: SharedStore | None = None  # a shared store: --replica-id (kv/store.py)
        self._keeper: LeaseKeeper | None = None
        self._foreign: set[SessionKey] = set()  # adopted from another replica, not read yet
        if cfg.disk_dir is not None:
            if cfg.replica_id is not None:
                self.store = SharedStore(cfg.disk_dir, cfg.replica_id, cfg.lease_ttl_s, observer)
            self.disk = DiskTier(
                cfg.disk_dir,
                cfg.disk_bytes,
                fingerprint,
                on_error=observer.snapshot_error,
                on_evict=self._on_disk_evict,
                replica_id=cfg.replica_id,
                owns=self.store.owns if self.store else None,
                on_io=observer.store_io,
            )
            if self.store is not None:
                self._keeper = LeaseKeeper(self.store, self._in_flight_keys)
            self.order = SnapshotOrder(self.disk)
            self._index_disk(self.disk)
        self.writer = (
            PersistWriter(self.persist, self.idle_dirty_keys, cfg.persist_idle_s)
            if self.disk
            else None
        )
        self._spills: dict[SessionKey, Spill] = {}

    def _index_disk(self, disk: DiskTier) -> None:
        """Sessions found on disk at start resume as DISK-tier sessions (not loaded)."""
        for entry in disk.entries():
            s = Session(entry.tenant, entry.session_id, tier=Tier.DISK, loaded=False)
            s.num_computed = s.num_persisted = entry.num_kv_tokens
            s.version = s.persisted_version = self._next_version()
            s.last_used = entry.last_used
            self._sessions[s.key] = s

    # ------------------------------------------------------------ down

    def demote(self, s: Session, to: Tier, reason: str, host: torch.Tensor | None = None) -> None:
        """Move an idle session's KV down to RAM or disk. `host`: its device KV already
        copied out (copy_out, at the current version)."""
        assert to in (Tier.RAM, Tier.DISK)
        if s.tier is to or s.tier is Tier.NONE:
            return
        if s.tier is Tier.DISK:
            return  # already below `to`
        if s.tier is Tier.DEVICE:
            assert s.block_table is not None
            if host is None:
                host = gather_to_host(self.kv, s.block_table.blocks, s.num_computed)
            assert host.shape[2] == s.num_computed
            s.block_table.release(self.blocks)
            s.block_table = None
            if to is Tier.RAM and self.ram.fits(nbytes(host)):
                s.host_kv, s.tier = host, Tier.RAM
                self.observer.session_moved("device", "ram", reason)
                self.ram.put(s.key, host)  # may push LRU entries to disk
                if self.writer and s.dirty_tokens:
                    self.writer.enqueue(s.key)
                return
            s.host_kv, s.tier = host, Tier.RAM  # transiently, for to_disk
            self.observer.session_moved("device", "ram", reason)
        else:
            self.ram.pop(s.key)
        self.to_disk(s, reason)

    def to_disk(self, s: Session, reason: str) -> None:
        """RAM → disk for a session whose host copy is in s.host_kv, out of the RAM LRU.
        With a current snapshot the copy is dropped now. Otherwise it spills: the copy stays
        with the session (tier RAM, restorable) and the writer thread writes it; `persist`
        makes the session DISK when the write lands. With no disk tier, or past the spill
        backlog (`spill_bytes`), the KV is lost: the session keeps its tokens, re-prefills."""
        assert s.host_kv is not None
        if self.order is not None and not s.dirty:
            self._spilled(s, reason)
            return
        size = nbytes(s.host_kv)
        backlog = sum(spill.num_bytes for spill in self._spills.values())
        if self.writer is None or (backlog and backlog + size > self.cfg.spill_bytes):
            self._lose(s, "backlog" if self.writer else reason)
            return
        self._spills[s.key] = Spill(size, reason)
        self.writer.enqueue(s.key)

    def _spilled(self, s: Session, reason: str) -> None:
        """The newest snapshot holds this session's state: only its index entry stays."""
        self._drop_host(s)
        s.disk_read_s = None
        s.num_persisted = s.num_computed
        s.tier, s.loaded = Tier.DISK, False
        s.token_ids, s.text = [], ""  # the snapshot holds them; read back on restore
        s.block_keys = []
        self.observer.session_moved("ram", "disk", reason)

    def _lose(self, s: Session, reason: str) -> None:
        self._drop_host(s)
        s.tier, s.num_computed, s.num_persisted = Tier.NONE, 0, 0
        self.observer.session_moved("ram", "none", reason)

    def _is_spilling(self, s: Session) -> bool:
        """A host copy held out of the LRU by an idle session: only a spill leaves one."""
        return s.tier is Tier.RAM and not s.in_flight and s.key not in self.ram

    def _on_ram_evict(self, key: SessionKey, host: torch.Tensor) -> None:
        s = self._sessions.get(key)
        if s is None or s.tier is not Tier.RAM:
            return
        s.host_kv = host
        self.to_disk(s, "ram_full")

    def _on_disk_evict(self, entry: DiskEntry) -> None:
        # Called by the disk tier (outside its own lock) when it deleted a snapshot to stay
        # within budget.
        key = (entry.tenant, entry.session_id)
        with self._lock:
            s = self._sessions.get(key)
            if s is None:
                return
            s.num_persisted, s.persisted_version = 0, -1
            if s.tier is Tier.DISK and not s.in_flight:
                del self._sessions[key]
                self.observer.session_moved("disk", "none", "disk_full")

    def truncate_host(self, s: Session, n: int) -> None:
        """Keep the first n tokens of a RAM session's host copy."""
        assert s.tier is Tier.RAM and s.host_kv is not None
        was_cached = self.ram.pop(s.key) is not None
        s.host_kv = s.host_kv[:, :, :n].clone()  # a clone frees the tail's memory
        if was_cached or self.ram.fits(nbytes(s.host_kv)):
            self.ram.put(s.key, s.host_kv)

    def forget(self, s: Session) -> None:
        """Drop a session's host copy and its snapshot (its device blocks are the pool's)."""
        self.forget_local(s)
        if self.order is not None and not s.ephemeral:
            self.order.drop(s.key, self._next_version())
            if self.store is not None:
                self.store.remove(s.key)

    def forget_local(self, s: Session) -> None:
        """Drop a session's host copy, leaving its snapshot in the store alone (a copy
        another replica may have made stale)."""
        self.ram.pop(s.key)
        self._drop_host(s)
        s.tier = Tier.NONE
        self._foreign.discard(s.key)

    def _in_flight_keys(self) -> list[SessionKey]:
        with self._lock:
            return [k for k, s in self._sessions.items() if s.in_flight and not s.ephemeral]

    def adopt(self, key: SessionKey) -> Session | None:
        """Shared store, on a miss: the key's snapshot as the store holds it, indexed (header
        checked) as a DISK session to be loaded (and verified) by its request. Disk I/O:
        call without the pool lock; installs under it unless a session appeared meanwhile."""
        assert self.disk is not None
        entry = self.disk.adopt(*key)
        if entry is None:
            return None
        with self._lock:
            if key in self._sessions:
                return None
            s = Session(entry.tenant, entry.session_id, tier=Tier.DISK, loaded=False)
            s.num_computed = s.num_persisted = entry.num_kv_tokens
            s.version = s.persisted_version = self._next_version()
            s.last_used = entry.last_used
            self._sessions[key] = s
            self._foreign.add(key)
            return s

    def file_in_ram(self, s: Session) -> None:
        """A host copy read from disk whose request ended before its restore: into the LRU."""
        assert s.host_kv is not None
        came_from = "disk" if s.disk_read_s is not None else "ram"
        s.disk_read_s = None
        if self.ram.fits(nbytes(s.host_kv)):
            self.ram.put(s.key, s.host_kv)
            if came_from == "disk":
                self.observer.session_moved("disk", "ram", "restore")
        else:
            self.to_disk(s, "ram_full")

    def close(self) -> None:
        """Flush to disk and stop the writer (clean shutdown)."""
        self.flush()
        if self.writer:
            self.writer.stop()
        if self._keeper is not None and self.store is not None:
            self._keeper.stop()
            self.store.release_all()  # drained: the next replica takes them at once
        if self.disk:
            self.disk.close()
