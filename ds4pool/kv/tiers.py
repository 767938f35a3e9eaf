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

Locking: every method that takes a Session runs with the pool lock held by its caller
(`lock` is that RLock); `persist`, `read_ahead` and the disk tier's eviction callback take
it themselves, and do their disk I/O without it. Nothing here waits for a
disk write while holding the pool lock (a write may call back into `_on_disk_evict`, which
takes it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds4pool.kv.blocks import BlockTable
from ds4pool.kv.config import PoolConfig, PoolObserver
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.disk_files import DiskEntry
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.persist import PersistWriter, SnapshotOrder
from ds4pool.kv.ram import RamTier, host_buffer, nbytes
from ds4pool.kv.session import Session, SessionKey, Tier
from ds4pool.kv.snapshot import Snapshot
from ds4pool.kv.store import LeaseKeeper, SharedStore
from ds4pool.kv.transfer import DeviceKV, gather_to_host, scatter_from_host


@dataclass(frozen=True)
class RestoreMove:
    """A restore between `begin_restore` and `finish_restore` / `abort_restore`."""

    src: Tier  # RAM (a host copy to scatter) or NONE (nothing to copy)
    came_from: Tier  # DISK when the host copy was read from a snapshot for this request
    started: float  # perf_counter at the start
    cached: bool  # the host copy was taken out of the RAM LRU (put back on abort)


@dataclass(frozen=True)
class Spill:
    """A host copy out of the RAM LRU, waiting for its snapshot write (see to_disk)."""

    num_bytes: int
    reason: str


class Tiers:
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

    def copy_out(self, s: Session, version: int) -> torch.Tensor | None:
        """An idle DEVICE session's KV as a new host tensor, copied without the pool lock:
        the session is leased meanwhile (in_flight, `copying`), so nothing moves, changes
        or frees its blocks. None if it is not that session at that version any more."""
        with self._lock:
            if (
                self._sessions.get(s.key) is not s
                or s.in_flight
                or s.tier is not Tier.DEVICE
                or s.version != version
            ):
                return None
            assert s.block_table is not None
            s.in_flight = s.copying = True
            blocks, n = list(s.block_table.blocks), s.num_computed
        try:
            return gather_to_host(self.kv, blocks, n)
        finally:
            with self._lock:
                s.in_flight = s.copying = False
                self._lock.notify_all()  # acquire() and admin calls waiting for it

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

    def _drop_host(self, s: Session) -> None:
        if s.host_kv is not None:
            self._reap(s.host_kv)
        s.host_kv = None

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

    # ------------------------------------------------------------ up

    def load(self, s: Session) -> None:
        """Read a DISK session's snapshot into a host buffer (tokens, text and KV), here and
        now: the fallback when no read-ahead brought it up first."""
        if s.tier is not Tier.DISK:
            return
        assert self.disk is not None
        t0 = time.perf_counter()
        snap = self.disk.read(s.tenant, s.session_id)
        self._install(s, snap, self._host_copy(snap, s.num_computed))
        # Held by the in-flight session only (not the RAM LRU): restore moves it to the
        # device next; file_in_ram() files it in RAM if no restore came.
        if s.tier is Tier.RAM:
            s.disk_read_s = time.perf_counter() - t0

    def read_ahead(self, key: SessionKey, kv: bool = True) -> None:
        """The prefetch thread's job: disk → host buffer (read, checksum, decode) off the pool
        lock, then file the copy in the RAM LRU, unless the session moved meanwhile.
        kv=False (its KV is to be recomputed, kv/cost.py): read its tokens and text only."""
        if self.disk is None:
            return
        with self._lock:
            s = self._sessions.get(key)
            if s is None or s.tier is not Tier.DISK or s.in_flight:
                return
            version, num_computed = s.version, s.num_computed
        t0 = time.perf_counter()
        snap = self.disk.read(*key) if kv else self.disk.read(*key, kv=False)
        host = self._host_copy(snap, num_computed) if kv else None
        read_s = time.perf_counter() - t0
        with self._lock:
            if self._sessions.get(key) is not s or s.tier is not Tier.DISK or s.in_flight:
                return  # taken by a request (it loads itself) or dropped: discard the read
            if not kv:
                if s.version == version:
                    self._install_tokens(s, snap)
                return
            if s.version != version or (host is not None and not self.ram.fits(nbytes(host))):
                return  # changed, or too large for RAM: the request reads it on its own
            self._install(s, snap, host)
            if host is not None:
                s.disk_read_s = read_s  # its restore counts as one from disk, read included
                self.ram.put(key, host)  # may spill older entries (no I/O here)

    def _host_copy(self, snap: Snapshot | None, num_computed: int) -> torch.Tensor | None:
        """The first num_computed tokens of a snapshot's KV as one host tensor [L, 2, T, H, D]
        (pinned on CUDA)."""
        if snap is None:
            return None
        n = min(num_computed, snap.header.num_kv_tokens)
        kv = [layer[:, :n] for layer in snap.kv]
        first = kv[0]
        host = host_buffer((len(kv), *first.shape), first.dtype, self.kv.device)
        for layer, src in enumerate(kv):
            host[layer].copy_(src)
        return host

    def _install(self, s: Session, snap: Snapshot | None, host: torch.Tensor | None) -> None:
        """A DISK session gets what its snapshot holds: now RAM (or NONE without one)."""
        if snap is None or host is None:  # absent or quarantined (counted): start fresh
            s.token_ids, s.text, s.num_computed, s.num_persisted = [], "", 0, 0
            s.tier, s.loaded, s.persisted_version = Tier.NONE, True, -1
            s.version = self._next_version()
            return
        n = host.shape[2]
        if s.key in self._foreign:
            self._foreign.discard(s.key)
            self.observer.foreign_restored()
        s.token_ids, s.text, s.loaded = snap.token_ids, snap.text, True
        s.block_keys = []
        if n < snap.header.num_kv_tokens:  # truncated while on disk: the text no longer fits
            s.token_ids, s.text = s.token_ids[:n], ""
        s.num_computed = n
        s.host_kv, s.tier = host, Tier.RAM

    def _install_tokens(self, s: Session, snap: Snapshot | None) -> None:
        """A DISK session gets its snapshot's tokens and text but no KV (tier NONE): its
        next prompt is matched against the tokens as they were and prefilled."""
        if snap is None:
            self._install(s, None, None)
            return
        n = min(s.num_computed, snap.header.num_kv_tokens)
        s.token_ids, s.text, s.loaded = snap.token_ids, snap.text, True
        if n < snap.header.num_kv_tokens:  # truncated while on disk (as in _install)
            s.token_ids, s.text = s.token_ids[:n], ""
        s.block_keys, s.text_marks = [], []
        s.tier, s.num_computed, s.num_persisted = Tier.NONE, 0, 0
        s.version = self._next_version()

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

    def begin_restore(self, s: Session) -> RestoreMove:
        """Start moving a loaded RAM/NONE session up. Its host copy leaves the RAM LRU first:
        making room pushes others into RAM, which must not push this one out to disk."""
        assert s.tier in (Tier.RAM, Tier.NONE)
        src = s.tier
        came_from = Tier.DISK if s.disk_read_s is not None else src
        cached = self.ram.pop(s.key) is not None if src is Tier.RAM else False
        return RestoreMove(src, came_from, time.perf_counter(), cached)

    def abort_restore(self, s: Session, move: RestoreMove) -> None:
        if move.cached:
            assert s.host_kv is not None
            self.ram.put(s.key, s.host_kv)

    def copy_in(self, s: Session, move: RestoreMove, table: BlockTable, start: int = 0) -> None:
        """Copy the host KV into the table's blocks (allocated by the pool) from token
        `start` on (a block boundary: the blocks before it are already there)."""
        if move.src is Tier.RAM:
            assert s.host_kv is not None and start % self.cfg.block_size == 0
            rest = table.blocks[start // self.cfg.block_size :]
            scatter_from_host(self.kv, s.host_kv[:, :, start:], rest, s.num_computed - start)

    def finish_restore(
        self,
        s: Session,
        move: RestoreMove,
        table: BlockTable,
        start: int = 0,
        copied: bool = False,
    ) -> None:
        """The session is DEVICE now, its KV copied in from `start` (here, unless
        `copied`: the caller ran copy_in without the pool lock)."""
        if not copied:
            self.copy_in(s, move, table, start)
        self._drop_host(s)
        s.block_table, s.tier = table, Tier.DEVICE
        if move.came_from is not Tier.NONE:
            seconds = time.perf_counter() - move.started + (s.disk_read_s or 0.0)
            self.observer.restored(move.came_from.value, seconds)
            self.observer.session_moved(move.came_from.value, Tier.DEVICE.value, "restore")
        s.disk_read_s = None

    # ------------------------------------------------------------ snapshots

    def snapshot(self, s: Session, host: torch.Tensor) -> Snapshot:
        """The session's snapshot; its leading blocks that other sessions share go to block
        files (written once for all of them), the rest into its own file."""
        n = host.shape[2]
        return Snapshot.create(
            s.tenant,
            s.session_id,
            self.fingerprint,
            s.token_ids,
            s.text,
            [host[layer] for layer in range(host.shape[0])],
            shared=self._shared_keys(s, n),
            block_size=self.cfg.block_size,
        )

    def _shared_keys(self, s: Session, num_kv_tokens: int) -> list[str]:
        """Hex chain keys of the leading full blocks of s's first num_kv_tokens that are
        shared: some other session holds the block on the device, or a block file for it is
        already on disk. Stops at the first private block (sharing is by prefix)."""
        if self.disk is None or not s.loaded:
            return []
        bs = self.cfg.block_size
        n = min(num_kv_tokens, len(s.token_ids)) // bs
        own = set(s.block_table.blocks) if s.block_table is not None else set()
        keys = list(s.block_keys[:n])
        out: list[str] = []
        while len(out) < n:
            if len(out) == len(keys):  # hash on only as far as the blocks stay shared
                more = min(n, len(keys) + 64) * bs
                keys = self.blocks.keys(s.tenant, s.token_ids[:more], keys)
            key = keys[len(out)]
            found = self.blocks.lookup([key])
            block = found[0] if found else None
            held_by_others = block is not None and self.blocks.holders(block) > (block in own)
            if not (held_by_others or self.disk.has_block(key.hex())):
                break
            out.append(key.hex())
        return out

    def persist(self, key: SessionKey) -> bool:
        """Write a snapshot of an idle session if it changed since the last one, and settle
        its spill if it has one. Called from the writer thread, by flush() and by an admin
        evict to disk; the device → host copy and the disk write run without the pool lock."""
        if self.order is None:
            return False
        host: torch.Tensor | None = None
        with self._lock:
            s = self._sessions.get(key)
            if s is None or s.in_flight or s.tier not in (Tier.DEVICE, Tier.RAM):
                self._spills.pop(key, None)  # dropped, or back in use: release() re-files it
                return False
            if not s.dirty:
                self._settle(s, written=True)
                return False
            version = s.version
            if s.tier is Tier.RAM:
                host = s.host_kv  # never modified in place: truncation replaces it
        if host is None:
            host = self.copy_out(s, version)
        with self._lock:
            if host is None or self._sessions.get(key) is not s or s.version != version:
                return False  # it changed or is in use: its next persist catches up
            snap, n = self.snapshot(s, host), s.num_computed
        if self.store is not None and not self.store.may_write(key):
            with self._lock:  # another replica holds the session: never write over it
                if self._sessions.get(key) is s and s.version == version:
                    self._settle(s, written=False)
            return False
        written = self.order.write(snap, version)
        with self._lock:
            if self._sessions.get(key) is s and s.version == version:
                if written:
                    s.num_persisted, s.persisted_version = n, version
                self._settle(s, written)
            else:  # it changed while we wrote: a newer spill, if any, is queued again
                self._spills.pop(key, None)
        return written

    def _settle(self, s: Session, written: bool) -> None:
        spill = self._spills.pop(s.key, None)
        if not self._is_spilling(s):
            return  # restored or filed in RAM again while the write ran: nothing to settle
        reason = spill.reason if spill else "ram_full"
        if written:
            self._spilled(s, reason)
        else:
            self._lose(s, reason)

    def idle_dirty_keys(self, idle_s: float) -> list[SessionKey]:
        cutoff = time.time() - idle_s
        with self._lock:
            return [
                s.key
                for s in self._sessions.values()
                if not s.in_flight
                and not s.ephemeral
                and s.dirty
                and s.last_used < cutoff
                and s.tier in (Tier.DEVICE, Tier.RAM)
            ]

    def flush(self) -> int:
        """Persist every idle session that changed since its last snapshot; returns the
        number written. In-flight sessions are skipped (they persist when released)."""
        if self.writer:
            self.writer.drain()
        with self._lock:
            keys = [k for k, s in self._sessions.items() if not s.ephemeral and s.dirty]
        return sum(self.persist(k) for k in keys)

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
