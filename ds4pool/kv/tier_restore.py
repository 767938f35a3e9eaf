"""The up path of one session's KV: disk → host buffer, then host → device.

    disk ──load / read_ahead──► host copy (tier RAM) ──begin_restore, copy_in──► device
                                      ▲                  finish_restore
                                      └── abort_restore (no room): back into the RAM LRU

`load` reads a DISK session's snapshot on the step thread (the fallback); `read_ahead` does the
same on the prefetch thread, off the pool lock, and files the copy in the RAM LRU. A restore
takes the host copy out of the LRU first, and copies to the device only what the block index
does not already hold there (`start`, kv/sharing.py). The way down (demote, RAM → disk,
evictions) is `Tiers` itself (kv/tiers.py), which this class is a part of: its attributes are
the ones `Tiers.__init__` sets. Locking as in kv/tiers.py: the caller holds the pool lock,
except around `read_ahead`'s disk read and `copy_in` when the caller says so.
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
from ds4pool.kv.ram import RamTier, host_buffer, nbytes
from ds4pool.kv.session import Session, SessionKey, Tier
from ds4pool.kv.snapshot import Snapshot
from ds4pool.kv.transfer import DeviceKV, scatter_from_host


@dataclass(frozen=True)
class RestoreMove:
    """A restore between `begin_restore` and `finish_restore` / `abort_restore`."""

    src: Tier  # RAM (a host copy to scatter) or NONE (nothing to copy)
    came_from: Tier  # DISK when the host copy was read from a snapshot for this request
    started: float  # perf_counter at the start
    cached: bool  # the host copy was taken out of the RAM LRU (put back on abort)


class TierRestores:
    """The up-path part of `Tiers` (see the module docstring)."""

    # set by Tiers.__init__ (kv/tiers.py)
    cfg: PoolConfig
    kv: DeviceKV
    ram: RamTier
    disk: DiskTier | None
    observer: PoolObserver
    _sessions: dict[SessionKey, Session]
    _lock: threading.Condition
    _next_version: Callable[[], int]
    _reap: Callable[[torch.Tensor], None]
    _foreign: set[SessionKey]

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

    def _drop_host(self, s: Session) -> None:
        if s.host_kv is not None:
            self._reap(s.host_kv)
        s.host_kv = None
