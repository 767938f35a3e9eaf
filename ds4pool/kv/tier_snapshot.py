"""Snapshots of one session's KV and their writes: what makes a RAM → disk move land.

`persist` (the writer thread, `flush`, an admin evict) copies an idle session's KV off the
device without the pool lock (`copy_out`), builds its snapshot (`snapshot`: the leading
blocks that others share go to block files written once, kv/blockstore.py) and writes it
through `SnapshotOrder`; then it settles the session's spill, if it had one (the host copy
goes and the session becomes DISK, or the KV is lost on a failed write). The moves themselves
(demote, to_disk, spills, evictions) are `Tiers` (kv/tiers.py), which this class is a part of:
its attributes are the ones `Tiers.__init__` sets. Locking as in kv/tiers.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds4pool.kv.config import PoolConfig
from ds4pool.kv.disk import DiskTier
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.index import BlockIndex
from ds4pool.kv.persist import PersistWriter, SnapshotOrder
from ds4pool.kv.session import Session, SessionKey, Tier
from ds4pool.kv.snapshot import Snapshot
from ds4pool.kv.store import SharedStore
from ds4pool.kv.transfer import DeviceKV, gather_to_host


@dataclass(frozen=True)
class Spill:
    """A host copy out of the RAM LRU, waiting for its snapshot write (see to_disk)."""

    num_bytes: int
    reason: str


class TierSnapshots:
    """The snapshot-and-write part of `Tiers` (see the module docstring)."""

    # set by Tiers.__init__ (kv/tiers.py)
    cfg: PoolConfig
    kv: DeviceKV
    blocks: BlockIndex
    fingerprint: ModelFingerprint
    disk: DiskTier | None
    order: SnapshotOrder | None
    store: SharedStore | None
    writer: PersistWriter | None
    _sessions: dict[SessionKey, Session]
    _lock: threading.Condition
    _spills: dict[SessionKey, Spill]

    if TYPE_CHECKING:  # the spill's two endings, defined by Tiers (kv/tiers.py)

        def _is_spilling(self, s: Session) -> bool: ...

        def _spilled(self, s: Session, reason: str) -> None: ...

        def _lose(self, s: Session, reason: str) -> None: ...

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
